"""kvfleet runtime: a paged-KV-cache LLM inference engine.

    from kvfleet_runtime import LLM, SamplingParams
    LLM(model="path").generate(["Hello"], SamplingParams(max_tokens=16))
"""

from kvfleet_runtime.config import EngineConfig
from kvfleet_runtime.llm import LLM
from kvfleet_runtime.outputs import CompletionOutput, RequestOutput
from kvfleet_runtime.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
