"""scripts/clock-timeline: gpu-check's CLOCKS=1 log (nvidia-smi --format=csv,nounits) read back
as a timeline, on a log written here in that format."""

from __future__ import annotations

import datetime
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "clock-timeline"
HEADER = ("timestamp, clocks.current.sm, clocks.current.memory, power.draw, temperature.gpu, "
          "clocks_event_reasons.active")


def stamp(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]


def test_buckets_medians_reasons_and_marks(tmp_path: Path) -> None:
    t0 = 1_796_200_000.0
    lines = [HEADER,
             f"{stamp(t0)}, 1980, 3201, 120.00, 40, 0x0000000000000001",        # idle
             f"{stamp(t0 + 1)}, 1980, 3201, 140.00, 45, 0x0000000000000000",
             f"{stamp(t0 + 2)}, 1970, 3201, [N/A], 45, 0x0000000000000000",      # skipped
             f"{stamp(t0 + 6)}, 1455, 3201, 690.00, 66, 0x0000000000000004",     # power cap
             f"{stamp(t0 + 7)}, 1485, 3201, 694.00, 69, 0x0000000000000004",
             f"{stamp(t0 + 8)}, 1470, 3201, 692.00, 67, 0x0000000000000084"]
    (tmp_path / "clocks.csv").write_text("\n".join(lines) + "\n")
    (tmp_path / "marks.txt").write_text(f"{t0 + 5.5} tp128 starts\n")
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "clocks.csv"), "--every", "5",
                          "--marks", str(tmp_path / "marks.txt")],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0].startswith("# 5 samples")
    first, mark, second = out[1:]
    assert [c.strip() for c in first.split("|")] == ["0.0", "1980", "3201", "130", "45", "idle"]
    assert mark == "-- tp128 starts (t 5.5 s)"
    assert [c.strip() for c in second.split("|")] == [
        "6.0", "1470", "3201", "692", "69", "sw-power-cap,hw-power-brake"]


def test_a_log_without_samples_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "clocks.csv").write_text(HEADER + "\n")
    run = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "clocks.csv")],
                         capture_output=True, text=True)
    assert run.returncode != 0 and "no samples" in run.stderr
