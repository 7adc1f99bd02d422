"""Adapter slots of one projection: every adapter of a step applied in two matmuls.

A Linear with P output pieces (qkv: 3) holds, for each of the engine's max_loras slots and each
piece, a rank-R block of A and of B (R = max_lora_rank; an adapter of a smaller rank leaves the
rest zero), side by side:
  a [P * L * R, in]:   column block (p, slot) holds piece p's A of the adapter in `slot`
  b [out, P * L * R]:  piece p's output rows hold its B (times the scaling) in block (p, slot)
For a step's tokens x [T, in] with each token's slot in `token_slots` (-1: no adapter):
  delta = ((x @ a^T) * [slot of column == slot of token]) @ b^T
Each token sees only its own adapter's columns (the others are set to zero),
with the same shapes every step: the CUDA graphs capture it as it is, and a batch mixes
adapters and base-model requests freely.
"""

from __future__ import annotations

import torch


class LoRASlots:
    def __init__(self, input_size: int, output_sizes: list[int], max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, token_slots: torch.Tensor) -> None:
        self.pieces, self.max_loras, self.max_rank = len(output_sizes), max_loras, max_rank
        self.output_starts = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        self.output_sizes = output_sizes
        width = self.pieces * max_loras * max_rank
        self.a = torch.zeros(width, input_size, dtype=dtype, device=device)
        self.b = torch.zeros(sum(output_sizes), width, dtype=dtype, device=device)
        # column c belongs to slot (c // R) % L
        self.column_slot = (torch.arange(width, device=device) // max_rank) % max_loras
        self.token_slots = token_slots       # the engine's, written before each step

    def _columns(self, piece: int, slot: int) -> slice:
        start = (piece * self.max_loras + slot) * self.max_rank
        return slice(start, start + self.max_rank)

    def set_slot(self, slot: int, pieces: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put an adapter's (A [r, in], scaled B [out_p, r]) of each piece it targets into
        `slot` (pieces it leaves out, and ranks above r, become zero)."""
        for piece in range(self.pieces):
            cols = self._columns(piece, slot)
            self.a[cols].zero_()
            self.b[:, cols].zero_()
            if piece in pieces:
                a, b = pieces[piece]
                r = a.shape[0]
                start, size = self.output_starts[piece], self.output_sizes[piece]
                self.a[cols.start:cols.start + r].copy_(a)
                self.b[start:start + size, cols.start:cols.start + r].copy_(b)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> the adapters' update [T, out]
        shrunk = x @ self.a.t()                                           # [T, P * L * R]
        other = self.token_slots[: x.shape[0], None] != self.column_slot  # [T, P * L * R]
        return shrunk.masked_fill(other, 0) @ self.b.t()
