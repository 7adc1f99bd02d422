"""`kvfleet serve` on the GPU: 64 concurrent streams, then `bench serve` figures (printed).

Run by scripts/gpu-check on the lent GPU machine (needs fastapi, uvicorn, pydantic,
aiohttp and openai there). fp32 keeps greedy outputs independent of the batch.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.server import ServerProcess, running_server

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[ServerProcess]:
    with running_server(tiny_llama, "--device", "cuda", "--dtype", "float32",
                        "--max-model-len", "1024", "--max-num-seqs", "64") as s:
        yield s


def test_concurrent_streams_on_cuda_equal_the_requests_alone(server: ServerProcess) -> None:
    bodies = [{"prompt": f"GPU request {i} about {i * 13}", "max_tokens": 16,
               "temperature": 0.0, "ignore_eos": True} for i in range(64)]
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        alone = [http.post("/v1/completions", json=b).json()["choices"][0]["text"]
                 for b in bodies]

    async def together() -> list[str]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
            answers = await asyncio.gather(*(http.post("/v1/completions", json=b)
                                             for b in bodies))
        return [a.json()["choices"][0]["text"] for a in answers]
    assert asyncio.run(together()) == alone
    assert server.metric("kvfleet_num_requests_running") == 0


def test_bench_serve_on_cuda(server: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "runs.json"
    done = subprocess.run(
        [sys.executable, "-m", "kvfleet_runtime.cli", "bench", "serve", "--base-url",
         server.base_url, "--num-prompts", "128", "--request-rate", "16,inf",
         "--input-len", "256", "--output-len", "64", "--json", str(out)],
        capture_output=True, text=True, timeout=600)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    runs = json.loads(out.read_text())
    assert all(r["completed"] == 128 and r["total_output_tokens"] == 128 * 64 for r in runs)
