"""Speculative decoding by n-gram prompt lookup (vLLM's `--speculative-config '{"method": "ngram",
"num_speculative_tokens": K, "prompt_lookup_max": N}'`).

Before each step, a decoding request whose sequence ends with an n-gram (n from
prompt_lookup_max down to prompt_lookup_min) that occurred earlier in its prompt or output
proposes the K tokens that followed that occurrence. The step then computes the request's last
token and its drafts in one go (a query of 1 + K tokens over its cached context, as a prompt
chunk is computed) and the sampler verifies them (`layers.sampler.verify_drafts`): greedy rows
keep the drafts that equal the model's argmax, then the argmax; random rows keep a draft with
the probability the model gives it and at the first rejection draw from the model's distribution
without it (rejection sampling with a one-hot draft), so every token is distributed as without
speculation. Drafts that are rejected leave their KV behind in slots the request owns past its
length, which the next steps overwrite. Each step gives a request 1 to K + 1 tokens.

Each drafted row is sampled as the step without drafts would sample it had the drafts before
it been generated: penalties and min_tokens count those drafts, a grammar (structured outputs)
masks it as it stands after them (drafts are cut to the prefix the grammar allows when they
are proposed), and logprobs are reported for every kept token.
A drafted request runs as one one-token sequence a position, so a step with drafts is a decode
step of more rows (the decode kernels, the CUDA graphs). Steps with drafts run synchronously
(drafts are proposed from the tokens on the host, and the next step needs to know how many
were kept); with async scheduling on, the engine steps asynchronously while no running
request's known tokens end in a recurring n-gram, and synchronously from the step after one
does until a step finds no drafts (LLMEngine._step).
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:       # (config.py imports this module: no torch here)
    from kvfleet_runtime.request import Request

SPECULATIVE_METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # no drafts in a step while more requests than this run (vLLM's key; None: always draft)
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From vLLM's JSON (`--speculative-config`) or a dict; ValueError names what is wrong."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config must be a JSON object; {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object; got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: "
                             f"{', '.join(sorted(known))}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        for name, given in value.items():      # the user's own values first, by their names
            if name != "method" and given is not None:
                _check_positive(name, given)
        config = dict(value)
        if config.get("method") == "[ngram]":      # vLLM's older spelling
            config["method"] = "ngram"
        lo, hi = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = 5                              # vLLM's defaults for ngram
        config["prompt_lookup_min"] = hi if lo is None else lo
        config["prompt_lookup_max"] = lo if hi is None else hi
        return cls(**config)

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of "
                             f"{', '.join(SPECULATIVE_METHODS)}; got {self.method!r} (draft "
                             f"models, EAGLE and Medusa are not supported)")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            _check_positive(name, getattr(self, name))
        if self.disable_by_batch_size is not None:
            _check_positive("disable_by_batch_size", self.disable_by_batch_size)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) "
                             f"must be <= prompt_lookup_max ({self.prompt_lookup_max})")

    def propose(self, request: Request, limit: int) -> list[int]:
        """Up to min(num_speculative_tokens, limit) drafts for `request`'s tokens (those on
        the host). Its tokens as bytes are kept on the request and extended as it grows."""
        k = min(self.num_speculative_tokens, limit)
        if k <= 0:
            return []
        tokens, buf = request.all_token_ids, request.token_bytes
        if len(buf) < 4 * len(tokens):
            buf += array("i", tokens[len(buf) // 4:]).tobytes()
        return propose_ngram(tokens, self.prompt_lookup_min, self.prompt_lookup_max, k, buf)


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"speculative_config.{name} must be a positive integer; got {value!r}")


def propose_ngram(tokens: list[int], min_n: int, max_n: int, k: int,
                  buf: bytes | bytearray | None = None) -> list[int]:
    """The (up to) k tokens that followed the latest earlier occurrence of the longest suffix
    of `tokens` of min_n..max_n tokens that occurred before; [] if none did (prompt lookup).

    The search is bytes.rfind over the ids as 4-byte words (C speed on long contexts; `buf`:
    those bytes, if the caller keeps them); a match must start on a word boundary."""
    num = len(tokens)
    if num <= min_n or k <= 0:
        return []
    if buf is None:
        buf = array("i", tokens).tobytes()
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        pattern = buf[-4 * n:]
        end = 4 * (num - 1)         # the occurrence must end before the sequence's last token
        while True:
            at = buf.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % 4 == 0:
                start = at // 4 + n
                return list(tokens[start:start + k])
            end = at + len(pattern) - 1     # a misaligned hit: look before its start
    return []
