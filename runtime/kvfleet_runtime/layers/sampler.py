"""Sampler: one decode step's logits -> one token per sequence, with its logprobs.

Owns the order of logits processing (as vLLM and HF transformers do it): raw logprobs are
taken from the raw logits; then min_tokens masks the stop ids, repetition penalty (HF),
presence/frequency penalties (OpenAI); then greedy argmax, or temperature, top_k, top_p,
min_p and a draw with the row's own generator.

It runs every decode step for up to max_num_seqs rows on the GPU, so everything that
is the same for all rows is one batched tensor op, and the only per-row loop is the
random draw of rows that carry their own seeded generator. Results come back to the
host with one .tolist() per tensor at the end, never one .item() per row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from kvfleet_runtime.sampling_params import SamplingParams

# top_k at most this large on every row: filter among topk candidates instead of sorting V
_MAX_TOP_K_CANDIDATES = 1024


@dataclass
class SamplingBatch:
    """One row per sequence that samples this step, built by the model runner."""
    params: list[SamplingParams]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]            # generated so far (before this step's token)
    generators: list[torch.Generator | None]     # per request, from params.seed; None: global RNG
    # async scheduling: a row's last generated token may still be on the device, not yet in
    # output_token_ids: its id here ([N], -1: none), and how many such tokens each row has
    pending_ids: torch.Tensor | None = None
    num_pending: list[int] | None = None
    # structured outputs: rows -> each row's SequenceGrammar (None: nothing to mask), asked
    # only for rows whose params carry structured_outputs (the model runner feeds the matchers
    # the tokens they have not seen first)
    grammar_lookup: Callable[[list[int]], list] | None = None

    def __post_init__(self) -> None:
        n = len(self.params)
        for name in ("prompt_token_ids", "output_token_ids", "generators"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"SamplingBatch.{name} must have one entry per row ({n}); "
                                 f"got {len(getattr(self, name))}")


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None         # under the raw model distribution (before any processing)
    rank: int | None = None              # 1 = argmax of the raw logits
    top_ids: list[int] | None = None     # the top-k ids (k = params.logprobs) and their logprobs
    top_logprobs: list[float] | None = None


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A request's own generator (None without a seed: it then draws from the global RNG)."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _flat_ids(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """rows of ids -> (row index [T], id [T]), built by numpy: no Python work per id.

    Prompts make this the largest host-side input of a step (256 rows x 1000s of ids):
    np.fromiter over them is several times faster than torch.tensor on nested lists.
    """
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    ids = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))
    row_index = np.repeat(np.arange(len(rows), dtype=np.int64), lengths)
    cuda = device.type == "cuda"

    def move(a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        return (t.pin_memory() if cuda else t).to(device, non_blocking=cuda)
    return move(row_index), move(ids)


def _rows_tensor(values: list, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    # pinned on CUDA: a copy from pageable memory may wait for the stream (async scheduling
    # launches the next step's sampling while the device still runs it)
    cuda = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=cuda).to(device, non_blocking=cuda)


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> list[SampledToken]:
        # logits: [N, V]
        if logits.shape[0] == 0 and not batch.params:
            return []
        raw = logits.float()
        token_ids = self.sample_ids(raw, batch)
        return _with_logprobs(raw, token_ids, [p.logprobs for p in batch.params])

    def sample_on_device(self, logits: torch.Tensor, batch: SamplingBatch
                         ) -> tuple[torch.Tensor, LogprobTensors | None]:
        """Token ids [N] and their logprob results, left on the device (no host sync)."""
        num_top = [p.logprobs for p in batch.params]
        if all(k is None for k in num_top):    # no logprobs: the fp32 copy only if sampling needs it
            return self.sample_ids(logits, batch), None
        raw = logits.float()
        token_ids = self.sample_ids(raw, batch)
        return token_ids, logprob_tensors(raw, token_ids, num_top)

    def sample_ids(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The sampled token ids [N], left on the device (no host sync).

        logits may be in the model's dtype: greedy rows without penalties take their argmax
        as they are (widening to fp32 is exact, so the index is the same); everything else
        runs in fp32. On a GPU, a batch whose random rows only set a temperature (no top_k,
        top_p, min_p or seed) draws in one kernel (`fused_draw`)."""
        num_rows = logits.shape[0]
        if num_rows != len(batch.params):
            raise ValueError(f"logits has {num_rows} rows but the SamplingBatch has "
                             f"{len(batch.params)}")
        processed = apply_penalties(logits, batch)
        greedy = [i for i, p in enumerate(batch.params) if p.greedy]
        randoms = [i for i, p in enumerate(batch.params) if not p.greedy]
        if not randoms:
            return greedy_argmax(processed)
        if fused_draw(processed, batch.params, batch.generators):
            temperatures = [0.0 if p.greedy else p.temperature for p in batch.params]
            from kvfleet_kernels.argmax import sample_rows
            seed = int(torch.randint(2**31 - 1, (1,)))     # torch's RNG, as the torch path draws
            return sample_rows(processed.contiguous(),
                               _rows_tensor(temperatures, logits.device, torch.float32), seed)
        processed = processed.float()
        if not greedy:
            token_ids = self._sample(processed, batch.params, batch.generators)
        else:
            token_ids = torch.empty(num_rows, dtype=torch.long, device=logits.device)
            rand_idx = _rows_tensor(randoms, logits.device, torch.long)
            token_ids[rand_idx] = self._sample(processed[rand_idx],
                                               [batch.params[i] for i in randoms],
                                               [batch.generators[i] for i in randoms])
            greedy_idx = _rows_tensor(greedy, logits.device, torch.long)
            token_ids[greedy_idx] = greedy_argmax(processed[greedy_idx])
        return token_ids

    def prompt_logprobs(self, logits: torch.Tensor, next_token_ids: list[int],
                        k: int) -> list[SampledToken]:
        """Row i: the logprob and rank of next_token_ids[i] under logits[i], plus the top-k."""
        # logits: [P, V]
        if logits.shape[0] != len(next_token_ids):
            raise ValueError(f"logits has {logits.shape[0]} rows but next_token_ids has "
                             f"{len(next_token_ids)}")
        if logits.shape[0] == 0:
            return []
        ids = _rows_tensor(next_token_ids, logits.device, torch.long)
        return _with_logprobs(logits.float(), ids, [k] * len(next_token_ids))

    @staticmethod
    def _sample(x: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> torch.Tensor:
        """Temperature, top_k, top_p, min_p, then one draw per row -> token ids [R]."""
        return _exponential_race(probabilities(x, params), generators)


def probabilities(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each row's distribution after temperature, top_k, top_p and min_p (unnormalised where
    min_p cut it: draws and ratios do not need the sum) -> [R, V] fp32."""
    # x: [R, V] fp32
    vocab = x.shape[1]
    temperatures = [p.temperature for p in params]
    if any(t != 1.0 for t in temperatures):      # 1.0 everywhere: nothing to divide
        x = x / _rows_tensor(temperatures, x.device, torch.float32).unsqueeze(1)
    top_k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        x = _top_k_top_p(x, top_k, top_p)
    probs = x.softmax(dim=-1)
    min_p = [p.min_p for p in params]
    if any(m > 0.0 for m in min_p):
        floor = _rows_tensor(min_p, x.device, torch.float32).unsqueeze(1) \
            * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


def verify_drafts(logits: torch.Tensor, drafts: list[list[int]], params: list[SamplingParams],
                  generators: list[torch.Generator | None],
                  prompt_token_ids: list[list[int]] | None = None,
                  output_token_ids: list[list[int]] | None = None,
                  grammars: list | None = None) -> list[list[SampledToken]]:
    """Speculative decoding's check of drafted tokens -> for each request, the drafts it
    keeps and the token that follows them (1 to len(drafts) + 1 tokens), with their logprobs
    where the request asks for them (under the raw logits of each token's row, as `Sampler`).

    logits: [sum(len(d) + 1), V], each request's rows in order: the row of its last token
    (which predicts drafts[0]), then one row per draft (the last predicts the token after
    every draft). Each row is processed as the step without drafts would process it had the
    drafts before it been generated: min_tokens, allowed_token_ids, logit_bias and penalties
    (apply_penalties) count the request's prompt and output (prompt_token_ids /
    output_token_ids, needed for penalties and min_tokens) plus the drafts before the row, and
    a request's grammar (grammars: its SequenceGrammar, fed its output; structured outputs)
    masks row j as it stands after drafts 0..j-1.
    Greedy requests keep the drafts equal to the argmax of their rows, then the argmax of
    the first row that disagrees (or of the last row). Random requests keep draft j with
    probability p_j(draft j), p_j being the row's distribution after that processing,
    temperature, top_k, top_p and min_p; at the first rejection they draw from p_j without
    the rejected token (renormalised), and after the last draft from its row's p: a drafted
    proposal is one-hot, so this is rejection sampling and every kept or drawn token is
    distributed as p_j exactly, as without drafts. Seeded requests draw from their own
    generator."""
    counts = [len(d) + 1 for d in drafts]
    num_rows = sum(counts)
    if logits.shape[0] != num_rows:
        raise ValueError(f"logits has {logits.shape[0]} rows but the drafts need {num_rows}")
    device = logits.device
    row_params = [p for p, c in zip(params, counts, strict=True) for _ in range(c)]
    if any(p.needs_penalties or p.min_tokens or p._bad_words_ids for p in params):
        if prompt_token_ids is None or output_token_ids is None:
            raise ValueError("penalties and min_tokens need prompt_token_ids and output_token_ids")
        row_prompts = [ids for ids, c in zip(prompt_token_ids, counts, strict=True)
                       for _ in range(c)]
        # row j of a request: its output as if drafts 0..j-1 had been generated
        row_outputs = [[*out, *d[:j]] for out, d in zip(output_token_ids, drafts, strict=True)
                       for j in range(len(d) + 1)]
    else:
        row_prompts = row_outputs = [[] for _ in range(num_rows)]
    x = apply_penalties(logits, SamplingBatch(params=row_params, prompt_token_ids=row_prompts,
                                              output_token_ids=row_outputs,
                                              generators=[None] * num_rows))
    if grammars is not None:
        entries, row = [], 0
        for g, d, c in zip(grammars, drafts, counts, strict=True):
            if g is not None and not g.done:
                entries.append((g, row, d))
            row += c
        if entries:
            from kvfleet_runtime.structured_outputs import mask_draft_rows
            if x is logits:     # (a grammar's row always has apply_penalties copy them)
                x = logits.clone()
            mask_draft_rows(x, entries)
    # each row's draft (-1 on a request's last row: there is nothing to check)
    draft = _rows_tensor([t for d in drafts for t in [*d, -1]], device, torch.long)
    greedy = [i for i, p in enumerate(row_params) if p.greedy]
    randoms = [i for i, p in enumerate(row_params) if not p.greedy]
    tokens = torch.empty(num_rows, dtype=torch.long, device=device)
    accept = torch.zeros(num_rows, dtype=torch.bool, device=device)
    if greedy:
        idx = _rows_tensor(greedy, device, torch.long)
        target = greedy_argmax(x[idx] if len(greedy) < num_rows else x)
        tokens[idx] = target
        accept[idx] = target == draft[idx]
    if randoms:
        idx = _rows_tensor(randoms, device, torch.long)
        probs = probabilities(x[idx].float(), [row_params[i] for i in randoms])
        row_draft = draft[idx]
        has_draft = row_draft >= 0
        at = row_draft.clamp(min=0).unsqueeze(1)
        total = probs.sum(dim=-1)                   # (min_p leaves rows unnormalised)
        p_draft = probs.gather(1, at).squeeze(1) / total
        row_generators = [g for g, c in zip(generators, counts, strict=True) for _ in range(c)]
        uniform = torch.empty(len(randoms), device=device)
        for j, g in enumerate(row_generators[i] for i in randoms):
            if g is not None:
                uniform[j : j + 1].uniform_(generator=g)
        unseeded = [j for j, i in enumerate(randoms) if row_generators[i] is None]
        if unseeded:
            uniform[_rows_tensor(unseeded, device, torch.long)] = torch.rand(len(unseeded),
                                                                           device=device)
        accept[idx] = has_draft & (uniform < p_draft)
        # the draw at a rejection: p without the rejected draft (the last row: p itself)
        residual = probs.scatter(1, at, torch.where(has_draft, 0.0, probs.gather(1, at).squeeze(1))
                                 .unsqueeze(1))
        tokens[idx] = _exponential_race(residual, [row_generators[i] for i in randoms])
    # each row's token if the request's output reaches it: its draft where kept, else the draw
    row_tokens = torch.where(accept, draft, tokens)
    num_top = [p.logprobs for p in row_params]
    lp = logprob_tensors(logits.float(), row_tokens, num_top)
    results = lp.tensors() if lp is not None else []
    host = [t.tolist() for t in (row_tokens, accept, *results)]   # one sync for all of them
    sampled = sampled_tokens(host[0], lp, num_top, host[2:])
    accept_host = host[1]
    out, row = [], 0
    for d, c in zip(drafts, counts, strict=True):
        kept = 0
        while kept < len(d) and accept_host[row + kept]:
            kept += 1
        out.append(sampled[row:row + kept + 1])
        row += c
    return out


def apply_penalties(raw: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """min_tokens mask, allowed_token_ids mask, logit_bias, repetition, presence and
    frequency penalties, then each grammar's mask (structured outputs); raw stays untouched.

    Returns raw itself when no row needs any of them, else a processed fp32 copy."""
    vocab = raw.shape[1]
    mask_rows: list[int] = []
    mask_cols: list[int] = []
    penalized: list[int] = []
    masked: list[int] = []
    pending = batch.num_pending or [0] * len(batch.params)
    # one pass with the fields read inline: it runs for every row every step (~0.1 ms a
    # property a pass at 1024 rows)
    for i, (p, out) in enumerate(zip(batch.params, batch.output_token_ids, strict=True)):
        if p.min_tokens and len(out) + pending[i] < p.min_tokens:
            for t in p._eos_token_ids.union(p.stop_token_ids):
                if t < vocab:
                    mask_rows.append(i)
                    mask_cols.append(t)
        if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                or p.repetition_penalty != 1.0):
            penalized.append(i)
        if p.logit_bias or p.allowed_token_ids is not None or p.structured_outputs is not None:
            masked.append(i)
        if p._bad_words_ids:    # (synchronous requests: out holds every token so far)
            for word in p._bad_words_ids:
                if len(word) == 1 or out[len(out) - len(word) + 1:] == word[:-1]:
                    mask_rows.append(i)
                    mask_cols.append(word[-1])
    if not mask_rows and not penalized and not masked:
        return raw
    x = raw.clone() if raw.dtype == torch.float32 else raw.float()
    if mask_rows:
        x[_rows_tensor(mask_rows, x.device, torch.long),
          _rows_tensor(mask_cols, x.device, torch.long)] = float("-inf")
    if masked:
        _allow_and_bias(x, [batch.params[i] for i in masked], masked)
    if penalized:
        params = [batch.params[i] for i in penalized]
        out_rows, out_ids = _flat_ids([batch.output_token_ids[i] for i in penalized], x.device)
        counts = torch.zeros(len(penalized), vocab, device=x.device)            # [P, V]
        counts.index_put_((out_rows, out_ids), torch.ones_like(out_ids, dtype=counts.dtype),
                          accumulate=True)
        seen_rows, seen_ids = _flat_ids([batch.prompt_token_ids[i] + batch.output_token_ids[i]
                                         for i in penalized], x.device)
        seen = torch.zeros(len(penalized), vocab, dtype=torch.bool, device=x.device)  # [P, V]
        seen[seen_rows, seen_ids] = True
        idx = _rows_tensor(penalized, x.device, torch.long)
        if batch.pending_ids is not None:
            # each row's token still on the device counts too (one scatter, no host sync)
            ids = batch.pending_ids[idx]
            extra = torch.zeros_like(counts)
            extra.scatter_(1, ids.clamp(min=0).unsqueeze(1), (ids >= 0).to(counts.dtype).unsqueeze(1))
            counts += extra
            seen |= extra > 0

        def column(values: list[float]) -> torch.Tensor:   # [P, 1]
            return _rows_tensor(values, x.device, torch.float32).unsqueeze(1)

        rep = column([p.repetition_penalty for p in params])
        freq = column([p.frequency_penalty for p in params])
        pres = column([p.presence_penalty for p in params])
        rows = x[idx]
        # HF RepetitionPenaltyLogitsProcessor: shrink a seen token's logit toward "less likely"
        rows = torch.where(seen, torch.where(rows > 0, rows / rep, rows * rep), rows)
        rows = rows - freq * counts - pres * (counts > 0).float()
        x[idx] = rows
    if masked and batch.grammar_lookup is not None:
        rows = [i for i in masked if batch.params[i].structured_outputs is not None]
        if rows:
            matchers = batch.grammar_lookup(rows)
            live = [(i, m) for i, m in zip(rows, matchers, strict=True) if m is not None]
            if live:
                from kvfleet_runtime.structured_outputs import mask_logits
                mask_logits(x, [i for i, _ in live], [m for _, m in live])
    return x


def _allow_and_bias(x: torch.Tensor, params: list[SamplingParams], rows: list[int]) -> None:
    """allowed_token_ids: every other id of the row to -inf; then logit_bias added (OpenAI's
    rule: a bias of -100 bans a token in effect, +100 all but forces it). In place on x."""
    vocab = x.shape[1]
    allowed = [(r, p.allowed_token_ids) for r, p in zip(rows, params, strict=True)
               if p.allowed_token_ids is not None]
    if allowed:
        keep_rows, keep_ids = _flat_ids([ids for _, ids in allowed], x.device)
        keep = torch.zeros(len(allowed), vocab, dtype=torch.bool, device=x.device)
        keep[keep_rows, keep_ids] = True
        idx = _rows_tensor([r for r, _ in allowed], x.device, torch.long)
        x[idx] = x[idx].masked_fill(~keep, float("-inf"))
    biased = [(r, p.logit_bias) for r, p in zip(rows, params, strict=True) if p.logit_bias]
    if biased:
        bias_rows = [r for r, b in biased for _ in b]
        bias_ids = [t for _, b in biased for t in b]
        values = [v for _, b in biased for v in b.values()]
        x.index_put_((_rows_tensor(bias_rows, x.device, torch.long),
                      _rows_tensor(bias_ids, x.device, torch.long)),
                     _rows_tensor(values, x.device, torch.float32), accumulate=True)


def _top_k_top_p(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Keep each row's top_k logits, then its smallest set holding top_p of the mass (HF rules)."""
    # x: [R, V]; top_k: V = off; top_p: 1.0 = off
    max_k = max(top_k)
    if max_k <= _MAX_TOP_K_CANDIDATES:
        # every row has a small top_k: the rest of the vocabulary can never be drawn, so
        # top_p only needs these candidates (a topk is ~10x cheaper than a full sort)
        descending, order = x.topk(max_k, dim=-1)
        ascending, order = descending.flip(-1), order.flip(-1)                # [R, K]
        out = torch.full_like(x, float("-inf"))
    else:
        ascending, order = x.sort(dim=-1)                                     # [R, V]
        out = torch.empty_like(x)
    width = ascending.shape[1]
    k = _rows_tensor(top_k, x.device, torch.long)
    # ties with the k-th largest value are kept, as HF's TopKLogitsWarper does
    kth = ascending.gather(1, (width - k).unsqueeze(1))
    ascending = ascending.masked_fill(ascending < kth, float("-inf"))
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    p = _rows_tensor(top_p, x.device, torch.float32)
    drop = cumulative <= (1.0 - p).unsqueeze(1)
    drop[:, -1] = False                      # the most likely token always survives
    ascending = ascending.masked_fill(drop, float("-inf"))
    return out.scatter_(1, order, ascending)


def fused_draw(logits: torch.Tensor, params: list[SamplingParams],
               generators: list[torch.Generator | None]) -> bool:
    """Whether kvfleet_kernels.argmax.sample_rows draws this batch: on a GPU, when no random row
    filters its distribution (top_k, top_p, min_p) or draws from its own seeded generator.
    There one launch reads the logits once; the torch race below makes ~8 fp32 passes over
    them (~2 ms a step at 1024 x 128k on an H200)."""
    if not logits.is_cuda or logits.numel() >= 2**31:
        return False
    vocab = logits.shape[1]
    return all(p.greedy or (g is None and p.top_p >= 1.0 and p.min_p <= 0.0
                            and (p.top_k <= 0 or p.top_k >= vocab))
               for p, g in zip(params, generators, strict=True))


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the vocabulary, [N, V] -> [N]: on a GPU a few rows take
    kvfleet_kernels.argmax (one block a row is slow over a 128k vocabulary), else torch."""
    if logits.is_cuda:
        from kvfleet_kernels.argmax import MAX_ROWS, argmax_rows
        if logits.shape[0] <= MAX_ROWS:
            return argmax_rows(logits.contiguous())
    return logits.argmax(dim=-1)


def _exponential(out: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Exponential(1) draws in place as -log(U): 4-5x faster than exponential_() on a CPU."""
    return out.uniform_(generator=generator).log_().neg_()


def _exponential_race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """argmax(probs / E) with E ~ Exponential(1) draws a token with probability probs (unnormalised).

    A seeded row draws its own V exponentials from its own generator, so its token depends
    only on its seed and its logits, never on which other rows share the batch.
    """
    # probs: [R, V]
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        _exponential(noise)
    else:
        for i, g in enumerate(generators):
            if g is not None:
                _exponential(noise[i], g)
        if unseeded:
            idx = _rows_tensor(unseeded, probs.device, torch.long)
            noise[idx] = _exponential(torch.empty(len(unseeded), probs.shape[1], device=probs.device))
    # a zero draw would give 0/0 = NaN on a masked token, and argmax picks NaN
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


@dataclass
class LogprobTensors:
    """A step's logprob results on the device; `sampled_tokens` reads them back (one sync)."""
    chosen: torch.Tensor                 # [N] logprob of each row's token under the raw logits
    wanted: list[int]                    # rows that asked for rank + top-k
    ranks: torch.Tensor | None = None    # [W]
    top_ids: torch.Tensor | None = None  # [W, max k]
    top_logprobs: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.chosen, self.ranks, self.top_ids, self.top_logprobs)
                if t is not None]


def logprob_tensors(raw: torch.Tensor, token_ids: torch.Tensor,
                    num_top: list[int | None]) -> LogprobTensors | None:
    """Each row's chosen logprob under the raw logits, and rank + top-k where num_top[i] is set;
    None when no row asked (the [N, V] logsumexp is the largest sampler cost on a CPU)."""
    # raw: [N, V]; token_ids: [N]
    if all(k is None for k in num_top):
        return None
    chosen = raw.gather(1, token_ids.unsqueeze(1)).squeeze(1)        # [N]
    normalizer = raw.logsumexp(dim=-1)                                 # [N]
    out = LogprobTensors(chosen=chosen - normalizer,
                         wanted=[i for i, k in enumerate(num_top) if k is not None])
    if not out.wanted:
        return out
    idx = _rows_tensor(out.wanted, raw.device, torch.long)
    every = len(out.wanted) == len(num_top)
    rows = raw if every else raw[idx]                                  # [W, V]
    out.ranks = (rows > (chosen if every else chosen[idx]).unsqueeze(1)).sum(dim=-1) + 1
    max_top = max(num_top[i] for i in out.wanted)
    if max_top > 0:
        values, out.top_ids = rows.topk(max_top, dim=-1)
        out.top_logprobs = values - (normalizer if every else normalizer[idx]).unsqueeze(1)
    return out


def sampled_tokens(token_ids: list[int], lp: LogprobTensors | None,
                   num_top: list[int | None], host: list[list] | None = None) -> list[SampledToken]:
    """SampledTokens from ids on the host and `lp` (its tensors' `.tolist()`s in `host`, in
    `lp.tensors()` order, when they were copied back already; else taken here)."""
    if lp is None:
        return [SampledToken(token_id=t) for t in token_ids]
    lists = host if host is not None else [t.tolist() for t in lp.tensors()]
    chosen = lists[0]
    result = [SampledToken(token_id=t, logprob=c) for t, c in zip(token_ids, chosen, strict=True)]
    if not lp.wanted:
        return result
    ranks = lists[1]
    top_ids, top_lps = (lists[2], lists[3]) if lp.top_ids is not None else (None, None)
    for j, i in enumerate(lp.wanted):
        k = num_top[i]
        result[i].rank = ranks[j]
        result[i].top_ids = top_ids[j][:k] if top_ids is not None else []
        result[i].top_logprobs = top_lps[j][:k] if top_lps is not None else []
    return result


def _with_logprobs(raw: torch.Tensor, token_ids: torch.Tensor,
                   num_top: list[int | None]) -> list[SampledToken]:
    """Each row's chosen logprob under the raw logits; rank and top-k where num_top[i] is set."""
    return sampled_tokens(token_ids.tolist(), logprob_tensors(raw, token_ids, num_top), num_top)
