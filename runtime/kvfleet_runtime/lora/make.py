"""`kvfleet make-lora`: a random LoRA adapter, in PEFT's format, for a model folder.

As make-model does for weights: the GPU machine has no trained adapter to download, and an
adapter's serving cost depends only on its shapes (rank, targeted projections). Written as
PEFT saves one: adapter_config.json and adapter_model.safetensors with
base_model.model.<module>.lora_A.weight [r, in] and .lora_B.weight [out, r] per projection.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kvfleet_runtime.lora.adapter import CONFIG_FILE, FUSED_NAMES, PROJECTIONS, WEIGHTS_FILE

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection an adapter may target, from an HF config.json."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads", heads) * head_dim
    inter = config["intermediate_size"]
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv),
            "v_proj": (hidden, kv), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden),
            "qkv_proj": (hidden, heads * head_dim + 2 * kv), "gate_up_proj": (hidden, 2 * inter)}


def _fuses_projections(config: dict) -> bool:
    """Whether the model's checkpoint (and so its adapters) names q/k/v and gate/up fused."""
    return config.get("model_type") == "phi3" or "Phi3ForCausalLM" in (
        config.get("architectures") or [])


def make_lora(model: str | Path, out: str | Path, rank: int = 16, alpha: float | None = None,
              targets: tuple[str, ...] = PROJECTIONS, seed: int = 0,
              dtype: str = "bfloat16") -> Path:
    """Write a random adapter of `rank` on `targets` of every layer of the model `model` (an HF
    folder's config.json, or a .gguf file's metadata) to `out` (a new or empty folder); on a
    model whose projections are fused (Phi-3) q/k/v and gate/up become its fused names. A
    mixture of experts' sparse layers take none on their MLP (its experts take no adapter):
    gate/up/down only where a layer is dense, and left out of target_modules where none is."""
    from safetensors.torch import save_file
    model, out = Path(model), Path(out)
    if rank < 1:
        raise ValueError(f"rank must be a positive integer; got {rank}")
    unknown = sorted(set(targets) - set(PROJECTIONS))
    if unknown or not targets:
        raise ValueError(f"targets must be some of {', '.join(PROJECTIONS)}; got {list(targets)}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}; got {dtype!r}")
    if model.suffix == ".gguf":
        from kvfleet_runtime.gguf_loader import load_gguf
        try:
            config = load_gguf(str(model)).config
        except FileNotFoundError as e:
            raise ValueError(str(e)) from e
    else:
        try:
            config = json.loads((model / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{model}: no readable config.json ({e})") from e
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty")
    shapes = projection_shapes(config)
    if _fuses_projections(config):
        targets = tuple(dict.fromkeys(FUSED_NAMES.get(t, t) for t in targets))
    from kvfleet_runtime.models.config import ModelConfig
    sparse = set(ModelConfig.from_hf(config).moe_layers) if "architectures" in config else set()
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    written: set[str] = set()
    for layer in range(config["num_hidden_layers"]):
        for proj in targets:
            parent = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj",
                                             "qkv_proj") else "mlp"
            if parent == "mlp" and layer in sparse:
                continue
            written.add(proj)
            name = f"base_model.model.model.layers.{layer}.{parent}.{proj}"
            fan_in, fan_out = shapes[proj]
            # A as PEFT's kaiming init; B small instead of PEFT's zeros (a no-op adapter)
            a = torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5
            b = torch.randn(fan_out, rank, generator=gen) * (0.02 / rank ** 0.5)
            tensors[f"{name}.lora_A.weight"] = a.to(_DTYPES[dtype])
            tensors[f"{name}.lora_B.weight"] = b.to(_DTYPES[dtype])
    targets = tuple(t for t in targets if t in written)
    if not targets:
        raise ValueError("a mixture of experts' MLP takes no LoRA adapter (its experts): "
                         "target attention projections (q_proj, k_proj, v_proj, o_proj)")
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE))
    adapter_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
                      "lora_alpha": alpha if alpha is not None else 2 * rank,
                      "lora_dropout": 0.0, "bias": "none", "target_modules": list(targets),
                      "base_model_name_or_path": str(model), "use_rslora": False,
                      "use_dora": False, "fan_in_fan_out": False, "inference_mode": True}
    (out / CONFIG_FILE).write_text(json.dumps(adapter_config, indent=2) + "\n")
    return out


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "make-lora", help="write a random LoRA adapter (PEFT format) for a model folder",
        description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None,
                   help="the base model: an HF folder (its config.json) or a .gguf file "
                        "(default: the default model, SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--out", required=True, help="a new or empty folder")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=None, help="lora_alpha (default: 2 x rank)")
    p.add_argument("--targets", default=",".join(PROJECTIONS),
                   help="comma-separated projections (default: all seven)")
    p.add_argument("--dtype", default="bfloat16", choices=list(_DTYPES))
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    try:
        from kvfleet_runtime.config import default_model
        out = make_lora(args.model or default_model(), args.out, args.rank, args.alpha, targets, args.seed,
                        args.dtype)
    except ValueError as e:
        print(f"kvfleet make-lora: error: {e}", file=sys.stderr)
        return 2
    written = json.loads((out / CONFIG_FILE).read_text())["target_modules"]
    print(f"wrote a rank-{args.rank} adapter on {', '.join(written)} to {out}")
    return 0
