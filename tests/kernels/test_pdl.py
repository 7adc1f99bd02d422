"""kvfleet_kernels.pdl: KVFLEET_PDL's values, and no PDL where it cannot run (CPU, the
interpreter). Its kernels compile for sm_90 with the wait and the trigger
(test_kernel_compile_sm90.py); the GPU tests run with it (the default) and scripts/gpu-check's pdl stage A/Bs it."""

from __future__ import annotations

import pytest
import torch
from kvfleet_kernels import pdl


@pytest.mark.parametrize("value, on", [("", True), ("0", False), ("1", True)])
def test_pdl_mode(value, on):
    assert pdl.pdl_mode(value) is on


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_pdl_mode_refuses_other_values(value):
    with pytest.raises(ValueError, match="KVFLEET_PDL must be unset, 0 or 1"):
        pdl.pdl_mode(value)


def test_no_pdl_on_the_cpu_even_when_asked(monkeypatch):
    monkeypatch.setattr(pdl, "_ON", True)
    pdl.pdl_enabled.cache_clear()
    try:
        assert pdl.pdl_args(torch.device("cpu")) == {"PDL": False}
    finally:
        pdl.pdl_enabled.cache_clear()
