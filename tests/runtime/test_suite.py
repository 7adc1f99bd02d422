"""The GPU benchmark suite's rows on a CPU engine (tiny model): each asked-for row comes out,
named and with its figures, and an unknown row is refused."""

from __future__ import annotations

import json

import pytest
from kvfleet_runtime.benchmarks import suite
from support.tiny_models import make_tiny_model


@pytest.mark.slow
def test_rows_are_written_to_the_json(tmp_path, capsys):
    model = make_tiny_model("llama", tmp_path / "m", max_position_embeddings=4096)
    out = tmp_path / "rows.json"
    # 1000-token prompts: as many as the KV cache holds at 2000 tokens, capped by --max-num-seqs;
    # prefilled over 4 steps of 512 tokens, the first decoding during the later ones
    assert suite.main(["--model", str(model), "--rows", "bs1,profile-1000,tp128",
                       "--num-prompts", "3", "--max-num-seqs", "2", "--max-model-len", "2048",
                       "--max-num-batched-tokens", "512",
                       "--dtype", "float32", "--label", "cpu-", "--repeat", "2",
                       "--json", str(out)]) == 0
    rows = {r["row"]: r for r in json.loads(out.read_text())}
    assert rows["cpu-bs1"]["decode_tokens_per_s_per_seq"] > 0
    assert rows["cpu-tp128"]["num_prompts"] == 3 and rows["cpu-tp128"]["max_num_seqs"] == 2
    assert rows["cpu-tp128"]["output_tokens_per_s"] > 0
    # --repeat 2: the throughput row again on the same engine, under its own name
    assert rows["cpu-tp128-run2"]["num_prompts"] == 3 and "cpu-bs1-run2" not in rows
    profiled = [name for name in rows if name.startswith("cpu-profile-bs2-")]
    assert sorted(profiled) == ["cpu-profile-bs2-decode", "cpu-profile-bs2-prefill"]
    # the 32 profiled decode steps ran with both requests (none finished inside them)
    assert rows["cpu-profile-bs2-decode"]["batch"] == [2, 2]
    assert "[profile batch 2 x 1000] decode: 32 step(s) at batch 2->2" in capsys.readouterr().out


def test_unknown_rows_are_refused(capsys):
    with pytest.raises(SystemExit):
        suite.main(["--model", "unused", "--rows", "bs1,tp9999"])
    assert "unknown tp9999" in capsys.readouterr().err


def test_repeat_below_one_is_refused(capsys):
    with pytest.raises(SystemExit):
        suite.main(["--model", "unused", "--rows", "tp128", "--repeat", "0"])
    assert "--repeat must be >= 1" in capsys.readouterr().err
