"""`POST /v1/embeddings` (OpenAI's, with vLLM's extras): each input's embedding from the served
model (kvfleet_runtime/pooling.py: its last token's final hidden state, L2-normalised), through
the engine beside generation requests.

Input: a string, a list of strings, a list of token ids, or a list of token-id lists (OpenAI's four
forms). `encoding_format` float or base64 (little-endian float32, as OpenAI's), `dimensions`
(Matryoshka models only), and vLLM's `truncate_prompt_tokens`, `add_special_tokens`, `normalize`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import struct
from typing import Any, Literal

from pydantic import Field

from kvfleet_runtime.pooling import EmbeddingRequestOutput, PoolingParams
from kvfleet_runtime.server import protocol as p


class PoolingInputs(p._Strict):
    """OpenAI's embeddings input (also /classify's), with vLLM's truncation and special-token
    flags."""
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    priority: int = 0      # vLLM's: the priority scheduling policy's order (lower first)

    def prompts(self, state: Any) -> list[list[int]]:
        """Each input's checked token ids (checked_prompt)."""
        return [checked_prompt(state, item, f"input {i}", self.truncate_prompt_tokens,
                               self.add_special_tokens)
                for i, item in enumerate(self.inputs())]

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        if isinstance(x, str):
            items: list[str | list[int]] = [x]
        elif x and all(isinstance(t, int) for t in x):
            items = [list(x)]           # one input of token ids
        else:
            items = list(x)
        if not items or any(not item for item in items):
            raise p.OpenAIError("input must not be empty, nor hold an empty input", param="input")
        return items


class EmbeddingRequest(PoolingInputs):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    normalize: bool | None = None       # vLLM's


def checked_prompt(state: Any, item: str | list[int], what: str, truncate: int | None,
                   add_special_tokens: bool = True, param: str = "input") -> list[int]:
    """One pooling input's token ids, truncated as truncate_prompt_tokens says; an OpenAIError
    naming `param` for ids out of the vocabulary or a prompt too long (`what` names it)."""
    engine = state.engine
    max_len = engine.config.max_model_len
    if isinstance(item, str):
        ids = engine.tokenizer.encode(item, add_special_tokens=add_special_tokens)
    else:
        vocab = len(engine.tokenizer)
        if any(not 0 <= t < vocab for t in item):
            raise p.OpenAIError(f"{param} token ids must be in [0, {vocab})", param=param)
        ids = list(item)
    ids = p.truncate_prompt(ids, truncate, max_len)
    if len(ids) >= max_len:     # (the engine's one-step request needs a slot past it)
        raise p.OpenAIError(
            f"This model's maximum context length is {max_len} tokens; {what} has {len(ids)} "
            f"(pooling takes at most {max_len - 1}). Shorten it, or set truncate_prompt_tokens.",
            param=param, code="context_length_exceeded")
    return ids


async def pool_all(state: Any, prompts: list[list[int]], params: PoolingParams,
                   lora_request: Any, request_id: str, priority: int = 0) -> list[list[float]]:
    """Each prompt's pooled output (an embedding, or a cross-encoder's [score]), run through
    the engine together. The engine's refusal (the model's pooling, dimensions) is an
    OpenAIError naming `dimensions` or `model` (`priority` under fcfs: naming it);
    EngineDeadError and EngineQueueFullError are the caller's."""
    engine = state.engine
    p.check_priority(engine, priority)
    engine.check_admission(len(prompts))

    async def one(i: int, ids: list[int]) -> EmbeddingRequestOutput:
        async with contextlib.aclosing(engine.encode(
                ids, params, request_id=f"{request_id}-{i}", lora_request=lora_request,
                priority=priority)) as outs:
            async for out in outs:
                return out
        raise RuntimeError(f"pooling request {request_id}-{i} gave no output")

    # one task an input; any failure (or this call cancelled: the client left) cancels the
    # others, whose requests the engine then aborts
    tasks = [asyncio.ensure_future(one(i, ids)) for i, ids in enumerate(prompts)]
    try:
        outs = await asyncio.gather(*tasks)
    except ValueError as e:         # the engine's check: the model's pooling, dimensions
        message = str(e)
        param = "dimensions" if message.startswith("dimensions") else "model"
        raise p.OpenAIError(message, param=param) from None
    finally:
        for t in tasks:
            t.cancel()
    return [out.outputs.embedding for out in outs]


async def create_embeddings(state: Any, body: EmbeddingRequest, lora_request: Any,
                            request_id: str) -> dict[str, Any]:
    """The response body; OpenAIError for a bad request (before anything runs where it can be
    told from the request alone)."""
    prompts = body.prompts(state)
    params = PoolingParams(normalize=body.normalize, dimensions=body.dimensions)
    embeddings = await pool_all(state, prompts, params, lora_request, request_id, body.priority)
    data = [{"object": "embedding", "index": i, "embedding": _encode(e, body.encoding_format)}
            for i, e in enumerate(embeddings)]
    tokens = sum(len(ids) for ids in prompts)
    return {"object": "list", "data": data, "model": body.model or state.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encode(values: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return values
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
