"""DeltaEngine: the LLMEngine of the engine process (engine_process.py), whose steps give each
touched request's output as a delta for the pipe instead of a RequestOutput: its new token
ids and logprobs, its text as (characters kept of the text sent before, what follows them),
the prompt's fields with the first delta only. Building them straight from the requests
skips what a RequestOutput costs a step at ~1000 running (two objects a request, a copy of
every token id list) in the process whose host time bounds the steps. `OutputMerger`, in the
server's process, turns the deltas back into the RequestOutputs LLMEngine gives.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvfleet_runtime.engine.engine import LLMEngine

# a delta: (request_id, finished, num_cached_tokens, metrics (RequestMetrics' fields) or None,
#           (prompt, prompt_token_ids, prompt_logprobs) the first time else None,
#           [(index, chars kept, new text, new token ids, cumulative_logprob, new logprobs,
#             finish_reason, stop_reason) per completion])
Delta = tuple


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

    def _make_output(self, group_id: str) -> Delta:   # type: ignore[override]
        children = self.groups[group_id]
        first = children[0]
        sent = self._sent.get(group_id)
        prompt = None
        if sent is None:
            sent = self._sent[group_id] = {}
            prompt = (self.prompts.get(group_id), first.prompt_token_ids,
                      None if first.prompt_logprobs is None else list(first.prompt_logprobs))
        completions = []
        for c in children:
            tokens, logprobs, text = sent.get(c.index, (0, 0, ""))
            now = c.detokenizer.output_text
            completions.append((
                c.index, *text_delta(text, now), c.output_token_ids[tokens:],
                c.cumulative_logprob if c.logprobs is not None else None,
                None if c.logprobs is None else c.logprobs[logprobs:],
                c.status.value if c.is_finished else None, c.stop_reason))
            sent[c.index] = (len(c.output_token_ids),
                             0 if c.logprobs is None else len(c.logprobs), now)
        finished = all(c.is_finished for c in children)
        metrics = first.metrics
        delta = (group_id, finished, max(first.num_cached_tokens, 0),
                 None if metrics is None else tuple(vars(metrics).values()), prompt, completions)
        if finished:
            del self._sent[group_id]
            self._retire(group_id)
        return delta

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        super().abort_request(ids)
        for rid in ids:
            self._sent.pop(rid, None)
