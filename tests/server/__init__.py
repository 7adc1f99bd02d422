"""Tests of `kvfleet serve`, the async engine, metrics and `kvfleet bench serve`."""
