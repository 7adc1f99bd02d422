"""DeltaEngine: the LLMEngine of the engine process (engine_process.py), whose steps give each
touched request's output as a delta for the pipe instead of a RequestOutput: its new token
ids and logprobs, its text as (characters kept of the text sent before, what follows them),
the prompt's fields with the first delta only. Building them straight from the requests
skips what a RequestOutput costs a step at ~1000 running (two objects a request, a copy of
every token id list) in the process whose host time bounds the steps. `OutputMerger`, in the
server's process, turns the deltas back into the RequestOutputs LLMEngine gives.

A request that needs no text to stop or to report (`server_detokenizes`: no stop strings, no
logprobs) is not detokenized here at all: its deltas carry no text and the server's process
turns its token ids into text (as vLLM's front-end process does), which takes that work, ~a
third of the engine's host time a step at ~1000 running, out of the process that bounds the
steps. Stop strings must stop the request in the step that completes them, and logprobs
carry each token's text, so those requests keep their detokenizer here.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvfleet_runtime.engine.engine import LLMEngine
from kvfleet_runtime.request import FINISHED_STATUSES as _FINISHED
from kvfleet_runtime.sampling_params import SamplingParams

# a delta: (request_id, finished, num_cached_tokens, metrics (RequestMetrics' fields),
#           (prompt, prompt_token_ids, prompt_logprobs) the first time else None,
#           [(index, chars kept, new text, new token ids, cumulative_logprob, new logprobs,
#             finish_reason, stop_reason) per completion], a pooling request's embedding or None)
# or, for the common step of a running request (one completion, one new token, no text or
# logprobs in this process, not finished), a short delta: (request_id, token id, its time)
Delta = tuple
SHORT_DELTA_LEN = 3

_NOTHING_SENT = (0, 0, "")     # (token ids, logprobs, text) of a completion sent so far


def server_detokenizes(params: SamplingParams) -> bool:
    """Whether the server's process, not the engine process, detokenizes a request: nothing
    the engine decides depends on its text (no stop strings) and it wants no token's text
    (no logprobs)."""
    return not params.stop and params.logprobs is None and params.prompt_logprobs is None


def text_delta(sent: str, now: str) -> tuple[int, str]:
    """(characters of `sent` kept, what follows them in `now`): a text grows at its end, but a
    stop string is cut off at the finish."""
    keep = len(sent) if now.startswith(sent) else 0
    return keep, now[keep:]


class DeltaEngine(LLMEngine):
    """LLMEngine whose step() returns Deltas (above) in place of RequestOutputs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # request -> completion index -> (token ids, logprobs, text) sent
        self._sent: dict[str, dict[int, tuple[int, int, str]]] = {}

    def _detokenizes(self, params: SamplingParams) -> bool:
        return not server_detokenizes(params)

    def _make_output(self, group_id: str) -> Delta:   # type: ignore[override]
        # runs for every running request every step (~1000 a step at full load, in the process
        # whose host time bounds the steps): attributes read once, no generator
        children = self.groups[group_id]
        first = children[0]
        sent = self._sent.get(group_id)
        if sent is not None and len(children) == 1 and first.detokenizer is None:
            # the short delta: what the merger needs of a running request's step is its token
            ids = first.output_token_ids
            tokens = sent[first.index][0]
            if (len(ids) == tokens + 1 and first.logprobs is None
                    and first.status not in _FINISHED):
                sent[first.index] = (tokens + 1, 0, "")
                return (group_id, ids[tokens], first.metrics.last_token_time)
        prompt = None
        if sent is None:
            sent = self._sent[group_id] = {}
            prompt = (self.prompts.get(group_id), first.prompt_token_ids,
                      None if first.prompt_logprobs is None else list(first.prompt_logprobs))
        completions = []
        finished = True
        for c in children:
            tokens, logprobs, text = sent.get(c.index, _NOTHING_SENT)
            if c.detokenizer is None:   # the server's process makes its text: none sent
                now, keep, new_text = "", 0, ""
            else:
                now = c.detokenizer.output_text
                keep, new_text = text_delta(text, now)
            ids, lps = c.output_token_ids, c.logprobs
            done = c.status in _FINISHED
            finished = finished and done
            completions.append((c.index, keep, new_text, ids[tokens:],
                                None if lps is None else c.cumulative_logprob,
                                None if lps is None else lps[logprobs:],
                                c.status.value if done else None, c.stop_reason))
            sent[c.index] = (len(ids), 0 if lps is None else len(lps), now)
        delta = (group_id, finished, max(first.num_cached_tokens, 0),
                 tuple(vars(first.metrics).values()), prompt, completions, first.embedding)
        if finished:
            del self._sent[group_id]
            self._retire(group_id)
        return delta

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        super().abort_request(ids)
        for rid in ids:
            self._sent.pop(rid, None)
