"""F.linear's GEMM (out = x @ w.T, bf16/fp16, no bias) through cuBLASLt with the algorithm chosen
by timing it under load, per (rows, out features, in features).

Why: with the H200 at its power cap (every throughput row, ~1470 MHz; twenty-third session) the
algorithm cuBLAS's heuristic runs for F.linear was 1-5% slower than the best of the eight cuBLASLt
offers at some of the engine's shapes (gate_up and o_proj at 16,384 rows, lm_head at 1,024;
docs/PERFORMANCE.md). Opt-in, `KVFLEET_CUBLASLT_TUNE=1` (needs nvmath-python): the engine tunes
the shapes of its unquantized projections at its full prefill chunk and any KVFLEET_CUBLASLT_ROWS
(`tune_rows`, `tune`), before it captures its graphs, and `lookup` serves those calls afterwards;
every other call stays on F.linear.

The planning is nvmath-python's (nvmath.linalg.advanced.Matmul: the descriptors, layouts and the
heuristic's algorithms for one shape); each call is one cublasLtMatmul with the chosen algorithm
on the caller's tensors and a workspace held here, so it can be captured in a CUDA graph (and
`choose` times it so).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from kvfleet_kernels.env import on_off


def tune_requested() -> bool:
    """KVFLEET_CUBLASLT_TUNE: unset or 0 -> off (the default), 1 -> on; anything else an error.
    On, it also needs nvmath-python 1.0: a clear error now rather than after the model loads."""
    if not on_off("KVFLEET_CUBLASLT_TUNE", os.environ.get("KVFLEET_CUBLASLT_TUNE", "0")):
        return False
    try:
        import nvmath
    except ImportError as exc:
        raise ValueError("KVFLEET_CUBLASLT_TUNE=1 needs nvmath-python (pip install "
                         "'nvmath-python>=1.0,<1.1'; scripts/fetch-gpu-wheels carries it)") from exc
    version = getattr(nvmath, "__version__", "unknown")
    if not version.startswith("1.0."):    # TunedGemm reads its plans' internals
        raise ValueError(f"KVFLEET_CUBLASLT_TUNE=1 is written against nvmath-python 1.0's Matmul "
                         f"plans; found {version} (pip install 'nvmath-python>=1.0,<1.1')")
    return True


def tune_rows(max_num_batched_tokens: int) -> list[int]:
    """The row counts the engine tunes: its full prefill chunk, and KVFLEET_CUBLASLT_ROWS
    (comma-separated row counts, e.g. a decode graph's batch size, which the lm_head is also
    tuned at). Decode graphs are not tuned unless listed: at 1,024 rows the algorithms timed
    fastest here ran ~2% slower inside the engine's decode steps than cuBLAS's own choice, where
    the prefill chunk's were ~2% faster, as timed (docs/PERFORMANCE.md, twenty-fourth session)."""
    extra = os.environ.get("KVFLEET_CUBLASLT_ROWS", "")
    try:
        rows = {int(r) for r in extra.split(",") if r.strip()}
    except ValueError:
        rows = {0}
    if any(r < 1 for r in rows):
        raise ValueError(f"KVFLEET_CUBLASLT_ROWS must be comma-separated row counts >= 1; got {extra!r}")
    return sorted(rows | {max_num_batched_tokens})


# an algorithm replaces F.linear at a shape where it was at least this much faster (run-to-run
# noise of the timing is ~0.5%)
MIN_GAIN = 0.01

# (rows, out features, in features, dtype, device index) -> the tuned GEMM; filled by tune()
_TABLE: dict[tuple[int, int, int, torch.dtype, int], TunedGemm] = {}
# one cuBLASLt workspace a device, as large as the largest plan's: every call runs on the
# caller's stream, one after another, as cuBLAS's own workspace is shared
_WORKSPACES: dict[int, torch.Tensor] = {}


def _workspace(device: torch.device, nbytes: int = 0) -> torch.Tensor:
    """The device's workspace, grown to nbytes first (only while planning: a CUDA graph
    captured before a growth would point at the old one)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    ws = _WORKSPACES.get(index)
    if ws is None or ws.numel() < nbytes:
        ws = _WORKSPACES[index] = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
    return ws


class TunedGemm:
    """cuBLASLt's algorithms for x [m, k] @ w[n, k].T -> [m, n] (row-major, contiguous)."""

    def __init__(self, m: int, weight: torch.Tensor, scratch: torch.Tensor | None = None,
                 limit: int = 8) -> None:
        """Planned on `weight` [n, k] (any contiguous 256-byte-aligned tensor of that shape) and
        an [m, k] input laid over `scratch` (bytes the planning only points at, e.g. the KV
        cache's, so a plan holds no memory of its own; None: a new tensor), both only for their
        shapes, dtype and alignment: calls pass their own operands."""
        from nvmath.bindings import cublasLt
        from nvmath.linalg.advanced import Matmul, MatmulPlanPreferences
        n, k = weight.shape
        self.m, self.n, self.k, self.dtype = m, n, k, weight.dtype
        nbytes = m * k * weight.element_size()
        if scratch is not None and scratch.numel() * scratch.element_size() >= nbytes:
            x = scratch.reshape(-1).view(torch.uint8)[:nbytes].view(weight.dtype).view(m, k)
        else:
            x = torch.empty(m, k, dtype=weight.dtype, device=weight.device)
        self._matmul = cublasLt.matmul
        self._mm = Matmul(x, weight.t(), stream=torch.cuda.current_stream(weight.device))
        self._mm.plan(preferences=MatmulPlanPreferences(limit=limit))
        strides = tuple(self._mm.result_traits.result_strides)
        if strides != (n, 1):
            raise RuntimeError(f"cuBLASLt planned a result with strides {strides}, not row-major")
        self._algos = self._mm.algorithms_buffer
        # each algorithm's cublasLtMatmulAlgo_t, held so the pointers calls pass stay valid
        self._algo_structs = [self._algos[i]["algo"] for i in range(len(self._algos))]
        # the plan's descriptors are all calls use: let go of the planning operands (x may lie
        # over an engine's KV pool, w is a model's weight) so a plan keeps no tensor alive
        self._mm.operands = None
        _workspace(weight.device, int(max(self._algos["workspace_size"])))
        self.choice: int | None = None      # the algorithm calls run (an index of _algos)

    @property
    def num_algorithms(self) -> int:
        return len(self._algos)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, algorithm: int | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ w.T with the chosen (or the given) algorithm, into `out` if given; x, w and out
        contiguous and 256-byte aligned."""
        index = self.choice if algorithm is None else algorithm
        if index is None:
            raise RuntimeError("TunedGemm called before an algorithm was chosen")
        if out is None:
            out = torch.empty(self.m, self.n, dtype=self.dtype, device=x.device)
        mm, ws = self._mm, _workspace(x.device)
        self._matmul(mm.handle, mm.mm_desc, mm.alpha.ctypes.data, x.data_ptr(), mm.a_layout_ptr,
                     w.data_ptr(), mm.b_layout_ptr, mm.beta.ctypes.data, 0, mm.c_layout_ptr,
                     out.data_ptr(), mm.d_layout_ptr, self._algo_structs[index].ctypes.data,
                     ws.data_ptr(), ws.numel(), torch.cuda.current_stream(x.device).cuda_stream)
        return out


def captured(fn: Callable[[], object], calls: int) -> torch.cuda.CUDAGraph:
    """`calls` calls of fn back to back in one CUDA graph (no host time between them, as in the
    engine's graphs), warmed up on a side stream first."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def _replay_ms(graph: torch.cuda.CUDAGraph, replays: int = 1) -> float:
    """GPU milliseconds of `replays` replays of graph back to back."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def choose(gemm: TunedGemm, seconds: float = 0.02, rounds: int = 3) -> str:
    """Time F.linear and each algorithm as CUDA-graph replays of ~`seconds` of back-to-back calls
    (the GPU warmed first, so under the power cap where the engine runs), in turns, `rounds`
    times; keep the fastest algorithm if it beats F.linear by MIN_GAIN and its result is
    F.linear's within bf16 rounding. Returns a report line."""
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(gemm.m, gemm.k, dtype=gemm.dtype, device=device)
    w = torch.randn(gemm.n, gemm.k, dtype=gemm.dtype, device=device).mul_(gemm.k ** -0.5)
    out = torch.empty(gemm.m, gemm.n, dtype=gemm.dtype, device=device)
    ref = F.linear(x, w)
    usable = [i for i in range(gemm.num_algorithms)
              if torch.allclose(gemm(x, w, i).float(), ref.float(), rtol=2e-2, atol=2e-2)]
    del ref
    fns = [lambda: torch.matmul(x, w.t(), out=out)] + [
        lambda i=i: gemm(x, w, i, out=out) for i in usable]
    once = _replay_ms(captured(fns[0], 1), replays=3) / 3
    calls = max(3, int(seconds * 1e3 / once))
    graphs = [captured(fn, calls) for fn in fns]
    _replay_ms(graphs[0], replays=4)                 # into the clocks the engine runs at
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for i, graph in enumerate(graphs):
            times[i].append(_replay_ms(graph) / calls)
    del graphs
    medians = [statistics.median(t) for t in times]
    best = min(range(1, len(fns)), key=lambda i: medians[i], default=None)
    shape = f"{gemm.m}x{gemm.n}x{gemm.k}"
    if best is None:
        gemm.choice = None
        return f"{shape}: no cuBLASLt algorithm matched F.linear; F.linear kept"
    gain = 1 - medians[best] / medians[0]
    gemm.choice = usable[best - 1] if gain >= MIN_GAIN else None
    kept = f"algorithm {gemm.choice}" if gemm.choice is not None else "F.linear"
    return (f"{shape}: F.linear {medians[0] * 1e3:.1f} us, best of {len(usable)} cuBLASLt "
            f"algorithms {medians[best] * 1e3:.1f} us ({gain:+.1%}); {kept}")


def tune(jobs: Iterable[tuple[torch.Tensor, Iterable[int]]], scratch: torch.Tensor | None = None,
         seconds: float = 0.02) -> list[str]:
    """Tune each (weight [n, k], row counts) job at each of its row counts (the plans laid over
    `scratch`: TunedGemm) and register the ones where an algorithm beat F.linear; returns a
    report line each. The timing's own operands are freed before it returns."""
    report = []
    for weight, rows in jobs:
        with torch.cuda.device(weight.device):
            for m in sorted(set(rows)):
                try:
                    gemm = TunedGemm(m, weight, scratch)
                except RuntimeError as exc:     # a plan calls cannot use: this shape keeps F.linear
                    report.append(f"{m}x{weight.shape[0]}x{weight.shape[1]}: {exc}; F.linear kept")
                    continue
                report.append(choose(gemm, seconds))
                if gemm.choice is not None:
                    _TABLE[(m, gemm.n, gemm.k, gemm.dtype, weight.device.index)] = gemm
    torch.cuda.empty_cache()
    return report


def lookup(x: torch.Tensor, weight: torch.Tensor) -> TunedGemm | None:
    """The tuned GEMM for F.linear(x, weight) without bias, where one was registered and the
    operands are as it was planned for (2-D, contiguous, 256-byte aligned as the planning's
    were); else None."""
    if not _TABLE or x.dim() != 2 or not x.is_cuda:
        return None
    gemm = _TABLE.get((x.shape[0], weight.shape[0], weight.shape[1], x.dtype, x.device.index))
    if (gemm is None or weight.dtype != x.dtype or not x.is_contiguous()
            or not weight.is_contiguous() or x.data_ptr() % 256 or weight.data_ptr() % 256):
        return None
    return gemm


def clear() -> None:
    """Forget every tuned GEMM and workspace (tests: an engine keeps its tuning for the process)."""
    _TABLE.clear()
    _WORKSPACES.clear()
