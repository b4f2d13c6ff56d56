"""A stricter Kubernetes API emulator for operator tests, on top of kmock's ``KubernetesEmulator``.

kmock serves discovery and the HTTP plumbing; it keeps no ``resourceVersion``, ``uid`` or
``generation``, merges status into spec, ignores label selectors, PUT, server-side apply and
subresources. This subclass does those the way an API server does, simply:

* every write stamps an increasing ``metadata.resourceVersion`` (a no-op write changes nothing
  and emits no event), ``uid`` and ``creationTimestamp`` on create, and bumps
  ``metadata.generation`` when ``spec`` changes;
* status lives apart: writes to the main resource ignore ``status`` of kinds with a status
  subresource, writes to ``/status`` change only ``status``;
* ``/scale`` of Deployments and of kinds declared with a scale subresource (GET and PATCH);
* PATCH as JSON merge / strategic merge (treated as merge) / JSON patch / server-side apply
  (creates a missing object, merges the applied fields, records the field manager);
* PUT with optimistic concurrency (a stale ``resourceVersion`` gets 409); a JSON patch whose
  ``test`` op fails gets 422, as Kopf's optimistic lock expects;
* DELETE honours finalizers (``deletionTimestamp``, then gone once they are removed);
  pods are deleted at once (no kubelet here) unless ``graceful_pods`` is set (a node agent,
  ``tests.operator.kubelet``, runs them): a pod bound to a node and not terminated is then
  only marked (``deletionTimestamp``, ``deletionGracePeriodSeconds`` from ``gracePeriodSeconds``
  or its ``terminationGracePeriodSeconds``), and goes when deleted again with grace 0 (the agent,
  once its process ended) -- or at once when asked with grace 0 in the first place;
* the namespace comes from the URL; ``generateName`` gets a suffix; list and watch honour
  ``labelSelector`` (equality terms) and watch replays events after ``resourceVersion``.

``calls`` records every request as ``(verb, group, resource[/subresource], namespace, bearer token)``: the RBAC
test derives the operator's permissions from it. The server runs on its own event loop in a
thread (``EmulatorThread``) so sync clients in the test can never deadlock it.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import threading
import uuid
from datetime import UTC, datetime
from typing import Any

import aiohttp.web
import jsonpatch
import kmock

Key = tuple[str, str, str, str | None, str]  # group, version, plural, namespace, name

STATUS_KINDS = {"pods", "deployments", "gpupools", "inferenceservices", "elastictrainingjobs", "services", "nodes"}


def _now() -> str:
    return datetime.now(tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def _status(code: int, reason: str, message: str) -> aiohttp.web.Response:
    return aiohttp.web.json_response({"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                                      "code": code, "reason": reason, "message": message}, status=code)


def _matches(obj: dict[str, Any], selector: str | None) -> bool:
    if not selector:
        return True
    labels = obj.get("metadata", {}).get("labels") or {}
    for term in selector.split(","):
        term = term.strip()
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.split("=", 1)
            if labels.get(k.strip().rstrip("=")) != v.strip().lstrip("="):
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


class StrictEmulator(kmock.KubernetesEmulator):
    """See module docstring. Declare resources with ``declare(...)`` before starting."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.store: dict[Key, dict[str, Any]] = {}
        self.events: list[tuple[int, tuple[str, str, str], dict[str, Any]]] = []
        self.calls: list[tuple[str, str, str, str | None, str]] = []
        self.scale_paths: dict[str, tuple[str, str, str | None]] = {}
        self.rv = itertools.count(100)
        self.last_rv = 100
        self.lock = threading.RLock()
        self._cond: asyncio.Condition | None = None
        self.graceful_pods = False  # True where a node agent terminates pods (see module docstring)

    # ---- set-up ---------------------------------------------------------------------------------
    def declare(self, group: str, version: str, plural: str, kind: str, *, namespaced: bool,
                subresources: tuple[str, ...] = (), scale: tuple[str, str, str | None] | None = None) -> None:
        key = f"{group}/{version}/{plural}" if group else f"{version}/{plural}"
        self.resources[key] = kmock.ResourceInfo(kind=kind, namespaced=namespaced, subresources=set(subresources),
                                                 verbs={"get", "list", "watch", "create", "update", "patch",
                                                        "delete"})
        if scale is not None:
            self.scale_paths[plural] = scale

    # ---- reading (thread-safe, for assertions) --------------------------------------------------
    def objects(self, plural: str, namespace: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            return [copy.deepcopy(o) for (_, _, p, ns, _), o in sorted(self.store.items(), key=lambda kv: str(kv[0]))
                    if p == plural and (namespace is None or ns == namespace)]

    def get(self, plural: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        with self.lock:
            for (_, _, p, ns, n), o in self.store.items():
                if p == plural and ns == namespace and n == name:
                    return copy.deepcopy(o)
        return None

    def calls_since(self, index: int) -> list[tuple[str, str, str, str | None, str]]:
        with self.lock:
            return list(self.calls[index:])

    # ---- request routing ------------------------------------------------------------------------
    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        res = request.resource
        if request.url.path.rstrip("/") == "/version":
            return aiohttp.web.json_response({
                "major": "1", "minor": "33", "gitVersion": "v1.33.0-emulated", "gitCommit": "0" * 40,
                "gitTreeState": "clean", "buildDate": "2025-01-01T00:00:00Z", "goVersion": "go1.24",
                "compiler": "gc", "platform": "linux/amd64"})
        if res is None or not res.plural:
            return await super(kmock.KubernetesEmulator, self)._handle(request)  # discovery, /version
        self._record(request)
        if request.action in (kmock.action.LIST, kmock.action.WATCH):
            return await super(kmock.KubernetesEmulator, self)._handle(request)
        rkey = (res.group or "", res.version or "", res.plural)
        method = str(request.method.value).upper()
        try:
            with self.lock:
                out = self._mutate(method, rkey, request)
        except _Fail as f:
            return _status(f.code, f.reason, f.message)
        if self._cond is not None:
            async with self._cond:
                self._cond.notify_all()
        return aiohttp.web.json_response(out)

    def _record(self, request: kmock.Request) -> None:
        res = request.resource
        assert res is not None
        method = str(request.method.value).upper()
        if request.action == kmock.action.WATCH:
            verb = "watch"
        elif method == "GET":
            verb = "get" if request.name else "list"
        else:
            verb = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(method, method)
        resource = res.plural + (f"/{request.subresource}" if request.subresource else "")
        who = (request.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
        with self.lock:
            self.calls.append((verb, res.group or "", resource, request.namespace, who))

    # ---- writes ---------------------------------------------------------------------------------
    def _emit(self, rkey: tuple[str, str, str], kind: str, obj: dict[str, Any]) -> None:
        rv = int(obj["metadata"]["resourceVersion"])
        self.events.append((rv, rkey, {"type": kind, "object": copy.deepcopy(obj)}))

    def _stamp(self, obj: dict[str, Any]) -> None:
        self.last_rv = next(self.rv)
        obj["metadata"]["resourceVersion"] = str(self.last_rv)

    def _mutate(self, method: str, rkey: tuple[str, str, str], request: kmock.Request) -> dict[str, Any]:
        ns, name, sub = request.namespace, request.name, request.subresource
        data = request.data if request.data is not None else (json.loads(request.text) if request.text else None)
        if method == "POST":
            return self._create(rkey, ns, data)
        key: Key = (*rkey, ns, name or "")
        live = self.store.get(key)
        ctype = (request.headers.get("Content-Type") or "").split(";")[0].strip()
        if method == "GET":
            if live is None:
                raise _Fail(404, "NotFound", f'{rkey[2]} "{name}" not found')
            return self._scale_view(rkey, live) if sub == "scale" else copy.deepcopy(live)
        if method == "DELETE":
            return self._delete(rkey, key, live, name, _grace(request, data))
        if live is None:
            if method == "PATCH" and ctype == "application/apply-patch+yaml" and not sub:
                obj = dict(data or {})
                obj.setdefault("metadata", {})["name"] = name
                self._create(rkey, ns, obj)
                self._manager(key, request)
                return copy.deepcopy(self.store[key])
            raise _Fail(404, "NotFound", f'{rkey[2]} "{name}" not found')
        new = self._patched(rkey, live, data, ctype, sub, method)
        if method == "PUT":
            want = (data or {}).get("metadata", {}).get("resourceVersion")
            if want and want != live["metadata"]["resourceVersion"]:
                raise _Fail(409, "Conflict", "the object has been modified; please apply your changes to the latest version")
        if ctype == "application/apply-patch+yaml":
            new.setdefault("metadata", {})["managedFields"] = [
                {"manager": request.params.get("fieldManager", ""), "operation": "Apply"}]
        if new != live:
            if new.get("spec") != live.get("spec"):
                new["metadata"]["generation"] = int(live["metadata"].get("generation", 1)) + 1
            self._stamp(new)
            # the last finalizer removed from an object marked for deletion: it goes
            if (new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers")
                    and live["metadata"].get("finalizers")):
                del self.store[key]
                self._emit(rkey, "DELETED", new)
            else:
                self.store[key] = new
                self._emit(rkey, "MODIFIED", new)
        return self._scale_view(rkey, new) if sub == "scale" else copy.deepcopy(new)

    def _manager(self, key: Key, request: kmock.Request) -> None:
        self.store[key]["metadata"]["managedFields"] = [
            {"manager": request.params.get("fieldManager", ""), "operation": "Apply"}]

    def _create(self, rkey: tuple[str, str, str], ns: str | None, data: dict[str, Any] | None) -> dict[str, Any]:
        obj = copy.deepcopy(data or {})
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if not meta.get("name"):
            raise _Fail(422, "Invalid", "metadata.name: Required value")
        if ns is not None:
            meta["namespace"] = ns
        key: Key = (*rkey, ns, meta["name"])
        if key in self.store:
            raise _Fail(409, "AlreadyExists", f'{rkey[2]} "{meta["name"]}" already exists')
        if rkey[2] in STATUS_KINDS and rkey[2] not in ("nodes", "services"):
            obj.pop("status", None)
        meta.update(uid=str(uuid.uuid4()), generation=1, creationTimestamp=_now())
        self._stamp(obj)
        self.store[key] = obj
        self._emit(rkey, "ADDED", obj)
        return copy.deepcopy(obj)

    def _delete(self, rkey: tuple[str, str, str], key: Key, live: dict[str, Any] | None, name: str | None,
                grace: int | None = None) -> dict[str, Any]:
        if live is None:
            raise _Fail(404, "NotFound", f'{rkey[2]} "{name}" not found')
        if rkey[2] == "pods" and self.graceful_pods and not live["metadata"].get("finalizers"):
            bound = bool((live.get("spec") or {}).get("nodeName"))
            ended = (live.get("status") or {}).get("phase") in ("Succeeded", "Failed")
            if grace is None:
                grace = int((live.get("spec") or {}).get("terminationGracePeriodSeconds", 30))
            if bound and not ended and grace > 0:
                if not live["metadata"].get("deletionTimestamp"):  # a second DELETE does not restart the clock
                    live = copy.deepcopy(live)
                    live["metadata"]["deletionTimestamp"] = _now()
                    live["metadata"]["deletionGracePeriodSeconds"] = grace
                    self._stamp(live)
                    self.store[key] = live
                    self._emit(rkey, "MODIFIED", live)
                return copy.deepcopy(live)
        if live["metadata"].get("finalizers"):
            if not live["metadata"].get("deletionTimestamp"):
                live = copy.deepcopy(live)
                live["metadata"]["deletionTimestamp"] = _now()
                self._stamp(live)
                self.store[key] = live
                self._emit(rkey, "MODIFIED", live)
            return copy.deepcopy(live)
        live = copy.deepcopy(live)
        del self.store[key]
        self._stamp(live)
        self._emit(rkey, "DELETED", live)
        return live

    def _patched(self, rkey: tuple[str, str, str], live: dict[str, Any], data: Any, ctype: str, sub: str | None,
                 method: str) -> dict[str, Any]:
        if sub == "scale":
            replicas = (data or {}).get("spec", {}).get("replicas")
            if ctype == "application/json-patch+json":
                replicas = jsonpatch.apply_patch(self._scale_view(rkey, live), data)["spec"]["replicas"]
            new = copy.deepcopy(live)
            path = self.scale_paths.get(rkey[2], (".spec.replicas", "", None))[0].strip(".").split(".")
            cur = new
            for p in path[:-1]:
                cur = cur.setdefault(p, {})
            cur[path[-1]] = replicas
            return new
        if method == "PUT":
            candidate = copy.deepcopy(data or {})
            candidate["metadata"] = {**live["metadata"], **{k: v for k, v in candidate.get("metadata", {}).items()
                                                            if k in ("labels", "annotations", "finalizers")}}
        elif ctype == "application/json-patch+json":
            try:
                candidate = jsonpatch.apply_patch(live, data)
            except (jsonpatch.JsonPatchTestFailed, jsonpatch.JsonPatchConflict) as e:
                # as the API server answers a failed ``test`` op (Kopf's optimistic lock on resourceVersion)
                raise _Fail(422, "Invalid", f"the server rejected our request due to an error in our request: {e}"
                            ) from None
        else:  # merge, strategic merge (as merge), apply (merge of the applied fields)
            candidate = merge_patch(live, data or {})
        has_status = rkey[2] in STATUS_KINDS
        new = copy.deepcopy(live)
        if sub == "status":
            if "status" in candidate:
                new["status"] = candidate["status"]
            else:
                new.pop("status", None)
            return new
        new = candidate
        for fixed in ("uid", "creationTimestamp", "generation", "resourceVersion", "namespace", "name",
                      "deletionTimestamp", "deletionGracePeriodSeconds"):
            if fixed in live["metadata"]:
                new["metadata"][fixed] = live["metadata"][fixed]
        if has_status:
            if "status" in live:
                new["status"] = copy.deepcopy(live["status"])
            else:
                new.pop("status", None)
        return new

    def _scale_view(self, rkey: tuple[str, str, str], obj: dict[str, Any]) -> dict[str, Any]:
        spec_path, status_path, selector_path = self.scale_paths.get(
            rkey[2], (".spec.replicas", ".status.replicas", None))

        def at(path: str | None) -> Any:
            cur: Any = obj
            for p in (path or "").strip(".").split("."):
                cur = cur.get(p) if isinstance(cur, dict) else None
            return cur

        selector = at(selector_path) if selector_path else ",".join(
            f"{k}={v}" for k, v in ((obj.get("spec", {}).get("selector") or {}).get("matchLabels") or {}).items())
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {k: obj["metadata"].get(k) for k in ("name", "namespace", "uid", "resourceVersion")},
                "spec": {"replicas": at(spec_path) or 0},
                "status": {"replicas": at(status_path) or 0, "selector": selector or ""}}

    # ---- list and watch -------------------------------------------------------------------------
    async def _serve_list(self, request: kmock.Request) -> Any:
        res = request.resource
        assert res is not None
        with self.lock:
            items = [copy.deepcopy(o) for (g, v, p, ns, _), o in self.store.items()
                     if (g, v, p) == (res.group or "", res.version or "", res.plural)
                     and (request.namespace is None or ns == request.namespace)
                     and _matches(o, request.params.get("labelSelector"))]
            rv = self.last_rv
        return {"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": str(rv)}, "items": items}

    async def _serve_watch(self, request: kmock.Request) -> Any:
        yield b""
        if self._cond is None:
            self._cond = asyncio.Condition()
        res = request.resource
        assert res is not None
        rkey = (res.group or "", res.version or "", res.plural)
        since = int(request.params.get("resourceVersion") or 0)
        selector = request.params.get("labelSelector")
        sent = 0
        while True:
            with self.lock:
                batch = self.events[sent:]
                sent = len(self.events)
            for rv, key, ev in batch:
                obj = ev["object"]
                if key != rkey or rv <= since or not _matches(obj, selector):
                    continue
                if request.namespace is not None and obj.get("metadata", {}).get("namespace") != request.namespace:
                    continue
                yield ev
            async with self._cond:
                with self.lock:
                    pending = len(self.events) > sent
                if not pending:
                    try:
                        await asyncio.wait_for(self._cond.wait(), timeout=1.0)
                    except TimeoutError:
                        pass


def _grace(request: kmock.Request, body: Any) -> int | None:
    """A DELETE's grace period: the ``gracePeriodSeconds`` query parameter or DeleteOptions body field."""
    v = request.params.get("gracePeriodSeconds")
    if v is None and isinstance(body, dict):
        v = body.get("gracePeriodSeconds")
    return None if v is None else int(v)


class _Fail(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


class EmulatorThread:
    """Runs a ``StrictEmulator`` behind a kmock ``Server`` on its own event loop thread."""

    def __init__(self, emulator: StrictEmulator) -> None:
        self.emulator = emulator
        self.url = ""
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="k8s-emulator", daemon=True)
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # noqa: BLE001 - surfaced in start()
            self._error = e
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.emulator._cond = asyncio.Condition()
        async with kmock.Server(self.emulator) as server:
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def start(self) -> EmulatorThread:
        self._thread.start()
        if not self._ready.wait(15) or self._error is not None:
            raise RuntimeError(f"emulator did not start: {self._error}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
