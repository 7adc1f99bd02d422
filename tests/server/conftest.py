"""Fixtures for server tests: a tiny random Llama checkpoint made once per session.

Each test module starts its own `kvfleet serve` (module-scoped) from it, so modules
that load the server differently (API key, queue limits, SIGTERM) stay independent.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from support.tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))
