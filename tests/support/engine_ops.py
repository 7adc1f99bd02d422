"""Engine drivers shared by tests: random add/abort/step sequences and the block-accounting check."""

from __future__ import annotations

from collections.abc import Callable

from kvfleet_runtime import SamplingParams
from kvfleet_runtime.engine.engine import LLMEngine
from kvfleet_runtime.outputs import RequestOutput


def all_blocks_free(engine: LLMEngine) -> bool:
    pool = engine.kv.block_pool
    return (not engine.kv.req_to_blocks and pool.get_num_free_blocks() == pool.num_usable_blocks
            and all(b.ref_cnt >= 0 for b in pool.blocks))


def _default_params(i: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=i, n=1 + i % 2)


def run_random_ops(engine: LLMEngine, ops: list[tuple[str, int, int]],
                   params_for: Callable[[int, int], SamplingParams] = _default_params,
                   priority_for: Callable[[int], int] | None = None
                   ) -> dict[str, RequestOutput]:
    """Drive `engine` through add/abort/step ops (op i adds with params_for(i, max_tokens), at
    priority_for(i) if given); no ref count < 0, every block free at the end. Returns the
    finished outputs by request id."""
    live: list[str] = []
    finished: dict[str, RequestOutput] = {}

    def step() -> None:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
                if out.request_id in live:
                    live.remove(out.request_id)
    for i, (op, length, max_tokens) in enumerate(ops):
        if op == "add":
            rid = f"prop-{i}-{engine.step_totals['steps']}"
            engine.add_request(rid, [(i * 7 + j) % 500 + 3 for j in range(length)],
                               params_for(i, max_tokens),
                               priority=0 if priority_for is None else priority_for(i))
            live.append(rid)
        elif op == "abort" and live:
            engine.abort_request(live.pop(length % len(live)))
        else:
            step()
        assert all(b.ref_cnt >= 0 for b in engine.kv.block_pool.blocks)
    while engine.has_unfinished_requests():
        step()
    assert all_blocks_free(engine)
    return finished
