"""tests/support/kube.py: the emulator behaves like an API server where kopf depends on it."""

from __future__ import annotations

import json

import httpx
import pytest
from support.kube import KubeCluster

CM = ("v1", "configmaps")


def configmap(name: str, **data: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": "ns"}, "data": data}


def watch_events(cluster: KubeCluster, since: str | None, count: int) -> list[tuple[str, str]]:
    params = {"watch": "true", **({"resourceVersion": since} if since else {})}
    events = []
    with httpx.stream("GET", f"{cluster.url}/api/v1/namespaces/ns/configmaps", params=params,
                      timeout=5) as response:
        for line in response.iter_lines():
            if line.strip():
                event = json.loads(line)
                events.append((event["type"], event["object"]["metadata"]["name"]))
            if len(events) == count:
                break
    return events


def test_create_assigns_identity_and_namespace_and_generate_name(cluster):
    obj = cluster.create({"apiVersion": "v1", "kind": "ConfigMap",
                          "metadata": {"generateName": "ev-", "namespace": "ns"}}, "configmaps")
    meta = obj["metadata"]
    assert meta["name"].startswith("ev-") and len(meta["name"]) > 3
    assert meta["uid"] and meta["resourceVersion"] and meta["creationTimestamp"]
    assert meta["namespace"] == "ns"
    with pytest.raises(httpx.HTTPStatusError) as conflict:
        cluster.create(configmap(meta["name"]), "configmaps")
    assert conflict.value.response.status_code == 409


def test_watch_replays_only_what_changed_after_the_given_version(cluster):
    cluster.create(configmap("a"), "configmaps")
    listed = cluster.http.get("/api/v1/namespaces/ns/configmaps").json()
    version = listed["metadata"]["resourceVersion"]
    cluster.create(configmap("b"), "configmaps")
    cluster.patch(*CM, "ns", "a", {"data": {"k": "v"}})
    assert watch_events(cluster, version, 2) == [("ADDED", "b"), ("MODIFIED", "a")]
    assert sorted(watch_events(cluster, None, 2)) == [("ADDED", "a"), ("ADDED", "b")]


def test_json_patch_test_failure_is_422_and_noop_patch_keeps_the_version(cluster):
    obj = cluster.create(configmap("a", k="v"), "configmaps")
    bad = [{"op": "test", "path": "/metadata/resourceVersion", "value": "stale"},
           {"op": "replace", "path": "/data/k", "value": "w"}]
    response = cluster.http.patch("/api/v1/namespaces/ns/configmaps/a", content=json.dumps(bad),
                                  headers={"Content-Type": "application/json-patch+json"})
    assert response.status_code == 422
    same = cluster.patch(*CM, "ns", "a", {"data": {"k": "v"}})
    assert same["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"]


def test_status_is_a_separate_subresource_and_spec_changes_bump_generation(cluster):
    cluster.create({"apiVersion": "apps/v1", "kind": "Deployment",
                    "metadata": {"name": "d", "namespace": "ns"},
                    "spec": {"replicas": 1}, "status": {"replicas": 9}}, "deployments")
    d = cluster.get("apps/v1", "deployments", "ns", "d")
    assert "status" not in d and d["metadata"]["generation"] == 1
    d = cluster.patch("apps/v1", "deployments", "ns", "d", {"status": {"replicas": 5}})
    assert "status" not in d  # the main resource ignores status
    d = cluster.patch("apps/v1", "deployments", "ns", "d", {"status": {"replicas": 5}},
                      subresource="status")
    assert d["status"] == {"replicas": 5} and d["metadata"]["generation"] == 1
    d = cluster.patch("apps/v1", "deployments", "ns", "d", {"spec": {"replicas": 2}})
    assert d["metadata"]["generation"] == 2 and d["status"] == {"replicas": 5}


def test_garbage_collection_follows_owner_references_transitively(cluster):
    def ref(obj: dict) -> list[dict]:
        return [{"apiVersion": "v1", "kind": "ConfigMap", "name": obj["metadata"]["name"],
                 "uid": obj["metadata"]["uid"]}]

    owner = cluster.create(configmap("owner"), "configmaps")
    child = cluster.create({**configmap("child"), "metadata": {
        "name": "child", "namespace": "ns", "ownerReferences": ref(owner)}}, "configmaps")
    cluster.create({**configmap("grandchild"), "metadata": {
        "name": "grandchild", "namespace": "ns", "ownerReferences": ref(child)}}, "configmaps")
    assert cluster.collect_garbage() == []
    cluster.delete(*CM, "ns", "owner")
    assert [key[2] for key in cluster.collect_garbage()] == ["child", "grandchild"]
    assert cluster.list(*CM, "ns") == []
