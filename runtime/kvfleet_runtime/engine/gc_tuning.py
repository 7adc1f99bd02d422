"""Python's garbage collector in the processes kvfleet owns: the server and the benchmarks.

An engine step at a large batch allocates tens of thousands of short-lived objects (requests'
token lists, scheduler records, outputs). With CPython's default thresholds (700, 10, 10) a
young-generation collection runs every 700 net allocations and the older generations follow,
walking the model's modules and every live request each time: at 1024 running sequences that
was ~15% of the host's time per step on this project's CPU (`python -m
kvfleet_runtime.benchmarks.host_overhead --tune-gc both`: async 10.5 -> 9.0 ms/step, sync 9.7 ->
8.1, docs/PERFORMANCE.md),
time a GPU step must hide. After start-up, `tune_gc()` collects once and raises the
thresholds, as servers with many small objects do; cyclic garbage then waits longer for its
collection (more memory for it, never a leak). `gc.freeze()` (vLLM's choice) measured the same
here but keeps everything alive at the time of the call for good.

KVFLEET_GC_THRESHOLD: "python" keeps CPython's thresholds; "a,b,c" sets those instead.
The offline `LLM` API runs in its user's process and leaves its collector alone.
"""

from __future__ import annotations

import gc
import logging
import os

log = logging.getLogger(__name__)

DEFAULT_THRESHOLD = (20000, 50, 50)


def gc_threshold(value: str) -> tuple[int, int, int] | None:
    """The thresholds a KVFLEET_GC_THRESHOLD value asks for; None for "python"."""
    if value == "python":
        return None
    if not value:
        return DEFAULT_THRESHOLD
    parts = value.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts) or int(parts[0]) == 0:
        raise ValueError("KVFLEET_GC_THRESHOLD must be 'python' or three integers "
                         f"'gen0,gen1,gen2' with gen0 > 0; got {value!r}")
    a, b, c = (int(p) for p in parts)
    return a, b, c


def tune_gc() -> tuple[int, int, int]:
    """Collect what start-up left, then set this process's thresholds; returns them."""
    threshold = gc_threshold(os.environ.get("KVFLEET_GC_THRESHOLD", ""))
    if threshold is not None:
        gc.collect()
        gc.set_threshold(*threshold)
    current = gc.get_threshold()
    log.info("garbage collector thresholds %s", current)
    return current
