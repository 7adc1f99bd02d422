"""LLM: the offline API — `LLM(model=...).generate(prompts, SamplingParams(...))` and `.chat()`."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from kvfleet_runtime.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from kvfleet_runtime.config import EngineConfig, check_priority
from kvfleet_runtime.engine.engine import LLMEngine
from kvfleet_runtime.generation_config import load_sampling_defaults
from kvfleet_runtime.lora import LoRARequest
from kvfleet_runtime.model_source import local_lora, resolve_config
from kvfleet_runtime.outputs import RequestOutput
from kvfleet_runtime.pooling import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingParams,
    ScoringOutput,
    ScoringRequestOutput,
    cosine,
    embedding_sampling_params,
    pair_prompt,
    score_pairs,
)
from kvfleet_runtime.sampling_params import SamplingParams

Prompt = str | list[int]


def _prompt_list(prompts: Prompt | dict | Sequence[Prompt | dict]) -> list[Prompt]:
    """One prompt (text, token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": ids}) or
    several, as a list of texts and token-id lists."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                            and isinstance(prompts[0], int)):
        prompts = [prompts]
    return [_as_prompt(p) for p in prompts]


def _as_prompt(prompt: Prompt | dict) -> Prompt:
    """vLLM's TextPrompt / TokensPrompt dicts as text / token ids."""
    if not isinstance(prompt, dict):
        return prompt
    keys = set(prompt)
    if keys == {"prompt_token_ids"}:
        return list(prompt["prompt_token_ids"])
    if keys == {"prompt"}:
        return prompt["prompt"]
    raise ValueError("a prompt dict takes 'prompt' (text) or 'prompt_token_ids' (token ids), "
                     f"one of them; got {sorted(keys)}")


class _Progress:
    """vLLM's use_tqdm bar over the finished requests of one call (True: tqdm's; a callable:
    made by it, as vLLM takes a tqdm factory; False: none), its postfix the call's token
    rates."""

    def __init__(self, use_tqdm, total: int, desc: str = "Processed prompts") -> None:
        self.bar = None
        if use_tqdm:
            factory = use_tqdm
            if not callable(factory):
                from tqdm.auto import tqdm as factory
            self.bar = factory(total=total, desc=desc, dynamic_ncols=True)
        self.input_tokens = self.output_tokens = 0

    def done(self, out: RequestOutput) -> None:
        bar = self.bar
        if bar is None:
            return
        self.input_tokens += len(out.prompt_token_ids)
        self.output_tokens += sum(len(c.token_ids) for c in out.outputs)
        elapsed = bar.format_dict.get("elapsed") or 0.0
        if elapsed > 0:
            bar.set_postfix_str(f"est. speed input: {self.input_tokens / elapsed:.2f} toks/s, "
                                f"output: {self.output_tokens / elapsed:.2f} toks/s",
                                refresh=False)
        bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


_TASK_RUNNERS = {"auto": "auto", "generate": "generate", "embed": "pooling",
                 "embedding": "pooling", "score": "pooling", "classify": "pooling",
                 "reward": "pooling"}


class LLM:
    """Keyword arguments are EngineConfig fields (block_size, max_num_seqs, max_model_len, ...).

    generation_config: where generate() and chat() without sampling_params take their
    defaults: "auto", the model folder's generation_config.json (as vLLM), "vllm" for
    SamplingParams(), or a folder holding one."""

    def __init__(self, model: str = "", generation_config: str = "auto",
                 task: str | None = None, **kwargs) -> None:
        """task: vLLM's older spelling of runner (LLM(..., task="score") in model cards):
        generate -> runner "generate", embed / score / classify / reward -> "pooling"."""
        if task is not None:
            if task not in _TASK_RUNNERS:
                raise ValueError(f"task must be one of {', '.join(_TASK_RUNNERS)}; got {task!r}")
            kwargs.setdefault("runner", _TASK_RUNNERS[task])
        fields = set(EngineConfig.__dataclass_fields__)
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise TypeError(f"LLM() got unknown argument(s) {', '.join(unknown)}; "
                            f"expected EngineConfig fields: {', '.join(sorted(fields))}")
        self._start(EngineConfig(model=model, **kwargs), generation_config)

    @classmethod
    def from_config(cls, config: EngineConfig, generation_config: str = "auto") -> LLM:
        llm = cls.__new__(cls)
        llm._start(config, generation_config)
        return llm

    def _start(self, config: EngineConfig, generation_config: str) -> None:
        resolve_config(config)      # a remote model pulled first: its generation_config.json too
        self._defaults = load_sampling_defaults(generation_config, config.model)
        self.engine = LLMEngine(config)
        self._ids = itertools.count()
        self._lora_folders: dict[str, str] = {}     # remote adapter path -> its pulled folder

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() use without sampling_params: SamplingParams() with the
        model's generation config's values (vLLM's method of this name)."""
        return SamplingParams(**self._defaults)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: Sequence[int] | None = None,
                 use_tqdm: bool | Callable = True) -> list[RequestOutput]:
        """Complete every prompt (vLLM's LLM.generate). lora_request: the LoRA adapter to run
        them with (LLM(..., enable_lora=True)), one for all or one per prompt (None: the base
        model). priority: one per prompt, under LLM(..., scheduling_policy="priority"): lower
        values are admitted first (all are queued before the first step, then). use_tqdm: a
        progress bar over the finished prompts (vLLM's; a callable: the tqdm to make it)."""
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params has {len(sampling_params)} entries for "
                             f"{len(prompts)} prompts; give one or one per prompt")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(prompts)
        lora_request = list(lora_request)
        if len(lora_request) != len(prompts):
            raise ValueError(f"lora_request has {len(lora_request)} entries for {len(prompts)} "
                             "prompts; give one or one per prompt")
        if priority is None:
            priority = [0] * len(prompts)
        priority = list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts; "
                             "give one per prompt")
        engine = self.engine
        for value in priority:
            check_priority(value, engine.config.scheduling_policy)
        # adapters named by a Hub id, hf:// or s3:// path: pulled once (model_source)
        lora_request = [local_lora(r, self._lora_folders) for r in lora_request]
        # every prompt checked before any is queued: a bad one raises with nothing running
        prompt_ids = [engine.check_request(p, sp, lr) for p, sp, lr in zip(
            prompts, sampling_params, lora_request, strict=True)]
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        results: dict[str, RequestOutput] = {}
        progress = _Progress(use_tqdm, len(ids))
        # the first step is launched once the queue holds more than it can take, and the rest
        # are queued while it runs: the GPU does not wait for the whole batch's host set-up
        # (~0.1 ms a request of 128 tokens). Where no prompt hits the prefix cache, that step
        # takes the requests it would take from the whole queue (FCFS, stopped by its token
        # budget or max_num_seqs before the queue runs out). Priorities order the whole queue:
        # no early step then.
        sched = engine.scheduler
        tokens = seqs = 0
        started = any(priority)
        added = []
        try:
            for rid, prompt, params, ids_, lora, prio in zip(
                    ids, prompts, sampling_params, prompt_ids, lora_request, priority, strict=True):
                engine.add_request(rid, prompt, params, final_only=True, prompt_ids=ids_,
                                   lora_request=lora, priority=prio)
                added.append(rid)
                tokens += len(ids_)  # n > 1: the samples after the first find the prompt cached
                seqs += params.n
                if not started and (tokens > sched.max_num_batched_tokens
                                    or seqs >= sched.max_num_seqs):
                    started = True
                    for out in engine.step():
                        if out.finished:
                            results[out.request_id] = out
                            progress.done(out)
        except ValueError:
            engine.abort_request(added)
            progress.close()
            raise
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        progress.done(out)
        finally:
            progress.close()
        return [results[rid] for rid in ids]

    def beam_search(self, prompts: Prompt | dict | Sequence[Prompt | dict],
                    params: BeamSearchParams,
                    lora_request: LoRARequest | None = None,
                    use_tqdm: bool | Callable = False) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search (kvfleet_runtime/beam_search.py): each prompt's beam_width
        best beams, best first, each with its tokens and text (the prompt's included, as
        vLLM's). Prompts: text, token ids, or vLLM's {"prompt": ...} / {"prompt_token_ids":
        ...}; every prompt's beams run together each round. use_tqdm: a bar over the rounds."""
        engine = self.engine
        searches = []
        for prompt in _prompt_list(prompts):
            # (a prompt of max_tokens must fit: the last round's request ends there)
            ids = engine.check_request(prompt, SamplingParams(max_tokens=params.max_tokens),
                                       lora_request)
            searches.append(BeamSearch(ids, params, set(engine.eos_token_ids)))
        progress = _Progress(use_tqdm, params.max_tokens, desc="Beam search")
        while live := [s for s in searches if not s.done]:
            rows = [(s, ids) for s in live for ids in s.requests()]
            outs = self.generate([ids for _, ids in rows], [s.sampling_params for s, _ in rows],
                                 lora_request, use_tqdm=False)
            start = 0
            for s in live:
                count = len(s.beams)
                s.advance(outs[start:start + count])
                start += count
            if progress.bar is not None:
                progress.bar.update(1)
        progress.close()
        tokenizer = self.get_tokenizer()
        results = []
        for s in searches:
            best = s.best()
            for beam in best:
                beam.text = tokenizer.decode(beam.tokens)
            results.append(BeamSearchOutput(best))
        return results

    def embed(self, prompts: Prompt | Sequence[Prompt],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
              use_tqdm: bool | Callable = True) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (vLLM's LLM.embed): its last token's final hidden state,
        L2-normalised unless the model's pooling config or pooling_params say otherwise
        (kvfleet_runtime/pooling.py). The prompts run batched and prefix-cached as generate()'s."""
        prompts = _prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_params = [pooling_params] * len(prompts)
        if len(pooling_params) != len(prompts):
            raise ValueError(f"pooling_params has {len(pooling_params)} entries for "
                             f"{len(prompts)} prompts; give one or one per prompt")
        params = [embedding_sampling_params(pp or PoolingParams()) for pp in pooling_params]
        return [EmbeddingRequestOutput(out.request_id, EmbeddingOutput(out.embedding),
                                       out.prompt_token_ids, out.finished)
                for out in self.generate(prompts, params, lora_request, use_tqdm=use_tqdm)]

    def classify(self, prompts: Prompt | Sequence[Prompt],
                 lora_request: LoRARequest | None = None,
                 use_tqdm: bool | Callable = True) -> list[ClassificationRequestOutput]:
        """Each prompt's label probabilities (vLLM's LLM.classify) from a classifier: a
        sequence-classification checkpoint (its `score` head; labels by config id2label) or a
        config naming classifier_from_token; softmax over the labels, sigmoid for one."""
        params = embedding_sampling_params(PoolingParams(task="classify"))
        return [ClassificationRequestOutput(out.request_id, ClassificationOutput(out.embedding),
                                            out.prompt_token_ids, out.finished)
                for out in self.generate(prompts, params, lora_request, use_tqdm=use_tqdm)]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str],
              lora_request: LoRARequest | None = None, *,
              chat_template: str | None = None,
              use_tqdm: bool | Callable = True) -> list[ScoringRequestOutput]:
        """Each (data_1, data_2) pair's score (vLLM's LLM.score): one text against one or
        many, or two lists pair by pair. A cross-encoder (a sequence-classification checkpoint,
        or a config naming classifier_from_token, e.g. Qwen3-Reranker) runs each pair as one
        prompt and gives its last label's probability; any other model gives the cosine
        similarity of the two texts' embeddings (kvfleet_runtime/pooling.py). chat_template: a
        cross-encoder's score template over the roles query and document (pooling.pair_prompt;
        Qwen3-Reranker's instruction format), in place of the tokenizer's text pair."""
        pairs = score_pairs(data_1, data_2)
        tok = self.engine.tokenizer
        if self.engine.pooler.cross_encoder:
            params = embedding_sampling_params(PoolingParams(task="score"))
            outs = self.generate([pair_prompt(tok, a, b, score_template=chat_template)
                                  for a, b in pairs], params,
                                 lora_request, use_tqdm=use_tqdm)
            return [ScoringRequestOutput(out.request_id, ScoringOutput(out.embedding[-1]),
                                         out.prompt_token_ids, out.finished) for out in outs]
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        embedded = dict(zip(texts, self.embed(texts, lora_request=lora_request,
                                              use_tqdm=use_tqdm), strict=True))
        return [ScoringRequestOutput(
                    f"{embedded[a].request_id}-{embedded[b].request_id}",
                    ScoringOutput(cosine(embedded[a].outputs.embedding,
                                         embedded[b].outputs.embedding)),
                    embedded[a].prompt_token_ids + embedded[b].prompt_token_ids)
                for a, b in pairs]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None,
             add_generation_prompt: bool = True, *, chat_template: str | None = None,
             tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None,
             lora_request: LoRARequest | None = None,
             use_tqdm: bool | Callable = True) -> list[RequestOutput]:
        """Generate for one conversation or several, rendered by the model's chat template (or
        `chat_template`), with `tools` (OpenAI's function definitions) and
        `chat_template_kwargs` (e.g. {"enable_thinking": False}) passed to it, as vLLM's
        LLM.chat. The answers are the model's text: read tool calls or reasoning out of it
        with kvfleet_runtime.server.tools / .reasoning, as the server does."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           chat_template=chat_template, tools=tools,
                                           **(chat_template_kwargs or {}))
                   for c in conversations]
        # the template already carries BOS where the model wants it
        prompt_ids = [tok(p, add_special_tokens=False).input_ids for p in prompts]
        return self.generate(prompt_ids, sampling_params, lora_request, use_tqdm=use_tqdm)
