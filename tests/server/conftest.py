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
    # wider init than HF's 0.02: the top-2 logit gap grows from ~0.03 to ~0.2, so greedy
    # outputs do not flip on float noise when the batch composition changes
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"), initializer_range=0.2)
