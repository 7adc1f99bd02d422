"""Reasoning outputs: a thinking model's `<think>...</think>` split from its answer
(`kvfleet serve --reasoning-parser`, as vLLM's), returned as the message's `reasoning` (and
`reasoning_content`, its earlier name, which clients still read) beside `content`.

- deepseek_r1 (DeepSeek-R1, QwQ): the chat template opens `<think>` in the prompt, so the
  output is reasoning up to `</think>` (a `<think>` the model writes itself is dropped); an
  output cut off before `</think>` is all reasoning.
- qwen3 (Qwen3): reasoning only when the output opens with `<think>`, up to `</think>` or the
  end (`enable_thinking: false` in chat_template_kwargs makes the model answer without).

The answer (content) then goes to the tool-call parser, if any. Streamed, reasoning and content
deltas go out as they come; a tag split across deltas is held back until it is whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvfleet_runtime.server.tools import partial_suffix

OPEN, CLOSE = "<think>", "</think>"


def split_reasoning(parser: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a finished output; None for an empty part."""
    if parser == "qwen3":
        body = text.lstrip()
        if not body.startswith(OPEN):
            return None, text or None
        reasoning, _, content = body[len(OPEN):].partition(CLOSE)
    else:
        reasoning, found, content = text.partition(CLOSE)
        if not found:
            reasoning, content = text, ""
        reasoning = _drop_open(reasoning)
    return reasoning or None, content.lstrip("\n") or None


def _drop_open(text: str) -> str:
    stripped = text.lstrip()
    return stripped[len(OPEN):] if stripped.startswith(OPEN) else text


@dataclass
class ReasoningStreamer:
    """One streamed choice: text deltas in, (reasoning, content) pieces out; the pieces of a
    whole stream join to split_reasoning's parts of its text."""
    parser: str
    text: str = ""
    state: str = "start"          # start (undecided) -> reasoning -> content
    sent: int = 0                 # chars of text accounted for
    skipping: bool = False        # the newlines between </think> and the answer

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        reasoning = ""
        while True:
            rest = self.text[self.sent:]
            if self.state == "start":
                body = rest.lstrip()
                if len(body) < len(OPEN) and OPEN.startswith(body):
                    return reasoning, ""           # may still open with <think>: hold
                if body.startswith(OPEN):
                    self.sent += len(rest) - len(body) + len(OPEN)
                    self.state = "reasoning"
                else:
                    self.state = "reasoning" if self.parser == "deepseek_r1" else "content"
                continue
            if self.state == "reasoning":
                found = rest.find(CLOSE)
                if found < 0:
                    keep = partial_suffix(rest, CLOSE)
                    self.sent += len(rest) - keep
                    return reasoning + rest[:len(rest) - keep], ""
                reasoning += rest[:found]
                self.sent += found + len(CLOSE)
                self.state, self.skipping = "content", True
                continue
            if self.skipping:
                body = rest.lstrip("\n")
                self.sent += len(rest) - len(body)
                self.skipping = not body
                rest = body
            self.sent = len(self.text)
            return reasoning, rest

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the choice."""
        rest = self.text[self.sent:]
        self.sent = len(self.text)
        if self.state == "reasoning":
            return rest, ""
        if self.state == "start":       # only whitespace or a start of "<think>" came
            reasoning, content = split_reasoning(self.parser, rest)
            return reasoning or "", content or ""
        return "", "" if self.skipping else rest


def num_reasoning_tokens(parser: str, token_ids: list[int],
                         decode: Callable[[list[int]], str]) -> int:
    """How many of an output's tokens its thinking took (the Responses API's
    output_tokens_details.reasoning_tokens): those up to the one that completes `</think>`, or
    all of them when the output thinks to its end; 0 when it has no reasoning."""
    text = decode(token_ids)
    if split_reasoning(parser, text)[0] is None:
        return 0
    if CLOSE not in text:
        return len(token_ids)
    low, high = 1, len(token_ids)       # the shortest prefix whose text holds the tag
    while low < high:
        mid = (low + high) // 2
        if CLOSE in decode(token_ids[:mid]):
            high = mid
        else:
            low = mid + 1
    return low
