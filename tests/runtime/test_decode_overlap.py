"""Decode steps as two overlapped half-batches (layers.overlap): the same tokens as HF."""

from __future__ import annotations

import random

import pytest
import torch
from kvfleet_runtime import LLM, SamplingParams
from kvfleet_runtime.layers import overlap
from kvfleet_runtime.layers.attention import AttentionMetadata
from support.hf_reference import hf_greedy


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randrange(2, 60))] for _ in range(n)]


def _greedy(llm: LLM, prompts, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _decode_meta(n: int, max_seq_len: int = 40) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.arange(100, 100 + n), block_tables=torch.arange(3 * n).view(n, 3),
        seq_lens=torch.arange(1, n + 1, dtype=torch.int32),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32), max_query_len=1,
        max_seq_len=max_seq_len)


def _settings(monkeypatch, min_batch: int) -> None:
    monkeypatch.setattr(overlap, "SETTINGS", overlap.OverlapSettings(min_batch, None, True))


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield
    from kvfleet_runtime.layers.backend import set_backend
    set_backend("auto")


def test_halves_split_rows_and_plan_for_the_whole_batch(monkeypatch, interpreter):
    from kvfleet_runtime.layers.backend import set_backend
    set_backend("triton")
    _settings(monkeypatch, 4)
    x = torch.zeros(7, 8)
    a, b = overlap.decode_halves(x, _decode_meta(7))
    assert a.seq_lens.tolist() == [1, 2, 3] and b.seq_lens.tolist() == [4, 5, 6, 7]
    assert a.slot_mapping.tolist() == [100, 101, 102]
    assert b.block_tables.tolist() == torch.arange(9, 21).view(4, 3).tolist()
    assert a.query_start_loc.tolist() == [0, 1, 2, 3]
    assert b.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    # each half cuts contexts into the partitions the whole batch would (same bits per row)
    assert a.plan_num_seqs == b.plan_num_seqs == 7 and a.max_seq_len == b.max_seq_len == 40
    meta = _decode_meta(7)
    meta.plan_num_seqs = 8                  # a CUDA graph's padded size wins
    assert overlap.decode_halves(x, meta)[1].plan_num_seqs == 8
    # below the smallest batch, prefill or mixed steps, switched off: the plain layer loop
    assert overlap.decode_halves(torch.zeros(3, 8), _decode_meta(3)) is None
    prefill = _decode_meta(7)
    prefill.max_query_len = 5
    assert overlap.decode_halves(x, prefill) is None
    _settings(monkeypatch, 0)
    assert overlap.decode_halves(x, _decode_meta(7)) is None


def test_halves_stay_off_on_the_torch_path(monkeypatch):
    _settings(monkeypatch, 2)
    assert overlap.decode_halves(torch.zeros(8, 4), _decode_meta(8)) is None   # a CPU, no Triton


@pytest.mark.parametrize("name, value", [("KVFLEET_DECODE_OVERLAP", "on"),
                                         ("KVFLEET_OVERLAP_CARVEOUT", "-8"),
                                         ("KVFLEET_OVERLAP_HIGH_PRIORITY", "yes")])
def test_bad_settings_are_refused_by_name(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        overlap.overlap_settings()


def test_settings_parse(monkeypatch):
    monkeypatch.setenv("KVFLEET_DECODE_OVERLAP", "64")
    monkeypatch.setenv("KVFLEET_OVERLAP_CARVEOUT", "16")
    monkeypatch.setenv("KVFLEET_OVERLAP_HIGH_PRIORITY", "0")
    assert overlap.overlap_settings() == overlap.OverlapSettings(64, 16, False)
    for name in ("KVFLEET_DECODE_OVERLAP", "KVFLEET_OVERLAP_CARVEOUT",
                 "KVFLEET_OVERLAP_HIGH_PRIORITY"):
        monkeypatch.delenv(name)
    assert overlap.overlap_settings() == overlap.OverlapSettings(0, None, True)


def _spy(monkeypatch) -> list[int]:
    runs: list[int] = []
    real = overlap.run_layers

    def spy(layers, positions, x, halves):
        runs.append(x.shape[0])
        return real(layers, positions, x, halves)
    monkeypatch.setattr(overlap, "run_layers", spy)
    return runs


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])     # qwen3: q/k norms before the rotary
def test_overlapped_decode_in_the_interpreter_matches_hf(arch, tiny_model_dir, monkeypatch,
                                                         interpreter):
    # the GPU code path's schedule on one stream: each half's layers in the overlapped order
    path = tiny_model_dir(arch)
    prompts = _prompts(5, seed=11)
    ref = hf_greedy(path, prompts, 8)
    _settings(monkeypatch, 2)
    runs = _spy(monkeypatch)
    llm = LLM(model=path, attention_backend="triton", max_num_seqs=5, max_num_batched_tokens=64)
    try:
        assert _greedy(llm, prompts, 8) == ref
        assert runs and max(runs) == 5 and min(runs) >= 2    # decode steps ran as two halves
        kv = llm.engine.kv
        assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_usable_blocks
    finally:
        llm.engine.shutdown()


@pytest.mark.gpu
def test_overlapped_decode_on_gpu_matches_hf_fp32_and_graphs_match_eager(tiny_model_dir,
                                                                           monkeypatch):
    # two streams, inside the decode CUDA graphs too
    path = tiny_model_dir("llama3")
    prompts = _prompts(24, seed=5)
    _settings(monkeypatch, 2)
    runs = _spy(monkeypatch)
    graphed = LLM(model=path, dtype="float32", max_num_seqs=32)
    assert _greedy(graphed, prompts, 12) == hf_greedy(path, prompts, 12)
    assert graphed.engine.runner.graph_runner.graphs and runs
    bf16 = _greedy(LLM(model=path, dtype="bfloat16", max_num_seqs=32), prompts, 16)
    eager = LLM(model=path, dtype="bfloat16", max_num_seqs=32, enforce_eager=True)
    assert _greedy(eager, prompts, 16) == bf16
