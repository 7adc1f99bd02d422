"""`kvfleet bench serve`: load a running OpenAI-compatible server like vLLM's `bench serve`.

Sends `--num-prompts` streaming /v1/completions requests (token-id prompts, so
input lengths are exact; ignore_eos, so output lengths are too) arriving as a
Poisson process at `--request-rate` (inf: all at once), at most
`--max-concurrency` in flight, and reports request and token throughput and
TTFT / TPOT / ITL mean, median and p99. `--request-rate 1,4,inf` sweeps.
Datasets: `random` (fixed lengths), `sharegpt-like` (lengths spread like chat
logs around the given means), `shared-prefix` (one long system prompt, many short
questions), the last reporting the prefix-cache hit rate read from /metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from kvfleet_runtime.benchmarks.cli import random_prompts

DATASETS = ("random", "sharegpt-like", "shared-prefix")


@dataclass
class BenchRequest:
    prompt: list[int]
    output_len: int


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    accepted: float = 0.0                              # seconds to the response's headers
    ttft: float = 0.0                                  # seconds
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)     # seconds between content chunks
    error: str = ""


def add_serve_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser("serve", help="load a running server over HTTP (streaming)",
                                    description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the server, without /v1 (default: http://127.0.0.1:8000)")
    p.add_argument("--model", help="model name to send (default: the server's first)")
    p.add_argument("--api-key", default=os.environ.get("KVFLEET_API_KEY"),
                   help="Bearer key (default: $KVFLEET_API_KEY)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", default="inf",
                   help="requests/s of the Poisson arrivals; inf sends all at once; "
                        "a comma-separated list runs a sweep (default: inf)")
    p.add_argument("--max-concurrency", type=int, help="most requests in flight (default: no cap)")
    p.add_argument("--input-len", type=int, default=128,
                   help="prompt tokens (the mean for sharegpt-like; the question's for "
                        "shared-prefix) (default: 128)")
    p.add_argument("--output-len", type=int, default=128,
                   help="output tokens (the mean for sharegpt-like) (default: 128)")
    p.add_argument("--dataset", choices=DATASETS, default="random")
    p.add_argument("--prefix-len", type=int, default=512,
                   help="shared-prefix: tokens of the common system prompt (default: 512)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--warm-connections", action="store_true",
                   help="open the run's connections (one a request in flight at most) before "
                        "its clock starts, so it measures the server without the burst of new "
                        "connections (as behind a proxy that pools them); default: every request "
                        "on a new connection, as vLLM's bench serve")
    p.add_argument("--json", metavar="PATH", help="write the list of run results as JSON")
    p.add_argument("--plot", metavar="PNG", help="draw throughput and latencies of the runs")
    p.set_defaults(func=run_serve)


def parse_rates(text: str) -> list[float]:
    rates = []
    for part in text.split(","):
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"--request-rate must be numbers or inf, comma-separated; "
                             f"got {part!r}") from None
        if not rate > 0:
            raise ValueError(f"--request-rate must be > 0; got {part!r}")
        rates.append(rate)
    return rates


def make_requests(dataset: str, num: int, input_len: int, output_len: int, prefix_len: int,
                  seed: int) -> list[BenchRequest]:
    if dataset == "random":
        return [BenchRequest(p, output_len) for p in random_prompts(num, input_len, seed)]
    rng = random.Random(seed)
    if dataset == "sharegpt-like":
        # chat logs: long-tailed lengths; a lognormal with sigma 0.8 around the given means
        def draw(mean: int) -> int:
            return max(4, min(4 * mean, round(rng.lognormvariate(math.log(mean) - 0.32, 0.8))))
        return [BenchRequest(random_prompts(1, draw(input_len), rng.randrange(1 << 30))[0],
                             draw(output_len)) for _ in range(num)]
    if dataset == "shared-prefix":
        (prefix,) = random_prompts(1, prefix_len, seed)
        questions = random_prompts(num, input_len, seed + 1)
        return [BenchRequest(prefix + q, output_len) for q in questions]
    raise ValueError(f"--dataset must be one of {', '.join(DATASETS)}; got {dataset!r}")


async def _send(session, url: str, model: str, req: BenchRequest, headers: dict[str, str],
                timeout: float) -> RequestResult:
    import aiohttp
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0}
    result = RequestResult(ok=False)
    start = last = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            if r.status != 200:
                result.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return result
            # the server answers a stream's headers once it has taken the request in: how
            # long that took says how fast it admits a burst, apart from the engine's work
            result.accepted = time.perf_counter() - start
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[len("data: "):])
                if "error" in data:
                    result.error = data["error"]["message"]
                    return result
                now = time.perf_counter()
                if data.get("usage"):
                    result.prompt_tokens = data["usage"]["prompt_tokens"]
                    result.output_tokens = data["usage"]["completion_tokens"]
                if data["choices"] and data["choices"][0]["text"]:
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
            result.latency = time.perf_counter() - start
            result.ok = result.output_tokens > 0
            if not result.ok:
                result.error = "no tokens came back"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def _run(args: argparse.Namespace, model: str, requests: list[BenchRequest],
               rate: float) -> tuple[list[RequestResult], float]:
    import aiohttp
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.base_url.rstrip("/") + "/v1/completions"
    limit = asyncio.Semaphore(args.max_concurrency or len(requests))
    rng = random.Random(args.seed)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(req: BenchRequest) -> RequestResult:
            async with limit:
                return await _send(session, url, model, req, headers, args.timeout)

        if args.warm_connections:
            await _open_connections(session, args.base_url.rstrip("/") + "/health",
                                    min(len(requests), args.max_concurrency or len(requests)))
        start = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(one(req)))
            if not math.isinf(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


async def _open_connections(session, url: str, count: int) -> None:
    """`count` connections in the session's pool, each opened by a GET of url answered and
    read at once (the server keeps them alive for the run's requests)."""
    async def get() -> None:
        async with session.get(url) as r:
            await r.read()

    # all at once: a connection goes back to the pool when its answer is read, so requests
    # in turn would reuse one
    await asyncio.gather(*(get() for _ in range(count)))


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """Aggregates with the keys plot_serve reads (times in ms)."""
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    summary: dict[str, Any] = {
        "duration_s": duration, "completed": len(done), "failed": len(results) - len(done),
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
    }
    for name, values in (("accept", [r.accepted for r in done]),
                         ("ttft", [r.ttft for r in done]), ("tpot", tpots),
                         ("itl", [x for r in done for x in r.itl]),
                         ("e2el", [r.latency for r in done])):
        ms = sorted(1e3 * v for v in values) or [0.0]
        summary[f"{name}_ms_mean"] = statistics.fmean(ms)
        summary[f"{name}_ms_median"] = statistics.median(ms)
        summary[f"{name}_ms_p99"] = ms[min(len(ms) - 1, math.ceil(0.99 * len(ms)) - 1)]
    summary["accept_ms_max"] = 1e3 * max((r.accepted for r in done), default=0.0)
    errors = [r.error for r in results if not r.ok]
    if errors:
        summary["first_error"] = errors[0]
    return summary


def _get(base_url: str, path: str, api_key: str | None) -> str:
    import urllib.request
    req = urllib.request.Request(base_url.rstrip("/") + path, headers=(
        {"Authorization": f"Bearer {api_key}"} if api_key else {}))
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read().decode()


_TOTALS = ("kvfleet_prefix_cache_queries_total", "kvfleet_prefix_cache_hits_total",
           "kvfleet_engine_steps_total", "kvfleet_engine_step_seconds_total",
           "kvfleet_engine_device_wait_seconds_total")
# read where the server has them (not every server runs an engine process, or says this much)
_OPTIONAL = ("process_cpu_seconds_total", "kvfleet_engine_process_cpu_seconds_total",
             "kvfleet_time_to_first_token_seconds_sum", "kvfleet_time_to_first_token_seconds_count",
             "kvfleet_request_queue_time_seconds_sum", "kvfleet_request_queue_time_seconds_count")


def _server_totals(base_url: str) -> dict[str, float] | None:
    """The server's counters in _TOTALS (0 where absent) and in _OPTIONAL (where present),
    summed over models, from its /metrics; None where it cannot be read (another server, a
    proxy without it, a server going away): the run is reported without the figures read
    from them rather than lost."""
    from prometheus_client.parser import text_string_to_metric_families
    totals = dict.fromkeys(_TOTALS, 0.0)
    try:
        text = _get(base_url, "/metrics", None)
    except OSError as e:
        print(f"kvfleet bench serve: no prefix-cache hit rate or engine figures: cannot read "
              f"{base_url}/metrics ({e})", file=sys.stderr)
        return None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _TOTALS or sample.name in _OPTIONAL:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def server_figures(before: dict[str, float], after: dict[str, float], duration: float
                   ) -> dict[str, float]:
    """What the server's counters say about a run: its prefix-cache hit rate and, where the
    server counts engine steps, their number, mean length, the share of them the engine
    spent on host work (not waiting on the device) and the share of the run spent in them;
    where it exports them, the CPU its process and its engine process used (in cores: CPU
    seconds over the run's length) and its own TTFT and queue time (from its taking a
    request in to the first token / the first step: without the client's side and HTTP)."""
    d = {name: after[name] - before[name] for name in after if name in before}
    queries, hits = d["kvfleet_prefix_cache_queries_total"], d["kvfleet_prefix_cache_hits_total"]
    figures = {"prefix_cache_hit_rate": hits / queries if queries else 0.0}
    steps, step_s = d["kvfleet_engine_steps_total"], d["kvfleet_engine_step_seconds_total"]
    if steps > 0:
        figures.update(engine_steps=int(steps), engine_step_ms_mean=1e3 * step_s / steps,
                       engine_host_share=1.0 - d["kvfleet_engine_device_wait_seconds_total"]
                       / max(step_s, 1e-9),
                       engine_busy=step_s / duration if duration > 0 else 0.0)
    for key, name in (("server_cpu", "process_cpu_seconds_total"),
                      ("engine_process_cpu", "kvfleet_engine_process_cpu_seconds_total")):
        if name in d and duration > 0:
            figures[key] = d[name] / duration
    for key, name in (("server_ttft_ms_mean", "kvfleet_time_to_first_token_seconds"),
                      ("server_queue_ms_mean", "kvfleet_request_queue_time_seconds")):
        if d.get(name + "_count", 0) > 0:
            figures[key] = 1e3 * d[name + "_sum"] / d[name + "_count"]
    return figures


def _print(run: dict[str, Any]) -> None:
    print(f"---- request rate {run['request_rate']:g}, max concurrency "
          f"{run['max_concurrency'] or 'none'}, dataset {run['dataset']}"
          f"{', connections opened before' if run.get('warm_connections') else ''} ----")
    print(f"completed {run['completed']}/{run['num_prompts']} in {run['duration_s']:.2f} s; "
          f"{run['request_throughput']:.2f} req/s, {run['output_throughput']:.1f} output tok/s, "
          f"{run['total_token_throughput']:.1f} total tok/s")
    for name in ("ttft", "tpot", "itl", "e2el"):
        print(f"{name.upper():>5} ms: mean {run[f'{name}_ms_mean']:.2f}  median "
              f"{run[f'{name}_ms_median']:.2f}  p99 {run[f'{name}_ms_p99']:.2f}")
    print(f"headers ms: mean {run['accept_ms_mean']:.2f}  median {run['accept_ms_median']:.2f}  "
          f"p99 {run['accept_ms_p99']:.2f}  last {run['accept_ms_max']:.2f} (the server taking "
          f"the requests in)")
    if "server_ttft_ms_mean" in run:
        queue = run.get("server_queue_ms_mean")
        print(f"server's own TTFT ms: mean {run['server_ttft_ms_mean']:.2f}"
              + ("" if queue is None else f" (queued {queue:.2f} of it)"))
    cpu = [f"{label} {run[key]:.2f}" for label, key in (
        ("client", "client_cpu"), ("server", "server_cpu"), ("engine process", "engine_process_cpu"))
        if key in run]
    print(f"CPU (cores busy over the run): {', '.join(cpu)}")
    if "prefix_cache_hit_rate" in run:
        print(f"prefix cache hit rate: {run['prefix_cache_hit_rate']:.1%}")
    if "engine_steps" in run:
        print(f"engine: {run['engine_steps']} steps, {run['engine_step_ms_mean']:.2f} ms a step "
              f"(host work {run['engine_host_share']:.0%} of it), in steps "
              f"{run['engine_busy']:.0%} of the run")
    if "first_error" in run:
        print(f"first error: {run['first_error']}")
    sys.stdout.flush()


def run_serve(args: argparse.Namespace) -> int:
    try:
        rates = parse_rates(args.request_rate)
        for name in ("num_prompts", "input_len", "output_len", "prefix_len"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1; "
                                 f"got {getattr(args, name)}")
        if args.max_concurrency is not None and args.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1; got {args.max_concurrency}")
    except ValueError as e:
        print(f"kvfleet bench serve: error: {e}", file=sys.stderr)
        return 2
    try:
        model = args.model or json.loads(
            _get(args.base_url, "/v1/models", args.api_key))["data"][0]["id"]
    except OSError as e:
        print(f"kvfleet bench serve: error: cannot list models at {args.base_url}: {e}",
              file=sys.stderr)
        return 2
    requests = make_requests(args.dataset, args.num_prompts, args.input_len, args.output_len,
                             args.prefix_len, args.seed)
    runs = []
    for rate in rates:
        before = _server_totals(args.base_url)
        cpu_start = time.process_time()
        results, duration = asyncio.run(_run(args, model, requests, rate))
        client_cpu = (time.process_time() - cpu_start) / duration
        after = _server_totals(args.base_url)
        run = {"request_rate": rate, "max_concurrency": args.max_concurrency,
               "warm_connections": args.warm_connections, "dataset": args.dataset, "num_prompts": args.num_prompts,
               "input_len": args.input_len, "output_len": args.output_len, "model": model,
               **summarize(results, duration), "client_cpu": client_cpu}
        if before is not None and after is not None:
            run.update(server_figures(before, after, duration))
        runs.append(run)
        _print(run)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=2)
    if args.plot:
        from kvfleet_runtime.benchmarks.plot import plot_serve
        plot_serve(runs, args.plot)
    return 0 if all(r["failed"] == 0 for r in runs) else 1
