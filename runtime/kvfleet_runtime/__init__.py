"""kvfleet runtime: a paged-KV-cache LLM inference engine.

    from kvfleet_runtime import LLM, SamplingParams
    LLM(model="path").generate(["Hello"], SamplingParams(max_tokens=16))

Names are imported on first use, so light commands (`kvfleet pull`) never load torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "kvfleet_runtime.llm",
    "SamplingParams": "kvfleet_runtime.sampling_params",
    "StructuredOutputsParams": "kvfleet_runtime.structured_outputs",
    "EngineConfig": "kvfleet_runtime.config",
    "RequestOutput": "kvfleet_runtime.outputs",
    "CompletionOutput": "kvfleet_runtime.outputs",
    "AsyncLLMEngine": "kvfleet_runtime.engine.async_engine",
    "LoRARequest": "kvfleet_runtime.lora",
    "PoolingParams": "kvfleet_runtime.pooling",
    "EmbeddingRequestOutput": "kvfleet_runtime.pooling",
    "ScoringRequestOutput": "kvfleet_runtime.pooling",
    "ClassificationRequestOutput": "kvfleet_runtime.pooling",
    "BeamSearchParams": "kvfleet_runtime.beam_search",
    "BeamSearchOutput": "kvfleet_runtime.beam_search",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvfleet_runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
