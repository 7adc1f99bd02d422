"""status.py: conditions and the endpoint computed from the Deployment's state."""

from __future__ import annotations

from kvfleet_operator.status import (
    CONDITION_TYPES,
    Condition,
    build_status,
    conditions_from_deployment,
    invalid_conditions,
    render_conditions,
    status_changed,
)


def deployment(ready: int, total: int, updated: int | None = None, generation: int = 1,
               observed: int = 1, available: bool = True, stuck: bool = False) -> dict:
    progressing = ({"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
                    "message": "ReplicaSet has timed out progressing."} if stuck else
                   {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"})
    return {"metadata": {"generation": generation},
            "status": {"observedGeneration": observed, "replicas": total, "readyReplicas": ready,
                       "updatedReplicas": total if updated is None else updated,
                       "conditions": [{"type": "Available", "status": str(available)},
                                      progressing]}}


def by_type(conditions: list[Condition]) -> dict[str, Condition]:
    return {c.type: c for c in conditions}


def test_available_rolled_out_deployment_is_ready():
    conds = by_type(conditions_from_deployment(deployment(ready=2, total=2), desired_replicas=2))
    assert conds["Ready"].status and conds["ModelReady"].status
    assert not conds["Progressing"].status and not conds["Degraded"].status


def test_rollout_in_progress_is_progressing_and_still_ready_while_old_pods_serve():
    conds = by_type(conditions_from_deployment(
        deployment(ready=2, total=3, updated=1, generation=2, observed=2), desired_replicas=2))
    assert conds["Progressing"].status and conds["Progressing"].reason == "RollingUpdate"
    assert conds["Ready"].status


def test_loading_model_is_not_ready():
    conds = by_type(conditions_from_deployment(deployment(ready=0, total=1, available=False), 1))
    assert not conds["Ready"].status and conds["ModelReady"].reason == "Loading"


def test_stuck_rollout_is_degraded_and_zero_replicas_are_not_ready():
    conds = by_type(conditions_from_deployment(deployment(ready=1, total=2, stuck=True), 2))
    assert conds["Degraded"].status and conds["Degraded"].reason == "ProgressDeadlineExceeded"
    assert by_type(conditions_from_deployment(deployment(0, 0), 0))["Ready"].reason == "ScaledToZero"
    assert not by_type(conditions_from_deployment(None, 1))["Ready"].status


def test_transition_time_moves_only_when_the_status_flips():
    before = [{"type": "Ready", "status": "False", "lastTransitionTime": "2020-01-01T00:00:00Z"}]
    same = render_conditions([Condition("Ready", False, "Unavailable", "")], before, 3)
    assert same[0]["lastTransitionTime"] == "2020-01-01T00:00:00Z"
    assert same[0]["observedGeneration"] == 3
    flipped = render_conditions([Condition("Ready", True, "Available", "")], before, 3)
    assert flipped[0]["lastTransitionTime"] != "2020-01-01T00:00:00Z"


def test_status_carries_url_counts_and_generation_and_is_stable():
    dep = deployment(ready=1, total=2)
    args = dict(conditions=conditions_from_deployment(dep, 2), generation=4,
                url="http://x.y.svc.cluster.local/v1", deployment=dep, selector="a=b")
    first = build_status(previous=None, **args)
    assert (first["replicas"], first["readyReplicas"], first["observedGeneration"]) == (2, 1, 4)
    assert first["url"] == "http://x.y.svc.cluster.local/v1" and first["selector"] == "a=b"
    again = build_status(previous=first, **args)
    assert not status_changed(first, again)  # nothing moved: nothing to write


def test_invalid_spec_is_degraded_only():
    conds = by_type(invalid_conditions("InvalidSpec", "spec.quantization must be one of ..."))
    assert conds["Degraded"].status and conds["Degraded"].reason == "InvalidSpec"
    assert not any(c.status for t, c in conds.items() if t != "Degraded")


def test_every_outcome_reports_the_same_four_conditions():
    for conditions in (conditions_from_deployment(None, 1), conditions_from_deployment(
            deployment(1, 1), 1), invalid_conditions("InvalidSpec", "x")):
        assert tuple(c.type for c in conditions) == CONDITION_TYPES


def test_status_lists_the_served_adapters_and_drops_them_with_the_adapters():
    dep = deployment(ready=1, total=1)
    args = dict(conditions=conditions_from_deployment(dep, 1), generation=2,
                url="http://x.y.svc.cluster.local/v1", deployment=dep, selector="a=b")
    served = build_status(previous=None, adapters=["sql", "chat-de"], **args)
    assert served["adapters"] == ["sql", "chat-de"]
    assert not status_changed(served, build_status(previous=served, adapters=["sql", "chat-de"], **args))
    # none left: a null in the merge patch removes status.adapters
    dropped = build_status(previous=served, adapters=[], **args)
    assert dropped["adapters"] is None and status_changed(served, dropped)
    # never had any: nothing to write
    assert not status_changed({k: v for k, v in dropped.items() if k != "adapters"}, dropped)
    # a spec that could not be reconciled leaves the field as it was
    assert "adapters" not in build_status(previous=served, **args)
