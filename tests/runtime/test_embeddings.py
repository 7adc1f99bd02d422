"""Embeddings (kvfleet_runtime/pooling.py): `LLM.embed` and the engine's pooling requests against
HF transformers' base model (the last token's final hidden state, normalised) on tiny random
checkpoints of each architecture; prompts chunked over steps, found in the prefix cache, batched
beside generation; the model's sentence-transformers pooling config; no KV block left behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from kvfleet_runtime import LLM, PoolingParams, SamplingParams
from kvfleet_runtime.config import EngineConfig
from kvfleet_runtime.engine.engine import LLMEngine
from kvfleet_runtime.pooling import embedding_sampling_params
from support.engine_ops import all_blocks_free
from support.tiny_models import ARCHS

PROMPTS = [[(7 * i + 3 * j) % 400 + 5 for j in range(n)] for i, n in enumerate((5, 37, 1, 80))]


def hf_embeddings(path: str, prompts: list[list[int]], normalize: bool = True) -> list[torch.Tensor]:
    from transformers import AutoModel
    hf = AutoModel.from_pretrained(path, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for ids in prompts:
            h = hf(torch.tensor([ids])).last_hidden_state[0, -1]
            out.append(torch.nn.functional.normalize(h, dim=-1) if normalize else h)
    return out


def _close(got: list[float], want: torch.Tensor, tol: float = 1e-4) -> bool:
    return torch.allclose(torch.tensor(got), want.float().cpu(), atol=tol, rtol=tol)


@pytest.mark.parametrize("arch", ARCHS)
def test_each_architecture_embeds_as_hf(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    # a 16-token step budget: the long prompts' prefills span several steps
    llm = LLM(model=path, device="cpu", dtype="float32", num_gpu_blocks=64,
              max_num_batched_tokens=16, max_model_len=128)
    outs = llm.embed(PROMPTS)
    for out, ids, want in zip(outs, PROMPTS, hf_embeddings(path, PROMPTS), strict=True):
        assert out.prompt_token_ids == ids and out.finished
        assert _close(out.outputs.embedding, want), arch
    assert all_blocks_free(llm.engine)


@pytest.fixture(scope="module", params=[("cpu", False), ("cpu", True),
                                        pytest.param(("cuda", None), marks=pytest.mark.gpu)],
                ids=["sync", "async", "gpu"])
def engine(tiny_model_dir, request) -> LLMEngine:
    device, async_scheduling = request.param
    return LLMEngine(EngineConfig(model=tiny_model_dir("llama"), device=device,
                                  async_scheduling=async_scheduling, num_gpu_blocks=64,
                                  max_num_batched_tokens=32, max_model_len=128,
                                  dtype="float32" if device == "cpu" else "bfloat16"))


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_pooling_beside_generation_and_from_the_prefix_cache(engine, tiny_model_dir):
    tol = 1e-4 if engine.config.device == "cpu" else 3e-2
    want = hf_embeddings(tiny_model_dir("llama"), PROMPTS)
    gen = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = _run(engine, {"g": (PROMPTS[3], gen)})["g"].outputs[0].token_ids
    pool = embedding_sampling_params(PoolingParams())
    mixed = _run(engine, {"g": (PROMPTS[3], gen),
                          **{f"e{i}": (ids, pool) for i, ids in enumerate(PROMPTS)}})
    assert mixed["g"].outputs[0].token_ids == alone         # generation unchanged beside them
    assert mixed["g"].embedding is None
    for i, w in enumerate(want):
        assert _close(mixed[f"e{i}"].embedding, w, tol), i
    # again: the long prompts' blocks are cached now (only their last token is computed)
    hits = engine.kv.prefix_cache_hits
    again = _run(engine, {f"e{i}": (ids, pool) for i, ids in enumerate(PROMPTS)})
    assert engine.kv.prefix_cache_hits > hits
    for i, w in enumerate(want):
        assert _close(again[f"e{i}"].embedding, w, tol), i
    assert all_blocks_free(engine)


def test_aborted_pooling_requests_free_their_blocks(engine):
    pool = embedding_sampling_params(PoolingParams())
    for i, ids in enumerate(PROMPTS):
        engine.add_request(f"a{i}", ids, pool)
    engine.step()
    engine.abort_request([f"a{i}" for i in range(len(PROMPTS))])
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()
    assert all_blocks_free(engine)


def test_normalize_dimensions_and_what_is_refused(tiny_model_dir, tmp_path):
    src = Path(tiny_model_dir("qwen3"))
    llm = LLM(model=str(src), device="cpu", dtype="float32", num_gpu_blocks=32, max_model_len=64)
    raw = hf_embeddings(str(src), PROMPTS[:2], normalize=False)
    outs = llm.embed(PROMPTS[:2], PoolingParams(normalize=False))
    assert all(_close(o.outputs.embedding, w) for o, w in zip(outs, raw, strict=True))
    with pytest.raises(ValueError, match="Matryoshka"):
        llm.embed(PROMPTS[0], PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match="one output"):
        llm.generate([PROMPTS[0]], SamplingParams(n=2, max_tokens=1,
                                                  pooling=PoolingParams()))
    with pytest.raises(ValueError, match="positive integer"):
        PoolingParams(dimensions=0)

    # a sentence-transformers folder: its Pooling module decides, Normalize's absence too
    def st_model(name: str, pooling: dict, normalize: bool, **config) -> str:
        path = tmp_path / name
        shutil.copytree(src, path)
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling/config.json").write_text(json.dumps(pooling))
        hf = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**hf, **config}))
        return str(path)

    last = {"word_embedding_dimension": 64, "pooling_mode_lasttoken": True,
            "pooling_mode_mean_tokens": False}
    unnormalized = LLM(model=st_model("st-raw", last, normalize=False), device="cpu",
                       dtype="float32", num_gpu_blocks=32, max_model_len=64)
    assert _close(unnormalized.embed(PROMPTS[0])[0].outputs.embedding, raw[0])
    matryoshka = LLM(model=st_model("st-mrl", last, normalize=True, is_matryoshka=True),
                     device="cpu", dtype="float32", num_gpu_blocks=32, max_model_len=64)
    short = matryoshka.embed(PROMPTS[0], PoolingParams(dimensions=8))[0].outputs.embedding
    assert _close(short, torch.nn.functional.normalize(raw[0][:8], dim=-1))
    with pytest.raises(ValueError, match="hidden size"):
        matryoshka.embed(PROMPTS[0], PoolingParams(dimensions=65))
    mean = LLM(model=st_model("st-mean", {"pooling_mode_mean_tokens": True}, normalize=True),
               device="cpu", dtype="float32", num_gpu_blocks=32, max_model_len=64)
    with pytest.raises(ValueError, match=r"pools by mean .*only last-token"):
        mean.embed(PROMPTS[0])
    assert mean.generate([PROMPTS[0]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_a_checkpoint_saved_from_the_base_model_embeds_and_refuses_to_generate(tiny_model_dir,
                                                                               tmp_path):
    # as Qwen3-Embedding's: tensors named `layers.0...` (no `model.`), no lm_head
    from safetensors.torch import load_file, save_file
    src = Path(tiny_model_dir("qwen3"))
    dst = tmp_path / "embedding-only"
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    assert "lm_head.weight" in weights            # (the tiny qwen3 does not tie it)
    save_file({k.removeprefix("model."): v for k, v in weights.items() if k != "lm_head.weight"},
              dst / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(model=str(dst), device="cpu", dtype="float32", num_gpu_blocks=32, max_model_len=64)
    outs = llm.embed(PROMPTS[:2])
    for out, want in zip(outs, hf_embeddings(str(src), PROMPTS[:2]), strict=True):
        assert _close(out.outputs.embedding, want)
    with pytest.raises(ValueError, match="serves embeddings"):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2))
    assert all_blocks_free(llm.engine)


def test_hf_overrides_make_a_model_matryoshka(tiny_model_dir):
    # vLLM's way for Qwen3-Embedding, whose config.json does not say it: --hf-overrides
    from kvfleet_runtime.loader import merged
    path = tiny_model_dir("qwen3")
    raw = hf_embeddings(path, PROMPTS[:1], normalize=False)[0]
    for overrides in ({"is_matryoshka": True}, '{"is_matryoshka": true}'):
        llm = LLM(model=path, device="cpu", dtype="float32", num_gpu_blocks=16, max_model_len=64,
                  hf_overrides=overrides)
        short = llm.embed(PROMPTS[0], PoolingParams(dimensions=8))[0].outputs.embedding
        assert _close(short, torch.nn.functional.normalize(raw[:8], dim=-1))
    for bad, says in (("{not json", "not JSON"), ("[1]", "JSON object")):
        with pytest.raises(ValueError, match=says):
            EngineConfig(model=path, hf_overrides=bad)
    assert merged({"a": {"x": 1, "y": 2}, "b": 1}, {"a": {"y": 3}, "c": 4}) == \
        {"a": {"x": 1, "y": 3}, "b": 1, "c": 4}
