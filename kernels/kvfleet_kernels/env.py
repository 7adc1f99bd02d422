"""Switches read from the environment, shared by the kernels and the runtime's layers."""

from __future__ import annotations


def on_off(name: str, value: str) -> bool:
    """An on-by-default switch `name` set to `value`: unset ("") or 1 -> on, 0 -> off; anything
    else is a clear error naming the variable."""
    if value not in ("", "0", "1"):
        raise ValueError(f"{name} must be unset, 0 or 1; got {value!r}")
    return value != "0"
