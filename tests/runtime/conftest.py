"""Fixtures for runtime tests: tiny checkpoints on disk, made once per session."""

from __future__ import annotations

import gc

import pytest
from support.tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Callable arch -> folder of a saved tiny random checkpoint (cached per session)."""
    made: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in made:
            made[arch] = str(make_tiny_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}")))
        return made[arch]
    return get


@pytest.fixture(autouse=True)
def _keep_gc_thresholds():
    # the benchmarks run in-process here and set this process's collector thresholds
    # (engine.gc_tuning): later tests get the ones they started with
    saved = gc.get_threshold()
    yield
    gc.set_threshold(*saved)
