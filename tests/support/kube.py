"""A Kubernetes API server for operator tests: kmock's emulator, its gaps fixed, on real HTTP.

`KubeEmulator` subclasses `kmock.KubernetesEmulator` and keeps kmock's request
parsing and API discovery, but owns the object store so it behaves like an API
server where kopf and the kubernetes client depend on it (ENVIRONMENT.md lists
the gaps of kmock 0.8):

- create takes the namespace from the URL, honours `generateName`, assigns
  `uid`, `resourceVersion`, `creationTimestamp`, `generation`, answers 201;
- patches understand JSON patch (a failed `test` answers 422) and JSON merge
  patch (also used for strategic-merge and apply patches: lists are replaced);
  PUT replaces; `/status` and the main resource are separate (the main one
  ignores status, `/status` changes only status); a spec change bumps
  `metadata.generation`; a no-op write changes nothing and sends no event;
- list returns a real `resourceVersion`; watch replays only the events after
  the `resourceVersion` it was given (or the current objects as ADDED when
  none), so nothing is lost or repeated across reconnects; `labelSelector`
  with `k=v` terms is honoured on list and watch;
- discovery names the core group `v1` (not `/v1`) and gives subresources no
  short names, so kubectl can map kinds and the `llms` short name;
- a CRD's scale subresource serves and accepts an autoscaling/v1 Scale
  (`kubectl scale`), reading and writing the CRD's replicas paths;
- `/api/v1/namespaces` (which kmock's path parser fails on) lists and watches
  the namespaces that hold objects, plus `default`;
- the request log is trimmed, so requests stay fast in long tests.

Like kmock, it has no controllers: `collect_garbage()` does what the garbage
collector does with ownerReferences, and tests play the Deployment controller
by patching `/status` themselves.

`KubeCluster` runs the emulator on a free 127.0.0.1 port in a background
thread, writes a kubeconfig pointing at it, and offers small synchronous
helpers (over HTTP, like any client) for tests.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import json
import secrets
import threading
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import httpx
import kmock
import yaml
from kmock._internal import apps, k8s, rendering

ResourceKey = tuple[str, str, str]  # group, version, plural
ObjectKey = tuple[ResourceKey, str | None, str]  # resource, namespace, name
REQUEST_LOG_KEEP = 64


class UnprocessableError(kmock.KubernetesError):
    """HTTP 422: kopf reads it as "the JSON patch test failed, re-read and retry"."""


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: dicts merge recursively, None deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]


def json_patch(doc: Any, ops: Iterable[Mapping[str, Any]]) -> Any:
    """RFC 6902 add / remove / replace / test (what kopf and kubectl send)."""
    doc = copy.deepcopy(doc)
    for op in ops:
        *parents, last = _pointer(op["path"])
        node = doc
        try:
            for part in parents:
                node = node[int(part)] if isinstance(node, list) else node[part]
            if op["op"] == "test":
                current = node[int(last)] if isinstance(node, list) else node.get(last)
                if current != op.get("value"):
                    raise UnprocessableError(status=422, reason="Invalid",
                                             message=f"test failed at {op['path']}")
            elif op["op"] == "remove":
                del node[int(last) if isinstance(node, list) else last]
            elif op["op"] in ("add", "replace"):
                if isinstance(node, list):
                    index = len(node) if last == "-" else int(last)
                    if op["op"] == "add":
                        node.insert(index, op["value"])
                    else:
                        node[index] = op["value"]
                else:
                    node[last] = op["value"]
            else:
                raise UnprocessableError(status=422, reason="Invalid",
                                         message=f"unsupported op {op['op']!r}")
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise UnprocessableError(status=422, reason="Invalid",
                                     message=f"cannot apply {op}: {e!r}") from e
    return doc


def _matches_selector(obj: Mapping[str, Any], selector: str | None) -> bool:
    if not selector:
        return True
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in selector.split(","):
        key, sep, value = term.partition("=")
        if not sep:
            if key.strip() not in labels:
                return False
        elif labels.get(key.strip()) != value.strip():
            return False
    return True


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesEmulator):
    """kmock's emulator with a store that keeps API-server semantics (see the module docstring)."""

    store: dict[ObjectKey, dict[str, Any]] = attrs.field(factory=dict, init=False)
    # resource -> [(resourceVersion, watch event)], for replays after a given version
    history: dict[ResourceKey, list[tuple[int, dict[str, Any]]]] = attrs.field(factory=dict,
                                                                             init=False)
    last_rv: int = attrs.field(default=0, init=False)
    # resource -> the CRD's scale paths (specReplicasPath, statusReplicasPath, labelSelectorPath)
    scale_paths: dict[ResourceKey, dict[str, str]] = attrs.field(factory=dict, init=False)
    _changed: asyncio.Condition | None = attrs.field(default=None, init=False)

    @property
    def changed(self) -> asyncio.Condition:
        if self._changed is None:  # created lazily: it binds to the server's event loop
            self._changed = asyncio.Condition()
        return self._changed

    # ------------------------------------------------------------ routing

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # kmock's path parser reads /api/v1/namespaces as "namespace <missing>" and fails
        # with a 500; kopf lists and watches it when it serves specific namespaces.
        if raw_request.path.rstrip("/") == "/api/v1/namespaces" and raw_request.method == "GET":
            return await self._serve_namespaces(raw_request)
        return await super().__call__(raw_request)

    async def _serve_version(self, request: rendering.Request) -> rendering.Payload:
        # kmock names the core group "/v1" and gives subresources the short names
        # of their resource; kubectl then finds no "v1" Secret and warns on `llms`.
        payload = await super()._serve_version(request)
        if payload.get("groupVersion") == "/v1":
            payload["groupVersion"] = "v1"
        for entry in payload.get("resources", []):
            if "/" in entry["name"]:
                entry.update(shortNames=[], categories=[], verbs=["get", "patch", "update"])
        return payload

    def _namespaces(self) -> list[dict[str, Any]]:
        """Namespaces exist implicitly: 'default' and every namespace holding an object."""
        names = {"default"} | {ns for (_, ns, _) in self.store if ns}
        return [{"apiVersion": "v1", "kind": "Namespace",
                 "metadata": {"name": name, "uid": f"namespace-{name}", "resourceVersion": "1"}}
                for name in sorted(names)]

    async def _serve_namespaces(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        if raw.query.get("watch") != "true":
            return aiohttp.web.json_response({
                "apiVersion": "v1", "kind": "NamespaceList",
                "metadata": {"resourceVersion": str(self.last_rv)}, "items": self._namespaces()})
        response = aiohttp.web.StreamResponse()
        await response.prepare(raw)
        sent: set[str] = set()
        while True:
            for namespace in self._namespaces():
                if namespace["metadata"]["name"] not in sent:
                    sent.add(namespace["metadata"]["name"])
                    line = json.dumps({"type": "ADDED", "object": namespace}) + "\n"
                    await response.write(line.encode())
            async with self.changed:
                await self.changed.wait()

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        self._trim_request_log()
        resource = request.resource
        actions = {kmock.action.LIST, kmock.action.FETCH, kmock.action.CREATE,
                   kmock.action.UPDATE, kmock.action.DELETE}
        is_put = request.method == kmock.method.PUT and request.name is not None
        if resource is None or not resource.plural or not (request.action in actions or is_put):
            # Discovery and watches go through kmock's reactions (watch: _serve_watch below).
            return await apps.RawHandler._handle(self, request)
        info = self._info(resource)
        key: ObjectKey = (self._rkey(resource), request.namespace if info.namespaced else None,
                          request.name or "")
        if request.action == kmock.action.LIST:
            return aiohttp.web.json_response(self._list(request, info))
        if request.action == kmock.action.FETCH:
            obj = self._fetch(key)
            return aiohttp.web.json_response(
                self._scale(key, obj) if request.subresource == "scale" else obj)
        async with self.changed:
            if request.action == kmock.action.CREATE:
                body, code = await self._create(key, request.data or {}), 201
            elif request.action == kmock.action.DELETE:
                body, code = await self._delete(key), 200
            else:
                body, code = await self._update(key, request, info), 200
            self.changed.notify_all()
        return aiohttp.web.json_response(body, status=code)

    def _trim_request_log(self) -> None:
        # Each request re-scans the logs of the root and of every reaction.
        for holder in (self, *self._payloads):
            log = getattr(holder, "_requests", None)
            if isinstance(log, list) and len(log) > 2 * REQUEST_LOG_KEEP:
                del log[:-REQUEST_LOG_KEEP]

    @staticmethod
    def _rkey(resource: kmock.resource) -> ResourceKey:
        return (resource.group or "", resource.version or "", resource.plural or "")

    def _info(self, resource: kmock.resource) -> kmock.ResourceInfo:
        for known in self.resources:
            if self._rkey(known) == self._rkey(resource):
                return self.resources[known]
        raise k8s.KubernetesResourceNotFoundError()

    # ------------------------------------------------------------ reads

    def _fetch(self, key: ObjectKey) -> dict[str, Any]:
        obj = self.store.get(key)
        if obj is None:
            raise k8s.KubernetesObjectNotFoundError()
        return obj

    @staticmethod
    def _visible(obj: Mapping[str, Any], namespace: str | None, selector: str | None) -> bool:
        obj_ns = (obj.get("metadata") or {}).get("namespace")
        return (namespace is None or obj_ns == namespace) and _matches_selector(obj, selector)

    def _list(self, request: rendering.Request, info: kmock.ResourceInfo) -> dict[str, Any]:
        rkey = self._rkey(request.resource)
        selector = request.params.get("labelSelector")
        items = [obj for (rk, _, _), obj in self.store.items()
                 if rk == rkey and self._visible(obj, request.namespace, selector)]
        return {"apiVersion": "v1", "kind": f"{info.kind}List",
                "metadata": {"resourceVersion": str(self.last_rv)}, "items": items}

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[Any]:
        yield b""  # send the headers now: the client waits for them before reading events
        rkey = self._rkey(request.resource)
        selector = request.params.get("labelSelector")
        since = int(request.params.get("resourceVersion") or 0)
        events = self.history.setdefault(rkey, [])
        if since:
            position = next((i for i, (rv, _) in enumerate(events) if rv > since), len(events))
            initial: list[dict[str, Any]] = []
        else:  # no version: the current objects, as a real API server starts a watch
            position = len(events)
            initial = [{"type": "ADDED", "object": copy.deepcopy(obj)}
                       for (rk, _, _), obj in self.store.items() if rk == rkey]
        for event in initial:
            if self._visible(event["object"], request.namespace, selector):
                yield event
        while True:
            while position < len(events):
                _, event = events[position]
                position += 1
                if self._visible(event["object"], request.namespace, selector):
                    yield event
            async with self.changed:
                await self.changed.wait()

    # ------------------------------------------------------------ writes

    def _record(self, key: ObjectKey, event_type: str, obj: dict[str, Any]) -> None:
        self.history.setdefault(key[0], []).append(
            (self.last_rv, {"type": event_type, "object": copy.deepcopy(obj)}))

    def _next_rv(self) -> str:
        self.last_rv += 1
        return str(self.last_rv)

    async def _create(self, key: ObjectKey, data: Mapping[str, Any]) -> dict[str, Any]:
        rkey, namespace, _ = key
        obj = copy.deepcopy(dict(data))
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        if not meta.get("name"):
            raise kmock.KubernetesError(status=422, reason="Invalid",
                                        message="metadata.name or generateName is required")
        key = (rkey, namespace, meta["name"])
        if key in self.store:
            raise k8s.KubernetesObjectConflictError()
        if namespace is not None:
            meta["namespace"] = namespace
        if "status" in self._info(kmock.resource(*rkey)).subresources:
            obj.pop("status", None)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1,
                    resourceVersion=self._next_rv())
        self.store[key] = obj
        self._record(key, "ADDED", obj)
        return obj

    @staticmethod
    def _patched(old: dict[str, Any], request: rendering.Request) -> dict[str, Any]:
        """`old` with the request's PUT body, JSON patch, or merge patch applied."""
        data = request.data
        content_type = next((v for k, v in request.headers.items()
                             if k.lower() == "content-type"), "")
        if request.method == kmock.method.PUT:
            return copy.deepcopy(data)
        if "json-patch" in content_type or isinstance(data, list):
            return json_patch(old, data)
        wanted_rv = ((data or {}).get("metadata") or {}).get("resourceVersion")
        if wanted_rv and wanted_rv != old["metadata"]["resourceVersion"]:
            raise kmock.KubernetesError(status=409, reason="Conflict",
                                        message="the object has been modified")
        return merge_patch(old, data or {})

    async def _update(self, key: ObjectKey, request: rendering.Request,
                      info: kmock.ResourceInfo) -> dict[str, Any]:
        old = self.store.get(key)
        if old is None:
            raise k8s.KubernetesObjectNotFoundError()
        if request.subresource == "scale":
            return self._scale(key, self._commit(key, old, self._unscaled(
                key, old, self._patched(self._scale(key, old), request)), None, info))
        return self._commit(key, old, self._patched(old, request), request.subresource, info)

    def _commit(self, key: ObjectKey, old: dict[str, Any], patched: dict[str, Any],
                subresource: str | None, info: kmock.ResourceInfo) -> dict[str, Any]:
        new = copy.deepcopy(old)
        if subresource == "status":
            new["status"] = patched.get("status")
        else:
            new.update({k: v for k, v in patched.items() if k not in ("metadata", "status")})
            for k in [k for k in new if k not in patched and k not in ("metadata", "status")]:
                del new[k]
            if "status" not in info.subresources and "status" in patched:
                new["status"] = patched["status"]
            frozen = {k: old["metadata"][k] for k in
                      ("uid", "name", "namespace", "creationTimestamp", "generation",
                       "resourceVersion", "deletionTimestamp") if k in old["metadata"]}
            new["metadata"] = {**patched.get("metadata", {}), **frozen}
        if new == old:
            return old
        spec_changed = any(new.get(k) != old.get(k) for k in set(new) | set(old)
                           if k not in ("metadata", "status"))
        if spec_changed:
            new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
        new["metadata"]["resourceVersion"] = self._next_rv()
        self.store[key] = new
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            del self.store[key]
            self._record(key, "DELETED", new)
        else:
            self._record(key, "MODIFIED", new)
        return new

    # ------------------------------------------------------------ the scale subresource

    def _scale_paths(self, key: ObjectKey) -> dict[str, str]:
        paths = self.scale_paths.get(key[0])
        if paths is None:
            raise k8s.KubernetesNotFoundError(message=f"{key[0]} has no scale subresource here")
        return paths

    @staticmethod
    def _read_path(obj: Mapping[str, Any], path: str | None) -> Any:
        for part in (path or "").strip(".").split("."):
            if not isinstance(obj, Mapping) or not part:
                return None
            obj = obj.get(part)
        return obj

    def _scale(self, key: ObjectKey, obj: dict[str, Any]) -> dict[str, Any]:
        """The autoscaling/v1 Scale view of `obj` (what `kubectl scale` and the HPA read)."""
        paths = self._scale_paths(key)
        meta = obj["metadata"]
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion",
                                                  "creationTimestamp") if k in meta},
                "spec": {"replicas": self._read_path(obj, paths["specReplicasPath"]) or 0},
                "status": {"replicas": self._read_path(obj, paths["statusReplicasPath"]) or 0,
                           "selector": self._read_path(obj, paths.get("labelSelectorPath")) or ""}}

    def _unscaled(self, key: ObjectKey, obj: dict[str, Any],
                  scale: Mapping[str, Any]) -> dict[str, Any]:
        """`obj` with the replicas a patched Scale asks for written to its spec path."""
        *parents, leaf = self._scale_paths(key)["specReplicasPath"].strip(".").split(".")
        new = copy.deepcopy(obj)
        node = new
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = (scale.get("spec") or {}).get("replicas")
        return new

    async def _delete(self, key: ObjectKey) -> dict[str, Any]:
        obj = self.store.get(key)
        if obj is None:
            raise k8s.KubernetesObjectNotFoundError()
        meta = obj["metadata"]
        if meta.get("finalizers"):
            if not meta.get("deletionTimestamp"):
                meta["deletionTimestamp"] = _now()
                meta["resourceVersion"] = self._next_rv()
                self._record(key, "MODIFIED", obj)
            return obj
        del self.store[key]
        meta["resourceVersion"] = self._next_rv()
        self._record(key, "DELETED", obj)
        return obj

    async def collect_garbage(self) -> list[ObjectKey]:
        """Delete every object whose owners are all gone, until none is left; returns their keys."""
        collected: list[ObjectKey] = []
        async with self.changed:
            while True:
                uids = {obj["metadata"]["uid"] for obj in self.store.values()}
                orphans = [key for key, obj in self.store.items()
                           if (refs := obj["metadata"].get("ownerReferences"))
                           and not any(ref.get("uid") in uids for ref in refs)]
                if not orphans:
                    break
                for key in orphans:
                    await self._delete(key)
                    collected.append(key)
            self.changed.notify_all()
        return collected


def crd_resource_info(crd: Mapping[str, Any]) -> tuple[str, kmock.ResourceInfo]:
    """A CustomResourceDefinition -> the kmock key ('group/version/plural') and discovery info."""
    spec = crd["spec"]
    version = next(v for v in spec["versions"] if v.get("storage"))
    info = kmock.ResourceInfo(
        kind=spec["names"]["kind"], singular=spec["names"].get("singular"),
        namespaced=spec["scope"] == "Namespaced",
        verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
        shortnames=set(spec["names"].get("shortNames", [])),
        subresources=set(version.get("subresources", {})))
    return f"{spec['group']}/{version['name']}/{spec['names']['plural']}", info


class KubeCluster:
    """A KubeEmulator on a free loopback port in its own thread, with a kubeconfig and HTTP helpers."""

    def __init__(self, workdir: Path, crds: Iterable[Mapping[str, Any]] = ()) -> None:
        self.workdir = workdir
        self.emulator = KubeEmulator()
        with warnings.catch_warnings():  # kmock 0.8 reads its bundle with a deprecated call
            warnings.simplefilter("ignore", DeprecationWarning)
            self.emulator.resources.load_bundled()
        for crd in crds:
            key, info = crd_resource_info(crd)
            self.emulator.resources[key] = info
            version = next(v for v in crd["spec"]["versions"] if v.get("storage"))
            if "scale" in version.get("subresources", {}):
                group, api_version, plural = key.split("/")
                self.emulator.scale_paths[(group, api_version, plural)] = \
                    version["subresources"]["scale"]
        self.url = ""
        self.kubeconfig = workdir / "kubeconfig"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kube-emulator", daemon=True)
        self.http: httpx.Client | None = None

    def _serve(self) -> None:
        async def main() -> None:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            async with self.emulator, kmock.Server(self.emulator, host="127.0.0.1") as server:
                self.url = str(server.url).rstrip("/")
                self._ready.set()
                await self._stop.wait()
        asyncio.run(main())

    def __enter__(self) -> KubeCluster:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the Kubernetes emulator did not start within 10 s")
        self.kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "emulator-token"}}],
            "contexts": [{"name": "emulator",
                          "context": {"cluster": "emulator", "user": "tester"}}],
        }))
        self.http = httpx.Client(base_url=self.url, timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.http is not None:
            self.http.close()
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    # ------------------------------------------------------------ client helpers

    @staticmethod
    def path(api_version: str, plural: str, namespace: str | None, name: str | None = None,
             subresource: str | None = None) -> str:
        prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        path = f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"
        return "/".join(p for p in (path, name, subresource) if p)

    def _send(self, method: str, path: str, body: Any = None,
              content_type: str = "application/json") -> httpx.Response:
        assert self.http is not None, "use KubeCluster as a context manager"
        content = None if body is None else json.dumps(body)
        return self.http.request(method, path, content=content,
                                 headers={"Content-Type": content_type})

    def get(self, api_version: str, plural: str, namespace: str | None,
            name: str) -> dict[str, Any] | None:
        response = self._send("GET", self.path(api_version, plural, namespace, name))
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return response.json()

    def list(self, api_version: str, plural: str, namespace: str | None = None) -> list[dict]:
        response = self._send("GET", self.path(api_version, plural, namespace))
        response.raise_for_status()
        return response.json()["items"]

    def create(self, obj: Mapping[str, Any], plural: str) -> dict[str, Any]:
        namespace = (obj.get("metadata") or {}).get("namespace")
        response = self._send("POST", self.path(obj["apiVersion"], plural, namespace), obj)
        response.raise_for_status()
        return response.json()

    def patch(self, api_version: str, plural: str, namespace: str | None, name: str,
              body: Mapping[str, Any], subresource: str | None = None) -> dict[str, Any]:
        response = self._send("PATCH", self.path(api_version, plural, namespace, name, subresource),
                              body, "application/merge-patch+json")
        response.raise_for_status()
        return response.json()

    def delete(self, api_version: str, plural: str, namespace: str | None, name: str) -> None:
        self._send("DELETE", self.path(api_version, plural, namespace, name)).raise_for_status()

    def collect_garbage(self) -> list[ObjectKey]:
        assert self._loop is not None
        future = asyncio.run_coroutine_threadsafe(self.emulator.collect_garbage(), self._loop)
        return future.result(10)


def wait_for(condition: Callable[[], Any], timeout: float = 15, what: str = "condition") -> Any:
    """Poll `condition` until it returns something truthy; fail with `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
