"""The fused all-reduce + RMSNorm across two GPUs (NCCL group, symmetric memory over NVLink):
each rank in a process of its own (fused_norm_child.py) checks it against the reference,
eagerly at every dtype and batch size up to its limit, and replayed from a CUDA graph."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# bf16 / fp16: one rounding of the sum and of the output at |x| ~ 4 (the reference rounds the
# same way; the kernel's fp32 sums of two or more parts may differ in their last bit)
TOLERANCE = {"torch.float32": 1e-4, "torch.float16": 8e-3, "torch.bfloat16": 6.25e-2}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.gpu
@pytest.mark.timeout(240)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_fused_all_reduce_norm_matches_the_reference(capsys):
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(here), str(here.parent), os.environ.get("PYTHONPATH", "")])}
    init = f"tcp://127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, str(here / "fused_norm_child.py"), str(rank), "2",
                               init], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for rank in range(2)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=200)
            assert p.returncode == 0, err[-4000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r in results:
        assert r["fused"], "the engine's self-check refused the fused path"
        assert r["eager_same_on_every_rank"] and r["graph_same_on_every_rank"]
        for dtype, rows, err in r["eager_errors"]:
            assert err <= TOLERANCE[dtype], (dtype, rows, err)
        assert {rows for _, rows, _ in r["eager_errors"]} >= {1, 2, 7, 32, 64}
        assert r["graph_max_error"] <= TOLERANCE["torch.bfloat16"]
        assert r["pushed_same_on_every_rank"]
        assert r["pushed_max_error"] <= TOLERANCE["torch.bfloat16"]
    with capsys.disabled():
        print("\nus per batch-1 call on rank 0 (CUDA graph of 64; gemv: 4096 x 2048 bf16):",
              results[0]["us_per_call"])
