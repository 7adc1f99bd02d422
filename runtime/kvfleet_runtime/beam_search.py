"""Beam search, as vLLM runs it (`LLM.beam_search`, the server's `use_beam_search`): over the
engine's own one-token requests, not inside its steps.

Each round every live beam runs as a greedy request of max_tokens 1 asking for 2 x beam_width
logprobs (the prefix cache holds the beams' shared blocks, so a round recomputes only each
beam's last partial block); every returned (token, logprob) extends its beam; the beam_width
best extensions by score go on. A beam extended by an end-of-sequence token is completed
(unless ignore_eos) rather than extended. After max_tokens rounds (or when no beam is left)
the completed and live beams are ranked together and the best beam_width returned.

score = cumulative logprob / length ** length_penalty, the length counting the prompt's tokens
and not a final end-of-sequence token (vLLM's get_beam_search_score). Within a round every
extension has the same length, so they rank by cumulative logprob, as HF transformers'
`generate(num_beams=...)` does; the two differ where beams end (vLLM's rule: every end token
among a beam's 2 x beam_width candidates completes a beam, and no round stops early).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet_runtime.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from kvfleet_runtime.sampling_params import SamplingParams

# logprobs are capped at 20 a position (SamplingParams): 2 x beam_width candidates a beam
MAX_BEAM_WIDTH = 10


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, what: str, value) -> ValueError:
            return ValueError(f"{name} must be {what}; got {value!r}")
        if (isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int)
                or not 1 <= self.beam_width <= MAX_BEAM_WIDTH):
            raise bad("beam_width", f"an integer in [1, {MAX_BEAM_WIDTH}]", self.beam_width)
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens < 1:
            raise bad("max_tokens", "an integer >= 1", self.max_tokens)
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise bad("temperature", "a number >= 0", self.temperature)
        if not isinstance(self.length_penalty, (int, float)) or isinstance(
                self.length_penalty, bool):
            raise bad("length_penalty", "a number", self.length_penalty)


@dataclass
class BeamSearchSequence:
    """A beam: its tokens (the prompt's, then the generated ones), each generated position's
    logprobs, and, once returned, its text (LLM.beam_search: of all its tokens, as vLLM)."""
    tokens: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_token_ids: set[int], length_penalty: float) -> float:
    length = len(beam.tokens)
    if beam.tokens and beam.tokens[-1] in eos_token_ids:
        length -= 1
    return beam.cum_logprob / (length ** length_penalty)


class BeamSearch:
    """One prompt's search, driven from outside: `requests()` are the token lists to extend by
    one token this round (each with `sampling_params`), `advance(outputs)` takes their outputs
    in the same order; `done` after the last round, then `best()`."""

    def __init__(self, prompt_ids: list[int], params: BeamSearchParams,
                 eos_token_ids: set[int]) -> None:
        self.params = params
        self.prompt_ids = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.eos_token_ids = eos_token_ids
        self.beams = [BeamSearchSequence(list(prompt_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.rounds = 0
        # greedy: only the logprobs are read, and they are the model's own (temperature does not
        # change them, as vLLM v1's default raw logprobs)
        self.sampling_params = SamplingParams(
            max_tokens=1, logprobs=2 * params.beam_width, temperature=0.0, ignore_eos=True)

    @property
    def done(self) -> bool:
        return self.rounds >= self.params.max_tokens or not self.beams

    def requests(self) -> list[list[int]]:
        return [beam.tokens for beam in self.beams]

    def _key(self, beam: BeamSearchSequence) -> float:
        return beam_score(beam, self.eos_token_ids, self.params.length_penalty)

    def advance(self, outputs: list[RequestOutput]) -> None:
        params = self.params
        width = 2 * params.beam_width
        extended = []
        for beam, out in zip(self.beams, outputs, strict=True):
            (position,) = out.outputs[0].logprobs
            for token_id, entry in position.items():
                if entry.rank is None or entry.rank > width:
                    continue    # (a token drawn outside the top: the search stays deterministic)
                cum = beam.cum_logprob + entry.logprob
                if token_id in self.eos_token_ids and not params.ignore_eos:
                    tokens = beam.tokens + [token_id] if params.include_stop_str_in_output \
                        else beam.tokens
                    self.completed.append(BeamSearchSequence(
                        tokens, beam.logprobs + [position], cum, finish_reason="stop",
                        stop_reason=token_id))
                else:
                    extended.append(BeamSearchSequence(beam.tokens + [token_id],
                                                       beam.logprobs + [position], cum))
        extended.sort(key=self._key, reverse=True)
        self.beams = extended[:params.beam_width]
        self.rounds += 1

    def best(self) -> list[BeamSearchSequence]:
        """The beam_width best beams, completed and live together, best first."""
        ranked = sorted(self.completed + self.beams, key=self._key, reverse=True)
        best = ranked[:self.params.beam_width]
        for beam in best:
            beam.finish_reason = beam.finish_reason or "length"
        return best

    def request_output(self, request_id: str, prompt: str | None, tokenizer,
                       skip_special_tokens: bool = True) -> RequestOutput:
        """The best beams as one finished RequestOutput of beam_width samples (the server's
        choices): each sample's generated tokens and their text."""
        outputs = []
        for i, beam in enumerate(self.best()):
            generated = beam.tokens[self.prompt_len:]
            shown = generated
            if generated and generated[-1] in self.eos_token_ids and beam.finish_reason == "stop":
                shown = generated[:-1]      # (include_stop_str_in_output: kept in the ids)
            outputs.append(CompletionOutput(
                index=i, text=tokenizer.decode(shown, skip_special_tokens=skip_special_tokens),
                token_ids=generated, cumulative_logprob=beam.cum_logprob,
                logprobs=beam.logprobs, finish_reason=beam.finish_reason,
                stop_reason=beam.stop_reason))
        return RequestOutput(request_id, prompt, self.prompt_ids, outputs, finished=True)
