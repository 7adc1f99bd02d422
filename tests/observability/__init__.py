"""Tests of the observability pack: dashboard, alert rules, benchmark plots."""
