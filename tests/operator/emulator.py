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

What the real ``kubectl`` needs on top (``tests/operator/test_kubectl_guide.py`` runs it):

* discovery that names each subresource's own kind (``autoscaling/v1`` ``Scale`` for ``/scale``),
  and an ``/openapi/v3`` that says every kind takes ``fieldValidation`` (kubectl then leaves
  validation to the server instead of downloading a schema to check against);
* a ``CustomResourceDefinition`` that is created registers its kinds for discovery, keeps its
  printer columns and schema, and reports ``NamesAccepted``/``Established``;
* ``Accept: ...;as=Table`` (``kubectl get``): a ``meta.k8s.io/v1`` Table, with a custom resource's
  ``additionalPrinterColumns`` evaluated the way the API server does (a ``date`` becomes an age),
  and a few built-in kinds' usual columns;
* ``fieldSelector`` on list and watch, for the fields the API server supports per kind (another
  field is a 400, as there); core ``v1`` Events are served as a view of ``events.k8s.io/v1``
  Events too (one store in a real cluster): ``kubectl describe`` lists them;
* with ``admission`` set, what an API server checks on the way in: a namespaced object needs its
  Namespace; a custom resource (spec on create/update, status on ``/status``) is pruned of fields
  its CRD's schema does not know, defaulted, validated against the schema and its CEL rules
  (``x-kubernetes-validations``), and refused (422) naming the field; ``fieldValidation=Strict``
  refuses unknown fields (400) instead of pruning them.

``calls`` records every request as ``(verb, group, resource[/subresource], namespace, bearer token)``: the RBAC
test derives the operator's permissions from it. The server runs on its own event loop in a
thread (``EmulatorThread``) so sync clients in the test can never deadlock it.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import itertools
import json
import re
import threading
import uuid
from datetime import UTC, datetime
from typing import Any

import aiohttp.web
import jsonpatch
import kmock
from kmock._internal import parsing as _kmock_parsing

Key = tuple[str, str, str, str | None, str]  # group, version, plural, namespace, name

_kmock_parse_path = _kmock_parsing.parse_path


def _parse_path(path: str) -> Any:
    """kmock's URL parser, but ``/api/v1/namespaces[/<name>[/status]]`` is the Namespace resource
    (kmock reads the name as a namespace with no resource, and fails on the bare list)."""
    parts = path.strip("/").split("/")
    if len(parts) >= 3 and parts[0] == "api" and parts[2] == "namespaces" and (
            len(parts) <= 4 or parts[4] in ("status", "finalize")):
        return _kmock_parsing.ParsedPath("", parts[1], "namespaces", None, parts[3] if len(parts) > 3 else None,
                                         "/".join(parts[4:]) or None)
    return _kmock_parse_path(path)


_kmock_parsing.parse_path = _parse_path  # kmock's request parsing looks it up on the module

# a built-in kind's short names and categories, as discovery reports them (``kubectl get deploy``)
_BUILT_IN_NAMES: dict[tuple[str, str], tuple[tuple[str, ...], tuple[str, ...]]] = {
    ("apiextensions.k8s.io", "customresourcedefinitions"): (("crd", "crds"), ("api-extensions",)),
    ("", "namespaces"): (("ns",), ()), ("", "nodes"): (("no",), ()), ("", "pods"): (("po",), ("all",)),
    ("", "services"): (("svc",), ("all",)), ("", "configmaps"): (("cm",), ()),
    ("", "serviceaccounts"): (("sa",), ()), ("", "events"): (("ev",), ()), ("events.k8s.io", "events"): (("ev",), ()),
    ("apps", "deployments"): (("deploy",), ("all",)),
}

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
        self.admission = False  # True: namespaces must exist, custom resources meet their CRD's schema
        self.status_kinds = set(STATUS_KINDS)  # plurals whose status is a subresource (CRDs add theirs)
        # (group, version, plural) of a registered CRD -> its kind, printer columns and schema
        self.crds: dict[tuple[str, str, str], dict[str, Any]] = {}

    # ---- set-up ---------------------------------------------------------------------------------
    def declare(self, group: str, version: str, plural: str, kind: str, *, namespaced: bool,
                subresources: tuple[str, ...] = (), scale: tuple[str, str, str | None] | None = None) -> None:
        key = f"{group}/{version}/{plural}" if group else f"{version}/{plural}"
        short, categories = _BUILT_IN_NAMES.get((group, plural), ((), ()))
        self.resources[key] = kmock.ResourceInfo(kind=kind, namespaced=namespaced, subresources=set(subresources),
                                                 verbs={"get", "list", "watch", "create", "update", "patch",
                                                        "delete"}, shortnames=set(short), categories=set(categories))
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
        if request.url.path.rstrip("/").startswith("/openapi/v3"):
            return self._openapi(request.url.path.rstrip("/"))
        if res is None or not res.plural:
            return await super(kmock.KubernetesEmulator, self)._handle(request)  # discovery, /version
        self._record(request)
        rkey = (res.group or "", res.version or "", res.plural)
        try:
            if request.action in (kmock.action.LIST, kmock.action.WATCH):
                self._field_terms(rkey, request.params.get("fieldSelector"))  # an unsupported field: 400
            if request.action == kmock.action.LIST:
                items, rv = self._list(rkey, request)
                if _wants_table(request):
                    return aiohttp.web.json_response(self._table(rkey, items, request, rv))
                kind = next((self.resources[r].kind for r in self.resources
                             if (r.group or "", r.version, r.plural) == rkey), None) or "List"
                # typed clients (kubectl describe's event search) decode the kind's own list type
                return aiohttp.web.json_response({"apiVersion": f"{rkey[0]}/{rkey[1]}" if rkey[0] else rkey[1],
                                                  "kind": f"{kind}List", "metadata": {"resourceVersion": rv},
                                                  "items": items})
        except _Fail as f:
            return _status(f.code, f.reason, f.message)
        if request.action == kmock.action.WATCH:
            return await self._stream_watch(request)
        method = str(request.method.value).upper()
        ctype = _header(request, "content-type").split(";")[0].strip()
        if ctype == "application/vnd.kubernetes.protobuf" and method == "POST" and rkey == ("", "v1", "namespaces"):
            # kubectl's typed clients send protobuf; of those the guide only creates a Namespace
            object.__setattr__(request, "data", _namespace_from_protobuf(request.body))
        elif method in ("POST", "PUT", "PATCH") and ctype in ("application/vnd.kubernetes.protobuf",
                                                              "application/cbor"):
            return _status(415, "UnsupportedMediaType", "the body of the request was in an unknown format - "
                                                        "accepted media types include: application/json")
        try:
            with self.lock:
                out = self._mutate(method, rkey, request)
        except _Fail as f:
            return _status(f.code, f.reason, f.message)
        if self._cond is not None:
            async with self._cond:
                self._cond.notify_all()
        if method == "GET" and not request.subresource and _wants_table(request):
            return aiohttp.web.json_response(self._table(rkey, [out], request, out["metadata"]["resourceVersion"]))
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
        strict = request.params.get("fieldValidation") == "Strict"
        if method == "POST":
            return self._registered(rkey, self._create(rkey, ns, self._admit(rkey, ns, data, "create", strict)))
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
                self._create(rkey, ns, self._admit(rkey, ns, obj, "create", strict))
                self._manager(key, request)
                return self._registered(rkey, copy.deepcopy(self.store[key]))
            raise _Fail(404, "NotFound", f'{rkey[2]} "{name}" not found')
        new = self._patched(rkey, live, data, ctype, sub, method)
        if sub != "scale":
            new = self._admit(rkey, ns, new, "status" if sub == "status" else "update", strict)
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
        if sub == "scale":
            return self._scale_view(rkey, new)
        return self._registered(rkey, copy.deepcopy(new)) if key in self.store and not sub else copy.deepcopy(new)

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
        if rkey[2] in self.status_kinds and rkey[2] not in ("nodes", "services"):
            obj.pop("status", None)
        if rkey == ("", "v1", "namespaces"):
            obj.setdefault("status", {"phase": "Active"})
        meta.update(uid=str(uuid.uuid4()), generation=1, creationTimestamp=_now())
        kind = next((self.resources[r].kind for r in self.resources if (r.group or "", r.version, r.plural) == rkey),
                    None)
        if kind:  # the API server answers with the URL's kind, whatever the body said (or left out)
            obj["apiVersion"], obj["kind"] = (f"{rkey[0]}/{rkey[1]}" if rkey[0] else rkey[1]), kind
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
        else:  # merge, strategic merge (as merge, its directives dropped), apply (merge of the applied fields)
            if ctype == "application/strategic-merge-patch+json":
                data = _without_directives(data)
            candidate = merge_patch(live, data or {})
        has_status = rkey[2] in self.status_kinds
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

    # ---- what kubectl needs: discovery, OpenAPI, CRDs, tables -----------------------------------
    async def _serve_version(self, request: kmock.Request) -> Any:
        """``/api/v1``, ``/apis/<group>/<version>``: kmock's, with each subresource's own kind
        (``/scale`` is ``autoscaling/v1`` ``Scale``: kubectl's scale client looks it up here)."""
        assert request.resource is not None
        g, v = request.resource.group or "", request.resource.version
        out = []
        for r in sorted(self.resources, key=lambda r: r.plural):
            if (r.group or "", r.version) != (g, v):
                continue
            info = self.resources[r]
            base = {"namespaced": bool(info.namespaced), "singularName": ""}
            out.append({**base, "name": r.plural, "singularName": info.singular or (info.kind or "").lower(),
                        "kind": info.kind, "verbs": sorted(info.verbs), "shortNames": sorted(info.shortnames),
                        "categories": sorted(info.categories)})
            for sub in sorted(info.subresources):
                kind = {"group": "autoscaling", "version": "v1", "kind": "Scale"} if sub == "scale" else {
                    "kind": info.kind}
                out.append({**base, **kind, "name": f"{r.plural}/{sub}", "verbs": ["get", "patch", "update"]})
        if not out and g:
            raise kmock.KubernetesResourceNotFoundError()
        return {"apiVersion": "v1", "kind": "APIResourceList", "groupVersion": f"{g}/{v}" if g else v,
                "resources": out}

    def _openapi(self, path: str) -> aiohttp.web.Response:
        """``/openapi/v3``: per group-version, a PATCH operation per kind that takes ``fieldValidation``
        (all kubectl looks for before it leaves validation to the server)."""
        docs: dict[str, dict[str, Any]] = {}
        for r in self.resources:
            g, v, info = r.group or "", r.version, self.resources[r]
            gv = f"apis/{g}/{v}" if g else f"api/{v}"
            ns = "namespaces/{namespace}/" if info.namespaced else ""
            doc = docs.setdefault(gv, {"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": "v1.33.0"},
                                       "paths": {}, "components": {"schemas": {}}})
            params = [{"name": n, "in": "query", "schema": {"type": "string"}}
                      for n in ("dryRun", "fieldManager", "fieldValidation", "force")]
            doc["paths"][f"/{gv}/{ns}{r.plural}/{{name}}"] = {"patch": {
                "x-kubernetes-group-version-kind": {"group": g, "version": v, "kind": info.kind},
                "x-kubernetes-action": "patch", "parameters": params}}
        if path == "/openapi/v3":
            return aiohttp.web.json_response({"paths": {gv: {"serverRelativeURL": f"/openapi/v3/{gv}?hash={_digest(d)}"}
                                                        for gv, d in sorted(docs.items())}})
        doc = docs.get(path.removeprefix("/openapi/v3/"))
        if doc is None:
            return _status(404, "NotFound", f"the server could not find the requested resource ({path})")
        return aiohttp.web.json_response(doc)

    def _registered(self, rkey: tuple[str, str, str], obj: dict[str, Any]) -> dict[str, Any]:
        """A CustomResourceDefinition written: serve its kinds, report NamesAccepted and Established."""
        if rkey != ("apiextensions.k8s.io", "v1", "customresourcedefinitions"):
            return obj
        spec, names = obj.get("spec") or {}, (obj.get("spec") or {}).get("names") or {}
        group, plural, kind = spec.get("group", ""), names.get("plural", ""), names.get("kind", "")
        for ver in spec.get("versions") or []:
            if not ver.get("served", True):
                continue
            subs = ver.get("subresources") or {}
            sc = subs.get("scale")
            self.declare(group, ver["name"], plural, kind, namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                         subresources=tuple(k for k in ("status", "scale") if k in subs),
                         scale=(sc["specReplicasPath"], sc["statusReplicasPath"], sc.get("labelSelectorPath"))
                         if sc else None)
            info = self.resources[f"{group}/{ver['name']}/{plural}"]
            info.singular = names.get("singular") or kind.lower()
            info.shortnames, info.categories = set(names.get("shortNames") or ()), set(names.get("categories") or ())
            if "status" in subs:
                self.status_kinds.add(plural)
            self.crds[(group, ver["name"], plural)] = {
                "kind": kind, "group": group, "columns": list(ver.get("additionalPrinterColumns") or []),
                "schema": (ver.get("schema") or {}).get("openAPIV3Schema") or {}}
        stored = [v["name"] for v in spec.get("versions") or [] if v.get("storage")]
        status = {"acceptedNames": names, "storedVersions": stored, "conditions": [
            {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts", "message": "no conflicts found"},
            {"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
             "message": "the initial names have been accepted"}]}
        key: Key = (*rkey, None, obj["metadata"]["name"])
        live = self.store[key]
        if {k: v for k, v in (live.get("status") or {}).items() if k != "conditions"} != {
                k: v for k, v in status.items() if k != "conditions"} or not (live.get("status") or {}).get("conditions"):
            live = copy.deepcopy(live)
            now = _now()
            live["status"] = {**status, "conditions": [dict(c, lastTransitionTime=now) for c in status["conditions"]]}
            self._stamp(live)
            self.store[key] = live
            self._emit(rkey, "MODIFIED", live)
        return copy.deepcopy(live)

    def _admit(self, rkey: tuple[str, str, str], ns: str | None, obj: Any, op: str, strict: bool) -> Any:
        """With ``admission``: the Namespace exists (create); a custom resource is pruned, defaulted and
        validated against its CRD's schema and CEL rules (see module docstring)."""
        if not self.admission or not isinstance(obj, dict):
            return obj
        if op == "create" and ns is not None and (("", "v1", "namespaces", None, ns) not in self.store):
            raise _Fail(404, "NotFound", f'namespaces "{ns}" not found')
        crd = self.crds.get(rkey)
        if crd is None:
            return obj
        schema, kind, name = crd["schema"], crd["kind"], (obj.get("metadata") or {}).get("name", "")
        parts = ("status",) if op == "status" else tuple(k for k in (schema.get("properties") or {})
                                                          if k not in ("apiVersion", "kind", "metadata", "status"))
        out = copy.deepcopy(obj)
        unknown: list[str] = []
        for k in list(out):
            if k not in ("apiVersion", "kind", "metadata") and k not in (schema.get("properties") or {}):
                unknown.append(k)
                del out[k]
        for part in parts:
            if part in out:
                out[part] = _default(schema["properties"][part], _prune(schema["properties"][part], out[part], part,
                                                                          unknown))
        if strict and unknown:
            raise _Fail(400, "BadRequest", f'{kind} in version "{rkey[1]}" cannot be handled as a {kind}: strict '
                                           "decoding error: " + ", ".join(f'unknown field "{u}"' for u in unknown))
        errors = []
        for part in parts:
            sub = schema["properties"][part]
            if part not in out:
                if part in (schema.get("required") or ()):
                    errors.append(f"{part}: Required value")
                continue
            errors += _schema_errors(sub, out[part], part) or _cel_errors(sub, out[part], part)
        if errors:
            raise _Fail(422, "Invalid", f'{kind}.{crd["group"]} "{name}" is invalid: ' + ", ".join(errors))
        return out

    def _table(self, rkey: tuple[str, str, str], objs: list[dict[str, Any]], request: kmock.Request,
               rv: str) -> dict[str, Any]:
        """``kubectl get``'s ``meta.k8s.io/v1`` Table: a CRD's printer columns or a built-in kind's."""
        name_col = {"name": "Name", "type": "string", "format": "name", "priority": 0,
                    "description": "Name must be unique within a namespace."}
        crd = self.crds.get(rkey)
        if crd is not None:
            cols = crd["columns"] or [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
            defs = [name_col] + [{"name": c["name"], "type": c["type"], "format": c.get("format", ""),
                                  "priority": int(c.get("priority", 0)), "description": c.get("description", "")}
                                 for c in cols]
            rows = [[o["metadata"]["name"], *(_cell(c["type"], _jsonpath(o, c["jsonPath"])) for c in cols)]
                    for o in objs]
        else:
            printer = _PRINTERS.get(rkey[2], _PRINTERS[""])
            defs = [name_col] + [{"name": n, "type": t, "format": "", "priority": pr, "description": ""}
                                 for n, t, pr, _ in printer]
            rows = [[o["metadata"]["name"], *(fn(o) for _, _, _, fn in printer)] for o in objs]
        include = request.params.get("includeObject", "Metadata")
        out_rows = []
        for o, cells in zip(objs, rows, strict=True):
            row: dict[str, Any] = {"cells": cells}
            if include == "Object":
                row["object"] = o
            elif include != "None":
                row["object"] = {"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
                                 "metadata": o["metadata"]}
            out_rows.append(row)
        return {"apiVersion": "meta.k8s.io/v1", "kind": "Table", "metadata": {"resourceVersion": rv},
                "columnDefinitions": defs, "rows": out_rows}

    # ---- list and watch -------------------------------------------------------------------------
    def _list(self, rkey: tuple[str, str, str], request: kmock.Request) -> tuple[list[dict[str, Any]], str]:
        """Items of a list (label and field selectors applied) and the resourceVersion it is at."""
        if not any((r.group or "", r.version, r.plural) == rkey for r in self.resources):
            raise _Fail(404, "NotFound", f"the server could not find the requested resource ({rkey[2]})")
        terms = self._field_terms(rkey, request.params.get("fieldSelector"))
        with self.lock:
            items = [copy.deepcopy(o) for (g, v, p, ns, _), o in sorted(self.store.items(), key=lambda kv: str(kv[0]))
                     if (g, v, p) == rkey and (request.namespace is None or ns == request.namespace)]
            if rkey == ("", "v1", "events"):  # one store in a real cluster: events.k8s.io/v1 seen as core/v1
                items += [_core_event(copy.deepcopy(o)) for (g, _, p, ns, _), o in self.store.items()
                          if (g, p) == ("events.k8s.io", "events")
                          and (request.namespace is None or ns == request.namespace)]
            rv = str(self.last_rv)
        items = [o for o in items if _matches(o, request.params.get("labelSelector")) and _fields_match(rkey, o, terms)]
        return items, rv

    async def _serve_list(self, request: kmock.Request) -> Any:
        res = request.resource
        assert res is not None
        items, rv = self._list((res.group or "", res.version or "", res.plural), request)
        return {"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": rv}, "items": items}

    def _field_terms(self, rkey: tuple[str, str, str], selector: str | None) -> list[tuple[str, str, bool]]:
        """``fieldSelector`` as (field, value, equal) terms; a field the API server does not index: 400."""
        terms = []
        for term in (selector or "").split(","):
            term = term.strip()
            if not term:
                continue
            m = re.fullmatch(r"([^=!]+)(==|=|!=)(.*)", term)
            if m is None:
                raise _Fail(400, "BadRequest", f"invalid field selector: {term!r}")
            field_, op, value = m.group(1).strip(), m.group(2), m.group(3).strip()
            if field_ not in _FIELDS.get(rkey, ()) and field_ not in ("metadata.name", "metadata.namespace"):
                raise _Fail(400, "BadRequest", f'"{field_}" is not a known field selector: only "metadata.name", '
                                                f'"metadata.namespace"' + "".join(f', "{f}"' for f in
                                                                                   _FIELDS.get(rkey, ())))
            terms.append((field_, value, op != "!="))
        return terms

    async def _stream_watch(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        """A watch as the API server streams it: ``application/json`` (client-go's watch decoder picks
        its serializer by content type), one event per line, ended after ``timeoutSeconds``."""
        resp = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request._raw_request)  # kmock keeps aiohttp's request here
        timeout = float(request.params.get("timeoutSeconds") or 0) or None
        events = self._serve_watch(request)

        async def pump() -> None:
            async for ev in events:
                if ev != b"":
                    await resp.write(json.dumps(ev).encode() + b"\n")

        try:
            await asyncio.wait_for(pump(), timeout)
        except (TimeoutError, ConnectionError):
            pass
        finally:
            await events.aclose()
        with contextlib.suppress(ConnectionError):
            await resp.write_eof()
        return resp

    async def _serve_watch(self, request: kmock.Request) -> Any:
        yield b""
        if self._cond is None:
            self._cond = asyncio.Condition()
        res = request.resource
        assert res is not None
        rkey = (res.group or "", res.version or "", res.plural)
        since = int(request.params.get("resourceVersion") or 0)
        selector = request.params.get("labelSelector")
        terms = self._field_terms(rkey, request.params.get("fieldSelector"))
        sent = 0
        while True:
            with self.lock:
                batch = self.events[sent:]
                sent = len(self.events)
            for rv, key, ev in batch:
                obj = ev["object"]
                if key != rkey or rv <= since or not _matches(obj, selector) or not _fields_match(rkey, obj, terms):
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


# ---- kubectl's side: tables, field selectors, schemas ------------------------------------------------

def _header(request: kmock.Request, name: str) -> str:
    return next((v for k, v in request.headers.items() if k.lower() == name), "")


def _wants_table(request: kmock.Request) -> bool:
    return "as=Table" in _header(request, "accept")


def _digest(doc: Any) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16].upper()


def _without_directives(patch: Any) -> Any:
    """A strategic merge patch minus its ``$patch``/``$setElementOrder``/``$retainKeys`` directives
    (applied here as a plain merge: lists are replaced, not merged by key)."""
    if isinstance(patch, dict):
        return {k: _without_directives(v) for k, v in patch.items() if not k.startswith("$")}
    if isinstance(patch, list):
        return [_without_directives(v) for v in patch if not (isinstance(v, dict) and "$patch" in v)]
    return patch


def _age(ts: str | None) -> str:
    """Kubernetes' ``duration.HumanDuration`` of the time since ``ts`` (RFC 3339)."""
    if not ts:
        return "<unknown>"
    try:
        t = datetime.strptime(ts[:19], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=UTC)
    except ValueError:
        return "<invalid>"
    sec = int((datetime.now(tz=UTC) - t).total_seconds())
    if sec < 0:
        return "0s"
    if sec < 120:
        return f"{sec}s"
    minutes, hours = sec // 60, sec // 3600
    if minutes < 10:
        return f"{minutes}m{sec % 60}s" if sec % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    return f"{hours // 24}d{hours % 24}h" if hours < 192 and hours % 24 else f"{hours // 24}d"


def _jsonpath(obj: Any, path: str) -> Any:
    """A printer column's ``jsonPath`` (``.a.b``, ``.a[0]``, ``.a['k.x']``, ``.a[?(@.k=="v")].b``):
    the first value it finds, None when it finds none."""
    cur: list[Any] = [obj]
    for part in re.findall(r"\[\?\(@\.[\w.]+\s*==\s*[\"'][^\"']*[\"']\)\]|\[\d+\]|\['[^']*'\]|[^.\[]+", path):
        nxt: list[Any] = []
        for c in cur:
            if part.startswith("[?"):
                k, v = re.match(r"\[\?\(@\.([\w.]+)\s*==\s*[\"']([^\"']*)[\"']\)\]", part).groups()  # type: ignore[union-attr]
                nxt += [x for x in (c if isinstance(c, list) else []) if _jsonpath(x, "." + k) == v]
            elif part.startswith("[") and part[1:-1].isdigit():
                i = int(part[1:-1])
                if isinstance(c, list) and i < len(c):
                    nxt.append(c[i])
            else:
                key = part[2:-2] if part.startswith("['") else part
                if isinstance(c, dict) and key in c:
                    nxt.append(c[key])
        cur = nxt
    return cur[0] if cur else None


def _cell(type_: str, value: Any) -> Any:
    """The API server's cell for a printer column value of ``type_`` (``date``: an age)."""
    if value is None:
        return None
    if type_ == "date":
        return _age(value) if isinstance(value, str) else None
    if type_ == "integer":
        return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value == int(value) \
            else None
    if type_ == "number":
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if type_ == "boolean":
        return value if isinstance(value, bool) else None
    return value if isinstance(value, str) else json.dumps(value)


def _pod_status(p: dict[str, Any]) -> str:
    if p["metadata"].get("deletionTimestamp"):
        return "Terminating"
    st = p.get("status") or {}
    for c in st.get("containerStatuses") or []:
        state = c.get("state") or {}
        for k in ("waiting", "terminated"):
            if (state.get(k) or {}).get("reason"):
                return str(state[k]["reason"])
    return str(st.get("phase") or "Pending")


def _ready_of(p: dict[str, Any]) -> str:
    cs = (p.get("status") or {}).get("containerStatuses") or []
    return f"{sum(1 for c in cs if c.get('ready'))}/{len((p.get('spec') or {}).get('containers') or [])}"


def _event_object(e: dict[str, Any]) -> str:
    ref = e.get("regarding") or e.get("involvedObject") or {}
    return f"{str(ref.get('kind', '')).lower()}/{ref.get('name', '')}"


def _event_time(e: dict[str, Any]) -> str | None:
    return e.get("lastTimestamp") or e.get("deprecatedLastTimestamp") or e.get("eventTime") or \
        e["metadata"].get("creationTimestamp")


_AGE = ("Age", "string", 0, lambda o: _age(o["metadata"].get("creationTimestamp")))
_EVENT = [("Last Seen", "string", 0, lambda e: _age(_event_time(e))), ("Type", "string", 0, lambda e: e.get("type")),
          ("Reason", "string", 0, lambda e: e.get("reason")), ("Object", "string", 0, _event_object),
          ("Message", "string", 0, lambda e: e.get("note") or e.get("message"))]
# a built-in kind's usual columns (name, type, priority, value); "": the API server's default
_PRINTERS: dict[str, list[tuple[str, str, int, Any]]] = {
    "": [("Created At", "date", 0, lambda o: o["metadata"].get("creationTimestamp"))],
    "namespaces": [("Status", "string", 0, lambda o: (o.get("status") or {}).get("phase", "Active")), _AGE],
    "nodes": [("Status", "string", 0, lambda o: "Ready" if any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in (o.get("status") or {}).get("conditions") or [])
        else "NotReady"), ("Roles", "string", 0, lambda o: "<none>"), _AGE,
        ("Version", "string", 0, lambda o: ((o.get("status") or {}).get("nodeInfo") or {}).get("kubeletVersion", ""))],
    "pods": [("Ready", "string", 0, _ready_of), ("Status", "string", 0, _pod_status),
             ("Restarts", "string", 0, lambda p: str(sum(int(c.get("restartCount") or 0) for c in (
                 p.get("status") or {}).get("containerStatuses") or []))), _AGE,
             ("IP", "string", 1, lambda p: (p.get("status") or {}).get("podIP") or "<none>"),
             ("Node", "string", 1, lambda p: (p.get("spec") or {}).get("nodeName") or "<none>")],
    "deployments": [("Ready", "string", 0, lambda d: f"{(d.get('status') or {}).get('readyReplicas', 0)}/"
                                                      f"{(d.get('spec') or {}).get('replicas', 1)}"),
                    ("Up-to-date", "integer", 0, lambda d: (d.get("status") or {}).get("updatedReplicas", 0)),
                    ("Available", "integer", 0, lambda d: (d.get("status") or {}).get("availableReplicas", 0)), _AGE],
    "events": _EVENT,
    "services": [("Type", "string", 0, lambda s: (s.get("spec") or {}).get("type", "ClusterIP")),
                 ("Cluster-IP", "string", 0, lambda s: (s.get("spec") or {}).get("clusterIP", "<none>")),
                 ("Port(s)", "string", 0, lambda s: ",".join(f"{p.get('port')}/{p.get('protocol', 'TCP')}" for p in (
                     s.get("spec") or {}).get("ports") or []) or "<none>"), _AGE],
    "configmaps": [("Data", "integer", 0, lambda o: len(o.get("data") or {}) + len(o.get("binaryData") or {})), _AGE],
    "secrets": [("Type", "string", 0, lambda o: o.get("type", "Opaque")),
                ("Data", "integer", 0, lambda o: len(o.get("data") or {})), _AGE],
    "serviceaccounts": [("Secrets", "integer", 0, lambda o: len(o.get("secrets") or [])), _AGE],
}

# the fields each kind's list/watch can select on, besides metadata.name and metadata.namespace
_EVENT_FIELDS = ("involvedObject.kind", "involvedObject.namespace", "involvedObject.name", "involvedObject.uid",
                 "involvedObject.apiVersion", "involvedObject.resourceVersion", "involvedObject.fieldPath", "reason",
                 "reportingComponent", "source", "type")
_FIELDS: dict[tuple[str, str, str], tuple[str, ...]] = {
    ("", "v1", "pods"): ("spec.nodeName", "spec.restartPolicy", "spec.schedulerName", "spec.serviceAccountName",
                         "spec.hostNetwork", "status.phase", "status.podIP", "status.nominatedNodeName"),
    ("", "v1", "nodes"): ("spec.unschedulable",),
    ("", "v1", "namespaces"): ("status.phase",),
    ("", "v1", "secrets"): ("type",),
    ("", "v1", "events"): _EVENT_FIELDS,
    ("events.k8s.io", "v1", "events"): ("reason", "regarding.kind", "regarding.namespace", "regarding.name",
                                        "regarding.uid", "regarding.apiVersion", "regarding.resourceVersion",
                                        "regarding.fieldPath", "reportingController", "type"),
}


def _fields_match(rkey: tuple[str, str, str], obj: dict[str, Any], terms: list[tuple[str, str, bool]]) -> bool:
    for field_, value, equal in terms:
        path = {"source": "source.component"}.get(field_, field_) if rkey == ("", "v1", "events") else field_
        got = _jsonpath(obj, "." + path)
        text = "" if got is None else (str(got).lower() if isinstance(got, bool) else str(got))
        if (text == value) != equal:
            return False
    return True


def _core_event(e: dict[str, Any]) -> dict[str, Any]:
    """An ``events.k8s.io/v1`` Event as the API server serves it through ``core/v1``."""
    out: dict[str, Any] = {"apiVersion": "v1", "kind": "Event", "metadata": e["metadata"],
                           "involvedObject": e.get("regarding") or {}, "reason": e.get("reason", ""),
                           "message": e.get("note", ""), "type": e.get("type", ""), "action": e.get("action", ""),
                           "eventTime": e.get("eventTime"), "reportingComponent": e.get("reportingController", ""),
                           "reportingInstance": e.get("reportingInstance", ""),
                           "source": e.get("deprecatedSource") or {"component": e.get("reportingController", "")},
                           "firstTimestamp": e.get("deprecatedFirstTimestamp"),
                           "lastTimestamp": e.get("deprecatedLastTimestamp"), "count": e.get("deprecatedCount")}
    if e.get("related"):
        out["related"] = e["related"]
    return {k: v for k, v in out.items() if v is not None}


def _prune(schema: dict[str, Any], value: Any, path: str, unknown: list[str]) -> Any:
    """Drop what a structural schema does not know (recording it in ``unknown``), and nulls it does not allow."""
    if schema.get("x-kubernetes-preserve-unknown-fields") and "properties" not in schema:
        return value
    if isinstance(value, dict) and schema.get("type") == "object":
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        out = {}
        for k, v in value.items():
            sub = (props or {}).get(k) if props is not None else (extra if isinstance(extra, dict) else None)
            if props is not None and k not in props:
                if not schema.get("x-kubernetes-preserve-unknown-fields"):
                    unknown.append(f"{path}.{k}")
                    continue
                out[k] = v
            elif v is None and sub is not None and not sub.get("nullable"):
                continue
            else:
                out[k] = _prune(sub, v, f"{path}.{k}", unknown) if sub is not None else v
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_prune(schema["items"], v, f"{path}[{i}]", unknown) for i, v in enumerate(value)]
    return value


def _default(schema: dict[str, Any], value: Any) -> Any:
    """The schema's ``default``s filled in, as the API server does before validating."""
    if isinstance(value, dict) and "properties" in schema:
        out = dict(value)
        for k, sub in schema["properties"].items():
            if k not in out and "default" in sub:
                out[k] = copy.deepcopy(sub["default"])
            if k in out:
                out[k] = _default(sub, out[k])
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_default(schema["items"], v) for v in value]
    return value


def _jsonschema(node: Any) -> Any:
    """OpenAPI v3 (``nullable``, boolean ``exclusiveMinimum``, ``x-kubernetes-*``) -> JSON Schema."""
    if isinstance(node, list):
        return [_jsonschema(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _jsonschema(v) for k, v in node.items() if not k.startswith("x-kubernetes") and k != "nullable"}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    for bound, limit in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if out.get(bound) is True:
            out[bound] = out.pop(limit)
        elif out.get(bound) is False:
            del out[bound]
    return out


def _schema_errors(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    import jsonschema

    v = jsonschema.Draft202012Validator(_jsonschema(schema))
    return [f"{'.'.join([path, *(str(p) for p in e.absolute_path)])}: Invalid value: {json.dumps(e.instance)[:80]}: "
            f"{e.message}" for e in sorted(v.iter_errors(value), key=lambda e: list(map(str, e.absolute_path)))]


_CEL: dict[str, Any] = {}


def _cel_errors(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    """The CEL rules (``x-kubernetes-validations``) of ``schema`` and its properties over ``value``."""
    import celpy

    errors = []
    for rule in schema.get("x-kubernetes-validations") or []:
        if "oldSelf" in rule["rule"]:
            continue  # transition rules: the emulator keeps no old object for them
        if rule["rule"] not in _CEL:
            env = celpy.Environment()
            _CEL[rule["rule"]] = env.program(env.compile(rule["rule"]))
        try:
            ok = bool(_CEL[rule["rule"]].evaluate({"self": celpy.json_to_cel(value)}))
        except Exception as e:  # noqa: BLE001 - a rule that cannot be evaluated is reported as the server does
            errors.append(f"{path}: Invalid value: \"object\": {rule['rule']}: {e}")
            continue
        if not ok:
            errors.append(f'{path}: Invalid value: "object": {rule.get("message") or rule["rule"]}')
    if isinstance(value, dict):
        for k, sub in (schema.get("properties") or {}).items():
            if value.get(k) is not None:
                errors += _cel_errors(sub, value[k], f"{path}.{k}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            errors += _cel_errors(schema["items"], v, f"{path}[{i}]")
    return errors


def _protobuf_fields(buf: bytes) -> list[tuple[int, Any]]:
    """(field number, value) of one protobuf message: varints as ints, length-delimited as bytes."""
    out, i = [], 0

    def varint() -> int:
        nonlocal i
        shift = n = 0
        while True:
            b = buf[i]
            i += 1
            n |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return n

    while i < len(buf):
        tag = varint()
        wire = tag & 7
        if wire == 0:
            out.append((tag >> 3, varint()))
        elif wire == 2:
            n = varint()
            out.append((tag >> 3, buf[i:i + n]))
            i += n
        else:
            raise _Fail(415, "UnsupportedMediaType", f"protobuf wire type {wire} is not decoded here; send JSON")
    return out


def _namespace_from_protobuf(body: bytes) -> dict[str, Any]:
    """A ``v1`` Namespace from the API's protobuf envelope (``k8s\\0`` + ``runtime.Unknown``): its
    metadata's name, labels and annotations (a Namespace's spec and status are the server's)."""
    if not body.startswith(b"k8s\x00"):
        raise _Fail(400, "BadRequest", "protobuf body without the k8s envelope")
    raw = next((v for f, v in _protobuf_fields(body[4:]) if f == 2), b"")
    meta_raw = next((v for f, v in _protobuf_fields(raw) if f == 1), b"")
    meta: dict[str, Any] = {}
    for f, v in _protobuf_fields(meta_raw):
        if f in (1, 2) and v:
            meta["name" if f == 1 else "generateName"] = v.decode()
        elif f in (11, 12):
            kv = dict(_protobuf_fields(v))
            meta.setdefault("labels" if f == 11 else "annotations", {})[kv.get(1, b"").decode()] = \
                kv.get(2, b"").decode()
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": meta}


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
