"""Rank 0's NCCL teardown at shutdown is bounded: a teardown that never returns (what
pytorch#115388 does once collectives were captured in CUDA graphs) costs TEARDOWN_TIMEOUT_S,
then the engine forgets the group instead of hanging."""

from __future__ import annotations

import logging
import threading
import time

import torch
from kvfleet_runtime.distributed import workers


def _group_on(device: str) -> workers.WorkerGroup:
    group = object.__new__(workers.WorkerGroup)     # no processes: only the teardown is tested
    group._device = torch.device(device)
    return group


def test_a_hung_nccl_teardown_is_left_behind_after_the_timeout(monkeypatch, caplog):
    release = threading.Event()
    calls = []
    monkeypatch.setattr(workers, "TEARDOWN_TIMEOUT_S", 0.3)
    monkeypatch.setattr(workers, "abort_device_group", lambda device: release.wait(30))
    monkeypatch.setattr(workers, "destroy_tensor_parallel", lambda: calls.append("destroy"))
    monkeypatch.setattr(workers, "forget_tensor_parallel", lambda: calls.append("forget"))
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=workers.__name__):
        _group_on("cuda")._leave_group()
    assert time.monotonic() - start < 5
    assert calls == ["forget"]
    assert "did not finish" in caplog.text
    release.set()


def test_a_teardown_that_finishes_destroys_the_group_and_forgets_nothing(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(workers, "abort_device_group", lambda device: calls.append("abort"))
    monkeypatch.setattr(workers, "destroy_tensor_parallel", lambda: calls.append("destroy"))
    monkeypatch.setattr(workers, "forget_tensor_parallel", lambda: calls.append("forget"))
    for device in ("cuda", "cpu"):
        calls.clear()
        with caplog.at_level(logging.WARNING, logger=workers.__name__):
            _group_on(device)._leave_group()
        assert calls == ["abort", "destroy"]
    assert "did not finish" not in caplog.text
