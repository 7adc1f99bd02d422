"""`plot_serve` / `plot_throughput` write a readable PNG of a sweep: right size, every panel drawn."""

from __future__ import annotations

import math

import numpy as np
import pytest
from kvfleet_runtime.benchmarks.plot import plot_serve, plot_throughput
from matplotlib.image import imread


def serve_run(rate: float, concurrency: int | None, load: float) -> dict:
    """One `bench serve` result whose latencies grow with `load` (as a saturating server's do)."""
    ttft, tpot = 20 + 200 * load, 8 + 30 * load
    return {
        "request_rate": rate, "max_concurrency": concurrency,
        "request_throughput": 2 + 10 * load, "output_throughput": 200 + 1500 * load,
        "ttft_ms_mean": ttft, "ttft_ms_median": 0.9 * ttft, "ttft_ms_p99": 2.5 * ttft,
        "tpot_ms_mean": tpot, "tpot_ms_median": 0.95 * tpot, "tpot_ms_p99": 1.8 * tpot,
        "itl_ms_mean": tpot, "itl_ms_median": 0.9 * tpot, "itl_ms_p99": 3 * tpot,
    }


def throughput_run(max_num_seqs: int) -> dict:
    out = 300.0 * math.log2(max_num_seqs + 1)
    return {"num_prompts": 256, "input_len": 128, "output_len": 128,
            "max_num_seqs": max_num_seqs, "output_tokens_per_s": out,
            "total_tokens_per_s": 2 * out, "elapsed_s": 256 * 128 / out}


def read_png(path) -> np.ndarray:
    """RGB pixels in 0..1, [H, W, 3]; fails unless the file is a real PNG."""
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    return imread(path)[..., :3]


def ink_fraction(pixels: np.ndarray) -> float:
    """Share of pixels that are not (near) white background."""
    return float((pixels.min(axis=-1) < 0.9).mean())


def colored_fraction(pixels: np.ndarray) -> float:
    """Share of saturated pixels: plotted lines, not black text or grey grid."""
    return float((pixels.max(axis=-1) - pixels.min(axis=-1) > 0.3).mean())


def test_plot_serve_rate_sweep_draws_all_four_panels(tmp_path):
    # rates given out of order, `inf` among them: the x axis must still be ordered and readable
    runs = [serve_run(r, None, load) for r, load in
            ((4.0, 0.5), (1.0, 0.1), (math.inf, 1.0), (16.0, 0.9))]
    path = tmp_path / "serve.png"
    plot_serve(runs, str(path))

    pixels = read_png(path)
    assert pixels.shape == (800, 1200, 3)
    h, w = pixels.shape[0] // 2, pixels.shape[1] // 2
    for quadrant in (pixels[:h, :w], pixels[:h, w:], pixels[h:, :w], pixels[h:, w:]):
        assert ink_fraction(quadrant) > 0.01          # axes, ticks, labels
        assert colored_fraction(quadrant) > 0.001     # the curves themselves


def test_plot_serve_concurrency_sweep(tmp_path):
    runs = [serve_run(math.inf, c, c / 64) for c in (64, 1, 8)]
    path = tmp_path / "serve.png"
    plot_serve(runs, str(path))
    assert colored_fraction(read_png(path)) > 0.002


def test_plot_throughput_batch_sweep(tmp_path):
    path = tmp_path / "throughput.png"
    plot_throughput([throughput_run(n) for n in (1, 8, 64, 256)], str(path))

    pixels = read_png(path)
    assert pixels.shape == (450, 1200, 3)
    left, right = pixels[:, :600], pixels[:, 600:]
    assert colored_fraction(left) > 0.001 and colored_fraction(right) > 0.001


def test_plot_throughput_accepts_batch_size_and_a_single_run(tmp_path):
    run = throughput_run(32)
    run["batch_size"] = run.pop("max_num_seqs")
    path = tmp_path / "one.png"
    plot_throughput([run], str(path))
    assert ink_fraction(read_png(path)) > 0.01


def color_fraction(pixels: np.ndarray, rgb: tuple[int, int, int]) -> float:
    return float((np.abs(pixels - np.array(rgb) / 255).max(axis=-1) < 0.08).mean())


def test_plot_throughput_draws_one_line_per_backend(tmp_path):
    # `bench throughput --backend kvfleet,hf`: the same setting, one run per backend
    runs = [{**throughput_run(n), "backend": "kvfleet"} for n in (8, 64)]
    runs += [{**r, "backend": "hf", "output_tokens_per_s": r["output_tokens_per_s"] / 3,
              "total_tokens_per_s": r["total_tokens_per_s"] / 3, "elapsed_s": 3 * r["elapsed_s"]}
             for r in runs]
    path = tmp_path / "backends.png"
    plot_throughput(runs, str(path))
    pixels = read_png(path)
    for rgb in ((31, 119, 180), (255, 127, 14)):        # tab:blue, tab:orange
        assert color_fraction(pixels, rgb) > 0.001, rgb


def test_missing_key_is_named(tmp_path):
    run = serve_run(1.0, None, 0.1)
    del run["itl_ms_p99"]
    with pytest.raises(ValueError, match=r"results\[0\] is missing itl_ms_p99"):
        plot_serve([run], str(tmp_path / "x.png"))
    no_batch = throughput_run(4)
    del no_batch["max_num_seqs"]
    with pytest.raises(ValueError, match="max_num_seqs, batch_size"):
        plot_throughput([no_batch], str(tmp_path / "y.png"))
    with pytest.raises(ValueError, match="at least one run"):
        plot_serve([], str(tmp_path / "z.png"))
