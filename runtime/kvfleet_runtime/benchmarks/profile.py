"""Where a step's time goes: GPU kernel time vs host time vs launch gaps (torch.profiler).

`kvfleet bench latency --profile` runs one more iteration under the profiler and
prints this for its prefill step and its decode steps separately.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile


@dataclass
class StepProfile:
    label: str
    num_steps: int
    wall_ms: float            # per step
    kernel_ms: float          # per step: summed device time of all kernels (one stream)
    top: list[tuple[str, float, float]]   # (kernel, ms per step, launches per step), largest first
    batch: tuple[int, int] | None = None  # running requests at the first and the last step

    def render(self) -> str:
        busy = self.kernel_ms / self.wall_ms if self.wall_ms else 0.0
        batch = f" at batch {self.batch[0]}->{self.batch[1]}" if self.batch else ""
        lines = [f"{self.label}: {self.num_steps} step(s){batch}, {self.wall_ms:.2f} ms/step wall, "
                 f"{self.kernel_ms:.2f} ms/step in GPU kernels ({busy:.0%} busy), "
                 f"{self.wall_ms - self.kernel_ms:.2f} ms/step host work + launch gaps"]
        if busy > 1.0:
            # programmatic dependent launch (kvfleet_kernels.pdl): a kernel starts before the one
            # ahead of it ends and its time includes that wait; the times do not add up
            lines[0] += " (kernels overlap: PDL; KVFLEET_PDL=0 for times that add up)"
        lines += [f"    {ms:8.3f} ms  {calls:6.1f}x  {name[:90]}" for name, ms, calls in self.top]
        return "\n".join(lines)


def profile_steps(step, num_steps: int, label: str, device: torch.device,
                  top: int | None = None, until=None) -> StepProfile:
    """Profile `num_steps` calls of `step()` (each one engine step), or fewer once `until()`.

    Only device-side kernel events are summed: a CPU op's own "device time" repeats the
    time of the kernels it launched. `top` (default: $KVFLEET_PROFILE_TOP, else 8) kernels
    are listed, each with its launches per step.
    """
    if top is None:
        top = int(os.environ.get("KVFLEET_PROFILE_TOP", "8"))
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    done = 0
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        while done < num_steps and not (until is not None and until()):
            step()
            done += 1
        sync()
        wall = time.perf_counter() - start
    kernel = torch.autograd.DeviceType.CUDA
    events = [e for e in prof.key_averages()
              if e.device_type == kernel and e.self_device_time_total > 0]
    kernel_us = sum(e.self_device_time_total for e in events)
    ranked = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:top]
    n = max(done, 1)
    return StepProfile(label=label, num_steps=done, wall_ms=1e3 * wall / n,
                       kernel_ms=kernel_us / 1e3 / n,
                       top=[(e.key, e.self_device_time_total / 1e3 / n, e.count / n)
                            for e in ranked])
