"""Rotary position embedding (neox / rotate_half style), with llama3, linear, YaRN and longrope
scaling, over the whole head or its first rot_dim dims (partial rotary)."""

from __future__ import annotations

import math

import torch
from torch import nn

from kvfleet_runtime.layers.backend import use_triton


def _inv_freq(rot_dim: int, base: float, scaling: dict | None, max_position: int = 0,
              context: int = 0) -> tuple[torch.Tensor, float]:
    """The inverse frequencies, and the factor cos and sin are multiplied by (longrope's and
    YaRN's attention factor; 1 for the others)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in ("default", None):
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "longrope":
        return _longrope(rot_dim, base, scaling, max_position, context)
    if kind == "yarn":
        return _yarn(rot_dim, base, scaling, max_position)
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise ValueError(f"rope_scaling type must be one of default, linear, llama3, longrope, yarn; "
                     f"got {kind!r}")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rot_dim: int, base: float, scaling: dict, max_position: int
          ) -> tuple[torch.Tensor, float]:
    """YaRN (Qwen2.5 / Qwen3 past 32k, as their model cards add it; DeepSeek's mscale pair): the
    frequencies that turn fewer than beta_slow times over the original length interpolated by
    `factor`, those that turn more than beta_fast times kept, a linear ramp between; cos and
    sin scaled by 0.1 ln(factor) + 1 unless attention_factor is given. HF's formula, step for
    step (its rounding too)."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position / original
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                     if mscale and mscale_all_dim else _yarn_mscale(factor))

    def dim_of(rotations: float) -> float:      # the dim turning `rotations` times
        return rot_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp                                  # the extrapolated (unscaled) share
    pos_freqs = base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim)
    return (1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep), float(attention)


def _longrope(rot_dim: int, base: float, scaling: dict, max_position: int,
              context: int) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini): per-frequency factors, the
    long ones for an engine whose contexts may pass original_max_position_embeddings (`context`:
    its max_model_len), else the short ones, for every position (vLLM's rule: one set for every
    sequence, so no cached K changes meaning as a sequence grows past the original length; HF
    switches per forward call, by its longest position: the same result for a prompt beyond
    the original length under the long set, and for a whole sequence within it under the
    short). cos and sin are scaled by sqrt(1 + ln(factor) / ln(original)), factor =
    max_position_embeddings / original unless given, or by attention_factor if given."""
    original = scaling["original_max_position_embeddings"]
    factors = scaling["long_factor"] if context > original else scaling["short_factor"]
    if len(factors) != rot_dim // 2:
        raise ValueError(f"longrope factors must number rotary_dim / 2 = {rot_dim // 2}; "
                         f"got {len(factors)}")
    exponents = torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim
    inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * base ** exponents)
    factor = scaling.get("factor") or max_position / original
    mscale = scaling.get("attention_factor")
    if mscale is None:
        mscale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv_freq, float(mscale)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size: int, rot_dim: int, max_position: int, base: float,
                 scaling: dict | None = None, context: int = 0) -> None:
        # context: the longest context the engine serves (longrope picks its factors by it;
        # 0: max_position)
        super().__init__()
        self.head_size = head_size
        self.rot_dim = rot_dim
        inv_freq, mscale = _inv_freq(rot_dim, base, scaling, max_position, context or max_position)
        t = torch.arange(max_position, dtype=torch.int64).float()
        freqs = t[:, None] * inv_freq[None, :]                           # [P, rot/2]
        # [P, rot]: cos half then sin half (the layout the Triton kernel reads)
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        if mscale != 1.0:
            cos_sin = cos_sin * mscale
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                tables: tuple[torch.Tensor, torch.Tensor] | None = None):
        # positions: [T]; q: [T, Hq*D]; k: [T, Hkv*D]; tables: from prepare(), or None.
        # The torch path (the Triton path rotates inside kvfleet_kernels.rotary.rotary_and_cache)
        if tables is None:
            tables = self.prepare(positions, q.dtype)
        return self.apply_tables(q, tables), self.apply_tables(k, tables)

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This step's cos and signed sin tables for the torch path, made once for all layers
        (None where the Triton kernel reads the cache itself)."""
        if use_triton(positions):
            return None
        cos, sin = self.cos_sin_cache.index_select(0, positions).to(dtype).chunk(2, dim=-1)
        cos = cos[:, None, None, :]                                       # [T, 1, 1, rot/2]
        signed_sin = torch.stack([-sin, sin], dim=1)[:, None]              # [T, 1, 2, rot/2]
        return cos, signed_sin

    def apply_tables(self, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]
                     ) -> torch.Tensor:
        """x: [T, heads*D] (any heads: q, k, or q and k side by side) -> rotated, new tensor.

        HF's x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), i.e. per half
        [x1*cos - x2*sin, x2*cos + x1*sin]: the same products and sums (x2 * -sin is
        -(x2*sin) exactly), as three tensor ops over both halves of every head at once.
        """
        cos, signed_sin = tables
        shape = x.shape
        half = self.rot_dim // 2
        if self.rot_dim == self.head_size:
            x = x.reshape(shape[0], -1, 2, half)                           # [T, H, 2, rot/2]
            return (x * cos + x.flip(2) * signed_sin).view(shape)
        x = x.reshape(shape[0], -1, self.head_size)
        rot = x[..., :self.rot_dim].reshape(shape[0], x.shape[1], 2, half)
        rotated = (rot * cos + rot.flip(2) * signed_sin).flatten(2)
        return torch.cat([rotated, x[..., self.rot_dim:]], dim=-1).reshape(shape)
