"""Triton kernels of kvfleet, each beside its pure-torch reference."""
