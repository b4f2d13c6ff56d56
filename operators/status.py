"""Status conditions and ``events.k8s.io/v1`` Events for the elastic custom resources.

What it is for: the operator's reasons (the controller's decision reasons, spec refusals)
reach ``kubectl get/describe`` here. Conditions follow the Kubernetes API conventions:
``type``, ``status``, ``reason``, ``message``, ``observedGeneration``, ``lastTransitionTime``
(which moves only when ``status`` flips). ``StatusWriter`` skips writes that change nothing,
so a quiet cluster sees no watch traffic from us.

What it must not do: decide anything, or write ``spec`` (status goes through ``/status``).
"""

from __future__ import annotations

import logging
import threading
from datetime import UTC, datetime
from typing import Any

from elastic.crds import GROUP, VERSION

log = logging.getLogger("operators.status")

MERGE = "application/merge-patch+json"
REPORTING_CONTROLLER = "elastic.dev/operator"
KIND_OF = {"gpupools": "GPUPool", "inferenceservices": "InferenceService", "elastictrainingjobs": "ElasticTrainingJob"}


def now_rfc3339() -> str:
    return datetime.now(tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(conditions: list[dict[str, Any]], type_: str, status: bool | str, reason: str, message: str,
                  generation: int, now: str | None = None) -> list[dict[str, Any]]:
    """``conditions`` with ``type_`` set; ``lastTransitionTime`` kept unless ``status`` changed."""
    st = status if isinstance(status, str) else ("True" if status else "False")
    old = next((c for c in conditions if c.get("type") == type_), None)
    since = old["lastTransitionTime"] if old and old.get("status") == st and old.get("lastTransitionTime") else (
        now or now_rfc3339())
    new = {"type": type_, "status": st, "reason": reason, "message": message[:32768],
           "observedGeneration": int(generation), "lastTransitionTime": since}
    return [new if c.get("type") == type_ else c for c in conditions] if old else [*conditions, new]


def condition(conditions: list[dict[str, Any]], type_: str) -> dict[str, Any] | None:
    return next((c for c in conditions if c.get("type") == type_), None)


class StatusWriter:
    """Patches ``/status`` of our CRs (merge patch) and posts Events; remembers what it wrote."""

    def __init__(self, api_client: Any, *, instance: str) -> None:
        from kubernetes import client

        self.custom = client.CustomObjectsApi(api_client)
        self.events = client.EventsV1Api(api_client)
        self.instance = instance
        self._written: dict[tuple[str, str | None, str], dict[str, Any]] = {}
        self._lock = threading.Lock()

    def known(self, plural: str, namespace: str | None, name: str) -> dict[str, Any]:
        with self._lock:
            return dict(self._written.get((plural, namespace, name), {}))

    def seed(self, plural: str, namespace: str | None, name: str, status: dict[str, Any] | None) -> None:
        """Start from the status the object carries (after an operator restart)."""
        with self._lock:
            self._written.setdefault((plural, namespace, name), dict(status or {}))

    def forget(self, plural: str, namespace: str | None, name: str) -> None:
        with self._lock:
            self._written.pop((plural, namespace, name), None)

    def conditions(self, plural: str, namespace: str | None, name: str) -> list[dict[str, Any]]:
        return list(self.known(plural, namespace, name).get("conditions", []))

    def patch(self, plural: str, namespace: str | None, name: str, status: dict[str, Any]) -> bool:
        """Merge ``status`` into the object's status; returns False when nothing would change."""
        from kubernetes.client.exceptions import ApiException

        key = (plural, namespace, name)
        with self._lock:
            before = self._written.get(key, {})
            after = {**before, **status}
            if after == before:
                return False
        body = {"status": status}
        try:
            if namespace is None:
                self.custom.patch_cluster_custom_object_status(GROUP, VERSION, plural, name, body, _content_type=MERGE)
            else:
                self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, plural, name, body,
                                                                  _content_type=MERGE)
        except ApiException as e:
            if e.status == 404:
                return False  # deleted meanwhile
            log.warning("status of %s %s/%s not written: HTTP %s %s", plural, namespace, name, e.status, e.reason)
            return False
        with self._lock:
            self._written[key] = after
        return True

    def set_condition(self, plural: str, namespace: str | None, name: str, type_: str, status: bool, reason: str,
                      message: str, generation: int, extra: dict[str, Any] | None = None) -> bool:
        """Set one condition (and extra status fields); True when the condition's status flipped or is new."""
        conds = self.conditions(plural, namespace, name)
        old = condition(conds, type_)
        new = set_condition(conds, type_, status, reason, message, generation)
        self.patch(plural, namespace, name, {"conditions": new, "observedGeneration": generation, **(extra or {})})
        return old is None or old.get("status") != ("True" if status else "False") or old.get("reason") != reason

    def event(self, plural: str, namespace: str | None, name: str, uid: str | None, *, type_: str, reason: str,
              note: str, action: str) -> None:
        """Post an ``events.k8s.io/v1`` Event about one of our objects (cluster-scoped ones in ``default``)."""
        from kubernetes.client.exceptions import ApiException

        now = datetime.now(tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        regarding: dict[str, Any] = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND_OF[plural], "name": name}
        if namespace:
            regarding["namespace"] = namespace
        if uid:
            regarding["uid"] = uid
        ns = namespace or "default"
        body = {
            "apiVersion": "events.k8s.io/v1", "kind": "Event",
            "metadata": {"generateName": f"{name}.", "namespace": ns},
            "eventTime": now, "reportingController": REPORTING_CONTROLLER, "reportingInstance": self.instance,
            "action": action[:128], "reason": reason[:128], "note": note[:1024], "type": type_,
            "regarding": regarding,
        }
        try:
            self.events.create_namespaced_event(ns, body)
        except ApiException as e:
            log.warning("event %s on %s/%s not posted: HTTP %s %s", reason, ns, name, e.status, e.reason)
