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


def test_bench_throughput_with_structured_outputs_on_a_share_of_prompts(
        tiny_model_dir, tmp_path, capsys, monkeypatch):
    from kvfleet_runtime.llm import LLM
    runs = []
    generate = LLM.generate

    def recording(self, prompts, params=None, **kwargs):
        outs = generate(self, prompts, params, **kwargs)
        runs.append((params, outs))
        return outs
    monkeypatch.setattr(LLM, "generate", recording)
    out = tmp_path / "tp.json"
    rc = main(["bench", "throughput", "--model", tiny_model_dir("llama"), "--num-prompts", "8",
               "--input-len", "12", "--output-len", "10", "--structured-output-ratio", "0.25",
               "--json", str(out)])
    assert rc == 0
    (result,) = json.loads(out.read_text())
    assert result["structured_output_ratio"] == 0.25
    assert "structured outputs on 25.0% of prompts" in capsys.readouterr().out
    params, outs = runs[-1]          # the timed run
    texts = [o.outputs[0].text for o in outs]
    grammar_rows = [i for i, p in enumerate(params) if p.structured_outputs is not None]
    assert grammar_rows == [0, 4]
    for i, text in enumerate(texts):
        assert len(outs[i].outputs[0].token_ids) == 10
        # a JSON array of integers cut at 10 tokens: "[" then digits, ", " and minus signs
        follows = text.startswith("[") and set(text[1:]) <= set("0123456789,- ")
        assert follows == (i in grammar_rows), (i, text)
    rc = main(["bench", "throughput", "--model", tiny_model_dir("llama"),
               "--structured-output-ratio", "1.5"])
    assert rc == 2 and "--structured-output-ratio must be in [0, 1]" in capsys.readouterr().err


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
