"""Embeddings (vLLM's pooling): a prompt's last token's final hidden state, L2-normalised, from the
same engine that generates (`LLM.embed`, `AsyncLLMEngine.encode`, the server's `/v1/embeddings`).

A pooling request runs as a one-token request whose prefill keeps the hidden state of its last
prompt position (after the model's final norm) instead of only its logits: it is scheduled,
chunked, prefix-cached and batched beside generation as any prompt is, and its blocks are freed
when it finishes. Last-token pooling is what decoder embedding models use (Qwen3-Embedding,
gte-Qwen2, e5-mistral) and what vLLM's `--convert embed` gives a causal LM. A model folder with
sentence-transformers' `modules.json` says its pooling there: last-token is served (mean and CLS
pooling are refused: a prefix-cached prompt's earlier positions are never computed) and its
`Normalize` module, or its absence, decides the normalisation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class PoolingParams:
    """normalize: L2-normalise the embedding (None: the model's pooling config says; default
    yes). dimensions: keep the first N values (Matryoshka models), then normalise."""
    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (
                not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool)
                or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer; got {self.dimensions!r}")


@dataclass(frozen=True)
class PoolerConfig:
    """How a model pools (from its folder): last token only; normalize by default or not;
    matryoshka: whether `dimensions` may shorten its embeddings; refused: why it cannot embed."""
    normalize: bool = True
    matryoshka: bool = False
    refused: str | None = None

    @classmethod
    def of(cls, model_dir: str | Path | None, hf_config: dict | None = None) -> PoolerConfig:
        hf_config = hf_config or {}
        matryoshka = bool(hf_config.get("is_matryoshka") or hf_config.get("matryoshka_dimensions"))
        folder = Path(model_dir) if model_dir else None
        modules_file = folder / "modules.json" if folder is not None and folder.is_dir() else None
        if modules_file is None or not modules_file.exists():
            return cls(matryoshka=matryoshka)
        modules = json.loads(modules_file.read_text())
        kinds = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules}
        refused = None
        pooling = kinds.get("Pooling")
        if pooling is not None:
            path = folder / pooling.get("path", "") / "config.json"
            config = json.loads(path.read_text()) if path.exists() else {}
            modes = sorted(k.removeprefix("pooling_mode_").removesuffix("_tokens")
                           for k, v in config.items() if k.startswith("pooling_mode_") and v)
            if modes != ["lasttoken"]:
                refused = (f"this model pools by {', '.join(modes) or 'nothing'} "
                           "(sentence-transformers' modules.json); only last-token pooling is "
                           "served")
        return cls(normalize="Normalize" in kinds, matryoshka=matryoshka, refused=refused)

    def check(self, params: PoolingParams, hidden_size: int) -> None:
        """ValueError (naming the field) for what this model cannot give."""
        if self.refused is not None:
            raise ValueError(self.refused)
        if params.dimensions is not None:
            if not self.matryoshka:
                raise ValueError("dimensions: this model does not support Matryoshka "
                                 "representation (its config.json sets no is_matryoshka / "
                                 "matryoshka_dimensions)")
            if params.dimensions > hidden_size:
                raise ValueError(f"dimensions must be <= the model's hidden size "
                                 f"({hidden_size}); got {params.dimensions}")

    def resolve(self, params: PoolingParams) -> PoolingParams:
        """params with normalize filled from this config."""
        if params.normalize is not None:
            return params
        return PoolingParams(normalize=self.normalize, dimensions=params.dimensions)


def embedding_sampling_params(pooling: PoolingParams):
    """The one-step request that carries an embedding through the engine: one greedy token
    (dropped), no text."""
    from kvfleet_runtime.sampling_params import SamplingParams
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, pooling=pooling)


def pool(hidden, params: PoolingParams) -> list[float]:
    """One embedding from a last position's hidden state (a 1-D tensor, on any device)."""
    import torch
    x = hidden.float()
    if params.dimensions is not None:
        x = x[:params.dimensions]
    if params.normalize is not False:
        x = torch.nn.functional.normalize(x, dim=-1)
    return x.cpu().tolist()


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """vLLM's: one prompt's embedding (LLM.embed, AsyncLLMEngine.encode)."""
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
