"""What `kvfleet pull` puts in DEST is what the engine loads: same greedy tokens as the source folder."""

from __future__ import annotations

import os
from pathlib import Path

from support.hub import HubServer, folder_files
from support.s3 import S3Server

from pull.conftest import run_pull, run_pull_process


def test_engine_loads_the_pulled_sharded_checkpoint(s3: S3Server, uploaded: str, checkpoint: Path,
                                                    tmp_path: Path) -> None:
    from kvfleet_runtime import LLM, SamplingParams

    dest = tmp_path / "model"
    r = run_pull(s3, uploaded, str(dest))
    assert r.returncode == 0, r.stderr
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    pulled = LLM(model=str(dest), max_num_seqs=2, num_gpu_blocks=16).generate("hello", params)[0]
    source = LLM(model=str(checkpoint), max_num_seqs=2, num_gpu_blocks=16).generate("hello", params)[0]
    assert len(pulled.outputs[0].token_ids) == 4
    assert pulled.outputs[0].token_ids == source.outputs[0].token_ids


def test_engine_loads_a_model_pulled_from_the_hub(hub: HubServer, checkpoint: Path, tmp_path: Path) -> None:
    from kvfleet_runtime import LLM, SamplingParams

    # as on the Hub: PyTorch weights beside the safetensors ones, which the pull leaves out
    hub.create_repo("kvfleet-test/tiny-llama", {**folder_files(checkpoint), "pytorch_model.bin": os.urandom(4096)})
    dest = tmp_path / "model"
    r = run_pull_process(hub, "hf://kvfleet-test/tiny-llama", str(dest))
    assert r.returncode == 0, r.stderr
    assert not (dest / "pytorch_model.bin").exists()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    pulled = LLM(model=str(dest), max_num_seqs=2, num_gpu_blocks=16).generate("hello", params)[0]
    source = LLM(model=str(checkpoint), max_num_seqs=2, num_gpu_blocks=16).generate("hello", params)[0]
    assert len(pulled.outputs[0].token_ids) == 4
    assert pulled.outputs[0].token_ids == source.outputs[0].token_ids
