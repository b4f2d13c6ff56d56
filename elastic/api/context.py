"""What every route module of the admin API shares.

The path prefix and the parameter types of the routes (names, page size, continue token, order),
the OpenAPI error responses each route can give, the conversion of store records into response
bodies, and ``_Api``: the route handlers' state (store, controller, clock, paging codec) with the
helpers every write uses (one audited transaction, the checks of operator mode and config files).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import Path as PathParam
from fastapi import Query

from elastic import store as db
from elastic.api import schemas as S
from elastic.api.auth import Principal, TokenSet
from elastic.api.pagination import ContinueCodec
from elastic.api.problems import PROBLEM_JSON, Problem, ProblemDetail, invalid
from elastic.model import PoolSpec

log = logging.getLogger("elastic.api")


API = "/api/v1"
DEFAULT_LIMIT = 50
MAX_LIMIT = 500
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$"

Name = Annotated[str, PathParam(pattern=NAME_PATTERN, description="workload or pool name")]
Limit = Annotated[int, Query(ge=1, le=MAX_LIMIT, description=f"page size, 1..{MAX_LIMIT}")]
Continue = Annotated[str | None, Query(alias="continue", max_length=2048,
                                       description="token from the previous page's metadata.continue")]
Order = Annotated[Literal["asc", "desc"], Query(description="desc: newest first (default); asc: oldest first")]


# ---- OpenAPI: the error responses each route can give -----------------------------------------------

def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    text = {400: "Malformed request (e.g. invalid JSON or continue token)", 401: "Missing or unknown bearer token",
            403: "The token is read-only", 404: "Not found", 409: "Conflict with the current state",
            415: "The body is not JSON (send Content-Type: application/json)",
            422: "Invalid input; 'field' names it", 502: "The workers could not do it (e.g. a failed write)",
            503: "Database or controller unavailable", 504: "Not done within the time asked for"}
    return {c: {"description": text[c], "model": ProblemDetail, "content": {PROBLEM_JSON: {}}} for c in codes}


READ_ERR = (401, 422, 503)
WRITE_ERR = (400, 401, 403, 409, 415, 422, 503)


# ---- record -> response ---------------------------------------------------------------------------------

def _workload(r: db.WorkloadRecord) -> S.Workload:
    return S.Workload(name=r.name, pool=r.pool, spec=r.spec, status=r.status, created_at=r.created_at,
                      updated_at=r.updated_at)


def _decision(r: db.DecisionRecord) -> S.Decision:
    return S.Decision(id=r.id, tick_at=r.tick_at, pool=r.pool, reason=r.reason, message=r.message,
                      inputs=r.inputs, plan=r.plan, hold=r.hold is not None, count=r.count, first_at=r.tick_at,
                      last_at=r.last_at or r.tick_at)


def _reshard(r: db.ReshardRecord) -> S.Reshard:
    return S.Reshard(**{f: getattr(r, f) for f in S.Reshard.model_fields})


def _epoch(t: float) -> datetime:
    return datetime.fromtimestamp(t, tz=UTC)


class _Api:
    """The route handlers' shared state: store, controller, clock, paging codec."""

    def __init__(self, store: db.Store, controller: Any | None, operator_mode: bool,
                 clock: Callable[[], float], codec: ContinueCodec) -> None:
        self.store, self.ctl, self.operator_mode, self.codec = store, controller, operator_mode, codec
        self.clock = clock
        self.tokens: TokenSet | None = None  # set by create_app: who may read the details of /readyz
        self.model_dir: Path | None = None  # set by create_app: model files of API-written specs come from here
        # interventions one at a time: the controller's live state and the audit log's last entry
        # must be the same write (two overrides racing could leave the other one live)
        self.serial = threading.Lock()

    # ---- helpers -------------------------------------------------------------------------------------
    def now(self) -> float:
        """The controller's clock when there is one (overrides are compared against it)."""
        return float(self.ctl.clock()) if self.ctl is not None else self.clock()

    def controller(self) -> Any:
        if self.ctl is None:
            raise Problem(503, "no-controller", "no controller runs in this process; this request needs "
                                                "'elastic serve' (or the operator) with the admin API enabled")
        return self.ctl

    def specs_writable(self, kind: str, name: str) -> None:
        if self.operator_mode:
            crd = "InferenceService" if kind == "service" else "TrainingJob"
            raise Problem(409, "owned-by-kubernetes",
                          f"{kind} specs are owned by Kubernetes custom resources in operator mode; use "
                          f"'kubectl apply -f <{crd}.yaml>' or 'kubectl delete {crd.lower()} {name}' instead")

    def from_config(self, kind: str, name: str, verb: str) -> None:
        """A workload the running controller manages from its config file is neither replaced nor deleted
        here: the file wins (the controller runs its spec, and every start writes it back to the store),
        so such a write would be reverted without a word. 409, naming the file; the header
        ``Elastic-Spec-Source: config`` says which source wins."""
        ctl = self.ctl
        if ctl is None:
            return
        declared = ctl.cfg.services if kind == "service" else ctl.cfg.jobs
        if any(w.name == name for w in declared):
            where = getattr(ctl, "config_source", None) or "the config file given to the controller"
            fix = ("remove it from that file and restart the controller to delete it" if verb == "delete" else
                   "change it in that file and restart the controller")
            raise Problem(409, "declared-in-config",
                          f"{kind} '{name}' is declared in {where} and the running controller manages it from "
                          f"there: the config file wins over the API (every start writes its spec back); {fix}",
                          headers={"Elastic-Spec-Source": "config"})

    def pool_spec(self, name: str, field: str = "pool") -> PoolSpec:
        rec = db.get_pool(self.store, name)
        if rec is None:
            known = ", ".join(p.name for p in db.list_pools(self.store)) or "none yet"
            raise invalid(field, f"unknown pool '{name}'; known pools: {known}")
        return PoolSpec.model_validate(rec.spec)

    def page(self, rows: list[Any], limit: int, query: dict[str, Any]) -> S.ListMeta:
        more = len(rows) > limit
        token = self.codec.encode(rows[limit - 1].id, query) if more else None
        return S.ListMeta(continue_=token)

    @contextmanager
    def audited(self, who: Principal, action: str, target: str, detail: Any) -> Iterator[Any]:
        """One transaction holding the write and its audit entry: both or neither."""
        with self.store.session() as s:
            yield s
            db.record_audit(s, actor=who.name, action=action, target=target, detail={"request": detail})
        log.info("%s %s by %s", action, target, who.name)
