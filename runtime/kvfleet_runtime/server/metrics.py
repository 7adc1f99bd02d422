"""Prometheus metrics of one server: the names are a contract with the operator's HPA,
the dashboard and the alerts (see docs/SERVER.md). Every metric has the label model_name.

The engine's metrics are also exported under vLLM's names (VLLM_NAMES: `vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc`, `vllm:lora_requests_info`, ...), read at each scrape from the same
series, so that what reads a vLLM server's (the Gateway API Inference Extension's endpoint
picker, KEDA / HPA rules, Grafana dashboards, vLLM's production-stack router) reads ours.

EngineMetrics is the AsyncLLMEngine's StatLogger: the loop thread calls it after
every step with the engine's stats snapshot and the step's outputs, from which it
derives per-request TTFT, ITL, queue time and end-to-end latency.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Metric,
    PlatformCollector,
    ProcessCollector,
)

from kvfleet_runtime.outputs import EngineStats, RequestOutput

FINISHED_REASONS = ("stop", "length", "abort")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000,
                  50000, 100000)


# kvfleet family -> vLLM's names for it (two where vLLM renamed it and readers of both exist)
VLLM_NAMES = {
    "kvfleet_num_requests_running": ("vllm:num_requests_running",),
    "kvfleet_num_requests_waiting": ("vllm:num_requests_waiting",),
    "kvfleet_kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "kvfleet_prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "kvfleet_prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "kvfleet_num_preemptions": ("vllm:num_preemptions",),
    "kvfleet_prompt_tokens": ("vllm:prompt_tokens",),
    "kvfleet_generation_tokens": ("vllm:generation_tokens",),
    "kvfleet_request_success": ("vllm:request_success",),
    "kvfleet_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "kvfleet_inter_token_latency_seconds": ("vllm:inter_token_latency_seconds",
                                            "vllm:time_per_output_token_seconds"),
    "kvfleet_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "kvfleet_request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "kvfleet_request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "kvfleet_request_generation_tokens": ("vllm:request_generation_tokens",),
    "kvfleet_spec_decode_num_drafts": ("vllm:spec_decode_num_drafts",),
    "kvfleet_spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "kvfleet_spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
    "kvfleet_lora_requests_info": ("vllm:lora_requests_info",),
}


class _VLLMNames:
    """A collector of the engine's families again under VLLM_NAMES (same samples, renamed)."""

    def __init__(self, families: dict[str, object], registry: CollectorRegistry) -> None:
        self._families = families
        registry.register(self)

    def describe(self) -> list[Metric]:
        return []       # (nothing to check at registration: the names are ours to give)

    def collect(self) -> Iterable[Metric]:
        for name, family in self._families.items():
            for metric in family.collect():
                for alias in VLLM_NAMES[name]:
                    renamed = Metric(alias, metric.documentation, metric.type)
                    for s in metric.samples:
                        renamed.add_sample(alias + s.name[len(metric.name):], s.labels, s.value,
                                           s.timestamp, s.exemplar)
                    yield renamed


@dataclass
class _RequestTrack:
    arrival_time: float
    num_tokens: int = 0
    last_token_time: float | None = None


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry,
                 vllm_names: bool = True) -> None:
        """vllm_names: also export the families under VLLM_NAMES."""
        self.model_name = model_name
        label = ["model_name"]
        families: dict[str, object] = {}

        def keep(name: str, family):
            families[name] = family
            return family

        def gauge(name: str, doc: str) -> Gauge:
            return keep(name, Gauge(name, doc, label, registry=registry)).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return keep(name, Counter(name, doc, label, registry=registry)).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return keep(name, Histogram(name, doc, label, buckets=buckets,
                                        registry=registry)).labels(model_name)

        self.num_requests_running = gauge("kvfleet_num_requests_running",
                                          "Requests in the running batch.")
        self.num_requests_waiting = gauge("kvfleet_num_requests_waiting",
                                          "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("kvfleet_kv_cache_usage_perc",
                                    "Fraction of KV-cache blocks in use (0..1).")
        self.prefix_cache_queries = counter("kvfleet_prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("kvfleet_prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("kvfleet_num_preemptions", "Preemptions.")
        self.prompt_tokens = counter("kvfleet_prompt_tokens", "Prefilled prompt tokens.")
        # how busy the engine is: its steps, the time inside them, and the part of that time it
        # waited on the device (the rest is its host work: scheduling, inputs, detokenizing)
        self.engine_steps = counter("kvfleet_engine_steps", "Engine steps.")
        self.engine_step_seconds = counter("kvfleet_engine_step_seconds",
                                           "Time inside engine steps.")
        self.engine_device_wait_seconds = counter(
            "kvfleet_engine_device_wait_seconds",
            "Time inside engine steps spent waiting on the device (model and sampling).")
        self.generation_tokens = counter("kvfleet_generation_tokens", "Generated tokens.")
        # speculative decoding (--speculative-config; vLLM's spec_decode counters): steps a
        # request's drafts were checked in, the drafts checked, and the drafts kept
        self.spec_decode_num_drafts = counter("kvfleet_spec_decode_num_drafts",
                                              "Draft runs checked (a request in a step).")
        self.spec_decode_num_draft_tokens = counter("kvfleet_spec_decode_num_draft_tokens",
                                                    "Draft tokens checked.")
        self.spec_decode_num_accepted_tokens = counter("kvfleet_spec_decode_num_accepted_tokens",
                                                       "Draft tokens accepted.")
        success = keep("kvfleet_request_success", Counter(
            "kvfleet_request_success", "Finished requests by finish reason.",
            ["model_name", "finished_reason"], registry=registry))
        self.request_success = {r: success.labels(model_name, r) for r in FINISHED_REASONS}
        self.ttft = histogram("kvfleet_time_to_first_token_seconds",
                              "Time to first token.", _LATENCY_BUCKETS)
        self.itl = histogram("kvfleet_inter_token_latency_seconds",
                             "Time between two outputs of one request.", _LATENCY_BUCKETS)
        self.e2e = histogram("kvfleet_e2e_request_latency_seconds",
                             "Arrival to finish.", _LATENCY_BUCKETS)
        self.queue_time = histogram("kvfleet_request_queue_time_seconds",
                                    "Arrival to first scheduled.", _LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("kvfleet_request_prompt_tokens",
                                               "Prompt length of finished requests.",
                                               _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("kvfleet_request_generation_tokens",
                                                   "Generated tokens of finished requests.",
                                                   _TOKEN_BUCKETS)
        # LoRA (vLLM's lora_requests_info, which LoRA-aware routers read): one series whose
        # labels name the adapters of the running and the waiting requests, its value the time
        # they were seen; the previous label set is dropped when they change
        self.lora_info = keep("kvfleet_lora_requests_info", Gauge(
            "kvfleet_lora_requests_info", "Running stats on LoRA requests.",
            ["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=registry))
        if vllm_names:
            _VLLMNames({n: f for n, f in families.items() if n in VLLM_NAMES}, registry)
        self._lora_labels: tuple[str, ...] | None = None
        # the engine's counters are cumulative totals: remember the last to add deltas
        self._last_totals = EngineStats()
        self._tracks: dict[str, _RequestTrack] = {}

    # ---- StatLogger (loop thread) ----

    def record_step(self, stats: EngineStats, outputs: list[RequestOutput], now: float) -> None:
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        last = self._last_totals
        self.prefix_cache_queries.inc(max(0, stats.prefix_cache_queries_total
                                          - last.prefix_cache_queries_total))
        self.prefix_cache_hits.inc(max(0, stats.prefix_cache_hits_total
                                       - last.prefix_cache_hits_total))
        self.num_preemptions.inc(max(0, stats.num_preemptions_total - last.num_preemptions_total))
        for metric, key in ((self.engine_steps, "steps"), (self.engine_step_seconds, "step_s"),
                            (self.engine_device_wait_seconds, "forward_s"),
                            (self.spec_decode_num_drafts, "spec_drafts"),
                            (self.spec_decode_num_draft_tokens, "spec_draft_tokens"),
                            (self.spec_decode_num_accepted_tokens, "spec_accepted_tokens")):
            metric.inc(max(0.0, stats.extra.get(key, 0.0) - last.extra.get(key, 0.0)))
        self._last_totals = stats
        if stats.lora is not None:
            max_lora, running, waiting = stats.lora
            labels = (self.model_name, str(max_lora), running, waiting)
            if labels != self._lora_labels:
                if self._lora_labels is not None:
                    self.lora_info.remove(*self._lora_labels)
                self._lora_labels = labels
            self.lora_info.labels(*labels).set_to_current_time()
        for out in outputs:
            self._record_output(out, now)

    def record_aborted(self, request_ids: list[str], now: float) -> None:
        for rid in request_ids:
            track = self._tracks.pop(rid, None)
            self.request_success["abort"].inc()
            if track is not None:
                self.e2e.observe(now - track.arrival_time)

    def _record_output(self, out: RequestOutput, now: float) -> None:
        m = out.metrics
        if out.embedding is not None:   # an embedding (one output, at its end): a prompt, no
            self._record_embedding(out, now)     # generated tokens (its one step's is dropped)
            return
        track = self._tracks.get(out.request_id)
        if track is None:
            track = self._tracks[out.request_id] = _RequestTrack(
                arrival_time=m.arrival_time if m is not None else now)
        num_tokens = sum(len(c.token_ids) for c in out.outputs)
        new_tokens = num_tokens - track.num_tokens
        if new_tokens > 0:
            if track.last_token_time is None:
                first = m.first_token_time if m is not None and m.first_token_time else now
                self.ttft.observe(max(0.0, first - track.arrival_time))
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                if m is not None and m.first_scheduled_time is not None:
                    self.queue_time.observe(max(0.0, m.first_scheduled_time - track.arrival_time))
            else:
                self.itl.observe(now - track.last_token_time)
            self.generation_tokens.inc(new_tokens)
            track.num_tokens = num_tokens
            track.last_token_time = now
        if out.finished:
            del self._tracks[out.request_id]
            self.e2e.observe(now - track.arrival_time)
            self.request_prompt_tokens.observe(len(out.prompt_token_ids))
            self.request_generation_tokens.observe(num_tokens)
            # with n > 1 the request counts once, by its first sample's reason
            reason = out.outputs[0].finish_reason if out.outputs else "abort"
            self.request_success[reason if reason in FINISHED_REASONS else "stop"].inc()


    def _record_embedding(self, out: RequestOutput, now: float) -> None:
        self._tracks.pop(out.request_id, None)
        m = out.metrics
        arrival = m.arrival_time if m is not None else now
        if m is not None and m.first_scheduled_time is not None:
            self.queue_time.observe(max(0.0, m.first_scheduled_time - arrival))
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.e2e.observe(now - arrival)
        self.request_prompt_tokens.observe(len(out.prompt_token_ids))
        self.request_success["stop"].inc()


class _EngineProcessCollector(ProcessCollector):
    """kvfleet_engine_process_* (cpu_seconds_total, resident_memory_bytes, open_fds, ...):
    ProcessCollector's figures of the engine's child process, labelled with model_name as
    every kvfleet_ metric is; nothing once the process is gone."""

    def __init__(self, pid: Callable[[], int], model_name: str,
                 registry: CollectorRegistry) -> None:
        self._model_name = model_name     # before registering: registering collects once
        super().__init__(namespace="kvfleet_engine", pid=pid, registry=registry)

    def collect(self) -> Iterable[Metric]:
        for family in super().collect():
            labelled = Metric(family.name, family.documentation, family.type)
            for sample in family.samples:
                labelled.add_sample(sample.name, {**sample.labels, "model_name": self._model_name},
                                    sample.value)
            yield labelled


def add_process_metrics(registry: CollectorRegistry, model_name: str,
                        engine_pid: Callable[[], int] | None = None) -> None:
    """The standard process_* (this process: CPU seconds, memory, file descriptors), python_gc_*
    and python_info series a Prometheus client exports by default, and with an engine process
    (engine_pid) the same figures of it as kvfleet_engine_process_*: what the server's process
    and the engine's each spend of a CPU is `rate(process_cpu_seconds_total[1m])` and
    `rate(kvfleet_engine_process_cpu_seconds_total[1m])`."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    if engine_pid is not None:
        _EngineProcessCollector(engine_pid, model_name, registry)


class HTTPMetrics:
    """kvfleet_http_requests_total{method,route,status}: every HTTP answer, errors included."""

    def __init__(self, model_name: str, registry: CollectorRegistry) -> None:
        self._counter = Counter("kvfleet_http_requests", "HTTP answers.",
                                ["model_name", "method", "route", "status"], registry=registry)
        self.model_name = model_name

    def record(self, method: str, route: str, status: int) -> None:
        self._counter.labels(self.model_name, method, route, str(status)).inc()
