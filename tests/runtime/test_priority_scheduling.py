"""vLLM's priority scheduling policy (`--scheduling-policy priority`): waiting requests admitted
by (priority, arrival), lower first; when KV blocks run out the running request latest in that
order is preempted, even one scheduled earlier in the same step; under fcfs a priority other
than 0 is refused."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvfleet_runtime import LLM, SamplingParams
from kvfleet_runtime.config import EngineConfig
from kvfleet_runtime.engine.scheduler import PriorityQueue, Scheduler
from kvfleet_runtime.request import Request
from support.engine_ops import all_blocks_free, run_random_ops

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir):
    return tiny_model_dir("llama3")


def _finish_order(engine) -> list[str]:
    order = []
    while engine.has_unfinished_requests():
        order += [out.request_id for out in engine.step() if out.finished]
    assert all_blocks_free(engine)
    return order


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_waiting_requests_run_by_priority_then_arrival(llama_dir, async_scheduling):
    llm = LLM(model=llama_dir, max_num_seqs=1, num_gpu_blocks=32, scheduling_policy="priority",
              async_scheduling=async_scheduling)
    engine = llm.engine
    for i, (rid, priority) in enumerate([("a", 5), ("b", 0), ("c", 5), ("d", -1), ("e", 0)]):
        engine.add_request(rid, [10 + i, 11, 12], GREEDY, priority=priority)
    assert _finish_order(engine) == ["d", "b", "e", "a", "c"]
    # one that arrives while another runs waits for it, then goes ahead of earlier arrivals
    engine.add_request("late-1", [20, 21], GREEDY, priority=3)
    engine.add_request("late-2", [22, 23], GREEDY, priority=3)
    engine.step()
    engine.add_request("urgent", [24, 25], GREEDY, priority=1)
    assert _finish_order(engine) == ["late-1", "urgent", "late-2"]


def test_fcfs_runs_in_arrival_order(llama_dir):
    engine = LLM(model=llama_dir, max_num_seqs=1, num_gpu_blocks=32).engine
    for i, rid in enumerate("abcde"):
        engine.add_request(rid, [10 + i, 11, 12], GREEDY)
    assert _finish_order(engine) == list("abcde")


def _prompt(seed: int) -> list[int]:
    return [(seed * 37 + 11 * j) % 400 + 5 for j in range(30)]


@pytest.mark.parametrize("policy, first_victim", [("priority", "x"), ("fcfs", "w")])
def test_running_out_of_blocks_preempts_the_lowest_priority(llama_dir, policy, first_victim):
    # 10 usable blocks of 16 tokens; x, y, z, w hold 2 each (30-token prompts), then each
    # grows into a 3rd: x (admitted a step before the others, so scheduled first in each step)
    # takes the 9th, y the 10th, and z finds none. Under priority x (priority 10) gives z its
    # blocks and the token it was scheduled for earlier in that step, and w still runs in that
    # step; under fcfs w, the latest admitted, gives z its blocks.
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    llm = LLM(model=llama_dir, max_num_seqs=4, num_gpu_blocks=11, block_size=16,
              enable_prefix_caching=False, scheduling_policy=policy)
    engine, sched = llm.engine, llm.engine.scheduler
    victims = []
    preempt, schedule = sched._preempt, sched.schedule
    sched._preempt = lambda r: (victims.append(r.request_id), preempt(r))

    def checked_schedule():
        out = schedule()
        if policy == "priority" and all(v.request_id == "x" for v in out.preempted):
            # nobody else preempted: every running request has its token this step
            assert ({s.request.request_id for s in out.scheduled}
                    == {r.request_id for r in sched.running})
            assert out.num_batched_tokens <= sched.max_num_batched_tokens
        return out
    sched.schedule = checked_schedule
    outs = {}

    def step():
        outs.update({o.request_id: o for o in engine.step() if o.finished})

    engine.add_request("x", _prompt(1), params, priority=10 if policy == "priority" else 0)
    step()
    for i, rid in enumerate("yzw"):
        engine.add_request(rid, _prompt(2 + i), params)
    while engine.has_unfinished_requests():
        step()
    assert victims[0] == first_victim
    assert all_blocks_free(engine)
    roomy = LLM(model=llama_dir, num_gpu_blocks=64, enable_prefix_caching=False)
    ref = roomy.generate([_prompt(i) for i in range(1, 5)], params)
    assert [outs[r].outputs[0].token_ids for r in "xyzw"] == [o.outputs[0].token_ids for o in ref]


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "abort", "step", "step", "step"]),
                              st.integers(1, 60), st.integers(1, 12)), min_size=5, max_size=40),
       priorities=st.lists(st.integers(-3, 3), min_size=40, max_size=40))
def test_random_add_abort_step_with_priorities_keeps_outputs_and_blocks(llama_dir, ops, priorities):
    # a small cache: preemptions of any request by any other; greedy outputs are those of the
    # same prompts run alone in a roomy engine, whatever was preempted and recomputed
    engine = _small_priority_engine(llama_dir)
    finished = run_random_ops(engine, ops, lambda i, m: SamplingParams(
        temperature=0.0, max_tokens=m, ignore_eos=True), priority_for=priorities.__getitem__)
    done = {rid: o for rid, o in finished.items() if o.outputs[0].finish_reason == "length"}
    for rid, out in done.items():
        ref = _reference(llama_dir, tuple(out.prompt_token_ids), len(out.outputs[0].token_ids))
        assert out.outputs[0].token_ids == ref, rid


_ENGINES: dict = {}


def _small_priority_engine(path):
    if "small" not in _ENGINES:
        _ENGINES["small"] = LLM(model=path, max_num_seqs=6, num_gpu_blocks=10, block_size=8,
                                scheduling_policy="priority").engine
    return _ENGINES["small"]


def _reference(path, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    key = (prompt, max_tokens)
    if key not in _ENGINES:
        if "roomy" not in _ENGINES:
            _ENGINES["roomy"] = LLM(model=path, num_gpu_blocks=64)
        _ENGINES[key] = _ENGINES["roomy"].generate(
            [list(prompt)], SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                           ignore_eos=True))[0].outputs[0].token_ids
    return _ENGINES[key]


def test_fcfs_refuses_a_priority_and_queues_nothing(llama_dir):
    llm = LLM(model=llama_dir, num_gpu_blocks=16)
    with pytest.raises(ValueError, match="got priority 2 but priority scheduling is not "
                                         "enabled: start the engine with --scheduling-policy"):
        llm.engine.add_request("r", [1, 2, 3], GREEDY, priority=2)
    with pytest.raises(ValueError, match="got priority -1"):
        llm.generate([[1, 2], [3, 4]], GREEDY, priority=[0, -1])
    assert not llm.engine.has_unfinished_requests() and all_blocks_free(llm.engine)
    assert llm.generate([[1, 2]], GREEDY, priority=[0])[0].outputs[0].token_ids


def test_generate_takes_one_priority_per_prompt(llama_dir):
    llm = LLM(model=llama_dir, max_num_seqs=1, num_gpu_blocks=32, scheduling_policy="priority")
    prompts = [[30 + i, 31, 32] for i in range(4)]
    with pytest.raises(ValueError, match="priority has 3 entries for 4 prompts"):
        llm.generate(prompts, GREEDY, priority=[0, 1, 2])
    with pytest.raises(TypeError, match="priority must be an integer; got 'high'"):
        llm.generate(prompts, GREEDY, priority=[0, 1, 2, "high"])
    outs = llm.generate(prompts, GREEDY, priority=[2, 0, 3, 1])
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs),
                                                  key=lambda r: int(r.split("-")[1]))
    started = [o.metrics.first_scheduled_time for o in outs]
    assert sorted(range(4), key=started.__getitem__) == [1, 3, 0, 2]
    alone = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == alone


def test_a_bad_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority; "
                                         "got 'lifo'"):
        EngineConfig(model="x", scheduling_policy="lifo")


def test_priority_queue_orders_by_priority_then_arrival_and_removes_any():
    params = SamplingParams(max_tokens=1)
    reqs = [Request(f"r{i}", [1], params, arrival_time=t, priority=p)
            for i, (p, t) in enumerate([(1, 5.0), (0, 9.0), (1, 2.0), (0, 9.0), (-2, 7.0)])]
    queue = PriorityQueue()
    for r in reqs:
        queue.append(r)
    assert sorted(r.request_id for r in queue) == ["r0", "r1", "r2", "r3", "r4"]
    queue.remove(reqs[3])
    queue.append(reqs[3])  # back in its place by arrival, not last
    queue.remove(reqs[1])
    assert queue[0] is reqs[4] and len(queue) == 4
    assert [queue.popleft().request_id for _ in range(4)] == ["r4", "r3", "r2", "r0"]
    assert not queue
    with pytest.raises(ValueError):
        queue.remove(reqs[0])


def test_an_unknown_policy_is_refused_by_the_scheduler():
    with pytest.raises(ValueError, match="scheduling policy must be one of fcfs, priority"):
        Scheduler(None, 1, 1, policy="sjf")
