"""The engine's adapters: read ones in host memory (LRU of max_cpu_loras), max_loras of them in
device slots, and each step's per-token slot (ModelRunner._prepare plans a step on rank 0,
every rank's forward applies the plan)."""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from kvfleet_runtime.lora import LoRARequest
from kvfleet_runtime.lora.adapter import SLOT_MODULES, LoRAAdapter, load_adapter
from kvfleet_runtime.lora.layers import LoRASlots, StepMasks, slot_dtype

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int,
                 max_tokens: int, dtype: torch.dtype, device: torch.device) -> None:
        from kvfleet_runtime.layers.linear import Linear
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self.device = device
        # each token's slot this step (-1: the base model); rows past the step's are stale
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        dtype = slot_dtype(dtype, device)
        self.masks = StepMasks(self.token_slots, max_loras, max_rank, dtype)
        # every forward (eager, or a graph's capture) makes its own masks
        model.register_forward_pre_hook(lambda module, args: self.masks.clear())
        self.layers: dict[str, LoRASlots] = {}
        modules = {}
        for name, module in model.named_modules():
            if isinstance(module, Linear) and name.rpartition(".")[2] in SLOT_MODULES:
                if len(module.output_sizes) != SLOT_MODULES[name.rpartition(".")[2]]:
                    continue
                module.lora = LoRASlots(module, max_loras, max_rank, dtype, device, self.masks)
                self.layers[name] = module.lora
                modules[name] = module
                # FP8 / W8A8 weights: the norm or activation before the projection hands it
                # its input unquantized (the adapter reads it); the GEMM quantizes it itself
                for producer in getattr(module, "fp8_input_producers", ()):
                    producer.fp8_out = producer.int8_out = False
        # the whole model's sizes (an adapter holds them all; each rank keeps its part)
        self.input_sizes = {n: m.full_input_size for n, m in modules.items()}
        self.output_sizes = {n: m.full_output_sizes for n, m in modules.items()}
        self.cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()     # most recent last
        self.slot_of: OrderedDict[int, int] = OrderedDict()         # adapter id -> slot
        self.known: dict[int, LoRARequest] = {}     # every id read so far: one folder an id
        nbytes = sum(s.a.numel() + s.b.numel() for s in self.layers.values()) * \
            torch.empty(0, dtype=dtype).element_size()
        logger.info("LoRA: %d projections carry %d adapter slots of rank %d (%.1f MiB)",
                    len(self.layers), max_loras, max_rank, nbytes / 2**20)

    def add(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter, read (and checked) now unless it is in host memory already; a
        ValueError says what is wrong with it."""
        known = self.known.get(request.lora_int_id)
        if known is not None and known.lora_path != request.lora_path:
            # (a slot may still hold the first one's weights under this id)
            raise ValueError(f"lora_int_id {request.lora_int_id} is already adapter "
                             f"{known.lora_name!r} ({known.lora_path}); got "
                             f"{request.lora_path!r}")
        adapter = self.cpu.get(request.lora_int_id)
        if adapter is not None:
            self.cpu.move_to_end(request.lora_int_id)
            return adapter
        adapter = load_adapter(request, set(self.layers), self.max_rank, self.input_sizes,
                               self.output_sizes)
        self.cpu[request.lora_int_id] = adapter
        self.known[request.lora_int_id] = request
        while len(self.cpu) > self.max_cpu_loras:
            self.cpu.popitem(last=False)
        logger.info("LoRA adapter %r (id %d, rank %d) read from %s", request.lora_name,
                    request.lora_int_id, adapter.rank, request.lora_path)
        return adapter

    def plan_step(self, requests: list[LoRARequest | None], counts: list[int]
                  ) -> tuple[np.ndarray, tuple[tuple[int, LoRARequest], ...]]:
        """Rank 0, as it prepares a step: each sequence's adapter (None: the base model) and
        its token count -> each token's slot, and the adapters to put into slots first (a
        free slot, else the least recently used one whose adapter is not in this step; the
        scheduler keeps a step to max_loras adapters). apply() carries them out, on every
        rank (the step's broadcast takes them to the tensor-parallel workers)."""
        ids = {r.lora_int_id: r for r in requests if r is not None}
        if len(ids) > self.max_loras:
            raise RuntimeError(f"a step holds {len(ids)} adapters; max_loras is {self.max_loras}")
        loads = []
        for lora_id, request in ids.items():
            if lora_id in self.slot_of:
                self.slot_of.move_to_end(lora_id)
                continue
            used = set(self.slot_of.values())
            free = [s for s in range(self.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next(i for i in self.slot_of if i not in ids)
                slot = self.slot_of.pop(victim)
            self.slot_of[lora_id] = slot
            loads.append((slot, request))
        slots = np.fromiter((-1 if r is None else self.slot_of[r.lora_int_id] for r in requests),
                            dtype=np.int32, count=len(requests))
        return np.repeat(slots, counts), tuple(loads)

    def apply(self, token_slots: torch.Tensor, loads: tuple[tuple[int, LoRARequest], ...]
              ) -> None:
        """A step's plan on this rank: the loads into their slots (this rank's part of each
        adapter), then each token's slot. Ordered on the stream after the step in flight."""
        for slot, request in loads:
            self._load(slot, self.add(request))
        self.token_slots[: token_slots.shape[0]].copy_(token_slots)

    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        pieces: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (module, piece), (a, b) in adapter.weights.items():
            pieces.setdefault(module, {})[piece] = (a, b)
        for name, layer in self.layers.items():
            layer.set_slot(slot, pieces.get(name, {}))
