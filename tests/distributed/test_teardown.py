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
    # let the left-behind teardown end while this test's stand-ins are still in place
    release.set()
    for thread in threading.enumerate():
        if thread.name == "kvfleet-tp-teardown":
            thread.join(10)
    assert calls == ["forget", "destroy"]


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


def test_a_process_that_left_a_group_behind_ends_with_its_code_and_flushed_output():
    # the interpreter's own exit would run the hung teardown again (the group's destructor)
    import subprocess
    import sys
    script = ("from kvfleet_runtime.distributed import parallel_state as ps\n"
              "assert ps.finish_process(3) == 3 and not ps.teardown_abandoned()\n"
              "ps.forget_tensor_parallel()\n"
              "print('flushed', end='')\n"
              "ps.finish_process(7)\n"
              "print('not reached')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (7, "flushed"), done.stderr
