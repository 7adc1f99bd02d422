"""`kvfleet make-model`: random checkpoints that transformers loads, in the presets' real shapes."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
from kvfleet_runtime import cli
from kvfleet_runtime.make_model import make_model
from safetensors import safe_open
from support.tiny_models import tokenizer_dir


def _make(out: Path, preset: str, *extra: str) -> None:
    assert cli.main(["make-model", "--preset", preset, "--out", str(out), *extra]) == 0


def _headers(out: Path) -> dict[str, tuple[str, list[int], str]]:
    """name -> (dtype, shape, file) read from the safetensors headers, without loading data."""
    found = {}
    for f in sorted(out.glob("model-*.safetensors")):
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                assert name not in found, f"{name} is in {found[name][2]} and {f.name}"
                sl = st.get_slice(name)
                found[name] = (sl.get_dtype(), sl.get_shape(), f.name)
    return found


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mixtral",
                                    "tiny-qwen3-moe"])
def test_tiny_preset_loads_in_transformers(tmp_path, preset):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _make(tmp_path, preset, "--dtype", "float32", "--tokenizer", str(tokenizer_dir()))
    config = json.loads((tmp_path / "config.json").read_text())
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert type(model).__name__ == config["architectures"][0]
    assert not info["missing_keys"]
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size) == (64, 2, 4, 2, 128, 49152)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (4 * 16, 64) and attn.k_proj.weight.shape == (2 * 16, 64)
    assert (attn.q_proj.bias is not None) is (preset == "tiny-qwen2")
    assert hasattr(attn, "q_norm") is preset.startswith("tiny-qwen3")
    experts = {"tiny-mixtral": (4, 2), "tiny-qwen3-moe": (8, 2)}.get(preset)
    if experts:         # a mixture of experts: the router and the stacked experts HF builds
        mlp = model.model.layers[0].mlp
        assert mlp.gate.weight.shape == (experts[0], 64)
        assert mlp.experts.gate_up_proj.shape[0] == experts[0]
        assert mlp.gate.top_k == experts[1]
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied is (preset == "tiny-llama") is config["tie_word_embeddings"]

    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        elif p.numel() > 1000:
            assert abs(p.std().item() - 0.02) < 0.002 and abs(p.mean().item()) < 0.002, name
    with torch.no_grad():
        logits = model(torch.tensor([[1, 400, 9000, 49151]])).logits
    assert logits.shape == (1, 4, 49152) and torch.isfinite(logits).all()

    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_id) == (config["bos_token_id"], config["eos_token_id"])
    assert "<|im_start|>user\nhi<|im_end|>" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False)


def test_index_lists_every_tensor_in_its_shard(tmp_path):
    # ~4 MiB shards: the embedding and lm_head (12 MiB each) get shards of their own
    _make(tmp_path, "tiny-qwen2", "--dtype", "float32", "--max-shard-gib", str(4 / 1024),
          "--tokenizer", str(tokenizer_dir()))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    headers = _headers(tmp_path)
    assert index["weight_map"] == {name: file for name, (_, _, file) in headers.items()}
    shards = sorted({file for _, _, file in headers.values()})
    assert len(shards) >= 3
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert index["metadata"]["total_size"] == sum(4 * torch.Size(shape).numel()
                                                  for _, shape, _ in headers.values())
    # 2 layers x (2 norms, q/k/v weight+bias, o, gate, up, down) + embed, final norm, lm_head
    assert len(headers) == 2 * 12 + 3


def test_same_seed_same_weights_other_seed_differs(tmp_path):
    def embedding(seed: int) -> torch.Tensor:
        out = tmp_path / f"seed{seed}-{len(list(tmp_path.iterdir()))}"
        make_model("tiny-llama", out, dtype="float32", seed=seed, tokenizer=str(tokenizer_dir()))
        with safe_open(out / "model-00001-of-00001.safetensors", framework="pt") as st:
            return st.get_tensor("model.embed_tokens.weight")

    first = embedding(0)
    assert torch.equal(first, embedding(0))
    assert not torch.equal(first, embedding(1))


@pytest.mark.slow
def test_llama_3_1_8b_one_layer_has_the_real_shapes(tmp_path):
    from transformers import AutoConfig

    out = tmp_path / "llama8b"
    try:
        _make(out, "llama-3.1-8b", "--num-layers", "1", "--tokenizer", str(tokenizer_dir()))
        headers = _headers(out)
        expected = {
            "model.embed_tokens.weight": [128256, 4096],
            "model.layers.0.input_layernorm.weight": [4096],
            "model.layers.0.self_attn.q_proj.weight": [4096, 4096],
            "model.layers.0.self_attn.k_proj.weight": [1024, 4096],
            "model.layers.0.self_attn.v_proj.weight": [1024, 4096],
            "model.layers.0.self_attn.o_proj.weight": [4096, 4096],
            "model.layers.0.post_attention_layernorm.weight": [4096],
            "model.layers.0.mlp.gate_proj.weight": [14336, 4096],
            "model.layers.0.mlp.up_proj.weight": [14336, 4096],
            "model.layers.0.mlp.down_proj.weight": [4096, 14336],
            "model.norm.weight": [4096],
            "lm_head.weight": [128256, 4096],
        }
        assert {name: shape for name, (_, shape, _) in headers.items()} == expected
        assert {dtype for dtype, _, _ in headers.values()} == {"BF16"}
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(expected)
        assert index["metadata"]["total_size"] == 2 * 1_268_789_248
        cfg = AutoConfig.from_pretrained(out)
        assert (cfg.num_hidden_layers, cfg.vocab_size, cfg.max_position_embeddings) == (1, 128256, 131072)
        assert cfg.rope_parameters == {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192}
        with safe_open(out / headers["lm_head.weight"][2], framework="pt") as st:
            sample = st.get_slice("lm_head.weight")[:64].float()
        assert abs(sample.std().item() - 0.02) < 0.001
    finally:
        shutil.rmtree(out, ignore_errors=True)   # 2.5 GB: do not leave it to pytest's tmp retention


def test_unknown_preset_exits_nonzero_naming_the_presets(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["make-model", "--preset", "gpt-5", "--out", str(tmp_path / "x")])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert "--preset: invalid choice: 'gpt-5'" in err
    for name in ("llama-3.1-8b", "qwen2.5-7b", "llama-2-7b", "llama-3.1-70b", "tiny-llama"):
        assert name in err
    assert not (tmp_path / "x").exists()


def test_byte_level_tokenizer_when_gguf_is_missing(tmp_path, monkeypatch, capsys):
    from transformers import AutoTokenizer

    monkeypatch.setitem(sys.modules, "gguf", None)     # makes `import gguf` fail
    _make(tmp_path, "tiny-llama", "--dtype", "float16")
    assert "byte-level" in capsys.readouterr().err
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == 3 + 256
    text = "héllo wörld ✓"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode()) and tok.decode(ids) == text
    assert tok.decode([40000]) == ""      # past the tokenizer, inside the model's vocab
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                       add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2) == (tok.bos_token_id, tok.eos_token_id)
    assert config["torch_dtype"] == "float16"
    assert {dtype for dtype, _, _ in _headers(tmp_path).values()} == {"F16"}


def test_tokenizer_larger_than_the_vocab_is_refused(tmp_path, capsys):
    assert cli.main(["make-model", "--preset", "llama-2-7b", "--out", str(tmp_path),
                     "--tokenizer", str(tokenizer_dir())]) == 2
    err = capsys.readouterr().err
    assert "has 49152 tokens, more than llama-2-7b's vocab_size 32000; use --tokenizer byte-level" in err
    assert not list(tmp_path.glob("*.safetensors"))


def test_non_empty_out_is_refused(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    assert cli.main(["make-model", "--preset", "tiny-llama", "--out", str(tmp_path)]) == 2
    assert "out must be a new or empty folder" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


@pytest.mark.parametrize("preset", ["tiny-mixtral", "tiny-qwen3-moe"])
def test_moe_presets_serve_hf_greedy_tokens(tmp_path, preset):
    from kvfleet_runtime import LLM, SamplingParams
    from support.hf_reference import hf_greedy
    _make(tmp_path, preset, "--dtype", "float32", "--tokenizer", str(tokenizer_dir()))
    prompts = [[5, 900, 31, 4000, 77], list(range(100, 160))]
    ours = LLM(model=str(tmp_path)).generate(prompts, SamplingParams(temperature=0, max_tokens=8),
                                             use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ours] == hf_greedy(tmp_path, prompts, 8)


@pytest.mark.parametrize(("preset", "experts", "inter"), [("mixtral-8x7b", 8, 14336),
                                                           ("qwen3-30b-a3b", 128, 768)])
def test_moe_presets_real_shapes(preset, experts, inter):
    from kvfleet_runtime.make_model import PRESETS, hf_config, tensor_shapes
    config = hf_config(PRESETS[preset], 1, "bfloat16", 1, 2)
    shapes = dict(tensor_shapes(config))
    block, gate = ("block_sparse_moe", "w1") if preset.startswith("mixtral") else ("mlp", "gate_proj")
    assert shapes[f"model.layers.0.{block}.gate.weight"] == (experts, config["hidden_size"])
    assert shapes[f"model.layers.0.{block}.experts.{experts - 1}.{gate}.weight"] == \
        (inter, config["hidden_size"])
    per_layer = sum(math.prod(s) for n, s in shapes.items() if n.startswith("model.layers."))
    rest = sum(math.prod(s) for n, s in shapes.items() if not n.startswith("model.layers."))
    # the whole model against the published totals: Mixtral 8x7B 46.7B, Qwen3-30B-A3B 30.5B
    total = per_layer * PRESETS[preset].num_hidden_layers + rest
    assert abs(total / {"mixtral-8x7b": 46.7e9, "qwen3-30b-a3b": 30.5e9}[preset] - 1) < 0.005
