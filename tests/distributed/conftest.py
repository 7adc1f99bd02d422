"""Fixtures for tensor-parallel tests: tiny checkpoints of each case, made once per session."""

from __future__ import annotations

import pytest
from support.tiny_models import make_tiny_model
from tp_cases import CASES


@pytest.fixture(scope="session")
def tp_model_dir(tmp_path_factory):
    """Callable case -> folder of a saved tiny random checkpoint (cached per session)."""
    made: dict[str, str] = {}

    def get(case: str) -> str:
        if case not in made:
            arch, overrides = CASES[case]
            made[case] = str(make_tiny_model(arch, tmp_path_factory.mktemp(f"tp-{case}"),
                                             **overrides))
        return made[case]
    return get
