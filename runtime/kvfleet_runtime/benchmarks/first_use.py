"""Where a benchmark run pays first-use costs: Triton compiles and its slowest engine steps.

`suite --trace-first-use` installs both around its rows. Triton compiles (or loads from its
disk cache) one binary per kernel specialisation the first time a launch meets it: a new
constexpr, a new warp count, or an integer argument that turns divisible by 16 or equal to 1.
Inside a timed run that is time no later run pays; each compile is logged with how long it
took and which row met it. The step log keeps each engine step's wall time, so the run's
slowest steps (and what their batch held) can be told apart from its typical one.
"""

from __future__ import annotations

import statistics
import time


class CompileLog:
    """Logs every Triton kernel compile through triton.knobs' JIT hooks (Triton >= 3.4)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float, str, str]] = []    # (row, seconds, kernel, repr)
        self.row = "start-up"
        self._started: dict[str, float] = {}

    def install(self) -> bool:
        try:
            from triton import knobs
        except ImportError:
            return False
        if not hasattr(knobs.runtime, "jit_post_compile_hook"):
            return False
        knobs.runtime.jit_cache_hook = self._before
        knobs.runtime.jit_post_compile_hook = self._after
        return True

    def _before(self, *, key, **_) -> bool:
        self._started[str(key)] = time.perf_counter()
        return False            # False: go on and compile

    def _after(self, *, key, repr, fn, **_) -> bool:
        t0 = self._started.pop(str(key), None)
        took = time.perf_counter() - t0 if t0 is not None else float("nan")
        self.events.append((self.row, took, f"{fn.module}.{fn.name}", repr))
        print(f"[first-use] {self.row}: compiled {fn.name} in {took * 1e3:.0f} ms: {repr}",
              flush=True)
        return False

    def summary(self, row: str) -> dict:
        mine = [e for e in self.events if e[0] == row]
        return {"compiles": len(mine), "compile_s": sum(e[1] for e in mine)}


_ALLOC_STATS = ("num_device_alloc", "num_device_free", "num_alloc_retries")


def _alloc_counts() -> tuple[int, ...] | None:
    """CUDA caching-allocator counters: cudaMalloc calls, cudaFree calls, and retries (a
    failed cudaMalloc made the allocator free its cache, which synchronizes the device)."""
    import torch
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    stats = torch.cuda.memory_stats()
    return tuple(int(stats.get(k, 0)) for k in _ALLOC_STATS)


class StepLog:
    """Wraps engine.step to keep each step's wall time and scheduled token count, and on a
    GPU the steps in which the caching allocator went to the driver."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.steps: list[tuple[float, int, int]] = []    # (seconds, tokens, sequences)
        self.allocs: list[tuple[int, ...]] = []          # (step index, *_ALLOC_STATS deltas)
        step = engine.step
        scheduler = engine.scheduler
        schedule = scheduler.schedule
        self._last = (0, 0)

        def timed_schedule():
            out = schedule()
            self._last = (sum(s.num_new_tokens for s in out.scheduled), len(out.scheduled))
            return out

        def timed_step():
            self._last = (0, 0)
            before = _alloc_counts()
            t0 = time.perf_counter()
            try:
                return step()
            finally:
                self.steps.append((time.perf_counter() - t0, *self._last))
                after = _alloc_counts()
                if before is not None and after != before:
                    self.allocs.append((len(self.steps) - 1,
                                        *(b - a for a, b in zip(before, after, strict=True))))

        scheduler.schedule = timed_schedule
        engine.step = timed_step

    def take(self) -> tuple[list[tuple[float, int, int]], list[tuple[int, ...]]]:
        steps, allocs, self.steps, self.allocs = self.steps, self.allocs, [], []
        return steps, allocs

    @staticmethod
    def summary(taken: tuple[list[tuple[float, int, int]], list[tuple[int, ...]]],
                top: int = 6) -> dict:
        steps, allocs = taken
        if not steps:
            return {}
        decode = [s for s, tokens, seqs in steps if tokens == seqs and seqs]
        slow = sorted(range(len(steps)), key=lambda i: -steps[i][0])[:top]
        return {"step_median_ms": statistics.median(s for s, _, _ in steps) * 1e3,
                "decode_step_median_ms": statistics.median(decode) * 1e3 if decode else None,
                "first_steps_ms": [round(s * 1e3, 1) for s, _, _ in steps[:4]],
                # (index, ms, tokens scheduled, sequences)
                "slowest_steps": [(i, round(steps[i][0] * 1e3, 1), steps[i][1], steps[i][2])
                                  for i in slow],
                # (index, cudaMalloc calls, cudaFree calls, retries) of the steps that made any
                "allocator_steps": allocs[:12],
                "time_by_kind": time_by_kind(steps)}


# decode steps by how many sequences they ran (fewest, name): where a long run's time goes
DECODE_BATCHES = ((512, "decode 512+"), (128, "decode 128-511"), (1, "decode 1-127"))


def step_kind(tokens: int, seqs: int) -> str:
    """A logged step's kind: decode steps (one token a sequence) by batch, else prefill."""
    if not seqs:
        return "empty"
    if tokens != seqs:
        return "prefill or mixed"
    return next(name for fewest, name in DECODE_BATCHES if seqs >= fewest)


def time_by_kind(steps: list[tuple[float, int, int]]) -> dict[str, list]:
    """kind -> [steps, seconds, tokens scheduled]."""
    out: dict[str, list] = {}
    for seconds, tokens, seqs in steps:
        row = out.setdefault(step_kind(tokens, seqs), [0, 0.0, 0])
        row[0] += 1
        row[1] += seconds
        row[2] += tokens
    return {kind: [n, round(s, 3), t] for kind, (n, s, t) in out.items()}
