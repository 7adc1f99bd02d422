"""kopf registrations (and the `kvfleet-operator` entry point); the work lives in apply.py.

Handlers are plain functions: kopf runs them in its thread pool, where the
synchronous kubernetes client is at home.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

import kopf
import kopf.cli

from kvfleet_operator import apply
from kvfleet_operator.resources import LABEL_MANAGED_BY, OPERATOR_NAME
from kvfleet_operator.spec import API_GROUP, API_VERSION, PLURAL

CHILD_RESOURCES = (
    ("apps", "v1", "deployments"),
    ("", "v1", "services"),
    ("autoscaling", "v2", "horizontalpodautoscalers"),
    ("policy", "v1", "poddisruptionbudgets"),
)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Keep kopf's bookkeeping in kvfleet.io annotations: the CRD's status schema is ours.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=API_GROUP, key="last-handled-configuration")
    # Only warnings become Kubernetes Events; info logs would flood `kubectl describe`.
    settings.posting.level = logging.WARNING


kopf.on.login()(apply.login)


@kopf.on.resume(API_GROUP, API_VERSION, PLURAL)
@kopf.on.create(API_GROUP, API_VERSION, PLURAL)
@kopf.on.update(API_GROUP, API_VERSION, PLURAL)
def reconcile_llmservice(body: kopf.Body, **_: Any) -> None:
    apply.reconcile(body)


def _child_changed(body: kopf.Body, **_: Any) -> None:
    apply.reconcile_owner(body)


# Drift repair and status: any change to a child (including its deletion or
# the Deployment's rollout progress) reconciles the owning LLMService. (No
# kopf timer for a periodic resync: timers make kopf put a finalizer on every
# LLMService, and deletion must not depend on the operator running.)
for _group, _version, _plural in CHILD_RESOURCES:
    kopf.on.event(_group, _version, _plural,
                  labels={LABEL_MANAGED_BY: OPERATOR_NAME})(_child_changed)


def kopf_args(argv: list[str] | None = None) -> list[str]:
    """`kvfleet-operator` arguments -> the `kopf run` command line for this module."""
    parser = argparse.ArgumentParser(prog="kvfleet-operator", description=__doc__.splitlines()[0])
    parser.add_argument("--namespace", "-n", action="append", default=[],
                        help="watch only this namespace (repeatable); default: all namespaces")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz",
                        help="liveness endpoint served by kopf (default: %(default)s)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    # --standalone: one replica, no peering objects (the chart runs a single replica).
    command = ["run", "--standalone", "-m", __name__, "--liveness", args.liveness]
    command += [arg for ns in args.namespace for arg in ("--namespace", ns)] or ["--all-namespaces"]
    return command + (["--verbose"] if args.verbose else [])


def run(argv: list[str] | None = None) -> int:
    """The `kvfleet-operator` console script: kopf on this module until stopped."""
    return kopf.cli.main(args=kopf_args(argv), prog_name="kvfleet-operator",
                         standalone_mode=False) or 0


if __name__ == "__main__":
    sys.exit(run())
