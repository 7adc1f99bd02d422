"""Pictures of benchmark sweeps: `bench serve --plot` and `bench throughput --plot`.

Owns turning a list of per-run result dicts into one PNG, so a sweep over
request rate, concurrency or batch size is seen at a glance rather than read
from a table. The bench commands measure; this module only draws.

Runs are placed at evenly spaced positions in sweep order, labelled with their
values: request rates such as 1, 4, 16 and `inf` (all at once) cannot share a
linear or log axis, and evenly spaced points keep every run readable.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Figure is used directly (not pyplot) so that plotting never touches a GUI
# backend or pyplot's global figure registry; savefig renders with Agg.
from matplotlib.figure import Figure

SERVE_KEYS = (
    "request_rate", "max_concurrency", "request_throughput", "output_throughput",
    "ttft_ms_mean", "ttft_ms_median", "ttft_ms_p99",
    "tpot_ms_mean", "tpot_ms_median", "tpot_ms_p99",
    "itl_ms_mean", "itl_ms_median", "itl_ms_p99",
)
THROUGHPUT_KEYS = (
    "num_prompts", "input_len", "output_len",
    "output_tokens_per_s", "total_tokens_per_s", "elapsed_s",
)
# `bench throughput` names its batch knob after the engine; offline batch
# benchmarks may call it batch_size. Either is accepted.
BATCH_KEYS = ("max_num_seqs", "batch_size")

DPI = 100
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")
LATENCY_STATS = (("mean", "o-"), ("median", "s--"), ("p99", "^:"))


@dataclass(frozen=True)
class SweepAxis:
    """The distinct settings of a sweep, in order, one x position each."""
    keys: list[str]                 # the result keys that were swept
    settings: list[tuple]           # sorted distinct values of `keys`; index = x position

    @property
    def title(self) -> str:
        return ", ".join(self.keys)

    @property
    def tick_labels(self) -> list[str]:
        if len(self.keys) == 1:
            return [_fmt(values[0]) for values in self.settings]
        return ["\n".join(f"{k}={_fmt(v)}" for k, v in zip(self.keys, values, strict=True))
                for values in self.settings]

    def position(self, run: dict) -> int:
        return self.settings.index(tuple(run.get(k) for k in self.keys))


def plot_serve(results: list[dict], path: str) -> None:
    """Write a PNG of an online-serving sweep: throughput and TTFT/TPOT/ITL against rate or concurrency."""
    _require_keys(results, SERVE_KEYS, "plot_serve")
    axis = _sweep_axis(results, ("request_rate", "max_concurrency"))
    runs = sorted(results, key=axis.position)
    x = [axis.position(r) for r in runs]

    fig = Figure(figsize=(12, 8), dpi=DPI, layout="constrained")
    (ax_tput, ax_ttft), (ax_tpot, ax_itl) = fig.subplots(2, 2)

    ax_tput.plot(x, [r["output_throughput"] for r in runs], "o-", color="tab:blue",
                 label="output tokens/s")
    ax_tput.set_ylabel("output tokens/s", color="tab:blue")
    ax_req = ax_tput.twinx()
    ax_req.plot(x, [r["request_throughput"] for r in runs], "s--", color="tab:orange",
                label="requests/s")
    ax_req.set_ylabel("requests/s", color="tab:orange")
    ax_tput.set_ylim(bottom=0)
    ax_req.set_ylim(bottom=0)
    ax_tput.set_title("Throughput")
    ax_tput.legend(handles=ax_tput.get_lines() + ax_req.get_lines(), loc="best")
    _set_sweep_ticks(ax_tput, axis)

    for ax, metric, name in ((ax_ttft, "ttft", "Time to first token (TTFT)"),
                             (ax_tpot, "tpot", "Time per output token (TPOT)"),
                             (ax_itl, "itl", "Inter-token latency (ITL)")):
        for stat, style in LATENCY_STATS:
            ax.plot(x, [r[f"{metric}_ms_{stat}"] for r in runs], style, label=stat)
        ax.set_title(name)
        ax.set_ylabel("ms")
        ax.set_ylim(bottom=0)
        ax.legend(loc="best")
        _set_sweep_ticks(ax, axis)

    fig.suptitle("kvfleet bench serve")
    fig.savefig(path, format="png")


def plot_throughput(results: list[dict], path: str) -> None:
    """Write a PNG of an offline-throughput sweep: tokens/s and elapsed time against batch size or lengths.

    Runs that name a `backend` (kvfleet, hf) are drawn as one line per backend.
    """
    _require_keys(results, THROUGHPUT_KEYS, "plot_throughput")
    for i, r in enumerate(results):
        if not any(k in r for k in BATCH_KEYS):
            raise ValueError(f"plot_throughput: results[{i}] must have one of "
                             f"{', '.join(BATCH_KEYS)}; got keys {sorted(r)}")
    batch_key = next(k for k in BATCH_KEYS if k in results[0])
    axis = _sweep_axis(results, (batch_key, "num_prompts", "input_len", "output_len"))
    backends = list(dict.fromkeys(r.get("backend") for r in results))

    fig = Figure(figsize=(12, 4.5), dpi=DPI, layout="constrained")
    ax_tok, ax_time = fig.subplots(1, 2)
    for i, backend in enumerate(backends):
        color = COLORS[i % len(COLORS)]
        runs = sorted((r for r in results if r.get("backend") == backend), key=axis.position)
        x = [axis.position(r) for r in runs]
        prefix = f"{backend} " if backend is not None else ""
        ax_tok.plot(x, [r["output_tokens_per_s"] for r in runs], "o-", color=color,
                    label=f"{prefix}output tokens/s")
        ax_tok.plot(x, [r["total_tokens_per_s"] for r in runs], "s--", color=color,
                    label=f"{prefix}total tokens/s")
        ax_time.plot(x, [r["elapsed_s"] for r in runs], "o-", color=color,
                     label=backend or "elapsed")
    ax_tok.set_title("Throughput")
    ax_tok.set_ylabel("tokens/s")
    ax_tok.legend(loc="best")
    ax_time.set_title("Elapsed time")
    ax_time.set_ylabel("s")
    if len(backends) > 1:
        ax_time.legend(loc="upper right")
    for ax in (ax_tok, ax_time):
        ax.set_ylim(bottom=0)
        _set_sweep_ticks(ax, axis)

    fixed = [f"{k}={_fmt(results[0][k])}" for k in ("num_prompts", "input_len", "output_len")
             if k not in axis.keys]
    fig.suptitle("kvfleet bench throughput" + (f" ({', '.join(fixed)})" if fixed else ""))
    fig.savefig(path, format="png")


def _require_keys(results: Sequence[dict], keys: Sequence[str], who: str) -> None:
    if not results:
        raise ValueError(f"{who}: results must hold at least one run; got an empty list")
    for i, r in enumerate(results):
        missing = [k for k in keys if k not in r]
        if missing:
            raise ValueError(f"{who}: results[{i}] is missing {', '.join(missing)}; "
                             f"each run needs {', '.join(keys)}")


def _sweep_axis(results: Sequence[dict], candidates: Sequence[str]) -> SweepAxis:
    """Pick the keys whose values differ between runs; their distinct settings become the x axis."""
    swept = [k for k in candidates if len({_sort_key(r.get(k)) for r in results}) > 1]
    if not swept:       # a single setting (one run, or one per backend): label by the first knob
        swept = [candidates[0]]
    settings = sorted({tuple(r.get(k) for k in swept) for r in results},
                      key=lambda values: tuple(_sort_key(v) for v in values))
    return SweepAxis(keys=swept, settings=settings)


def _sort_key(value: object) -> float:
    # None (no concurrency cap) and inf (send everything at once) sort last.
    if value is None:
        return math.inf
    return float(value)  # type: ignore[arg-type]


def _fmt(value: object) -> str:
    if value is None:
        return "unlimited"
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:g}"
    return str(value)


def _set_sweep_ticks(ax, axis: SweepAxis) -> None:
    ax.set_xticks(range(len(axis.settings)), axis.tick_labels)
    ax.set_xlabel(axis.title)
    ax.grid(True, alpha=0.3)
