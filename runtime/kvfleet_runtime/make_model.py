"""`kvfleet make-model`: random-weight checkpoints in real architectures' shapes.

The GPU machine cannot download weights, yet benchmarks need the real work of a
Llama-3.1-8B or Qwen2.5-7B forward pass. This module owns the presets (shapes
of those models and tiny ones for tests) and writes an HF folder for one:
config.json, generation_config.json, sharded safetensors with
model.safetensors.index.json, and tokenizer files.

Weights are normal(0, 0.02) (norm weights 1), generated on the fastest device
one shard at a time, so a 70B shape never sits in memory whole; while one
shard is written to disk the next is generated.

Runs with torch, safetensors, transformers and tokenizers only; gguf (for the
default SmolLM2 tokenizer) is imported only when present.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

GiB = 1024 ** 3
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
BYTE_LEVEL = "byte-level"
INIT_STD = 0.02
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# a mixture of experts' checkpoint names: its sparse MLP, each expert's gate, up, down
_MOE_NAMES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
              "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj")}
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# ChatML, as SmolLM2 and Qwen use; for the byte-level fallback tokenizer
_CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
           "{{ message['content'] }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@dataclass(frozen=True)
class Preset:
    """The shape of one architecture; qkv bias (qwen2) and q/k norm (qwen3) follow model_type."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    head_dim: int | None = None      # None: hidden_size // num_attention_heads
    # a mixture of experts (mixtral, qwen3_moe): every layer sparse, num_experts MLPs of
    # moe_intermediate_size (mixtral: intermediate_size), experts_per_tok a token
    num_experts: int = 0
    experts_per_tok: int = 0
    moe_intermediate_size: int = 0


def _llama3(hidden: int, layers: int, heads: int, intermediate: int) -> Preset:
    return Preset("llama", 128256, hidden, layers, heads, 8, intermediate, 131072,
                  rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE)


def _tiny(model_type: str, **kw: Any) -> Preset:
    # vocab = SmolLM2's tokenizer, so every sampled id decodes to text
    return Preset(model_type, 49152, 64, 2, 4, 2, 128, 2048, **kw)


PRESETS: dict[str, Preset] = {
    "llama-3.1-8b": _llama3(4096, 32, 32, 14336),
    "llama-3.1-70b": _llama3(8192, 80, 64, 28672),
    "llama-2-7b": Preset("llama", 32000, 4096, 32, 32, 32, 11008, 4096),
    "qwen2.5-7b": Preset("qwen2", 152064, 3584, 28, 28, 4, 18944, 32768,
                         rope_theta=1e6, rms_norm_eps=1e-6),
    "qwen3-8b": Preset("qwen3", 151936, 4096, 36, 32, 8, 12288, 40960,
                       rope_theta=1e6, rms_norm_eps=1e-6, head_dim=128),
    "tiny-llama": _tiny("llama", tie_word_embeddings=True),
    "tiny-qwen2": _tiny("qwen2", rope_theta=1e6, rms_norm_eps=1e-6),
    "tiny-qwen3": _tiny("qwen3", rope_theta=1e6, rms_norm_eps=1e-6, head_dim=16),
    # mixtures of experts: Mixtral 8x7B (47B parameters, 94 GB in bf16: an H200) and
    # Qwen3-30B-A3B (30.5B, 61 GB)
    "mixtral-8x7b": Preset("mixtral", 32000, 4096, 32, 32, 8, 14336, 32768, rope_theta=1e6,
                           num_experts=8, experts_per_tok=2, moe_intermediate_size=14336),
    "qwen3-30b-a3b": Preset("qwen3_moe", 151936, 2048, 48, 32, 4, 6144, 40960, rope_theta=1e6,
                            rms_norm_eps=1e-6, head_dim=128, num_experts=128,
                            experts_per_tok=8, moe_intermediate_size=768),
    "tiny-mixtral": _tiny("mixtral", num_experts=4, experts_per_tok=2, moe_intermediate_size=128),
    "tiny-qwen3-moe": _tiny("qwen3_moe", rope_theta=1e6, rms_norm_eps=1e-6, head_dim=16,
                            num_experts=8, experts_per_tok=2, moe_intermediate_size=32),
}


def hf_config(preset: Preset, num_layers: int | None, dtype: str,
              bos_token_id: int | None, eos_token_id: int | None) -> dict[str, Any]:
    """config.json for `preset`, optionally cut to its first `num_layers` layers."""
    return {
        "architectures": [_ARCHITECTURES[preset.model_type]],
        "model_type": preset.model_type,
        "vocab_size": preset.vocab_size,
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": num_layers or preset.num_hidden_layers,
        "num_attention_heads": preset.num_attention_heads,
        "num_key_value_heads": preset.num_key_value_heads,
        "head_dim": preset.head_dim or preset.hidden_size // preset.num_attention_heads,
        "hidden_act": "silu",
        "rms_norm_eps": preset.rms_norm_eps,
        "rope_theta": preset.rope_theta,
        "rope_scaling": preset.rope_scaling,
        "max_position_embeddings": preset.max_position_embeddings,
        "tie_word_embeddings": preset.tie_word_embeddings,
        "attention_bias": preset.model_type == "qwen2",
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": dtype,
        **({} if not preset.num_experts else
           {"num_local_experts": preset.num_experts, "num_experts_per_tok": preset.experts_per_tok}
           if preset.model_type == "mixtral" else
           {"num_experts": preset.num_experts, "num_experts_per_tok": preset.experts_per_tok,
            "moe_intermediate_size": preset.moe_intermediate_size, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": []}),
    }


def tensor_shapes(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the checkpoint `config` describes: (HF name, shape), in HF's order."""
    hidden, ffn = config["hidden_size"], config["intermediate_size"]
    head_dim = config["head_dim"]
    q_rows = config["num_attention_heads"] * head_dim
    kv_rows = config["num_key_value_heads"] * head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (config["vocab_size"], hidden))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.append((p + "input_layernorm.weight", (hidden,)))
        for proj, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
            shapes.append((p + f"self_attn.{proj}_proj.weight", (rows, hidden)))
            if config["attention_bias"]:
                shapes.append((p + f"self_attn.{proj}_proj.bias", (rows,)))
        if config["model_type"] in ("qwen3", "qwen3_moe"):
            shapes += [(p + "self_attn.q_norm.weight", (head_dim,)),
                       (p + "self_attn.k_norm.weight", (head_dim,))]
        shapes += [(p + "self_attn.o_proj.weight", (hidden, q_rows)),
                   (p + "post_attention_layernorm.weight", (hidden,))]
        if config["model_type"] in _MOE_NAMES:
            block, gate, up, down = _MOE_NAMES[config["model_type"]]
            experts = config.get("num_experts") or config["num_local_experts"]
            inter = config.get("moe_intermediate_size") or ffn
            shapes.append((p + f"{block}.gate.weight", (experts, hidden)))
            for e in range(experts):
                q = p + f"{block}.experts.{e}."
                shapes += [(q + f"{gate}.weight", (inter, hidden)),
                           (q + f"{up}.weight", (inter, hidden)),
                           (q + f"{down}.weight", (hidden, inter))]
            continue
        shapes += [(p + "mlp.gate_proj.weight", (ffn, hidden)),
                   (p + "mlp.up_proj.weight", (ffn, hidden)),
                   (p + "mlp.down_proj.weight", (hidden, ffn))]
    shapes.append(("model.norm.weight", (hidden,)))
    if not config["tie_word_embeddings"]:
        shapes.append(("lm_head.weight", (config["vocab_size"], hidden)))
    return shapes


def plan_shards(shapes: list[tuple[str, tuple[int, ...]]], itemsize: int,
                max_shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Split tensors, in order, into shards of at most max_shard_bytes (a bigger tensor gets its own)."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        nbytes = itemsize * math.prod(shape)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def byte_level_tokenizer():
    """A minimal tokenizer for when no real one is at hand: 256 byte tokens + ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # ids 0-2 as in SmolLM2, so configs agree on bos/eos whichever tokenizer was written
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(specials + alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", unk_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", chat_template=_CHATML)


def load_tokenizer(source: str | None):
    """`source`: a tokenizer folder, "byte-level", or None for SmolLM2's (byte-level without gguf)."""
    if source == BYTE_LEVEL:
        return byte_level_tokenizer()
    if source is not None:
        from transformers import AutoTokenizer

        if not os.path.isdir(source):
            raise ValueError(f"--tokenizer must be a folder or {BYTE_LEVEL!r}; got {source!r}")
        return AutoTokenizer.from_pretrained(source)
    from .config import default_model
    from .gguf_loader import gguf_tokenizer
    try:
        import gguf  # noqa: F401  (transformers reads GGUF tokenizers through it)
        path = default_model()
    except (ImportError, ValueError) as e:
        print(f"make-model: default SmolLM2 tokenizer unavailable ({e}); writing a byte-level "
              "tokenizer", file=sys.stderr)
        return byte_level_tokenizer()
    return gguf_tokenizer(path)


@dataclass
class MadeModel:
    path: Path
    num_params: int
    num_bytes: int
    shard_files: list[str] = field(default_factory=list)
    seconds: float = 0.0


def make_model(preset: str, out: str | os.PathLike, dtype: str = "bfloat16", seed: int = 0,
               num_layers: int | None = None, tokenizer: str | None = None,
               device: str = "auto", max_shard_bytes: int = 4 * GiB) -> MadeModel:
    """Write a random-weight HF checkpoint of `preset` to `out` (a new or empty folder)."""
    start = time.perf_counter()
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}; got {preset!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    if num_layers is not None and num_layers < 1:
        raise ValueError(f"num_layers must be a positive integer; got {num_layers!r}")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"out must be a new or empty folder; {str(out)!r} is not empty")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    out.mkdir(parents=True, exist_ok=True)

    tok = load_tokenizer(tokenizer)
    vocab_size = PRESETS[preset].vocab_size
    if len(tok) > vocab_size:
        # ids past the embedding would crash the model; ids past the tokenizer only decode to ""
        if tokenizer is not None:
            raise ValueError(f"tokenizer: {tokenizer!r} has {len(tok)} tokens, more than "
                             f"{preset}'s vocab_size {vocab_size}; use --tokenizer {BYTE_LEVEL}")
        tok = byte_level_tokenizer()
    tok.save_pretrained(out)
    config = hf_config(PRESETS[preset], num_layers, dtype, tok.bos_token_id, tok.eos_token_id)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json",
                {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id})

    torch_dtype = DTYPES[dtype]
    shards = plan_shards(tensor_shapes(config), torch_dtype.itemsize, max_shard_bytes)
    made = MadeModel(path=out, num_params=0, num_bytes=0)
    weight_map: dict[str, str] = {}
    gen = torch.Generator(device=device).manual_seed(seed)
    # one writer thread: shard i goes to disk while shard i+1 is generated (2 shards in memory)
    with ThreadPoolExecutor(max_workers=1) as writer:
        pending: Future | None = None
        for i, shard in enumerate(shards):
            tensors = {name: _random_tensor(name, shape, torch_dtype, device, gen)
                       for name, shape in shard}
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            if pending is not None:
                pending.result()
            pending = writer.submit(_save_shard, tensors, out / fname)
            for name, t in tensors.items():
                weight_map[name] = fname
                made.num_params += t.numel()
                made.num_bytes += t.numel() * t.element_size()
            made.shard_files.append(fname)
        if pending is not None:
            pending.result()
    _write_json(out / "model.safetensors.index.json",
                {"metadata": {"total_size": made.num_bytes}, "weight_map": weight_map})
    made.seconds = time.perf_counter() - start
    return made


def _random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: str,
                   gen: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    t = torch.randn(shape, generator=gen, dtype=dtype, device=device).mul_(INIT_STD)
    return t.cpu()


def _save_shard(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})
    # safetensors creates files 0600; a serving pod may run as another user than the writer
    path.chmod(0o644)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text!r}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "make-model", help="write a random-weight checkpoint in a real model's shape",
        description=__doc__.splitlines()[0])
    p.add_argument("--preset", required=True, choices=list(PRESETS))
    p.add_argument("--out", required=True, help="a new or empty folder")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-layers", type=_positive_int, default=None,
                   help="keep only the first N layers (default: the preset's)")
    p.add_argument("--tokenizer", default=None,
                   help=f"a tokenizer folder to copy, or {BYTE_LEVEL!r} (default: SmolLM2's "
                        "from the default GGUF; byte-level when gguf is not installed)")
    p.add_argument("--device", default="auto", help="where weights are generated (default: cuda if present)")
    p.add_argument("--max-shard-gib", type=float, default=4.0)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        made = make_model(args.preset, args.out, dtype=args.dtype, seed=args.seed,
                          num_layers=args.num_layers, tokenizer=args.tokenizer,
                          device=args.device, max_shard_bytes=int(args.max_shard_gib * GiB))
    except ValueError as e:
        print(f"kvfleet make-model: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.preset} ({made.num_params / 1e9:.2f}B params, "
          f"{made.num_bytes / GiB:.2f} GiB {args.dtype}, {len(made.shard_files)} shards) "
          f"to {made.path} in {made.seconds:.1f} s")
    return 0
