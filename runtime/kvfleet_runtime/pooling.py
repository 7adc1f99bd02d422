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

Classifiers (vLLM's `classify` task: `LLM.classify`, the server's `/classify`) give the label
probabilities of a prompt's last position: softmax over the labels' logits (sigmoid for one).
A classifier is a sequence-classification checkpoint (`XForSequenceClassification`: X's decoder
and a `score` head of one row a label, named by its config's id2label; reward models,
classifiers, rerankers saved so), or a causal LM whose config names `classifier_from_token`
(vLLM's recipe for Qwen3-Reranker: `--hf-overrides '{"architectures":
["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
"is_original_qwen3_reranker": true}'`), whose labels' logits are those tokens' from its lm_head.

Scoring (vLLM's `score` task: `LLM.score`, the server's `/score` and `/rerank`): a classifier of
one or two labels is a cross-encoder, scoring a (query, document) pair run as one prompt by its
last label's probability (sigmoid(logit(yes) - logit(no)) for Qwen3-Reranker). Any other model
scores by the cosine similarity of the two texts' embeddings.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

TASKS = ("embed", "score", "classify")


@dataclass
class PoolingParams:
    """normalize: L2-normalise the embedding (None: the model's pooling config says; default
    yes). dimensions: keep the first N values (Matryoshka models), then normalise. task
    "classify": a classifier's probabilities of its labels for the prompt (softmax; sigmoid for
    one label); "score": a cross-encoder's relevance of the prompt (a query and a document run
    as one), its last label's probability, as a one-value output. Both only for a classifier:
    a sequence-classification checkpoint or a config naming classifier_from_token.
    classifier_token_ids: set by the engine for the latter (PoolerConfig.resolve).
    use_activation (vLLM's): False gives classify's raw logits and score's raw logit (the last
    label's, less the first's for two) in place of probabilities."""
    normalize: bool | None = None
    dimensions: int | None = None
    task: str = "embed"
    classifier_token_ids: tuple[int, ...] | None = None
    use_activation: bool = True

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}; got {self.task!r}")
        if self.dimensions is not None and (
                not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool)
                or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer; got {self.dimensions!r}")


@dataclass(frozen=True)
class PoolerConfig:
    """How a model pools (from its folder): last token only; normalize by default or not;
    matryoshka: whether `dimensions` may shorten its embeddings; refused: why it cannot embed.
    A classifier either way: classifier_token_ids, a causal LM's tokens (its config's
    classifier_from_token) whose logits are its labels' (classifier_refused: why those cannot
    be), or labels, a sequence-classification checkpoint's (its `score` head's rows, named by
    id2label). Neither: the model scores by embeddings' cosine similarity."""
    normalize: bool = True
    matryoshka: bool = False
    refused: str | None = None
    classifier_token_ids: tuple[int, ...] = ()
    classifier_refused: str | None = None
    labels: tuple[str, ...] = ()

    @classmethod
    def of(cls, model_dir: str | Path | None, hf_config: dict | None = None,
           tokenizer=None, num_labels: int = 0) -> PoolerConfig:
        hf_config = hf_config or {}
        matryoshka = bool(hf_config.get("is_matryoshka") or hf_config.get("matryoshka_dimensions"))
        classifier = _classifier(hf_config.get("classifier_from_token"), tokenizer)
        if num_labels:
            names = hf_config.get("id2label") or {}
            classifier["labels"] = tuple(str(names.get(str(i), names.get(i, f"LABEL_{i}")))
                                         for i in range(num_labels))
        folder = Path(model_dir) if model_dir else None
        modules_file = folder / "modules.json" if folder is not None and folder.is_dir() else None
        if modules_file is None or not modules_file.exists():
            return cls(matryoshka=matryoshka, **classifier)
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
        return cls(normalize="Normalize" in kinds, matryoshka=matryoshka, refused=refused,
                   **classifier)

    @property
    def cross_encoder(self) -> bool:
        """Scores a pair run as one prompt (a classifier), not by cosine similarity."""
        return (bool(self.classifier_token_ids or self.labels)
                or self.classifier_refused is not None)

    @property
    def num_labels(self) -> int:
        return len(self.classifier_token_ids) or len(self.labels)

    def check(self, params: PoolingParams, hidden_size: int) -> None:
        """ValueError (naming the field) for what this model cannot give."""
        if params.task in ("score", "classify"):
            if self.classifier_refused is not None:
                raise ValueError(self.classifier_refused)
            if not self.num_labels:
                raise ValueError(
                    f"task {params.task!r} needs a classifier (a sequence-classification "
                    "checkpoint, or a config naming classifier_from_token); this model "
                    + ("scores by the cosine similarity of embeddings"
                       if params.task == "score" else "has no labels"))
            if params.task == "score" and self.num_labels > 2:
                raise ValueError(f"a score is one label's probability; this classifier has "
                                 f"{self.num_labels} labels: classify instead")
            return
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
        """params with normalize (an embedding) or the classifier's tokens (a score) filled from
        this config."""
        if params.task in ("score", "classify"):
            return PoolingParams(task=params.task,
                                 classifier_token_ids=self.classifier_token_ids or None,
                                 use_activation=params.use_activation)
        if params.normalize is not None:
            return params
        return PoolingParams(normalize=self.normalize, dimensions=params.dimensions)


def _classifier(tokens, tokenizer) -> dict:
    """PoolerConfig's classifier fields from a config's classifier_from_token."""
    if tokens is None:
        return {}
    if (not isinstance(tokens, list) or not 1 <= len(tokens) <= 2
            or not all(isinstance(t, str) for t in tokens)):
        return {"classifier_refused": "classifier_from_token must list one or two tokens (a "
                                      f"score from their logits); got {tokens!r}"}
    if tokenizer is None:
        return {"classifier_refused": "classifier_from_token needs the model's tokenizer"}
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    unknown = [t for t, i in zip(tokens, ids, strict=True)
               if i is None or tokenizer.convert_ids_to_tokens(i) != t]
    if unknown:
        return {"classifier_refused": f"classifier_from_token: {unknown} not tokens of this "
                                      "model's vocabulary"}
    return {"classifier_token_ids": tuple(ids)}


def embedding_sampling_params(pooling: PoolingParams):
    """The one-step request that carries an embedding through the engine: one greedy token
    (dropped), no text."""
    from kvfleet_runtime.sampling_params import SamplingParams
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, pooling=pooling)


def score_pairs(data_1: str | Sequence[str], data_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's pairing of score inputs: one text with one or many (1:N), or two lists of one
    length, pair by pair (N:N). A ValueError names the side that does not fit."""
    first = [data_1] if isinstance(data_1, str) else list(data_1)
    second = [data_2] if isinstance(data_2, str) else list(data_2)
    if not first or not second:
        raise ValueError(f"{'text_1' if not first else 'text_2'} must not be empty")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(f"text_1 must hold one text or as many as text_2 ({len(second)}); "
                         f"got {len(first)}")
    return list(zip(first, second, strict=True))


def pair_prompt(tokenizer, first: str, second: str, add_special_tokens: bool = True,
                score_template: str | None = None) -> list[int]:
    """A cross-encoder's prompt: the two texts as the tokenizer joins a text pair; or, with a
    score template (vLLM's --chat-template for a score model, e.g. Qwen3-Reranker's), that
    Jinja template rendered over the messages [{"role": "query", "content": first},
    {"role": "document", "content": second}] (its text carries its own special tokens)."""
    if score_template is not None:
        text = tokenizer.apply_chat_template(
            [{"role": "query", "content": first}, {"role": "document", "content": second}],
            chat_template=score_template, tokenize=False)
        return tokenizer(text, add_special_tokens=False).input_ids
    return tokenizer(text=first, text_pair=second,
                     add_special_tokens=add_special_tokens).input_ids


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Two embeddings' cosine similarity (an embedding model's score)."""
    import torch
    return torch.nn.functional.cosine_similarity(torch.tensor(a, dtype=torch.float32),
                                                 torch.tensor(b, dtype=torch.float32),
                                                 dim=0).item()


def pool(hidden, logits, params: PoolingParams, score_head=None) -> list[float]:
    """One embedding from a last position's hidden state (a 1-D tensor, on any device); or a
    classifier's label probabilities (classify) or its last label's ([p]: score), from the
    logits of its classifier tokens or from its `score_head` (a sequence classifier's)."""
    import torch
    if params.task in ("score", "classify"):
        x = (logits.float()[list(params.classifier_token_ids)] if params.classifier_token_ids
             else score_head(hidden).float())
        if not params.use_activation:
            return x.tolist() if params.task == "classify" else [(x[-1] - x[0] if len(x) == 2
                                                                  else x[0]).item()]
        # two labels: the softmax's second is sigmoid(x1 - x0) (Qwen3-Reranker's yes over no)
        probs = torch.softmax(x, dim=-1) if len(x) > 1 else torch.sigmoid(x)
        return probs.tolist() if params.task == "classify" else [probs[-1].item()]
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
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """vLLM's: one pair's score (LLM.score)."""
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """vLLM's: one prompt's label probabilities (LLM.classify)."""
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class EmbeddingRequestOutput:
    """vLLM's: one prompt's embedding (LLM.embed, AsyncLLMEngine.encode)."""
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
