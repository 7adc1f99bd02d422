"""LLMService status: conditions and the endpoint, computed from the children's state.

Pure functions: the caller passes the live Deployment (or None) and the
previous conditions; a condition keeps its lastTransitionTime while its status
does not change, so an unchanged world yields an identical status and the
operator writes nothing.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

CONDITION_TYPES = ("Ready", "ModelReady", "Progressing", "Degraded")


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool
    reason: str
    message: str


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def render_conditions(conditions: Sequence[Condition], previous: Sequence[Mapping[str, Any]],
                      generation: int | None) -> list[dict[str, Any]]:
    """Conditions as the API stores them; lastTransitionTime moves only when status flips."""
    before = {c.get("type"): c for c in previous}
    rendered = []
    for cond in conditions:
        status = "True" if cond.status else "False"
        old = before.get(cond.type) or {}
        moved = old.get("status") != status or not old.get("lastTransitionTime")
        rendered.append({
            "type": cond.type,
            "status": status,
            "reason": cond.reason,
            "message": cond.message,
            "lastTransitionTime": _now() if moved else old["lastTransitionTime"],
            "observedGeneration": generation,
        })
    return rendered


def _deployment_condition(deployment: Mapping[str, Any], type_: str) -> Mapping[str, Any]:
    for cond in (deployment.get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return cond
    return {}


def conditions_from_deployment(deployment: Mapping[str, Any] | None,
                               desired_replicas: int) -> list[Condition]:
    """Ready, ModelReady, Progressing, Degraded as the Deployment's status shows them."""
    if deployment is None:
        return [
            Condition("Ready", False, "DeploymentMissing", "the Deployment does not exist yet"),
            Condition("ModelReady", False, "DeploymentMissing", "no pod has loaded the model"),
            Condition("Progressing", True, "Creating", "creating the children"),
            Condition("Degraded", False, "AsExpected", ""),
        ]
    status = deployment.get("status") or {}
    ready = int(status.get("readyReplicas") or 0)
    updated = int(status.get("updatedReplicas") or 0)
    total = int(status.get("replicas") or 0)
    available = _deployment_condition(deployment, "Available").get("status") == "True"
    progress = _deployment_condition(deployment, "Progressing")
    generation = (deployment.get("metadata") or {}).get("generation")
    seen = status.get("observedGeneration")
    rolled_out = (seen is not None and seen == generation and updated == total
                  and ready == total and total >= desired_replicas)

    if desired_replicas == 0:
        ready_cond = Condition("Ready", False, "ScaledToZero", "spec.replicas is 0")
    elif available and ready > 0:
        ready_cond = Condition("Ready", True, "Available", f"{ready} replica(s) serving")
    else:
        ready_cond = Condition("Ready", False, "Unavailable",
                               f"{ready} of {desired_replicas} replica(s) ready")
    model_cond = (Condition("ModelReady", True, "ModelLoaded", "a replica has loaded the model")
                  if ready > 0 else
                  Condition("ModelReady", False, "Loading",
                            "pulling or loading the model (no replica passes /health yet)"))
    progressing = (Condition("Progressing", False, "RolledOut", "all replicas run the current spec")
                   if rolled_out else
                   Condition("Progressing", True, "RollingUpdate",
                             f"{updated} of {total} replica(s) updated, {ready} ready"))
    if progress.get("reason") == "ProgressDeadlineExceeded":
        degraded = Condition("Degraded", True, "ProgressDeadlineExceeded",
                             progress.get("message") or "the rollout is stuck")
    else:
        degraded = Condition("Degraded", False, "AsExpected", "")
    return [ready_cond, model_cond, progressing, degraded]


def invalid_conditions(reason: str, message: str) -> list[Condition]:
    """The spec cannot be reconciled: Degraded with the reason, nothing else is true."""
    return [
        Condition("Ready", False, reason, message),
        Condition("ModelReady", False, reason, message),
        Condition("Progressing", False, reason, message),
        Condition("Degraded", True, reason, message),
    ]


def build_status(*, conditions: Sequence[Condition], previous: Mapping[str, Any] | None,
                 generation: int | None, url: str | None,
                 deployment: Mapping[str, Any] | None, selector: str | None,
                 adapters: Sequence[str] | None = None) -> dict[str, Any]:
    """The whole .status of an LLMService (as a merge patch: a key left out keeps its value).

    `adapters`: the adapter names the Deployment serves besides the model; an empty
    list removes status.adapters, None leaves it as it was (a spec that could not be
    reconciled leaves the children, and so what they serve, as they were).
    """
    previous = previous or {}
    dep_status = (deployment or {}).get("status") or {}
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "conditions": render_conditions(conditions, previous.get("conditions") or [], generation),
        "replicas": int(dep_status.get("replicas") or 0),
        "readyReplicas": int(dep_status.get("readyReplicas") or 0),
    }
    if url:
        status["url"] = url
    if selector:
        status["selector"] = selector
    if adapters is not None:
        status["adapters"] = list(adapters) or None
    return status


def status_changed(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """Whether writing `new` would change anything the user sees."""
    old = old or {}
    return any(old.get(key) != value for key, value in new.items())
