"""SamplingParams: the user's generation knobs, validated with clear errors."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from kvfleet_runtime.pooling import PoolingParams
from kvfleet_runtime.structured_outputs import StructuredOutputsParams

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1            # -1 (or 0): off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None          # top-k logprobs per generated token (0: only the chosen)
    prompt_logprobs: int | None = None   # top-k logprobs per prompt token
    skip_special_tokens: bool = True
    # OpenAI's logit_bias: token id -> a value in [-100, 100] added to its logit before sampling
    logit_bias: dict[int, float] | None = None
    # vLLM's allowed_token_ids: sample only among these ids
    allowed_token_ids: list[int] | None = None
    # vLLM's bad_words: words never generated (as they start the text or follow a space); a
    # word of several tokens loses its last token wherever the output ends in the others
    bad_words: list[str] | None = None
    # vLLM's cache_salt: the prefix cache shares blocks only among requests of the same salt
    # (a tenant's prompts cannot be timed by another's hits)
    cache_salt: str | None = None
    # a JSON schema, regex, choice or grammar the output must follow (vLLM's field)
    structured_outputs: StructuredOutputsParams | None = None
    # an embedding request (LLM.embed, AsyncLLMEngine.encode, /v1/embeddings): one step that
    # keeps the last prompt position's hidden state (kvfleet_runtime/pooling.py)
    pooling: PoolingParams | None = None
    # filled by the engine: ids that end generation besides stop_token_ids (EOS)
    _eos_token_ids: set[int] = field(default_factory=set, repr=False)
    # filled by the engine from bad_words: each word's token ids (bad_words_token_ids)
    _bad_words_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or [])]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, rule: str, value: object) -> ValueError:
            return ValueError(f"{name} must be {rule}; got {value!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1", self.n)
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str)
                                            or not self.cache_salt):
            raise bad("cache_salt", "a non-empty string", self.cache_salt)
        if self.bad_words is not None and not all(
                isinstance(w, str) and w.strip() for w in self.bad_words):
            raise bad("bad_words", "a list of non-empty strings", self.bad_words)
        if self.temperature < 0:
            raise bad("temperature", ">= 0", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]", self.top_p)
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "-1 (off) or a positive integer", self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]", self.min_p)
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]", self.presence_penalty)
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", "in (0, 2]", self.repetition_penalty)
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1", self.max_tokens)
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", "an integer in [0, 20]", self.logprobs)
        if self.prompt_logprobs is not None and (
                not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= 20):
            raise bad("prompt_logprobs", "an integer in [0, 20]", self.prompt_logprobs)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "non-empty strings", self.stop)
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "non-negative integers", self.stop_token_ids)
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "an integer", self.seed)
        if self.logit_bias is not None:
            for token_id, bias in self.logit_bias.items():
                if not _is_int(token_id) or token_id < 0:
                    raise bad("logit_bias", "a map of token ids (integers >= 0) to biases",
                              token_id)
                if isinstance(bias, bool) or not isinstance(bias, int | float) \
                        or not -100.0 <= bias <= 100.0:
                    raise bad("logit_bias", f"biases in [-100, 100] (token {token_id})", bias)
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids
                or any(not _is_int(t) or t < 0 for t in self.allowed_token_ids)):
            raise bad("allowed_token_ids", "a non-empty list of token ids (integers >= 0)",
                      self.allowed_token_ids)
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "a StructuredOutputsParams",
                      type(self.structured_outputs).__name__)

    def check_token_ids(self, vocab_size: int) -> None:
        """The ids logit_bias and allowed_token_ids name must be in the model's vocabulary."""
        for name, ids in (("logit_bias", self.logit_bias or ()),
                          ("allowed_token_ids", self.allowed_token_ids or ())):
            bad = sorted(t for t in ids if t >= vocab_size)
            if bad:
                raise ValueError(f"{name} must name token ids in [0, {vocab_size}); "
                                 f"got {bad[:5]}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        # (the sampler's apply_penalties reads these fields inline)
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def clone(self) -> SamplingParams:
        """A copy that shares no mutable state: the fields are immutable scalars but for the
        stop lists and the EOS set (copy.deepcopy took ~60% of add_request's time)."""
        new = copy.copy(self)
        new.stop = list(self.stop)
        new.stop_token_ids = list(self.stop_token_ids)
        new._eos_token_ids = set(self._eos_token_ids)
        if self.logit_bias is not None:
            new.logit_bias = dict(self.logit_bias)
        if self.allowed_token_ids is not None:
            new.allowed_token_ids = list(self.allowed_token_ids)
        return new


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's tokenization of bad_words: each word as it starts the text and, where that is
    other tokens of the same count, as it follows a space; no special tokens."""
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        for ids in (bare, spaced):
            if ids and ids not in out and (ids is bare or (len(ids) == len(bare)
                                                            and ids[0] != bare[0])):
                out.append(ids)
    return out
