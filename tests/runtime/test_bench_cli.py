"""`kvfleet bench throughput | latency` run for real on a tiny model and report sane numbers."""

from __future__ import annotations

import json

from kvfleet_runtime.cli import main


def test_bench_throughput_side_by_side_with_hf(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "tp.json"
    png = tmp_path / "tp.png"
    rc = main(["bench", "throughput", "--model", tiny_model_dir("llama"), "--num-prompts", "6",
               "--input-len", "12", "--output-len", "5", "--backend", "kvfleet,hf",
               "--json", str(out), "--plot", str(png)])
    assert rc == 0
    results = {r["backend"]: r for r in json.loads(out.read_text())}
    assert set(results) == {"kvfleet", "hf"}
    for r in results.values():
        assert r["output_tokens_per_s"] > 0
        assert abs(r["output_tokens_per_s"] * r["elapsed_s"] - 30) < 1e-6
    assert 0.0 <= results["kvfleet"]["host_share"] <= 1.0
    assert "ratio kvfleet/hf" in capsys.readouterr().out
    assert png.stat().st_size > 10_000


def test_bench_latency_reports_ttft_tpot_and_a_profile(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "lat.json"
    rc = main(["bench", "latency", "--model", tiny_model_dir("llama"), "--batch-size", "2",
               "--input-len", "10", "--output-len", "4", "--num-iters", "1", "--profile",
               "--json", str(out)])
    assert rc == 0
    (res,) = json.loads(out.read_text())
    assert res["ttft_ms"] > 0 and res["tpot_ms"] > 0
    assert res["latency_s"] * 1e3 >= res["ttft_ms"]
    assert res["profile_decode"]["wall_ms"] > 0
    assert "ms/step host work" in capsys.readouterr().out


def test_bench_rejects_an_unknown_backend(tiny_model_dir, capsys):
    rc = main(["bench", "throughput", "--model", tiny_model_dir("llama"), "--backend", "trt"])
    assert rc == 2 and "--backend must list kvfleet and/or hf" in capsys.readouterr().err


def test_a_bad_model_path_is_one_clear_line_and_exit_2(capsys):
    assert main(["serve", "/nonexistent/model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvfleet serve: error: model '/nonexistent/model' is neither")
    assert "Traceback" not in err


def test_a_profile_whose_kernels_overlap_says_so():
    # under PDL the kernels' summed time exceeds the wall time; the line must not read as
    # negative host time without saying why
    from kvfleet_runtime.benchmarks.profile import StepProfile
    overlapping = StepProfile("decode", 32, wall_ms=4.46, kernel_ms=6.80, top=[]).render()
    assert "kernels overlap: PDL" in overlapping
    additive = StepProfile("decode", 32, wall_ms=5.08, kernel_ms=4.65, top=[]).render()
    assert "overlap" not in additive and "0.43 ms/step host work" in additive
