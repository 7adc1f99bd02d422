"""A fresh engine on a GPU compiles its kernels at start, not in its first steps.

Triton compiles a kernel specialisation on its first launch in a process; the decode graphs
and the memory profile run no prefill, so before ModelRunner._warm_up_eager_steps a fresh
server's first prompts waited on those compiles. Each case runs in a fresh process (an earlier
test in this one may have compiled the same kernels) and reports the Triton compiles its
workload met after start-up: prompts of many lengths through small prefill chunks, so that
steps mix prompt chunks with decode rows of many counts and contexts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

_WORKLOAD = r"""
import json, random, sys
from kvfleet_runtime import LLM, SamplingParams
from kvfleet_runtime.benchmarks.first_use import CompileLog
llm = LLM(model=sys.argv[1], dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=256,
          max_model_len=1024, kv_cache_dtype=sys.argv[2])
log = CompileLog()
assert log.install()
log.row = "workload"
rng = random.Random(5)
prompts = [[rng.randrange(3, 30000) for _ in range(rng.randrange(2, 600))] for _ in range(48)]
llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
llm.generate(prompts[:3], SamplingParams(temperature=0.7, max_tokens=8, seed=1))
print("COMPILES " + json.dumps([e[2] for e in log.events if e[0] == "workload"]))
"""


def _compiles(model: str, kv_cache_dtype: str, warm_up: bool) -> list[str]:
    env = dict(os.environ, KVFLEET_WARM_UP_STEPS="1" if warm_up else "0")
    done = subprocess.run([sys.executable, "-c", _WORKLOAD, model, kv_cache_dtype], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("COMPILES "))
    return json.loads(line.removeprefix("COMPILES "))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_the_first_steps_compile_nothing(tiny_model_dir, kv_cache_dtype):
    path = str(tiny_model_dir("llama3"))
    cold = _compiles(path, kv_cache_dtype, warm_up=False)
    # without the warm-up the workload meets the prefill kernel first (the check can fail)
    assert any(name.endswith("._prefill_kernel") for name in cold), cold
    warm = _compiles(path, kv_cache_dtype, warm_up=True)
    assert warm == [], f"compiled in the workload after the warm-up ({kv_cache_dtype}): {warm}"
