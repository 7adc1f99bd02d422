"""Structured outputs: a JSON schema, any JSON, a regex, a choice of strings or an EBNF grammar
confines what a request may generate (vLLM's `structured_outputs`, OpenAI's `response_format`).

xgrammar does the grammar work (vLLM's default backend): `StructuredOutputsParams.check()`
parses the request's grammar without a tokenizer (the server's check, before a response
starts); `GrammarBackend` compiles it against the model's vocabulary (cached by xgrammar,
so the same schema compiles once) and gives each sequence a `GrammarMatcher`. Every step the
sampler asks each matcher for its allowed next tokens (a bitmask) and sets the others' logits
to -inf; each token is fed to the matcher before the next mask (with async scheduling, by the
model runner from the step that sampled it, while the next step's forward already runs), and
the engine stops the sequence once the grammar is complete.

With a reasoning parser (EngineConfig.reasoning_parser) the grammar holds only the answer, as
vLLM's: a sequence thinking (its prompt opened `<think>`, or its output did) samples freely
until `</think>`, and the grammar starts on the token after it. A qwen3 output may open with
`<think>` (the first token's mask allows it beside the grammar's) or answer at once; a prompt
that ends its reasoning (`</think>` then whitespace: thinking switched off) leaves the grammar
all of the output. The tags must be single tokens of the vocabulary (DeepSeek-R1's, QwQ's and
Qwen3's are); otherwise the grammar holds the whole output (one warning).
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import xgrammar

log = logging.getLogger(__name__)

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of json (a JSON schema, as a dict or its text), regex, choice (a list of
    strings), grammar (EBNF, xgrammar's dialect of GBNF) or json_object (any JSON object).
    disable_any_whitespace: JSON without whitespace between its tokens (a model that emits
    runs of newlines otherwise may fill max_tokens with them)."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    _text: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, "
                             f"grammar, json_object; got {', '.join(given) or 'none'}")
        (kind,) = given
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, dict):
                text = json.dumps(value)
            elif isinstance(value, str):
                text = value
                try:
                    json.loads(text)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json must be a JSON schema; it is "
                                     f"not JSON: {e}") from None
            else:
                raise ValueError("structured_outputs.json must be a JSON schema (an object or "
                                 f"its text); got {type(value).__name__}")
        elif kind == "choice":
            if (not isinstance(value, list | tuple) or not value
                    or any(not isinstance(c, str) or not c for c in value)):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 f"non-empty strings; got {value!r}")
            object.__setattr__(self, "choice", list(value))
            # xgrammar's EBNF string literals take JSON's escapes
            text = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
        elif kind == "json_object":
            text = ""
        else:
            if not isinstance(value, str) or not value:
                raise ValueError(f"structured_outputs.{kind} must be a non-empty string; "
                                 f"got {value!r}")
            text = value
        object.__setattr__(self, "_text", text)

    @property
    def kind(self) -> str:
        """json, regex, choice, grammar or json_object."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def check(self) -> None:
        """Parse the grammar (no tokenizer needed); ValueError saying what is wrong with it."""
        import xgrammar as xgr
        kind = self.kind
        try:
            if kind == "json":
                xgr.Grammar.from_json_schema(self._text, any_whitespace=not self.disable_any_whitespace)
            elif kind == "regex":
                xgr.Grammar.from_regex(self._text)
            elif kind in ("choice", "grammar"):
                xgr.Grammar.from_ebnf(self._text)
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"structured_outputs.{kind} is not valid: {_reason(e)}") from None

    def compile(self, compiler: xgrammar.GrammarCompiler) -> xgrammar.CompiledGrammar:
        kind = self.kind
        try:
            if kind == "json":
                return compiler.compile_json_schema(
                    self._text, any_whitespace=not self.disable_any_whitespace)
            if kind == "json_object":
                if self.disable_any_whitespace:
                    return compiler.compile_json_schema(
                        '{"type": "object"}', any_whitespace=False)
                return compiler.compile_builtin_json_grammar()
            if kind == "regex":
                return compiler.compile_regex(self._text)
            return compiler.compile_grammar(self._text)
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"structured_outputs.{kind} is not valid: {_reason(e)}") from None


def _reason(error: Exception) -> str:
    """xgrammar's message without its C++ source location ("[time] file.cc:123: ...")."""
    text = str(error).strip()
    head, sep, rest = text.partition(": ")
    return rest if sep and head.startswith("[") and ".cc:" in head else text


# a sequence's grammar phase
GRAMMAR = 0         # every token the grammar's
START = 1           # qwen3's first token: the grammar's, or <think> (then THINKING)
THINKING = 2        # free until </think> (then GRAMMAR)

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningTags:
    """A thinking model's tags as token ids, and how its reasoning parser starts an output."""
    parser: str
    open_id: int
    close_id: int

    @classmethod
    def of(cls, parser: str, tokenizer: Any) -> ReasoningTags | None:
        """None (with a warning) where a tag is not one token of the tokenizer."""
        ids = [tokenizer.encode(tag, add_special_tokens=False) for tag in (OPEN, CLOSE)]
        if any(len(i) != 1 for i in ids):
            log.warning("reasoning parser %s: %s / %s are not single tokens of this tokenizer "
                        "(%s); structured outputs constrain the whole output, thinking "
                        "included", parser, OPEN, CLOSE, ids)
            return None
        return cls(parser, ids[0][0], ids[1][0])

    def first_phase(self, prompt_ids: list[int], decode: Any) -> int:
        """Where a new output starts: THINKING when the prompt's last tag opens reasoning,
        GRAMMAR when its last tag closes it with only whitespace after (thinking switched off
        in the template), else the parser's rule (deepseek_r1: thinking; qwen3: either)."""
        for at in range(len(prompt_ids) - 1, -1, -1):
            t = prompt_ids[at]
            if t == self.open_id:
                return THINKING
            if t == self.close_id:
                if not decode(prompt_ids[at + 1:]).strip():
                    return GRAMMAR
                break
        return THINKING if self.parser == "deepseek_r1" else START


class GrammarBackend:
    """The model's vocabulary as xgrammar sees it, and its compiler."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: set[int],
                 reasoning_parser: str | None = None) -> None:
        import xgrammar as xgr
        self._xgr = xgr
        # the tokenizer's ids only: a model's vocabulary padded past them (a 49k tokenizer on a
        # 128k shape; Qwen's 151,665 of 152,064) would be ids xgrammar takes for special tokens
        # (accept_token then costs ~16 us instead of ~1 at 128k); mask_logits bans the rest
        vocab_size = min(vocab_size, len(tokenizer))
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids) or None)
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(info)
        self._decode = tokenizer.decode
        self.tags = (ReasoningTags.of(reasoning_parser, tokenizer)
                     if reasoning_parser is not None else None)
        if self.tags is not None and max(self.tags.open_id, self.tags.close_id) >= vocab_size:
            self.tags = None
        log.info("structured outputs: xgrammar %s over a vocabulary of %d%s",
                 getattr(xgr, "__version__", "?"), vocab_size,
                 f"; grammars start after {CLOSE}" if self.tags is not None else "")

    def sequence(self, params: StructuredOutputsParams,
                 prompt_ids: list[int] | None = None) -> SequenceGrammar:
        """A new sequence's grammar state (ValueError if the grammar does not compile); with
        reasoning tags, its first phase follows the prompt (ReasoningTags.first_phase)."""
        grammar = SequenceGrammar(self._xgr.GrammarMatcher(params.compile(self.compiler)),
                                  self.vocab_size, self.tags)
        if self.tags is not None and prompt_ids is not None:
            grammar.phase = self.tags.first_phase(prompt_ids, self._decode)
        return grammar


class SequenceGrammar:
    """One sequence's GrammarMatcher, and how many of its output tokens it has been fed.

    With async scheduling the model runner feeds a sequence's newest token (read back from the
    step that sampled it) before the engine appends it; the engine then feeds only what the
    runner has not (catch_up). `phase`: GRAMMAR, or with reasoning tags START / THINKING, whose
    tokens the matcher never sees."""
    __slots__ = ("matcher", "vocab_size", "fed", "broken", "phase", "tags")

    def __init__(self, matcher: xgrammar.GrammarMatcher, vocab_size: int,
                 tags: ReasoningTags | None = None) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size     # the ids the matcher knows: [0, vocab_size)
        self.fed = 0
        self.broken = False      # a token the grammar refused (only a stop token was left and
                                 # min_tokens masked it): the sequence is stopped
        self.phase = GRAMMAR
        self.tags = tags

    def feed(self, tokens: list[int]) -> None:
        m = self.matcher
        for t in tokens:
            if self.phase == THINKING:
                if t == self.tags.close_id:
                    self.phase = GRAMMAR
                continue
            if self.phase == START:
                if t == self.tags.open_id:
                    self.phase = THINKING
                    continue
                self.phase = GRAMMAR
            if not self.broken and not m.is_terminated() and not m.accept_token(t):
                self.broken = True
        self.fed += len(tokens)

    def catch_up(self, output_token_ids: list[int]) -> None:
        if self.fed < len(output_token_ids):
            self.feed(output_token_ids[self.fed:])

    @property
    def done(self) -> bool:
        """Complete (the output says all it can) or broken: nothing more to sample under it."""
        return self.broken or (self.phase != THINKING and self.matcher.is_terminated())

    @property
    def masks(self) -> bool:
        """Whether the next token is masked (not while the sequence thinks)."""
        return self.phase != THINKING

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """The next token's allowed ids into bitmask[row] (not while thinking: masks)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.phase == START:
            _allow(bitmask, row, self.tags.open_id)


def _allow(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Set token_id's bit in bitmask[row] (int32 words, bit i % 32 of word i // 32)."""
    import torch
    bit = torch.tensor(1, dtype=bitmask.dtype) << (token_id % 32)
    bitmask[row, token_id // 32] |= bit


_local = threading.local()


def _batch_matcher() -> xgrammar.BatchGrammarMatcher:
    """xgrammar's batch filler (its own threads), one per thread that steps an engine."""
    batch = getattr(_local, "batch", None)
    if batch is None:
        import xgrammar as xgr
        batch = _local.batch = xgr.BatchGrammarMatcher("auto")
    return batch


def mask_logits(logits: torch.Tensor, rows: list[int], grammars: list[SequenceGrammar]) -> None:
    """Set the logits of the tokens each row's grammar does not allow next to -inf, in place
    (logits [N, V]; rows[i] is grammars[i]'s row). The bitmask is filled on the host by
    xgrammar's threads into pinned memory (the caching host allocator keeps a buffer from
    reuse while its copy is in flight) and applied by its kernel to those rows only. Ids past
    the tokenizer's (a model's padded vocabulary) are never allowed."""
    import torch
    import xgrammar as xgr
    if not all(g.masks for g in grammars):      # rows thinking: nothing to mask
        live = [(r, g) for r, g in zip(rows, grammars, strict=True) if g.masks]
        if not live:
            return
        rows, grammars = [r for r, _ in live], [g for _, g in live]
    vocab = grammars[0].vocab_size
    cuda = logits.is_cuda
    bitmask = torch.empty(xgr.get_bitmask_shape(len(rows), vocab), dtype=xgr.bitmask_dtype,
                          pin_memory=cuda)
    _batch_matcher().batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask)
    for i, g in enumerate(grammars):
        if g.phase == START:
            _allow(bitmask, i, g.tags.open_id)
    if cuda:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    if len(rows) == logits.shape[0]:
        _apply(logits, bitmask, vocab)
        return
    # the grammar rows gathered, masked and put back: xgrammar's kernel with row indices is a
    # Triton specialization of its own (a compile at its first use, ~0.5 s mid-serving)
    index = torch.tensor(rows, dtype=torch.long, pin_memory=cuda).to(logits.device,
                                                                       non_blocking=cuda)
    sub = logits.index_select(0, index)
    _apply(sub, bitmask, vocab)
    logits.index_copy_(0, index, sub)


def grammar_prefix(grammar: SequenceGrammar, drafts: list[int]) -> int:
    """How many of `drafts` (speculative decoding) the grammar allows in turn after the
    sequence's tokens: up to the first it refuses, or through one that ends it (a stop token).
    The matcher is left as it was (rolled back). While the sequence thinks, the drafts up to
    `</think>` (whatever follows it is the grammar's; the token after the last draft is sampled
    unmasked); none for qwen3's first token (START)."""
    m = grammar.matcher
    if grammar.done or grammar.phase == START:
        return 0
    if grammar.phase == THINKING:
        close = grammar.tags.close_id
        return drafts.index(close) if close in drafts else len(drafts)
    n = 0
    for t in drafts:
        if t >= grammar.vocab_size or not m.accept_token(t):
            break
        n += 1
        if m.is_terminated():
            break
    if n:
        m.rollback(n)
    return n


def mask_draft_rows(logits: torch.Tensor, requests: list[tuple[SequenceGrammar, int, list[int]]]
                    ) -> None:
    """mask_logits for speculative decoding's rows, in place: each (grammar, first row, drafts)
    owns rows first .. first + len(drafts), row j masked as the grammar stands after drafts
    0..j-1 (which grammar_prefix allowed when they were proposed). A row past a draft that ends
    the grammar is left unmasked: the sequence stops at that draft if it is kept."""
    import torch
    import xgrammar as xgr
    # a thinking sequence's rows stay free (grammar_prefix kept its drafts before </think>)
    requests = [entry for entry in requests if entry[0].masks]
    if not requests:
        return
    vocab = requests[0][0].vocab_size
    rows = [first + j for _, first, drafts in requests for j in range(len(drafts) + 1)]
    cuda = logits.is_cuda
    bitmask = torch.full(xgr.get_bitmask_shape(len(rows), vocab), -1, dtype=xgr.bitmask_dtype,
                         pin_memory=cuda)
    at = 0
    for grammar, _, drafts in requests:
        m, fed = grammar.matcher, 0
        for j in range(len(drafts) + 1):
            if not m.is_terminated():
                grammar.fill(bitmask, at + j)
            if j < len(drafts) and not m.is_terminated():
                if not m.accept_token(drafts[j]):
                    raise ValueError(f"draft {drafts[j]} is not allowed by the grammar")
                fed += 1
        if fed:
            m.rollback(fed)
        at += len(drafts) + 1
    if cuda:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    index = torch.tensor(rows, dtype=torch.long, pin_memory=cuda).to(logits.device,
                                                                       non_blocking=cuda)
    sub = logits.index_select(0, index)
    _apply(sub, bitmask, vocab)
    logits.index_copy_(0, index, sub)


def _apply(logits: torch.Tensor, bitmask: torch.Tensor, vocab: int) -> None:
    import xgrammar as xgr
    width = logits.shape[1]
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=min(vocab, width))
    if vocab < width:
        logits[:, vocab:] = float("-inf")


def warm_up_masks(device: torch.device, width: int) -> None:
    """Compile xgrammar's mask kernel for the row counts Triton tells apart (1, a multiple of
    16, any other) on fp32 logits of `width` columns, as the sampler's are: at the first
    structured request, not at one of its later steps."""
    import torch
    import xgrammar as xgr
    if device.type != "cuda":
        return
    for rows in (1, 2, 16):
        logits = torch.zeros(rows, width, device=device)
        bitmask = torch.full(xgr.get_bitmask_shape(rows, width), -1, dtype=xgr.bitmask_dtype,
                             device=device)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
    torch.cuda.synchronize(device)
