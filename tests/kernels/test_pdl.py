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


@pytest.mark.parametrize("value, on", [("", False), ("0", False), ("1", True)])
def test_early_mode(value, on):
    assert pdl.early_mode(value) is on


def test_early_mode_refuses_other_values():
    with pytest.raises(ValueError, match="KVFLEET_PDL_EARLY must be unset, 0 or 1"):
        pdl.early_mode("on")


@pytest.mark.parametrize("value, nbytes", [("", 0), ("0", 0), ("24", 24 << 20)])
def test_l2_budget(value, nbytes):
    assert pdl.l2_budget(value) == nbytes


@pytest.mark.parametrize("value", ["-1", "1.5", "lots"])
def test_l2_budget_refuses_other_values(value):
    with pytest.raises(ValueError, match="KVFLEET_L2_PREFETCH_MB must be a whole number"):
        pdl.l2_budget(value)


def test_l2_prefetch_tiles_stay_within_the_budget(monkeypatch):
    monkeypatch.setattr(pdl, "_L2_BYTES", 16 << 20)
    monkeypatch.setattr(pdl, "pdl_enabled", lambda device: True)
    # 528 programs of 8 KB tiles: 4.1 MB a round; 16 MB hold 3 rounds, the first in registers
    assert pdl.l2_prefetch_tiles(torch.device("cuda"), 528, 8192) == 2
    # a round above the budget: nothing asked of L2
    assert pdl.l2_prefetch_tiles(torch.device("cuda"), 8016, 16384) == 0
    monkeypatch.setattr(pdl, "pdl_enabled", lambda device: False)
    assert pdl.l2_prefetch_tiles(torch.device("cuda"), 528, 8192) == 0
    monkeypatch.setattr(pdl, "pdl_enabled", lambda device: True)
    monkeypatch.setattr(pdl, "_L2_BYTES", 0)
    assert pdl.l2_prefetch_tiles(torch.device("cuda"), 528, 8192) == 0
