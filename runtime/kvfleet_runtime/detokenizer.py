"""IncrementalDetokenizer: one sequence's generated token ids -> the text that may be shown.

Owns three things: turning tokens into text one step at a time without ever showing a
broken UTF-8 character (vLLM's prefix/read offsets), catching stop strings (also across
token boundaries) and holding back the tail that could still turn out to start one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvfleet_runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Prompt tokens decoded in front of the first generated token, so that tokenizers which
# drop a word's leading space at the start of a decode (SentencePiece) keep it there.
_PROMPT_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"   # what a decode of a partial UTF-8 byte sequence ends with


def _text_decoder(tokenizer: PreTrainedTokenizerBase,
                  skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """ids -> text, without clean-up: it rewrites spaces across tokens, so shown text could change."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # a fast tokenizer: its Rust decoder directly, without transformers' ~5 us of Python
        # per call (two calls per token, for every running sequence, every step)
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                        clean_up_tokenization_spaces=False)


def stop_token_unshown(params: SamplingParams, token_id: int, num_output: int) -> bool:
    """Whether `token_id`, the num_output-th generated token, ends the sequence as an EOS or
    stop token id without text of its own in the output: unless include_stop_str_in_output
    (vLLM's rule; with skip_special_tokens off an EOS would otherwise show as `</s>`)."""
    return (not params.include_stop_str_in_output and num_output >= params.min_tokens
            and (token_id in params._eos_token_ids or token_id in params.stop_token_ids))


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int],
                 params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = len(tokenizer)
        self._decode = _text_decoder(tokenizer, params.skip_special_tokens)
        self._stop: list[str] = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
        # a stop string may still complete over the last max_stop_len - 1 characters
        self._num_held_back = max(params.max_stop_len - 1, 0)
        self._ids = [t for t in prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:] if self._known(t)]
        # tokens[prefix_offset:read_offset] were already turned into text; decoding them
        # again in front of the new tokens gives the new tokens' text in context
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._text = ""
        self._finished = False
        # a fast tokenizer: the same offsets kept in Rust, one call per token instead of two
        # decodes (this runs for every running sequence every step)
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = None
        # ... unless the prompt's tail ends inside a character: the stream would then show
        # prompt text once a generated token completes it; the offsets below never do
        if self._backend is not None and not self._decode(self._ids).endswith(_INCOMPLETE):
            from tokenizers.decoders import DecodeStream
            self._stream = DecodeStream(ids=list(self._ids),
                                        skip_special_tokens=params.skip_special_tokens)

    @property
    def output_text(self) -> str:
        if self._finished or not self._num_held_back:
            return self._text
        return self._text[:max(len(self._text) - self._num_held_back, 0)]

    def update(self, new_token_ids: list[int]) -> str | None:
        """Appends tokens; returns the stop string they completed (the text then ends), else None."""
        if self._finished:
            raise RuntimeError("IncrementalDetokenizer.update called after the sequence finished")
        searched_up_to = len(self._text)
        vocab_size, stream = self._vocab_size, self._stream
        for token_id in new_token_ids:
            # ids beyond the tokenizer (random-weight models have larger vocabularies) are blank
            if not 0 <= token_id < vocab_size:
                continue
            if stream is not None:
                text = stream.step(self._backend, token_id)
                if text:
                    self._text += text
            else:
                self._ids.append(token_id)
                self._text += self._decode_new_suffix()
        # runs for every sequence every step: no stop strings, nothing to search
        return self._find_stop(searched_up_to) if self._stop else None

    def update_one(self, token_id: int) -> str | None:
        """update([token_id]), with a shortcut for the common case (a fast tokenizer, no stop
        strings): this runs for every running sequence every step."""
        if self._stream is not None and not self._stop and not self._finished:
            if 0 <= token_id < self._vocab_size:
                text = self._stream.step(self._backend, token_id)
                if text:
                    self._text += text
            return None
        return self.update((token_id,))

    def finish(self) -> None:
        """Generation ended for another reason (EOS, length, abort): release the held-back text."""
        self._finished = True

    def decode_token(self, token_id: int) -> str:
        """One token's own text, as shown next to its logprob."""
        if not self._known(token_id):
            return ""
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def _known(self, token_id: int) -> bool:
        return 0 <= token_id < self._vocab_size

    def _decode_new_suffix(self) -> str:
        """The text the tokens after read_offset add; "" while it ends inside a character."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_INCOMPLETE):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full_text[len(prefix_text):]

    def _find_stop(self, searched_up_to: int) -> str | None:
        """The earliest stop string that ends in the text after `searched_up_to`; truncates there."""
        match: tuple[int, str] | None = None
        for stop in self._stop:
            start = self._text.find(stop, max(searched_up_to - len(stop) + 1, 0))
            if start != -1 and (match is None or start < match[0]):
                match = (start, stop)
        if match is None:
            return None
        start, stop = match
        self._text = self._text[:start + len(stop) if self._include_stop else start]
        self._finished = True
        return stop
