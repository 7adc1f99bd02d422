"""Reconcile one LLMService: check, create-or-patch each child, adopt it, write the status.

Every call this operator makes to the API server goes through `KubeApi` below
(kopf's own calls are listed too). The Helm chart derives its RBAC from this list:

    kvfleet.io            llmservices                     get list watch patch   (kopf: watch, annotations)
    kvfleet.io            llmservices/status              get patch
    apps                  deployments                     get list watch create patch
    ""                    services                        get list watch create patch
    autoscaling           horizontalpodautoscalers        get list watch create patch delete
    policy                poddisruptionbudgets            get list watch create patch delete
    ""                    secrets                         get                    (checks referenced Secrets exist)
    ""                    events                          create                 (kopf.event)
    apiextensions.k8s.io  customresourcedefinitions       list watch             (kopf: resource discovery)
    ""                    namespaces                      list watch             (kopf, with --namespace too)

Children are removed by Kubernetes garbage collection through their
ownerReferences; the operator itself deletes only an HPA or a PDB the spec no
longer asks for. A patch is sent only when the live child differs from the
desired one, so a reconcile of an unchanged world writes nothing (which keeps
the child watchers from looping on their own writes).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf
import kubernetes.client
import kubernetes.config
from kubernetes.client.rest import ApiException

from kvfleet_operator import resources, status
from kvfleet_operator.spec import (
    API_GROUP,
    API_VERSION,
    KIND,
    LLMServiceSpec,
    SpecError,
    parse_spec,
)

MERGE_PATCH = "application/merge-patch+json"
LAST_APPLIED = f"{API_GROUP}/last-applied-configuration"


@dataclass(frozen=True)
class ApiKind:
    api_version: str
    plural: str

    def path(self, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
        prefix = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        path = f"{prefix}/namespaces/{namespace}/{self.plural}"
        if name:
            path += f"/{name}"
        if subresource:
            path += f"/{subresource}"
        return path


KINDS: dict[str, ApiKind] = {
    KIND: ApiKind(f"{API_GROUP}/{API_VERSION}", "llmservices"),
    "Deployment": ApiKind("apps/v1", "deployments"),
    "Service": ApiKind("v1", "services"),
    "HorizontalPodAutoscaler": ApiKind("autoscaling/v2", "horizontalpodautoscalers"),
    "PodDisruptionBudget": ApiKind("policy/v1", "poddisruptionbudgets"),
    "Secret": ApiKind("v1", "secrets"),
}


class MissingReference(Exception):
    """A Secret the spec names is absent (or lacks a key); the user may still create it."""


class KubeApi:
    """Plain-dict access to namespaced objects (the typed models of the client are not needed)."""

    def __init__(self, client: kubernetes.client.ApiClient | None = None) -> None:
        self.client = client or kubernetes.client.ApiClient()

    def _call(self, method: str, path: str, body: Any = None,
              content_type: str = "application/json") -> dict[str, Any]:
        return self.client.call_api(
            path, method,
            header_params={"Accept": "application/json", "Content-Type": content_type},
            body=body,
            response_types_map={200: "object", 201: "object", 202: "object"},
            auth_settings=["BearerToken"],
            _return_http_data_only=True,
        )

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", KINDS[kind].path(namespace, name))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def create(self, kind: str, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return self._call("POST", KINDS[kind].path(namespace), body)

    def patch(self, kind: str, namespace: str, name: str, body: Mapping[str, Any],
              subresource: str | None = None) -> dict[str, Any]:
        return self._call("PATCH", KINDS[kind].path(namespace, name, subresource), body,
                          MERGE_PATCH)

    def delete(self, kind: str, namespace: str, name: str) -> None:
        try:
            self._call("DELETE", KINDS[kind].path(namespace, name))
        except ApiException as e:
            if e.status != 404:
                raise


def login(**_: Any) -> kopf.ConnectionInfo:
    """Configure the kubernetes client (in-cluster, else $KUBECONFIG read now) and hand kopf the same."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
    config = kubernetes.client.Configuration.get_default_copy()
    header = (config.get_api_key_with_prefix("BearerToken")
              or config.get_api_key_with_prefix("authorization") or "")
    scheme, _, token = header.partition(" ") if " " in header else ("", "", header)
    return kopf.ConnectionInfo(
        server=config.host,
        ca_path=config.ssl_ca_cert,
        insecure=not config.verify_ssl,
        username=config.username or None,
        password=config.password or None,
        scheme=scheme or None,
        token=token or None,
        certificate_path=config.cert_file,
        private_key_path=config.key_file,
    )


# ---------------------------------------------------------------- children


def is_applied(patch: Any, live: Any) -> bool:
    """Whether `live` already holds everything the merge patch says (the server adds defaults)."""
    if isinstance(patch, Mapping):
        return isinstance(live, Mapping) and all(
            key not in live if value is None else key in live and is_applied(value, live[key])
            for key, value in patch.items())
    if isinstance(patch, list):
        return (isinstance(live, list) and len(patch) == len(live)
                and all(is_applied(p, v) for p, v in zip(patch, live, strict=True)))
    return patch == live


def removals(last: Any, desired: Any) -> Any:
    """`desired` plus a null for every map key the last apply set and `desired` no longer has.

    This is kubectl's client-side three-way merge: a removed nodeSelector entry
    or a dropped init container disappears, while fields the API server or
    other controllers added (never in our last apply) are left alone.
    """
    if not (isinstance(last, Mapping) and isinstance(desired, Mapping)):
        return desired
    patch = {key: removals(last.get(key), value) for key, value in desired.items()}
    patch.update({key: None for key in last if key not in desired})
    return patch


def forget(last: dict[str, Any], path: tuple[str, ...]) -> None:
    """Drop one field from a last-applied manifest, so the next apply never removes it."""
    *parents, leaf = path
    for key in parents:
        last = last.get(key)
        if not isinstance(last, dict):
            return
    last.pop(leaf, None)


def adopt(manifest: dict[str, Any], owner: Mapping[str, Any]) -> dict[str, Any]:
    kopf.append_owner_reference(manifest, owner=owner)
    return manifest


def apply_child(api: KubeApi, manifest: dict[str, Any]) -> dict[str, Any]:
    """Create the child, or patch it where it differs from `manifest`; returns the live object."""
    kind, meta = manifest["kind"], manifest["metadata"]
    # Remember what was applied, for the next apply's removals (as kubectl apply does).
    applied = json.dumps(manifest, sort_keys=True, separators=(",", ":"))
    manifest = copy.deepcopy(manifest)
    manifest["metadata"].setdefault("annotations", {})[LAST_APPLIED] = applied
    live = api.get(kind, meta["namespace"], meta["name"])
    if live is None:
        try:
            return api.create(kind, meta["namespace"], manifest)
        except ApiException as e:
            if e.status != 409:  # 409: created meanwhile (another reconcile); patch it below
                raise
            live = api.get(kind, meta["namespace"], meta["name"]) or {}
    last = ((live.get("metadata") or {}).get("annotations") or {}).get(LAST_APPLIED)
    previous = json.loads(last) if last else {}
    for path in resources.HANDED_OVER.get(kind, ()):
        forget(previous, path)
    patch = removals(previous, manifest)
    if is_applied(patch, live):
        return live
    return api.patch(kind, meta["namespace"], meta["name"], patch)


def remove_child(api: KubeApi, kind: str, namespace: str, name: str, owner_uid: str) -> None:
    """Delete a child the spec no longer asks for, but only one this LLMService owns."""
    live = api.get(kind, namespace, name)
    if live is None:
        return
    owners = (live.get("metadata") or {}).get("ownerReferences") or []
    if any(ref.get("uid") == owner_uid for ref in owners):
        api.delete(kind, namespace, name)


def check_references(api: KubeApi, spec: LLMServiceSpec) -> None:
    """Every Secret the pods read exists with its keys; else MissingReference names it."""
    for field, secret_name, keys in spec.secret_refs():
        secret = api.get("Secret", spec.namespace, secret_name)
        if secret is None:
            raise MissingReference(f"{field}: Secret {spec.namespace}/{secret_name} not found")
        present = set(secret.get("data") or {}) | set(secret.get("stringData") or {})
        missing = [key for key in keys if key not in present]
        if missing:
            raise MissingReference(f"{field}: Secret {spec.namespace}/{secret_name} lacks "
                                   f"key(s) {', '.join(missing)}")


# ---------------------------------------------------------------- one reconcile


def _write_status(api: KubeApi, body: Mapping[str, Any], new: dict[str, Any]) -> None:
    if status.status_changed(body.get("status"), new):
        meta = body["metadata"]
        try:
            api.patch(KIND, meta["namespace"], meta["name"], {"status": new}, subresource="status")
        except ApiException as e:
            if e.status != 404:  # 404: deleted meanwhile; its children go with it
                raise


def _fail(api: KubeApi, body: Mapping[str, Any], reason: str, message: str) -> None:
    """Degraded with a message and a Warning Event; no child is touched."""
    new = status.build_status(
        conditions=status.invalid_conditions(reason, message), previous=body.get("status"),
        generation=body["metadata"].get("generation"), url=None, deployment=None, selector=None)
    _write_status(api, body, new)
    kopf.event(dict(body), type="Warning", reason=reason, message=message)


def reconcile(body: Mapping[str, Any], api: KubeApi | None = None) -> None:
    """Bring the children of one LLMService in line with its spec, and write its status.

    Raises kopf.PermanentError for a spec that can never work and
    kopf.TemporaryError while a referenced Secret is missing; in both cases
    the status says Degraded and no child was created or changed.
    """
    api = api or KubeApi()
    try:
        spec = parse_spec(body)
        check_references(api, spec)
    except SpecError as e:
        _fail(api, body, "InvalidSpec", str(e))
        raise kopf.PermanentError(str(e)) from e
    except MissingReference as e:
        _fail(api, body, "MissingSecret", str(e))
        raise kopf.TemporaryError(str(e), delay=retry_delay()) from e

    owner_uid = body["metadata"]["uid"]
    deployment: dict[str, Any] | None = None
    for kind, manifest in resources.build_children(spec).items():
        if manifest is None:
            remove_child(api, kind, spec.namespace, spec.name, owner_uid)
            continue
        live = apply_child(api, adopt(manifest, body))
        if kind == "Deployment":
            deployment = live

    selector = ",".join(f"{k}={v}" for k, v in resources.selector_labels(spec).items())
    new = status.build_status(
        conditions=status.conditions_from_deployment(deployment, spec.min_replicas),
        previous=body.get("status"), generation=body["metadata"].get("generation"),
        url=resources.service_url(spec), deployment=deployment, selector=selector,
        adapters=[a.name for a in spec.adapters])
    _write_status(api, body, new)


def reconcile_owner(child: Mapping[str, Any]) -> None:
    """A child changed (or vanished): reconcile its LLMService, unless that is gone or going."""
    meta = child.get("metadata") or {}
    owner_name = (meta.get("labels") or {}).get(resources.LABEL_OWNER)
    if not owner_name:
        return
    api = KubeApi()
    owner = api.get(KIND, meta["namespace"], owner_name)
    if owner is None or owner["metadata"].get("deletionTimestamp"):
        return
    try:
        reconcile(owner, api)
    except (kopf.PermanentError, kopf.TemporaryError):
        pass  # already reported on the owner's status; its own handler retries


def retry_delay() -> float:
    """Seconds before a reconcile blocked by a missing Secret is retried."""
    return float(os.environ.get("KVFLEET_OPERATOR_RETRY_DELAY", "30"))
