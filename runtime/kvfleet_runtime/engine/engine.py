"""LLMEngine: add / abort requests; step() = schedule -> run -> update -> outputs."""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Iterable

import torch

from kvfleet_runtime.config import EngineConfig, check_priority
from kvfleet_runtime.detokenizer import IncrementalDetokenizer, stop_token_unshown
from kvfleet_runtime.distributed.workers import WorkerDiedError, WorkerGroup
from kvfleet_runtime.engine.kv_cache_manager import KVCacheManager
from kvfleet_runtime.engine.model_runner import ModelRunner, ModelRunnerOutput, PendingStep
from kvfleet_runtime.engine.scheduler import Scheduler, SchedulerOutput
from kvfleet_runtime.layers.backend import set_backend
from kvfleet_runtime.layers.sampler import SampledToken
from kvfleet_runtime.loader import load_model
from kvfleet_runtime.lora import LoRARequest
from kvfleet_runtime.model_source import resolve_config
from kvfleet_runtime.outputs import CompletionOutput, EngineStats, Logprob, RequestOutput
from kvfleet_runtime.pooling import PoolerConfig, PoolingParams
from kvfleet_runtime.request import FINISHED_STATUSES as _FINISHED
from kvfleet_runtime.request import Request, RequestStatus
from kvfleet_runtime.sampling_params import SamplingParams, bad_words_token_ids
from kvfleet_runtime.structured_outputs import grammar_prefix

log = logging.getLogger(__name__)

_EMBEDDINGS_ONLY = ("this model's checkpoint has no lm_head (an embedding model's or a "
                    "sequence classifier's): it serves embeddings, scores and classes "
                    "(/v1/embeddings, /score, /classify; LLM.embed, .score, .classify), not "
                    "generation")


def _token_ids(prompt: Iterable[int], vocab: int) -> list[int]:
    """A prompt given as token ids -> a list of Python ints, each checked to be in [0, vocab).
    The common case runs in C (array('q'), min, max: ~10x faster than a Python check a token on
    1000-token prompts, host time during which an offline batch's GPU still waits); anything
    else falls back to the check a token, which names the offending ids."""
    try:
        ids = array("q", prompt)
    except (TypeError, OverflowError, ValueError):
        ids = None
    if ids is not None and (not ids or (min(ids) >= 0 and max(ids) < vocab)):
        return ids.tolist()
    ids = list(prompt)
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:3]}")
    return ids


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        resolve_config(config)      # a Hub id, hf:// or s3:// model: pulled, then its folder
        self.config = config
        set_backend(config.attention_backend)
        torch.manual_seed(config.seed)
        # ranks 1.. of a tensor-parallel group load their shards alongside this process (rank 0)
        self.workers = WorkerGroup(config) if config.tensor_parallel_size > 1 else None
        try:
            loaded = load_model(config)
            config.finalize(loaded.config.max_position_embeddings)
            self.runner = ModelRunner(config, loaded)
            if self.workers is not None:
                self.workers.wait_ready()
        except BaseException as e:
            self._fail_start(e)
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.config
        self.served_model_name = config.served_model_name or loaded.name
        self.eos_token_ids = set(loaded.config.eos_token_ids)
        windows = set(loaded.config.sliding_windows)
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size,
                                 config.enable_prefix_caching,
                                 sliding_window=windows.pop() if len(windows) == 1 else 0)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill, config.admission_headroom,
                                   config.scheduling_policy, config.long_prefill_token_threshold)
        self.scheduler.speculative = config.speculative is not None
        if config.enable_lora:
            self.scheduler.max_loras = config.max_loras
        # speculative decoding: steps that checked drafts, drafts checked, drafts kept
        self.spec_stats = {"spec_drafts": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0}
        self._drafting = False     # the last look found drafts: step synchronously
        self.groups: dict[str, list[Request]] = {}
        self.prompts: dict[str, str | None] = {}
        # async scheduling: the step launched by the last step() call, not yet read back;
        # groups whose sampling reads their earlier tokens on the host run synchronously
        self.in_flight: tuple[SchedulerOutput, PendingStep] | None = None
        self.sync_groups: set[str] = set()
        self.final_only: set[str] = set()
        self._pooler: PoolerConfig | None = None    # the model's pooling (self.pooler)
        self._grammar_backend = None     # structured outputs: made at the first such request
        # cumulative step timings: forward_s is the model + sampler, the rest of step_s is host work
        self.step_totals: dict[str, float] = {"steps": 0, "prepare_s": 0.0, "forward_s": 0.0,
                                              "step_s": 0.0}
        log.info("engine ready: %s, %d KV blocks of %d tokens, dtype %s, device %s, "
                 "async scheduling %s", self.served_model_name, self.runner.num_blocks,
                 config.block_size, loaded.dtype, config.device,
                 "on" if config.async_scheduling else "off")

    def _fail_start(self, error: BaseException) -> None:
        if self.workers is None:
            raise error
        # rank 0 often sees only the broken collective; the worker's own report says why
        reason = self.workers.startup_error()
        self.workers.shutdown()
        if reason is not None:
            raise WorkerDiedError(reason) from error
        raise error

    def is_healthy(self) -> bool:
        """False once a tensor-parallel worker has died (or the engine was shut down)."""
        return self.workers is None or self.workers.is_alive()

    def death_reason(self) -> str | None:
        """Why this engine cannot step any more (a tensor-parallel worker died or hung, or
        the engine was shut down); None while it is healthy."""
        return None if self.is_healthy() else self.workers.dead

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do with one GPU). Idempotent."""
        if self.workers is not None:
            self.workers.shutdown()

    def kill_workers(self, wait_s: float) -> None:
        """SIGKILL the tensor-parallel workers now, without the shutdown's release and
        teardown (for a process about to exit); waits up to wait_s for them to exit."""
        if self.workers is not None:
            self.workers.kill_now(wait_s)

    # ---- requests -----------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt).input_ids
        else:
            ids = _token_ids(prompt, self.model_config.vocab_size)
        if not ids:
            raise ValueError("prompt must not be empty")
        return ids

    def check_request(self, prompt: str | list[int], params: SamplingParams,
                      lora_request: LoRARequest | None = None) -> list[int]:
        """The prompt's token ids, after the checks add_request makes (a ValueError names what
        is wrong); nothing is queued and params is not changed."""
        self._check_lora(lora_request)
        prompt_ids = self.tokenize(prompt)
        params.check_token_ids(self.model_config.vocab_size)
        self._check_lengths(len(prompt_ids), params.clone())
        if params.structured_outputs is not None:
            self._grammar_matcher(params)      # compiled (and cached) now: errors say so here
        self._check_runner(params)
        if params.pooling is not None:
            self.pooling_params(params.pooling)
        return prompt_ids

    def _check_runner(self, params: SamplingParams) -> None:
        """ValueError for a request this engine does not serve: generation from a model
        without lm_head or with runner "pooling"; pooling with runner "generate"."""
        runner = self.config.runner
        if params.pooling is None and not self.model_config.generates:
            raise ValueError(_EMBEDDINGS_ONLY)
        if params.pooling is None and runner == "pooling":
            raise ValueError("this engine runs the model for pooling (runner 'pooling', "
                             "--runner pooling): embeddings, scores and classes "
                             "(/v1/embeddings, /score, /classify), not generation")
        if params.pooling is not None and runner == "generate":
            raise ValueError("this engine runs the model for generation (runner 'generate', "
                             "--runner generate): no embeddings, scores or classes")

    def pooling_params(self, params: PoolingParams | None = None) -> PoolingParams:
        """An embedding request's params checked against this model's pooling (a ValueError
        says what it cannot give) and completed (normalize, as the model's config says)."""
        params = params if params is not None else PoolingParams()
        self.pooler.check(params, self.model_config.hidden_size)
        return self.pooler.resolve(params)

    @property
    def pooler(self) -> PoolerConfig:
        """How this model embeds and scores (kvfleet_runtime/pooling.py); read once."""
        if self._pooler is None:
            self._pooler = PoolerConfig.of(self.config.model, self.model_config.hf_config,
                                           self.tokenizer, self.model_config.num_labels)
        return self._pooler

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter before any request names it (vLLM's add_lora); a
        ValueError says why it cannot serve."""
        self._check_lora(lora_request)

    def _check_lora(self, lora_request: LoRARequest | None) -> None:
        """The adapter is read (once; kept in host memory) and checked: a ValueError says why
        it cannot serve."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest; got {type(lora_request).__name__}")
        if self.runner.lora is None:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} requested but LoRA is not "
                             "enabled: start the engine with enable_lora=True (--enable-lora)")
        self.runner.lora.add(lora_request)

    def _grammar_matcher(self, params: SamplingParams, prompt_ids: list[int] | None = None):
        """A new sequence's SequenceGrammar for params.structured_outputs (ValueError if it
        does not compile); with a reasoning parser it starts after the thinking `prompt_ids`
        opens, if any. The backend reads the vocabulary at the first request that needs it."""
        if self._grammar_backend is None:
            from kvfleet_runtime.structured_outputs import GrammarBackend, warm_up_masks
            self._grammar_backend = GrammarBackend(self.tokenizer, self.model_config.vocab_size,
                                                   self.eos_token_ids, self.config.reasoning_parser)
            warm_up_masks(self.config.torch_device, self.model_config.vocab_size)
        return self._grammar_backend.sequence(params.structured_outputs, prompt_ids)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, final_only: bool = False,
                    prompt_ids: list[int] | None = None,
                    lora_request: LoRARequest | None = None, priority: int = 0) -> None:
        """Queue a request. final_only: step() returns its output once, when it finishes
        (offline generate; as vLLM's FINAL_ONLY), not after every token. prompt_ids:
        check_request's result for this prompt (not tokenized again). lora_request: the LoRA
        adapter it runs with (enable_lora engines). priority: its place under the priority
        scheduling policy (lower first; any other value than 0 is refused under fcfs)."""
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        check_priority(priority, self.config.scheduling_policy)
        self._check_lora(lora_request)
        if prompt_ids is None:
            prompt_ids = self.tokenize(prompt)
        params = params.clone()
        self._check_runner(params)
        if params.bad_words:
            params._bad_words_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        if params.pooling is not None:
            if params.n != 1:
                raise ValueError(f"an embedding request has one output; got n={params.n}")
            params.pooling = self.pooling_params(params.pooling)
        params.check_token_ids(self.model_config.vocab_size)
        self._check_lengths(len(prompt_ids), params)
        params._eos_token_ids = set() if params.ignore_eos else set(self.eos_token_ids)
        grammars = ([self._grammar_matcher(params, prompt_ids) for _ in range(params.n)]
                    if params.structured_outputs is not None else None)
        children = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            r = Request(child_id, prompt_ids, params, arrival_time, group_id=request_id, index=i,
                        lora_request=lora_request, priority=priority)
            if params.seed is not None:
                r.generator = torch.Generator(device=self.config.torch_device).manual_seed(
                    params.seed + i)
            if self._detokenizes(params) and params.pooling is None:
                r.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, params)
            if i and self.config.enable_prefix_caching and params.prompt_logprobs is None:
                r.sibling = children[0]
            if grammars is not None:
                r.grammar = grammars[i]
            children.append(r)
        self.groups[request_id] = children
        self.prompts[request_id] = prompt if isinstance(prompt, str) else None
        # prompt logprobs' targets are read row by row on the host; a pooling request's hidden
        # state is read in the step that ends its prompt (ModelRunner.execute)
        if (params.prompt_logprobs is not None or params.pooling is not None
                or params._bad_words_ids):     # (bad words read the tokens so far on the host)
            self.sync_groups.add(request_id)
        if final_only:
            self.final_only.add(request_id)
        for r in children:
            self.scheduler.add_request(r)

    def _detokenizes(self, params: SamplingParams) -> bool:
        """Whether this engine turns a request's tokens into its text (DeltaEngine leaves
        what needs no text to stop to the server's process)."""
        return True

    def _check_lengths(self, num_prompt: int, params: SamplingParams) -> None:
        max_len = self.config.max_model_len
        if params.max_tokens is None:
            params.max_tokens = max_len - num_prompt
        if num_prompt + params.max_tokens > max_len:
            raise ValueError(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{num_prompt + params.max_tokens} tokens ({num_prompt} in the prompt, "
                f"{params.max_tokens} for the completion). Reduce the prompt or max_tokens.")
        need = self.kv.max_blocks_held(num_prompt + params.max_tokens,
                                       self.config.max_num_batched_tokens)
        if need > self.kv.block_pool.num_usable_blocks:
            raise ValueError(f"the request needs {need} KV blocks but the cache holds only "
                             f"{self.kv.block_pool.num_usable_blocks}; lower max_tokens")

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            for r in self.groups.pop(rid, []):
                if not r.is_finished:
                    self.scheduler.finish(r, RequestStatus.FINISHED_ABORTED)
            self.prompts.pop(rid, None)
            self.sync_groups.discard(rid)
            self.final_only.discard(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    # ---- the loop ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        if self.workers is None:
            return self._step(t0)
        self.workers.check_alive()
        self.workers.step_began()     # the supervisor fails a step that never returns
        try:
            return self._step(t0)
        finally:
            self.workers.step_ended()

    def _step(self, t0: float) -> list[RequestOutput]:
        speculative = self.config.speculative is not None
        if self.config.async_scheduling and not self.sync_groups and not self._drafting:
            outputs = self._step_async(t0)
            if speculative:
                # a running request's known tokens (the step in flight's aside) end in an
                # n-gram that recurs: from the next step on, steps are synchronous, with drafts
                self._drafting = self._propose(dry_run=True)
            return outputs
        outputs = self._drain()
        if speculative:
            # no drafts for any request: the next step may be asynchronous again
            self._drafting = self._propose()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        try:
            result = self.runner.execute(sched, self._block_ids(sched))
        except RuntimeError as e:
            if self.workers is None:
                raise
            raise self.workers.fail(e) from e
        touched = self._update(sched, result)
        outputs += self._outputs(touched)
        self._account(result, t0)
        return outputs

    def _step_async(self, t0: float) -> list[RequestOutput]:
        """Schedule step N+1 counting the tokens step N is still sampling, launch it, and only
        then wait for step N and process its tokens (detokenize, stop checks, outputs) while
        N+1 runs. A request that step N finishes wastes its row of N+1, which is dropped."""
        sched = self.scheduler.schedule()
        prev, self.in_flight = self.in_flight, None
        if not sched.is_empty:
            try:
                pending = self.runner.launch(sched, self._block_ids(sched),
                                             prev[1] if prev else None)
            except RuntimeError as e:
                if self.workers is None:
                    raise
                raise self.workers.fail(e) from e
            for s in sched.scheduled:
                r = s.request
                if s.samples:
                    r.num_pending += 1
                r.num_computed_tokens += s.num_new_tokens
            self.in_flight = (sched, pending)
        if prev is None:      # the first launch: no result yet, but its time is a step's
            self.step_totals["step_s"] += time.perf_counter() - t0
            return []
        outputs, result = self._finish_launched(prev)
        self._account(result, t0)
        return outputs

    def _propose(self, dry_run: bool = False) -> bool:
        """Speculative decoding: drafts for every running request that decodes and may be
        drafted (engine/speculative.py), never past its max_tokens; none while more requests
        run than the config's disable_by_batch_size. True if any request got drafts.
        dry_run: only say whether any would, from the tokens on the host (async steps)."""
        spec = self.config.speculative
        running = self.scheduler.running
        limit = spec.disable_by_batch_size
        if limit is not None and len(running) > limit:
            if not dry_run:
                for r in running:
                    r.spec_token_ids = []
            return False
        found = False
        for r in running:
            drafts = []
            if r.num_computed_tokens >= len(r.all_token_ids) - 1:
                drafts = spec.propose(r, r.params.max_tokens - len(r.output_token_ids)
                                      - r.num_pending - 1)
                if drafts and dry_run:
                    return True
                if drafts and r.grammar is not None:    # only what the grammar allows
                    r.grammar.catch_up(r.output_token_ids)
                    drafts = drafts[:grammar_prefix(r.grammar, drafts)]
            if not dry_run:
                r.spec_token_ids = drafts
            found = found or bool(drafts)
        return found

    def _drain(self) -> list[RequestOutput]:
        """Finish the launched step, if any (before a step that needs every token on the host)."""
        prev, self.in_flight = self.in_flight, None
        return self._finish_launched(prev)[0] if prev else []

    def _finish_launched(self, launched: tuple[SchedulerOutput, PendingStep]
                         ) -> tuple[list[RequestOutput], ModelRunnerOutput]:
        sched, pending = launched
        try:
            result = self.runner.finish(pending)
        except RuntimeError as e:
            if self.workers is None:
                raise
            raise self.workers.fail(e) from e
        now = time.monotonic()
        touched: dict[str, None] = {}
        sampled, final_only, append = result.sampled, self.final_only, self._append
        for s in sched.scheduled:
            r = s.request
            token_id = sampled.get(r.request_id)
            if token_id is None:
                continue
            r.num_pending -= 1
            if r.status in _FINISHED:   # stopped or aborted while this step ran: drop its token
                continue
            # a final-only group has an output only once its last request finishes
            if append(r, token_id, result, now) or r.group_id not in final_only:
                touched[r.group_id] = None
        return self._outputs(touched), result

    def _block_ids(self, sched: SchedulerOutput) -> dict[str, list[int]]:
        get = self.kv.get_block_ids
        return {rid: get(rid) for rid in [s.request.request_id for s in sched.scheduled]}

    def _account(self, result: ModelRunnerOutput, t0: float) -> None:
        totals = self.step_totals
        totals["steps"] += 1
        totals["prepare_s"] += result.prepare_s
        totals["forward_s"] += result.forward_s
        totals["step_s"] += time.perf_counter() - t0

    def _update(self, sched: SchedulerOutput, result) -> list[str]:
        now = time.monotonic()
        touched: dict[str, None] = {}
        sampled, prompt_logprobs = result.sampled, result.prompt_logprobs
        final_only, append = self.final_only, self._append
        embeddings = result.embeddings
        for s in sched.scheduled:
            r = s.request
            r.num_computed_tokens += s.num_new_tokens
            if embeddings and r.request_id in embeddings:
                r.embedding = embeddings[r.request_id]
            if prompt_logprobs:
                for tok in prompt_logprobs.get(r.request_id, ()):
                    r.prompt_logprobs.append(self._position_logprobs(r, tok))
            if s.spec_token_ids:
                if self._append_verified(r, s, result.spec_tokens[r.request_id], result, now) \
                        or r.group_id not in final_only:
                    touched[r.group_id] = None
                continue
            token_id = sampled.get(r.request_id)
            if token_id is None:
                continue
            # a final-only group has an output only once its last request finishes
            if append(r, token_id, result, now) or r.group_id not in final_only:
                touched[r.group_id] = None
        return list(touched)

    def _append_verified(self, r: Request, s, tokens: list[SampledToken],
                         result: ModelRunnerOutput, now: float) -> bool:
        """Speculative decoding: append a step's kept drafts and the token after them, one by
        one (a stop among them drops the rest); True when that finished `r`. The KV of the
        rejected drafts stays in slots past the request's length: it counts as not computed."""
        stats = self.spec_stats
        stats["spec_drafts"] += 1
        stats["spec_draft_tokens"] += len(s.spec_token_ids)
        stats["spec_accepted_tokens"] += len(tokens) - 1
        r.spec_token_ids = []
        for tok in tokens:
            if self._append(r, tok.token_id, result, now, tok):
                return True
        r.num_computed_tokens = len(r.all_token_ids) - 1
        return False

    def _append(self, r: Request, token_id: int, result: ModelRunnerOutput, now: float,
                tok: SampledToken | None = None) -> bool:
        """Appends a sampled token (detokenize, stop checks; its logprobs from `tok`, else
        from `result`, where asked for); True when it finished `r`. Runs for every running
        request every step: the common case reads few attributes."""
        r.output_token_ids.append(token_id)
        r.all_token_ids.append(token_id)
        if r.logprobs is not None:    # decoding the top-k costs: only when asked for
            if tok is None:
                tok = result.logprobs[r.request_id]
            r.add_logprobs(self._position_logprobs(r, tok), tok.logprob)
        metrics = r.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        metrics.num_generation_tokens += 1
        detokenizer = r.detokenizer
        p = r.params
        stop_id = token_id in p._eos_token_ids or token_id in p.stop_token_ids
        stop_str = None
        if detokenizer is not None and not (
                stop_id and stop_token_unshown(p, token_id, len(r.output_token_ids))):
            stop_str = detokenizer.update_one(token_id)
        if (stop_str is None and r.grammar is None and not stop_id
                and len(r.output_token_ids) < p.max_tokens
                and len(r.all_token_ids) < self.config.max_model_len):
            return False          # nothing _check_stop could stop it for
        status = self._check_stop(r, token_id, stop_str)
        if status is None:
            return False
        if not isinstance(r.stop_reason, str) and detokenizer is not None:
            detokenizer.finish()
        metrics.finished_time = now
        self.scheduler.finish(r, status)
        return True

    @staticmethod
    def _grammar_done(r: Request) -> bool:
        """Feed the request's grammar the tokens it has not seen (the model runner may have fed
        the newest already); True once the grammar is complete (its output says all it can),
        or if a token broke it (only a stop token was left and min_tokens masked it)."""
        grammar = r.grammar
        grammar.catch_up(r.output_token_ids)
        if grammar.broken:
            log.warning("request %s: a token does not follow its structured output; stopped",
                        r.request_id)
        return grammar.done

    def _check_stop(self, r: Request, token_id: int, stop_str: str | None) -> RequestStatus | None:
        p = r.params
        if r.grammar is not None and self._grammar_done(r):
            return RequestStatus.FINISHED_STOPPED
        if len(r.output_token_ids) >= p.min_tokens:
            if token_id in p._eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in p.stop_token_ids:
                r.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            if stop_str is not None:
                r.stop_reason = stop_str
                return RequestStatus.FINISHED_STOPPED
        if len(r.output_token_ids) >= p.max_tokens or r.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    @staticmethod
    def _position_logprobs(r: Request, tok: SampledToken) -> dict[int, Logprob]:
        decode = r.detokenizer.decode_token
        pos = {}
        for rank, (tid, lp) in enumerate(zip(tok.top_ids or [], tok.top_logprobs or [], strict=True), 1):
            pos[tid] = Logprob(lp, rank, decode(tid))
        if tok.token_id not in pos:
            pos = {tok.token_id: Logprob(tok.logprob, tok.rank, decode(tok.token_id)), **pos}
        return pos

    def _outputs(self, group_ids) -> list[RequestOutput]:
        """Outputs of the groups a step touched (a final-only group's only once it finished)."""
        groups, final_only = self.groups, self.final_only
        return [self._make_output(gid) for gid in group_ids if gid in groups and (
            gid not in final_only or all(c.is_finished for c in groups[gid]))]

    def _make_output(self, group_id: str) -> RequestOutput:
        # new lists each step (token ids, logprobs): AsyncLLMEngine hands the output to another
        # thread while this one goes on appending to the request's own
        children = self.groups[group_id]
        first = children[0]
        outs = [CompletionOutput(
            index=c.index, text=c.detokenizer.output_text if c.detokenizer else "",
            token_ids=list(c.output_token_ids),
            cumulative_logprob=c.cumulative_logprob if c.logprobs is not None else None,
            logprobs=list(c.logprobs) if c.logprobs is not None else None,
            finish_reason=c.status.value if c.is_finished else None,
            stop_reason=c.stop_reason) for c in children]
        finished = all(c.is_finished for c in children)
        out = RequestOutput(
            request_id=group_id, prompt=self.prompts.get(group_id),
            prompt_token_ids=first.prompt_token_ids, outputs=outs, finished=finished,
            prompt_logprobs=list(first.prompt_logprobs) if first.prompt_logprobs is not None else None,
            num_cached_tokens=max(first.num_cached_tokens, 0), metrics=first.metrics,
            embedding=first.embedding)
        if finished:
            self._retire(group_id)
        return out

    def _retire(self, group_id: str) -> None:
        """Forget a finished group (its last output has been made)."""
        del self.groups[group_id]
        self.prompts.pop(group_id, None)
        self.sync_groups.discard(group_id)
        self.final_only.discard(group_id)

    def get_stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries_total=self.kv.prefix_cache_queries,
            prefix_cache_hits_total=self.kv.prefix_cache_hits,
            num_preemptions_total=self.scheduler.num_preemptions,
            extra={**self.step_totals, **self.spec_stats},
            lora=None if not self.config.enable_lora else (
                self.config.max_loras, _adapter_names(self.scheduler.running),
                _adapter_names(self.scheduler.waiting)))


def _adapter_names(requests: Iterable[Request]) -> str:
    """The requests' LoRA adapters' names, sorted and comma-joined."""
    return ",".join(sorted({r.lora_request.lora_name for r in requests if r.lora_request}))
