"""Fixtures for runtime tests: tiny checkpoints on disk, made once per session."""

from __future__ import annotations

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
