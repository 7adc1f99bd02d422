"""Adapter slots of one projection: every adapter of a step applied in two launches.

A Linear with P output pieces (qkv: 3) holds, for each of the engine's max_loras slots and each
piece, a rank-R block of A and of B (R = max_lora_rank; an adapter of a smaller rank leaves the
rest zero), side by side, slot by slot (W = P * R columns a slot):
  a [L * W, in]:   rows s*W + p*R .. hold piece p's A of the adapter in slot s
  b [out, L * W]:  piece p's output rows hold its B (times the scaling) in columns s*W + p*R ..
For a step's tokens x [T, in] with each token's slot in `token_slots` (-1: no adapter), the
shrink x @ a^T is one GEMM over every slot; then each token takes its own slot's W columns:
  on a GPU, kvfleet_kernels.lora.lora_expand adds shrunk[t, slot] @ b[:, slot]^T into out in
  one launch (KVFLEET_LORA_KERNEL=0: the torch path below instead);
  elsewhere out += (shrunk * mask) @ b^T, mask[t, c] = 1 where column c's slot is token t's
  (the masks depend only on the width, so StepMasks makes each once a forward, for every layer).
Same shapes every step: the CUDA graphs capture it as it is, and a batch mixes adapters and
base-model requests freely.
"""

from __future__ import annotations

import os

import torch
from kvfleet_kernels.env import on_off

from kvfleet_runtime.layers.backend import use_triton

_KERNEL = on_off("KVFLEET_LORA_KERNEL", os.environ.get("KVFLEET_LORA_KERNEL", ""))


def slot_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The slots' dtype: the model's, except bf16 on a CPU, where the adapters' small matmuls
    run ~5x faster in fp32 (oneDNN's bf16 path has a fixed cost a call)."""
    return torch.float32 if device.type == "cpu" and dtype == torch.bfloat16 else dtype


class StepMasks:
    """This forward's [T, width] masks by width, made at their first use in the forward (inside
    the CUDA graph being captured, when it is one) from the engine's token_slots; clear() at
    the start of every forward. A forward whose last layer runs past its attention on some of
    the step's rows only (ModelRunner) select()s them: a projection of that many rows takes
    their slots."""

    def __init__(self, token_slots: torch.Tensor, max_loras: int, max_rank: int,
                 dtype: torch.dtype) -> None:
        self.token_slots, self.max_loras, self.max_rank = token_slots, max_loras, max_rank
        self.dtype = dtype
        self._masks: dict[int, torch.Tensor] = {}
        self._column_slots: dict[int, torch.Tensor] = {}
        self._selected: torch.Tensor | None = None

    def clear(self) -> None:
        self._masks.clear()

    def select(self, rows: torch.Tensor | None) -> None:
        """The rows of the step the last layer keeps (fewer than the step's tokens), or None."""
        self._selected = None if rows is None else self.token_slots.index_select(0, rows)

    def slots(self, num_tokens: int) -> torch.Tensor:
        """The slots of a projection's num_tokens rows (the first num_tokens entries): the
        step's tokens', or the selected rows' when there are that many of them."""
        selected = self._selected
        if selected is not None and selected.shape[0] == num_tokens:
            return selected
        return self.token_slots

    def __call__(self, num_tokens: int, width: int) -> torch.Tensor:
        mask = self._masks.get(width)
        if mask is None or mask.shape[0] != num_tokens:
            columns = self._column_slots.get(width)
            if columns is None:     # column c belongs to slot c // (width / L)
                columns = self._column_slots[width] = torch.arange(
                    width, device=self.token_slots.device) // (width // self.max_loras)
            mine = self.slots(num_tokens)[:num_tokens, None] == columns
            mask = self._masks[width] = mine.to(self.dtype)
        return mask


class LoRASlots:
    """The slots of one Linear (this rank's part of it under tensor parallelism: a
    column-parallel layer keeps its rows of each piece's B, a row-parallel one its columns of
    A; its partial update then joins the all-reduce with the projection's own)."""

    def __init__(self, layer, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, masks: StepMasks) -> None:
        output_sizes = layer.output_sizes
        self.pieces, self.max_loras, self.max_rank = len(output_sizes), max_loras, max_rank
        # where each piece's rows sit in this rank's output, and where they start in the piece
        self.output_starts = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        self.output_sizes = output_sizes
        self.piece_starts = layer.output_starts
        self.input_start, self.input_size = layer.input_start, layer.input_size
        width = self.pieces * max_loras * max_rank
        self.a = torch.zeros(width, layer.input_size, dtype=dtype, device=device)
        self.b = torch.zeros(sum(output_sizes), width, dtype=dtype, device=device)
        self.masks = masks

    def _columns(self, piece: int, slot: int) -> slice:
        start = (slot * self.pieces + piece) * self.max_rank
        return slice(start, start + self.max_rank)

    def set_slot(self, slot: int, pieces: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put an adapter's (A [r, in], scaled B [out_p, r]; the whole model's sizes) of each
        piece it targets into `slot`, this rank's part (pieces it leaves out, and ranks above
        r, become zero)."""
        for piece in range(self.pieces):
            cols = self._columns(piece, slot)
            self.a[cols].zero_()
            self.b[:, cols].zero_()
            if piece in pieces:
                a, b = pieces[piece]
                r = a.shape[0]
                start, size = self.output_starts[piece], self.output_sizes[piece]
                a = a[:, self.input_start:self.input_start + self.input_size]
                b = b[self.piece_starts[piece]:self.piece_starts[piece] + size]
                self.a[cols.start:cols.start + r].copy_(a)
                self.b[start:start + size, cols.start:cols.start + r].copy_(b)

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out [T, out] (x's projection, a fresh tensor) plus each token's adapter's update."""
        if x.dtype != self.a.dtype:     # bf16 on a CPU: the slots are fp32 (slot_dtype)
            shrunk = x.to(self.a.dtype) @ self.a.t()
            shrunk.mul_(self.masks(x.shape[0], shrunk.shape[1]))
            return out.add_(shrunk @ self.b.t())
        shrunk = x @ self.a.t()                                           # [T, L * P * R]
        if _KERNEL and use_triton(x):
            from kvfleet_kernels.lora import lora_expand
            return lora_expand(out, shrunk, self.b, self.masks.slots(x.shape[0]), self.max_loras)
        shrunk.mul_(self.masks(x.shape[0], shrunk.shape[1]))
        return out.addmm_(shrunk, self.b.t())
