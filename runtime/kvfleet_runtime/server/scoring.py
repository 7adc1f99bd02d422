"""vLLM's scoring endpoints: `POST /score` (`/v1/score`), `POST /rerank` (`/v1/rerank`,
`/v2/rerank`: Jina's and Cohere's API, as vLLM serves them) and `POST /classify`, through the
engine beside generation.

A cross-encoder (a classifier of one or two labels: a sequence-classification checkpoint, or a
causal LM served with vLLM's `classifier_from_token` recipe, e.g. Qwen3-Reranker) runs each
(query, document) pair as one prompt, joined as its tokenizer joins a text pair, and scores it by
its last label's probability; any other model scores by the cosine similarity of the two texts'
embeddings (kvfleet_runtime/pooling.py). /classify gives each input's label probabilities.

/score pairs `text_1` with `text_2` as vLLM does: one text with one or many, or two lists pair
by pair. /rerank scores `query` against each of `documents` and answers them best first, the
first `top_n` (0: all).
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import Field

from kvfleet_runtime.pooling import PoolingParams, cosine, pair_prompt, score_pairs
from kvfleet_runtime.server import protocol as p
from kvfleet_runtime.server.embeddings import PoolingInputs, checked_prompt, pool_all


class ScoreRequest(p._Strict):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    user: str | None = None
    use_activation: bool = True     # vLLM's: False gives a cross-encoder's raw logit
    priority: int = 0      # vLLM's: the priority scheduling policy's order (lower first)


class RerankDocument(p._Strict):
    text: str


class RerankRequest(p._Strict):
    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int = Field(default=0, ge=0)
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    user: str | None = None
    # Cohere's: each document scored on its first N tokens (the answer keeps its whole text)
    max_tokens_per_doc: int | None = Field(default=None, ge=1)
    use_activation: bool = True     # vLLM's: False gives a cross-encoder's raw logit
    priority: int = 0      # vLLM's: the priority scheduling policy's order (lower first)


async def _scores(state: Any, pairs: list[tuple[str, str]], truncate: int | None,
                  add_special_tokens: bool, lora_request: Any, request_id: str,
                  param: str, use_activation: bool, priority: int) -> tuple[list[float], int]:
    """Each pair's score and the prompt tokens run for them; `param` names the field a prompt
    too long is blamed on."""
    engine = state.engine
    if engine.pooler.cross_encoder:
        prompts = []
        for i, (a, b) in enumerate(pairs):
            # --chat-template: the score template over the roles query and document
            ids = pair_prompt(engine.tokenizer, a, b, add_special_tokens, state.chat_template)
            prompts.append(checked_prompt(state, ids, f"pair {i}", truncate, param=param))
        outs = await pool_all(state, prompts,
                              PoolingParams(task="score", use_activation=use_activation),
                              lora_request, request_id, priority)
        return [out[-1] for out in outs], sum(len(ids) for ids in prompts)
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    prompts = [checked_prompt(state, t, f"text {i}", truncate, add_special_tokens, param=param)
               for i, t in enumerate(texts)]
    embedded = dict(zip(texts, await pool_all(state, prompts, PoolingParams(), lora_request,
                                              request_id, priority), strict=True))
    return ([cosine(embedded[a], embedded[b]) for a, b in pairs],
            sum(len(ids) for ids in prompts))


async def create_score(state: Any, body: ScoreRequest, lora_request: Any,
                       request_id: str) -> dict[str, Any]:
    try:
        pairs = score_pairs(body.text_1, body.text_2)
    except ValueError as e:
        raise p.OpenAIError(str(e), param=str(e).split(" ", 1)[0]) from None
    scores, tokens = await _scores(state, pairs, body.truncate_prompt_tokens,
                                   body.add_special_tokens, lora_request, request_id, "text_2",
                                   body.use_activation, body.priority)
    return {"id": request_id, "object": "list", "created": int(time.time()),
            "model": body.model or state.model_name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens,
                      "completion_tokens": 0}}


async def create_rerank(state: Any, body: RerankRequest, lora_request: Any,
                        request_id: str) -> dict[str, Any]:
    documents = [d if isinstance(d, str) else d.text for d in body.documents]
    if not documents:
        raise p.OpenAIError("documents must not be empty", param="documents")
    scored = documents
    if body.max_tokens_per_doc is not None:
        tok = state.engine.tokenizer
        scored = [tok.decode(tok.encode(d, add_special_tokens=False)[:body.max_tokens_per_doc])
                  for d in documents]
    scores, tokens = await _scores(state, [(body.query, d) for d in scored],
                                   body.truncate_prompt_tokens, body.add_special_tokens,
                                   lora_request, request_id, "documents", body.use_activation,
                                   body.priority)
    order = sorted(range(len(documents)), key=lambda i: -scores[i])
    if body.top_n:
        order = order[:body.top_n]
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": documents[i]}} if body.return_documents else {})}
               for i in order]
    return {"id": request_id, "model": body.model or state.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "results": results}


class ClassificationRequest(PoolingInputs):
    use_activation: bool = True     # vLLM's: False gives the raw logits, not probabilities


async def create_classification(state: Any, body: ClassificationRequest, lora_request: Any,
                                request_id: str) -> dict[str, Any]:
    prompts = body.prompts(state)
    outs = await pool_all(state, prompts,
                          PoolingParams(task="classify", use_activation=body.use_activation),
                          lora_request, request_id, body.priority)
    pooler = state.engine.pooler
    # a sequence classifier's id2label, or a causal LM's classifier tokens
    labels = pooler.labels or tuple(
        state.engine.tokenizer.convert_ids_to_tokens(list(pooler.classifier_token_ids)))
    tokens = sum(len(ids) for ids in prompts)
    return {"id": request_id, "object": "list", "created": int(time.time()),
            "model": body.model or state.model_name,
            "data": [{"index": i, "label": labels[max(range(len(probs)), key=probs.__getitem__)],
                      "probs": probs, "num_classes": len(probs)}
                     for i, probs in enumerate(outs)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}
