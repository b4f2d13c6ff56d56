"""The admin API's reads: pools, services and jobs, the decision log, a job's reshard history,
the database and the controller's state. Never writes."""

from __future__ import annotations

import math
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Query

from elastic import store as db
from elastic.api import schemas as S
from elastic.api.context import (
    API,
    DEFAULT_LIMIT,
    READ_ERR,
    Continue,
    Limit,
    Name,
    Order,
    _Api,
    _decision,
    _epoch,
    _errors,
    _reshard,
    _workload,
)
from elastic.api.middleware import reader
from elastic.api.problems import Problem
from elastic.model import PoolSpec


def _routes_reads(app: FastAPI, api: _Api, require_auth: bool) -> None:
    deps = [Depends(reader)] if require_auth else []  # documents the bearer scheme only where it is needed

    @app.get(f"{API}/pools", response_model=S.PoolList, responses=_errors(*READ_ERR), dependencies=deps,
             tags=["pools"])
    def list_pools() -> S.PoolList:
        return S.PoolList(items=[_pool(api, p) for p in db.list_pools(api.store)])

    @app.get(f"{API}/pools/{{name}}", response_model=S.Pool, responses=_errors(404, *READ_ERR), dependencies=deps,
             tags=["pools"])
    def get_pool(name: Name) -> S.Pool:
        rec = db.get_pool(api.store, name)
        if rec is None:
            raise Problem(404, "not-found", f"pool '{name}' not found; GET {API}/pools lists them")
        return _pool(api, rec)

    for kind, lister, getter in (("services", db.list_services, db.get_service), ("jobs", db.list_jobs, db.get_job)):
        _workload_reads(app, api, kind, lister, getter, deps)

    @app.get(f"{API}/decisions", response_model=S.DecisionList, response_model_by_alias=True,
             responses=_errors(400, *READ_ERR), dependencies=deps, tags=["history"])
    def list_decisions(limit: Limit = DEFAULT_LIMIT, cont: Continue = None, pool: str | None = None,
                       order: Order = "desc",
                       changes: Annotated[bool, Query(description="true: only changes (decisions that acted, "
                                                                  "failed or recovered), no holds")] = False,
                       ) -> S.DecisionList:
        query: dict[str, Any] = {"pool": pool, "order": order}
        if changes:  # only then: tokens minted before this parameter existed stay valid
            query["changes"] = True
        after = api.codec.decode(cont, query) if cont else None
        rows = db.list_decisions(api.store, limit + 1, after, pool=pool, newest_first=order == "desc",
                                 changes_only=changes)
        return S.DecisionList(items=[_decision(r) for r in rows[:limit]], metadata=api.page(rows, limit, query))

    @app.get(f"{API}/database", response_model=S.Database, responses=_errors(*READ_ERR), dependencies=deps,
             tags=["ops"])
    def database() -> S.Database:
        """The state database: its size and, per history table, rows, oldest kept row and retention."""
        days = api.ctl.cfg.controller.retention.days() if api.ctl is not None else {}
        return S.Database(dialect=api.store.dialect, url=api.store.url, size_bytes=db.database_size(api.store),
                          tables=[S.TableInfo(table=t.table, rows=t.rows, oldest=t.oldest,
                                              retention_days=days.get(t.table))
                                  for t in db.history_stats(api.store)])

    @app.get(f"{API}/jobs/{{name}}/reshards", response_model=S.ReshardList, response_model_by_alias=True,
             responses=_errors(400, 404, *READ_ERR), dependencies=deps, tags=["history"])
    def list_reshards(name: Name, limit: Limit = DEFAULT_LIMIT, cont: Continue = None,
                      order: Order = "desc") -> S.ReshardList:
        if db.get_job(api.store, name) is None:
            raise Problem(404, "not-found", f"training job '{name}' not found")
        query = {"job": name, "order": order}
        after = api.codec.decode(cont, query) if cont else None
        rows = db.list_reshards(api.store, name, limit + 1, after, newest_first=order == "desc")
        return S.ReshardList(items=[_reshard(r) for r in rows[:limit]], metadata=api.page(rows, limit, query))

    @app.get(f"{API}/controller", response_model=S.ControllerStatus, responses=_errors(*READ_ERR),
             dependencies=deps, tags=["controller"])
    def controller_status() -> S.ControllerStatus:
        return _controller_status(api.controller())


def _pool(api: _Api, rec: db.PoolRecord) -> S.Pool:
    alloc = db.current_allocations(api.store, rec.name)
    lease = db.lease_holder(api.store, rec.name, now=_epoch(api.now()))
    try:
        total: int | None = PoolSpec.model_validate(rec.spec).total_gpus
    except ValueError:  # a spec written by a newer version: still list the pool
        total = None
    return S.Pool(name=rec.name, spec=rec.spec, total_gpus=total,
                  allocated_gpus={w: len(a.gpus) for w, a in alloc.items()},
                  leader=lease.owner if lease else None, created_at=rec.created_at, updated_at=rec.updated_at)


def _workload_reads(app: FastAPI, api: _Api, kind: str, lister: Any, getter: Any, deps: list[Any]) -> None:
    what = "inference service" if kind == "services" else "training job"

    @app.get(f"{API}/{kind}", response_model=S.WorkloadList, responses=_errors(*READ_ERR), dependencies=deps,
             tags=[kind], name=f"list_{kind}")
    def list_all(pool: str | None = None) -> S.WorkloadList:
        return S.WorkloadList(items=[_workload(r) for r in lister(api.store, pool)])

    @app.get(f"{API}/{kind}/{{name}}", response_model=S.Workload, responses=_errors(404, *READ_ERR),
             dependencies=deps, tags=[kind], name=f"get_{kind}")
    def get_one(name: Name) -> S.Workload:
        rec = getter(api.store, name)
        if rec is None:
            raise Problem(404, "not-found", f"{what} '{name}' not found; GET {API}/{kind} lists them")
        return _workload(rec)


def _controller_status(ctl: Any) -> S.ControllerStatus:
    t = ctl.last_tick
    last = None if t is None else S.LastTick(at=_epoch(t.at), acted=t.acted, reason=t.reason, message=t.message,
                                              seconds=t.seconds, error=t.error)
    on_record = dict(getattr(ctl, "intervened", {}))
    overrides = {}
    for s, (r, u) in dict(ctl.overrides).items():
        rec = on_record.get(("override", s))
        overrides[s] = {"replicas": r, "until": _epoch(u).isoformat() if math.isfinite(u) else None,
                        "by": rec.actor if rec else None, "at": rec.at.isoformat() if rec else None}
    pinned = {j: str(next(iter(tbl.values()))[0]) for j, tbl in dict(ctl.pinned).items() if tbl}
    interventions = [S.Intervention(kind=r.kind, target=r.target, value=r.value, by=r.actor, at=r.at, until=r.until)
                     for _, r in sorted(on_record.items())]
    backoff = {j: S.JobBackoff(failures=b.failures, reason=b.reason, next_attempt_at=_epoch(b.next_at))
               for j, b in dict(getattr(ctl, "backoff", {})).items()}
    return S.ControllerStatus(pool=ctl.pool, owner=ctl.owner, leader=bool(ctl.is_leader), paused=bool(ctl.paused),
                              ready=bool(ctl.ready), last_error=ctl.last_error, last_tick=last, overrides=overrides,
                              pinned=pinned, interventions=interventions, backoff=backoff)
