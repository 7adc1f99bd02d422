"""Model runner: SchedulerOutput -> input tensors -> forward -> sampled tokens.

Owns the KV cache tensors (sized from memory), builds the flat batch
(input_ids, positions, slot_mapping, block tables) and, on CUDA, replays
captured CUDA graphs for decode-only batches.

Under tensor parallelism every rank has a runner over its shard of the model: rank 0's
`execute` builds the step and broadcasts it, the other ranks run `execute_remote` in their
worker loop; all run the same forward (graphs included), rank 0 alone gets logits and samples.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch
import triton
from kvfleet_kernels.env import on_off
from kvfleet_kernels.paged_attention import FP8_KV_DTYPE, head_major_k, token_major_v

from kvfleet_runtime.config import EngineConfig
from kvfleet_runtime.distributed.communication import StepInputs, broadcast_step, min_over_ranks
from kvfleet_runtime.engine.cuda_graphs import context_buckets, decode_plan, graph_batch_sizes
from kvfleet_runtime.engine.scheduler import SchedulerOutput
from kvfleet_runtime.layers.attention import AttentionMetadata
from kvfleet_runtime.layers.backend import use_triton
from kvfleet_runtime.layers.sampler import (
    LogprobTensors,
    SampledToken,
    Sampler,
    SamplingBatch,
    sampled_tokens,
    verify_drafts,
)
from kvfleet_runtime.loader import LoadedModel

log = logging.getLogger(__name__)


@dataclass
class LogitsLayout:
    """Where each use of a step's logits rows sits (indices into those rows, in order)."""
    sample: list[int] = field(default_factory=list)        # one per sampling request
    prompt: list[tuple] = field(default_factory=list)      # (request, first row, count)
    # speculative decoding: one (first row, count) per request with drafts, whose rows (its
    # last token's and its drafts') are not in `sample`
    spec: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class PendingStep:
    """A launched step whose sampled tokens are still on (or coming back from) the device."""
    rows: dict[str, int]                 # request id -> its row in token_ids
    token_ids: torch.Tensor | None       # [S] on the device: the next step's inputs read it there
    host_ids: torch.Tensor | None        # [S] the same, copied back without blocking
    done: torch.cuda.Event | None        # recorded after those copies (None on a CPU)
    prepare_s: float = 0.0
    logprobs: LogprobTensors | None = None        # rows that asked for logprobs ...
    host_logprobs: list[torch.Tensor] = field(default_factory=list)   # ... copied back
    num_top: list[int | None] = field(default_factory=list)


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)       # request id -> its new token
    # speculative decoding: request id -> its accepted drafts and the token after them (with
    # their logprobs where the request asks for them)
    spec_tokens: dict[str, list[SampledToken]] = field(default_factory=dict)
    # the requests that asked for logprobs: their new token's (SampledToken: logprob, rank,
    # top-k); no object a row for the others (~1000 rows a step)
    logprobs: dict[str, SampledToken] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[SampledToken]] = field(default_factory=dict)
    # pooling requests whose prompt ended this step: request id -> its embedding
    embeddings: dict[str, list[float]] = field(default_factory=dict)
    prepare_s: float = 0.0       # CPU time building inputs
    forward_s: float = 0.0       # forward + sampling, synchronised (async: the wait for them)


def host_to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor without waiting for the device: on CUDA through pinned
    memory (a copy from pageable memory may synchronise with the stream, and async scheduling
    needs every launch to return at once)."""
    cuda = device.type == "cuda"
    return torch.tensor(data, dtype=dtype, pin_memory=cuda).to(device, non_blocking=cuda)


def numpy_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """As host_to_device, for an array built by numpy."""
    t = torch.from_numpy(array)
    cuda = device.type == "cuda"
    return (t.pin_memory() if cuda else t).to(device, non_blocking=cuda)


def _copy_to_host(t: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of a device tensor, enqueued without waiting."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def _grammar_matchers(sampling: list, rows: list[int], prev: PendingStep | None) -> list:
    """The SequenceGrammars of sampling[rows] (structured outputs), each fed every token of its
    sequence first: those on the host, and with async scheduling the one `prev` (the step still
    in flight) sampled, read back once it is done (this step's forward is queued already, so
    the GPU does not wait); None for a row whose grammar is done (its sequence stops with the
    token `prev` gives it, and this step's token is dropped)."""
    out = []
    host_ids = None
    for i in rows:
        r = sampling[i].request
        grammar = r.grammar
        if grammar is None:
            out.append(None)
            continue
        grammar.catch_up(r.output_token_ids)
        if r.num_pending and prev is not None and grammar.fed == len(r.output_token_ids):
            if host_ids is None:
                if prev.done is not None:
                    prev.done.synchronize()
                host_ids = prev.host_ids.tolist()
            grammar.feed([host_ids[prev.rows[r.request_id]]])
        out.append(None if grammar.done else grammar)
    return out


def _expand_drafts(scheduled: list, tables: list[list[int]]):
    """Speculative decoding's step layout (ModelRunner._prepare): each request with d drafts
    becomes d + 1 one-token sequences (its last token, then each draft, at consecutive
    positions, all over its blocks); the others stay as they are. -> the per-sequence
    (requests, starts, token counts, block-id lists), the step's input ids, and each scheduled
    request's first sequence."""
    reqs, starts, nums, out_tables, ids, first = [], [], [], [], [], []
    for s, table in zip(scheduled, tables, strict=True):
        r, start = s.request, s.request.num_computed_tokens
        first.append(len(nums))
        if s.spec_token_ids:
            for j, token in enumerate((r.all_token_ids[start], *s.spec_token_ids)):
                reqs.append(r)
                starts.append(start + j)
                nums.append(1)
                out_tables.append(table)
                ids.append(token)
        else:
            reqs.append(r)
            starts.append(start)
            nums.append(s.num_new_tokens)
            out_tables.append(table)
            ids.extend(r.all_token_ids[start:start + s.num_new_tokens])
    return reqs, starts, nums, out_tables, ids, first


def _padded_table(rows: list[list[int]]) -> np.ndarray:
    """Block-id lists -> [len(rows), longest] int32, zero-padded, without a Python loop per id
    (1000-token contexts make this ~250 rows x 60+ ids every step)."""
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    flat = np.fromiter(chain.from_iterable(rows), dtype=np.int32, count=int(lengths.sum()))
    table = np.zeros((len(rows), int(lengths.max())), dtype=np.int32)
    table[np.arange(table.shape[1]) < lengths[:, None]] = flat
    return table


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel) -> None:
        self.config = config
        self.model = loaded.model
        self.model_config = loaded.config
        self.dtype = loaded.dtype
        self.kv_cache_dtype = config.resolve_kv_cache_dtype(loaded.dtype)
        self.device = config.torch_device
        self.block_size = config.block_size
        self.sampler = Sampler()
        # most sampled rows (and decode sequences) a step has: a request with speculative drafts
        # runs as 1 + num_speculative_tokens of them
        spec = config.speculative
        self.max_rows = config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0))
        self.num_kv_heads = self.model.attention_layers()[0].num_kv_heads     # on this rank
        self.lora = None      # LoRA adapters' slots, before the memory profile and the graphs
        if config.enable_lora:
            from kvfleet_runtime.lora.manager import LoRAManager
            most_rows = max(graph_batch_sizes(self.max_rows), default=0)
            self.lora = LoRAManager(
                self.model, config.max_loras, config.max_lora_rank,
                config.max_cpu_loras or config.max_loras,
                max(config.max_num_batched_tokens, self.max_rows, most_rows), self.dtype,
                self.device)
        # eager steps run the last layer past its attention on the rows whose logits they
        # want only (adapters: those rows keep their slots, StepMasks.select);
        # KVFLEET_LAST_LAYER_ROWS=0: on every row (an A/B switch)
        self.last_layer_rows = on_off(
            "KVFLEET_LAST_LAYER_ROWS", os.environ.get("KVFLEET_LAST_LAYER_ROWS", ""))
        self._check_kv_cache_dtype()
        self._bind_kv_scales()
        # every rank holds the same block ids, so the pool is the smallest rank's
        self.num_blocks = min_over_ranks(self._determine_num_blocks())
        self._allocate_kv_cache()
        self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)
        # the decode graphs' sizes, also when there are none: eager decode steps plan split-KV
        # attention for them (cuda_graphs.decode_plan)
        self.decode_batch_sizes = graph_batch_sizes(self.max_rows)
        self.decode_buckets = context_buckets(config.max_model_len)
        self.graph_runner = None
        self._hidden: torch.Tensor | None = None    # _forward's, kept for pooling
        if self.device.type == "cuda":
            self._tune_gemms()
        # the torch attention path reads host-side lengths each step: a graph would replay the
        # captured ones, so it runs eagerly (it is the comparison path, not the fast one)
        if (self.device.type == "cuda" and not config.enforce_eager
                and use_triton(torch.empty(0, device=self.device))):
            from kvfleet_runtime.engine.cuda_graphs import CUDAGraphRunner
            self.graph_runner = CUDAGraphRunner(self)
            self.graph_runner.capture_all()
        if self.device.type == "cuda":
            self._warm_up_logits()
            if use_triton(torch.empty(0, device=self.device)) and on_off(
                    "KVFLEET_WARM_UP_STEPS", os.environ.get("KVFLEET_WARM_UP_STEPS", "")):
                self._warm_up_eager_steps()

    @torch.inference_mode()
    def _tune_gemms(self) -> None:
        """KVFLEET_CUBLASLT_TUNE=1: time cuBLASLt's algorithms for each unquantized projection
        (and the lm_head) at the full prefill chunk and KVFLEET_CUBLASLT_ROWS' row counts,
        before the graphs capture them (kvfleet_kernels.cublaslt); one log line a shape."""
        from kvfleet_kernels import cublaslt

        from kvfleet_runtime.distributed.layers import VocabParallelEmbedding
        from kvfleet_runtime.layers.linear import Linear, LinearMethod
        if not cublaslt.tune_requested():
            return
        rows = cublaslt.tune_rows(self.config.max_num_batched_tokens)
        # the lm_head runs on the sampled rows only: never a whole prefill chunk
        sampled = [r for r in rows if r != self.config.max_num_batched_tokens]
        jobs: dict[tuple[int, ...], tuple[torch.Tensor, list[int]]] = {}
        for module in self.model.modules():
            if (isinstance(module, Linear) and type(module.linear_method) is LinearMethod
                    and module.bias is None and module.weight.dtype == self.dtype):
                jobs.setdefault(tuple(module.weight.shape), (module.weight, rows))
            elif (isinstance(module, VocabParallelEmbedding) and module.weight.dtype == self.dtype
                    and sampled):
                weight = module.local_rows()
                jobs.setdefault(tuple(weight.shape), (weight, sampled))
        start = time.perf_counter()
        # the plans point at the KV pool for their inputs' shape (TunedGemm): no memory of their own
        report = cublaslt.tune(jobs.values(), scratch=self.kv_cache)
        for line in report:
            log.info("cuBLASLt tuning %s", line)
        log.info("cuBLASLt tuning: %d shapes in %.1f s", len(report), time.perf_counter() - start)

    @torch.inference_mode()
    def _warm_up_logits(self) -> None:
        """The lm_head GEMM once at every sampled-row count a step can have, in steps of 8.

        cuBLAS picks its kernel by the row count, and a kernel's first launch loads its module
        (CUDA loads lazily). In a running batch that stalled the asynchronous pipeline for a
        whole step, the first time a mixed step sampled a new count (128/128 at 1024 running,
        H200: the steps of 510 and 879 rows took ~730 ms instead of ~370, on a fresh engine
        only). Warming every count (not only multiples of 8) also removed the one stall left
        (510 rows) but gained no throughput: the host waited while the GPU had queued work.
        Under tensor parallelism every rank runs the same calls (lm_head gathers)."""
        top = self.max_rows
        hidden = torch.zeros(top, self.model_config.hidden_size, dtype=self.dtype,
                             device=self.device)
        for rows in sorted({1, 2, 4, *range(8, top + 1, 8), top}):
            self.model.compute_logits(hidden[:rows])
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    @torch.inference_mode()
    def _warm_up_eager_steps(self) -> None:
        """Eager forwards of a prefill step and of mixed steps (a prompt chunk beside decode
        rows), as serving first meets them, before any request comes: Triton compiles a
        kernel on its first launch with new constants, and the decode graphs and the memory
        profile never run the prefill kernel (nor the decode kernel's eager tile shapes), so a
        fresh server's first requests waited seconds on those compiles (a fresh 8B server on
        the H200 streamed its first 1000 requests 30% slower than the next 1000, ~40% of the
        engine's time in Triton's compiler). Nothing is written (slots -1); reads go to the
        null block. Then the sampler, greedy and at a temperature. Every tensor-parallel rank
        runs the same steps. KVFLEET_WARM_UP_STEPS=0 skips them (an A/B switch)."""
        start = time.perf_counter()
        shapes = self._warm_up_shapes()
        for rows, context, chunk in shapes:
            # the rows a step whose prompt chunk ends its prompt wants: the decode rows', the last
            wanted = None
            if self.last_layer_rows:
                wanted = torch.arange(rows + 1, device=self.device)
                wanted[-1] = rows + chunk - 1
            self.model(*self._synthetic_step(rows, context, chunk), wanted)
        logits = self.model.compute_logits(
            torch.zeros(2, self.model_config.hidden_size, dtype=self.dtype, device=self.device))
        if logits is not None:          # (rank 0 of a tensor-parallel group samples)
            from kvfleet_runtime.sampling_params import SamplingParams
            for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)):
                for rows in (1, 2):
                    self.sampler.sample_on_device(logits[:rows], SamplingBatch(
                        params=[params] * rows, prompt_token_ids=[[0]] * rows,
                        output_token_ids=[[]] * rows, generators=[None] * rows))
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        log.info("warmed up %d prefill and mixed step shapes and the sampler in %.1f s",
                 len(shapes), time.perf_counter() - start)

    def _warm_up_shapes(self) -> list[tuple[int, int, int]]:
        """(decode rows, their context, prompt chunk) of the warm-up's steps: a prefill alone,
        then one mixed step for each launch of the decode kernels that differs in its compiled
        constants (tiles, preloading, the reduce's padded split count and whether that count is
        a multiple of 16), as decode_launch chooses them for the eager steps'
        batches (the decode graphs compiled theirs)."""
        from kvfleet_kernels.paged_attention import decode_launch, decode_preload, decode_split
        cfg = self.config
        chunk = max(1, min(17, cfg.max_model_len - 1, cfg.max_num_batched_tokens - 1))
        shapes = [(0, 0, max(1, min(32, cfg.max_model_len - 1, cfg.max_num_batched_tokens)))]
        fp8 = self.kv_cache_dtype == FP8_KV_DTYPE
        elem, head_dim, heads = (self.kv_cache.element_size(), self.model_config.head_dim,
                                 self.num_kv_heads)
        # a mixed step's sequences (its decode rows and the prompt's): every count while the
        # decode kernel may split contexts, then the graphs' sizes + 1 (the tiles change with
        # the count only at thresholds that sit on them) and the largest
        most = min(self.max_rows, cfg.max_num_batched_tokens - chunk + 1)
        counts = {most, *(b + 1 for b in self.decode_batch_sizes if b + 1 <= most)}
        split_counts = set()
        for seqs in range(2, most + 1):
            if decode_split(seqs, heads, cfg.max_model_len, 16, self.device).num_splits == 1:
                break
            split_counts.add(seqs)
        # contexts: every 16 tokens up to 8192 (the tiles and the partitions' rounding move
        # there), then every 25% more (a long context splits into as many partitions as a
        # shorter one)
        contexts = list(range(chunk, min(cfg.max_model_len, 8192), 16))
        while contexts[-1] * 1.25 < cfg.max_model_len - 1:
            contexts.append(int(contexts[-1] * 1.25))
        contexts.append(cfg.max_model_len - 1)
        # the layers' attention windows (0: full) launch differently at one context
        windows = sorted(set(self.model_config.sliding_windows)) or [0]

        def launch(seqs: int, context: int, window: int) -> tuple:
            tile, split = decode_launch(seqs, heads, context, window, True, fp8, self.device)
            splits = split.num_splits if seqs in split_counts else 1
            return (tile, decode_preload(seqs * heads, tile.block_n, head_dim, elem),
                    triton.next_power_of_2(splits), splits % 16 == 0)

        seen = set()
        for seqs in sorted(counts | split_counts):
            for context in contexts:
                key = tuple(launch(seqs, context, window) for window in windows)
                if key not in seen:
                    seen.add(key)
                    shapes.append((seqs - 1, context, chunk))
        return shapes

    def _synthetic_step(self, rows: int, context: int, chunk: int
                        ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input ids, positions, metadata) of a step of `rows` decode rows of `context` tokens
        each, then a prompt chunk of `chunk` tokens: zeros, written nowhere, reading block 0."""
        dev = self.device
        seq_lens = [context] * rows + [chunk]
        width = -(-max(seq_lens) // self.block_size)
        starts = list(range(rows + 1)) + [rows + chunk]
        positions = [context - 1] * rows + list(range(chunk))
        meta = AttentionMetadata(
            slot_mapping=torch.full((rows + chunk,), -1, dtype=torch.long, device=dev),
            block_tables=torch.zeros(rows + 1, width, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            max_query_len=chunk, max_seq_len=max(seq_lens), seq_lens_cpu=seq_lens,
            query_start_loc_cpu=starts, min_query_len=1 if rows else chunk)
        ids = torch.zeros(rows + chunk, dtype=torch.long, device=dev)
        return ids, torch.tensor(positions, dtype=torch.long, device=dev), meta

    # ---- KV memory ---------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        c = self.model_config
        elem = torch.tensor([], dtype=self.kv_cache_dtype).element_size()
        return 2 * c.num_layers * self.block_size * self.num_kv_heads * c.head_dim * elem

    def _check_kv_cache_dtype(self) -> None:
        # Triton converts to and from e4m3 (its fp8e4nv) only on compute capability >= 8.9
        if (self.kv_cache_dtype != self.dtype and self.device.type == "cuda"
                and use_triton(torch.empty(0, device=self.device))
                and torch.cuda.get_device_capability(self.device) < (8, 9)):
            major, minor = torch.cuda.get_device_capability(self.device)
            raise ValueError(f"kv_cache_dtype {self.config.kv_cache_dtype} needs a GPU of compute "
                             f"capability >= 8.9 (Ada, Hopper) for the Triton kernels; this one "
                             f"is {major}.{minor} (attention_backend torch runs it, slowly)")

    def _bind_kv_scales(self) -> None:
        """An fp8 cache's per-layer scales: the checkpoint's calibrated ones, else 1.0 (vLLM's
        choice too); any other cache keeps K and V as they are."""
        layers = self.model.attention_layers()
        calibrated = [layer for layer in layers if layer.checkpoint_kv_scales is not None]
        fp8 = self.kv_cache_dtype == FP8_KV_DTYPE
        for layer in layers:
            layer.k_scale, layer.v_scale = (layer.checkpoint_kv_scales or (1.0, 1.0)) if fp8 \
                else (1.0, 1.0)
        if fp8 and calibrated:
            log.info("fp8 KV cache: the checkpoint's calibrated k_scale / v_scale for %d of %d "
                     "layers", len(calibrated), len(layers))
        elif fp8:
            log.warning("fp8 KV cache with scale 1.0 (the checkpoint has no calibrated k_scale / "
                        "v_scale): K and V beyond +-448 saturate")
        elif calibrated:
            log.info("the checkpoint's calibrated KV-cache scales apply to an fp8 cache "
                     "(--kv-cache-dtype fp8); this %s cache keeps K and V as they are",
                     self.kv_cache_dtype)

    def _determine_num_blocks(self) -> int:
        cfg = self.config
        # more blocks than max_num_seqs full-length sequences can never be used
        useful = cfg.max_num_seqs * -(-cfg.max_model_len // self.block_size) + 1
        if cfg.num_gpu_blocks is not None:
            return cfg.num_gpu_blocks
        if self.device.type == "cuda":
            available = self._profile_free_memory()
        else:
            available = int(cfg.cpu_kv_cache_gb * (1 << 30))
        num = min(int(available // self.bytes_per_block()), useful)
        if num < 2:
            raise ValueError(f"not enough memory for the KV cache: {available / 2**30:.2f} GiB "
                             f"available, {self.bytes_per_block() / 2**20:.1f} MiB per block; "
                             "raise gpu_memory_utilization or lower max_model_len")
        return num

    @torch.inference_mode()
    def _profile_free_memory(self) -> int:
        """Peak memory of a forward at the full token budget, then what utilization leaves."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        num_tokens = self.config.max_num_batched_tokens
        c = self.model_config
        dummy = torch.zeros(2, self.block_size, self.num_kv_heads, c.head_dim,
                            dtype=self.kv_cache_dtype, device=self.device)
        for layer in self.model.attention_layers():     # laid out as the real cache (same kernels)
            layer.kv_cache = self._kv_layout(dummy, dummy)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=self.device),
            block_tables=torch.zeros(1, 1, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([1], dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            max_query_len=num_tokens, max_seq_len=1)
        # one sequence of num_tokens queries over a 1-token context is invalid attention;
        # profile it as num_tokens sequences of one token each instead
        meta.block_tables = torch.zeros(num_tokens, 1, dtype=torch.int32, device=self.device)
        meta.seq_lens = torch.ones(num_tokens, dtype=torch.int32, device=self.device)
        meta.query_start_loc = torch.arange(num_tokens + 1, dtype=torch.int32, device=self.device)
        meta.max_query_len = 1
        hidden = self.model(ids, ids, meta)
        self.model.compute_logits(hidden[: self.max_rows])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        total = torch.cuda.get_device_properties(self.device).total_memory
        # memory other processes hold counts against us too
        free, _ = torch.cuda.mem_get_info()
        used_elsewhere = max(total - free - torch.cuda.memory_reserved(), 0)
        budget = total * self.config.gpu_memory_utilization - peak - used_elsewhere
        for layer in self.model.attention_layers():
            layer.kv_cache = None
        torch.cuda.empty_cache()
        log.info("memory profile: peak %.2f GiB, KV budget %.2f GiB", peak / 2**30, budget / 2**30)
        return int(max(budget, 0))

    def _kv_layout(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's K and V caches as the kernels get them. An fp8 cache keeps each block's V
        token-major (keys adjacent), which the attention kernels read with ldmatrix instead of
        byte by byte (paged_attention.token_major_v; KVFLEET_V_TOKEN_MAJOR=0 keeps V in rows, an
        A/B switch); with KVFLEET_K_HEAD_MAJOR=1 (off by default: its decode kernels ran 1.5-3%
        faster, the engine no faster; docs/PERFORMANCE.md) each block's K head-major too
        (paged_attention.head_major_k: a head's keys one 2 KB run, where rows leave 128-byte
        pieces 1 KB apart). Both are views of the same pool, each block still one contiguous run
        of it."""
        if self.kv_cache_dtype != FP8_KV_DTYPE:
            return k, v
        if on_off("KVFLEET_K_HEAD_MAJOR", os.environ.get("KVFLEET_K_HEAD_MAJOR", "0")):
            k = head_major_k(k)
        if on_off("KVFLEET_V_TOKEN_MAJOR", os.environ.get("KVFLEET_V_TOKEN_MAJOR", "")):
            v = token_major_v(v)
        return k, v

    def _allocate_kv_cache(self) -> None:
        c = self.model_config
        # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
        self.kv_cache = torch.zeros(c.num_layers, 2, self.num_blocks, self.block_size,
                                    self.num_kv_heads, c.head_dim, dtype=self.kv_cache_dtype,
                                    device=self.device)
        for i, layer in enumerate(self.model.attention_layers()):
            layer.kv_cache = self._kv_layout(self.kv_cache[i, 0], self.kv_cache[i, 1])
        log.info("KV cache: %d blocks of %d tokens, dtype %s, %.2f GiB", self.num_blocks,
                 self.block_size, self.kv_cache_dtype,
                 self.kv_cache.numel() * self.kv_cache.element_size() / 2**30)

    # ---- one step -------------------------------------------------------------------------
    def _prepare(self, sched: SchedulerOutput, block_ids: dict[str, list[int]],
                 prev: PendingStep | None = None):
        # one Python pass over the rows for what only they hold (their token ids, their block
        # ids), numpy for everything per token (positions, slots): at 1024 rows this runs
        # in the shadow of the device's step, and must stay well inside it
        scheduled = sched.scheduled
        reqs = [s.request for s in scheduled]
        nums = [s.num_new_tokens for s in scheduled]
        starts = [r.num_computed_tokens for r in reqs]
        tables = [block_ids[r.request_id] for r in reqs]
        input_ids: list[int] = []
        from_prev: list[int] = []            # rows of input_ids still being sampled ...
        prev_rows: list[int] = []            # ... and their rows in prev.token_ids
        # speculative decoding: a request with drafts runs as one sequence of one token per
        # position (its last token, then each draft), each over the same blocks up to its own
        # position: a decode batch, which the decode kernels and graphs run (each layer writes
        # every row's K/V before any row attends, so a draft's row sees the drafts before it)
        first_seq = None
        if self.config.speculative is not None and any(s.spec_token_ids for s in scheduled):
            reqs, starts, nums, tables, input_ids, first_seq = _expand_drafts(scheduled, tables)
        n = len(nums)
        lora_plan = (None if self.lora is None
                     else self.lora.plan_step([r.lora_request for r in reqs], nums))
        if first_seq is None and prev is not None and all(num == 1 for num in nums) and all(
                start == len(r.all_token_ids) for r, start in zip(reqs, starts, strict=True)):
            # async decode: every row's input is the token the previous step is sampling
            input_ids = [0] * n
            from_prev = list(range(n))
            prev_rows = [prev.rows[r.request_id] for r in reqs]
        elif first_seq is None:
            append, extend = input_ids.append, input_ids.extend
            for r, start, num in zip(reqs, starts, nums, strict=True):
                tokens = r.all_token_ids
                end = start + num
                if end <= len(tokens):
                    if num == 1:
                        append(tokens[start])
                    else:
                        extend(tokens[start:end])
                else:       # async scheduling: the previous step is sampling this token
                    extend(tokens[start:])
                    from_prev.append(len(input_ids))
                    prev_rows.append(prev.rows[r.request_id])
                    append(0)
        bs = self.block_size
        num_new = np.array(nums, dtype=np.int64)
        seq_lens = np.array(starts, dtype=np.int64) + num_new
        query_start = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(num_new, out=query_start[1:])
        if int(query_start[-1]) == n:       # decode: one token per row
            positions = seq_lens - 1
            rows = np.arange(n)
        else:
            rows = np.repeat(np.arange(n), num_new)
            positions = np.arange(int(query_start[-1]), dtype=np.int64) + (seq_lens - query_start[1:])[rows]
        table = _padded_table(tables)
        slots = table[rows, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens_cpu = seq_lens.tolist()
        query_start_cpu = query_start.tolist()
        logits_rows: list[int]               # flat-batch rows whose logits we need
        layout = LogitsLayout()              # which of those rows serve what
        if first_seq is None and all(r.prompt_logprobs is None for r in reqs):
            logits_rows = [query_start_cpu[i + 1] - 1 for i, s in enumerate(scheduled) if s.samples]
            layout.sample = list(range(len(logits_rows)))
        else:
            logits_rows = []
            for i, s in enumerate(scheduled):
                e = i if first_seq is None else first_seq[i]     # its (first) sequence
                r, start = s.request, starts[e]
                base, end = query_start_cpu[e], seq_lens_cpu[e]
                if s.spec_token_ids:    # a row a position: its last token's, then the drafts'
                    layout.spec.append((len(logits_rows), s.num_new_tokens))
                    logits_rows.extend(range(base, base + s.num_new_tokens))
                    continue
                if r.prompt_logprobs is not None and start < r.num_prompt_tokens - 1:
                    count = min(end, r.num_prompt_tokens - 1) - start
                    layout.prompt.append((r, len(logits_rows), count))
                    logits_rows.extend(range(base, base + count))
                if s.samples:
                    layout.sample.append(len(logits_rows))
                    logits_rows.append(base + s.num_new_tokens - 1)
        dev = self.device

        def tensor(data, dtype):
            return host_to_device(data, dtype, dev)

        max_query_len, max_seq_len, plan_num_seqs = max(nums), max(seq_lens_cpu), None
        plan = (decode_plan(len(nums), max_seq_len, self.decode_batch_sizes, self.decode_buckets)
                if max_query_len == 1 else None)
        if plan is not None:    # as the graph of this size would run it, graphs or not
            plan_num_seqs, max_seq_len = plan
        meta = AttentionMetadata(
            slot_mapping=numpy_to_device(slots, dev),
            block_tables=numpy_to_device(table, dev),
            seq_lens=numpy_to_device(seq_lens.astype(np.int32), dev),
            query_start_loc=numpy_to_device(query_start.astype(np.int32), dev),
            max_query_len=max_query_len, max_seq_len=max_seq_len,
            seq_lens_cpu=seq_lens_cpu, query_start_loc_cpu=query_start_cpu,
            plan_num_seqs=plan_num_seqs, min_query_len=min(nums))
        ids = tensor(input_ids, torch.long)
        if from_prev:
            ids[tensor(from_prev, torch.long)] = prev.token_ids[tensor(prev_rows, torch.long)]
        step = StepInputs(ids, numpy_to_device(positions, dev), meta, logits_rows)
        if lora_plan is not None:
            step.lora_slots, step.lora_loads = numpy_to_device(lora_plan[0], dev), lora_plan[1]
        return step, layout

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, block_ids: dict[str, list[int]]) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        step, layout = self._prepare(sched, block_ids)
        t1 = time.perf_counter()
        sampling = [s for s in sched.scheduled if s.samples]
        pooling = any(s.request.params.pooling is not None for s in sampling)
        logits = self._forward(broadcast_step(step, self.device), keep_hidden=pooling)
        out = ModelRunnerOutput(prepare_s=t1 - t0)
        for r, first, count in layout.prompt:
            targets = r.prompt_token_ids[r.num_computed_tokens + 1:r.num_computed_tokens + 1 + count]
            out.prompt_logprobs[r.request_id] = self.sampler.prompt_logprobs(
                logits[first:first + count], targets, r.params.prompt_logprobs)
        if layout.spec:
            drafting = [s for s in sampling if s.spec_token_ids]
            sampling = [s for s in sampling if not s.spec_token_ids]
            out.spec_tokens = self._verify(logits, layout, drafting)
        if pooling:         # the last prompt position's hidden state: its sampling row's
            from kvfleet_runtime.pooling import pool
            hidden, self._hidden = self._hidden, None
            for s, row in zip(sampling, layout.sample, strict=True):
                params = s.request.params.pooling
                if params is not None:
                    out.embeddings[s.request.request_id] = pool(
                        hidden[row], logits[row], params, getattr(self.model, "score", None))
        if sampling:
            last, batch = self._sampling_inputs(logits, layout, sampling)
            batch.grammar_lookup = lambda rows: _grammar_matchers(sampling, rows, None)
            for s, tok in zip(sampling, self.sampler(last, batch), strict=True):
                out.sampled[s.request.request_id] = tok.token_id
                if s.request.logprobs is not None:
                    out.logprobs[s.request.request_id] = tok
        out.forward_s = time.perf_counter() - t1
        return out

    def _sampling_inputs(self, logits: torch.Tensor, layout: LogitsLayout,
                         sampling: list) -> tuple[torch.Tensor, SamplingBatch]:
        """The sampling rows of `logits` (interleaved with prompt-logprob rows) and their batch."""
        batch = SamplingBatch(
            params=[s.request.params for s in sampling],
            prompt_token_ids=[s.request.prompt_token_ids for s in sampling],
            output_token_ids=[s.request.output_token_ids for s in sampling],
            generators=[s.request.generator for s in sampling])
        last = logits if len(layout.sample) == logits.shape[0] else \
            logits.index_select(0, host_to_device(layout.sample, torch.long, self.device))
        return last, batch

    def _verify(self, logits: torch.Tensor, layout: LogitsLayout,
                drafting: list) -> dict[str, list[SampledToken]]:
        """Speculative decoding: each drafting request's accepted drafts and the token after them."""
        rows = [row for first, count in layout.spec for row in range(first, first + count)]
        mine = logits.index_select(0, host_to_device(rows, torch.long, self.device))
        reqs = [s.request for s in drafting]
        grammars = None
        if any(r.grammar is not None for r in reqs):
            for r in reqs:      # (drafted steps are synchronous: every token is on the host)
                if r.grammar is not None:
                    r.grammar.catch_up(r.output_token_ids)
            grammars = [r.grammar for r in reqs]
        tokens = verify_drafts(mine, [s.spec_token_ids for s in drafting],
                               [r.params for r in reqs], [r.generator for r in reqs],
                               [r.prompt_token_ids for r in reqs],
                               [r.output_token_ids for r in reqs], grammars)
        return {r.request_id: t for r, t in zip(reqs, tokens, strict=True)}

    def _add_pending_history(self, batch: SamplingBatch, sampling: list,
                             prev: PendingStep | None) -> None:
        """Penalties and min_tokens count every generated token: give the sampler the ones
        `prev` is still sampling (read on the device) and how many each row has."""
        needs = any(s.request.needs_history for s in sampling)
        rows = [(i, prev.rows[s.request.request_id]) for i, s in enumerate(sampling)
                if s.request.num_pending] if needs and prev is not None else []
        if not rows:
            return
        batch.num_pending = [s.request.num_pending for s in sampling]
        batch.pending_ids = torch.full((len(sampling),), -1, dtype=torch.long, device=self.device)
        batch.pending_ids[host_to_device([i for i, _ in rows], torch.long, self.device)] = \
            prev.token_ids[host_to_device([j for _, j in rows], torch.long, self.device)]

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, block_ids: dict[str, list[int]],
               prev: PendingStep | None) -> PendingStep:
        """Async scheduling: enqueue the step (forward + sampling) and return without waiting.

        Not for steps with prompt logprobs: the engine runs those through `execute`. Tokens
        the still-running `prev` step samples are read on the device, where it leaves them:
        as this step's inputs, and as history for penalties and min_tokens.
        """
        t0 = time.perf_counter()
        step, layout = self._prepare(sched, block_ids, prev)
        t1 = time.perf_counter()
        logits = self._forward(broadcast_step(step, self.device))
        sampling = [s for s in sched.scheduled if s.samples]
        pending = PendingStep(rows={}, token_ids=None, host_ids=None, done=None, prepare_s=t1 - t0)
        if sampling:
            last, batch = self._sampling_inputs(logits, layout, sampling)
            self._add_pending_history(batch, sampling, prev)
            batch.grammar_lookup = lambda rows: _grammar_matchers(sampling, rows, prev)
            ids, pending.logprobs = self.sampler.sample_on_device(last, batch)
            pending.num_top = [p.logprobs for p in batch.params]
            pending.rows = {s.request.request_id: i for i, s in enumerate(sampling)}
            pending.token_ids = ids
            results = pending.logprobs.tensors() if pending.logprobs is not None else []
            if self.device.type == "cuda":
                pending.host_ids, *pending.host_logprobs = (_copy_to_host(t) for t in [ids, *results])
                pending.done = torch.cuda.Event()
                pending.done.record()
            else:
                pending.host_ids, pending.host_logprobs = ids, results
        return pending

    def finish(self, pending: PendingStep) -> ModelRunnerOutput:
        """Wait for a launched step's tokens."""
        t0 = time.perf_counter()
        out = ModelRunnerOutput(prepare_s=pending.prepare_s)
        if pending.token_ids is not None:
            if pending.done is not None:
                pending.done.synchronize()
            ids = pending.host_ids.tolist()
            out.sampled = {rid: ids[row] for rid, row in pending.rows.items()}
            if pending.logprobs is not None:
                tokens = sampled_tokens(ids, pending.logprobs, pending.num_top,
                                        [t.tolist() for t in pending.host_logprobs])
                top = pending.num_top
                out.logprobs = {rid: tokens[row] for rid, row in pending.rows.items()
                                if top[row] is not None}
        # async: only the wait counts as device time; host work overlapped the device
        out.forward_s = time.perf_counter() - t0
        return out

    @torch.inference_mode()
    def execute_remote(self) -> bool:
        """A worker rank's step: rank 0's inputs through this rank's shard; False on stop."""
        step = broadcast_step(None, self.device)
        if step is None:
            return False
        self._forward(step)
        return True

    def _forward(self, step: StepInputs, keep_hidden: bool = False) -> torch.Tensor | None:
        """Hidden states of the logits rows -> logits on rank 0 (None on the other ranks);
        keep_hidden: those hidden states are left in self._hidden too (pooling)."""
        meta = step.meta
        if self.lora is not None:       # this step's adapters into their slots, on every rank
            self.lora.apply(step.lora_slots, step.lora_loads)
        rows = step.logits_rows
        every = len(rows) == step.input_ids.shape[0] and rows[-1] == len(rows) - 1   # decode
        if self.graph_runner is not None and self.graph_runner.can_run(meta, meta.seq_lens.shape[0]):
            hidden = self.graph_runner.run(step.input_ids, step.positions, meta)
        elif every or not self.last_layer_rows:
            hidden = self.model(step.input_ids, step.positions, meta)
        else:   # the last layer's attention output, o_proj and MLP on these rows alone
            # (a step that wants no row still runs one: every layer's K/V go into the cache)
            wanted = host_to_device(rows or [0], torch.long, self.device)
            if self.lora is not None:
                self.lora.masks.select(wanted)
            try:
                hidden = self.model(step.input_ids, step.positions, meta, wanted)[:len(rows)]
            finally:
                if self.lora is not None:
                    self.lora.masks.select(None)
            every = True
        if not every:
            hidden = hidden.index_select(0, host_to_device(rows, torch.long, self.device))
        if keep_hidden:
            self._hidden = hidden
        return self.model.compute_logits(hidden)
