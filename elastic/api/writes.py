"""The admin API's spec writes: create, replace and delete services and jobs.

Each write is validated first (names, the pool, the model, a user job's entrypoint) and then
written together with its audit entry in one transaction; a rejected request changes nothing.
Refused in operator mode (Kubernetes custom resources own the specs) and for a workload the
running controller manages from its config file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Response

from elastic import store as db
from elastic.api import schemas as S
from elastic.api.context import API, WRITE_ERR, Name, _Api, _errors, _workload
from elastic.api.middleware import Writer
from elastic.api.problems import Problem, invalid
from elastic.config import name_problem
from elastic.model import MODEL_PRESETS, SpecError, load_model


def _check_names(body: Any) -> None:
    """Names become URL path segments, pod names and keys: DNS-1123 labels only (as the config file's)."""
    for field, name in (("spec.name", body.spec.name), ("pool", body.pool)):
        if (why := name_problem(name)) is not None:
            raise invalid(field, why)


def _check_service(api: _Api, body: S.ServiceWrite) -> None:
    _check_names(body)
    pool = api.pool_spec(body.pool)
    s, gpn = body.spec, pool.gpus_per_node
    if s.gpus_per_replica > gpn and s.gpus_per_replica % gpn:
        raise invalid("spec.gpus_per_replica", f"{s.gpus_per_replica} GPUs per replica is more than a node ({gpn}) "
                                               "and not a multiple of it; a larger replica takes whole nodes")
    need = s.min_replicas * s.gpus_per_replica
    if need > pool.total_gpus:
        raise invalid("spec.min_replicas", f"{s.min_replicas} x {s.gpus_per_replica} = {need} GPUs exceeds pool "
                                           f"'{pool.name}' ({pool.total_gpus} GPUs); lower min_replicas")


def _check_job(api: _Api, body: S.JobWrite) -> None:
    _check_names(body)
    pool = api.pool_spec(body.pool)
    try:  # a user job too: the planner sizes it from the declared model; files only from the model directory
        _api_model(api, body.spec.model)
    except SpecError as e:
        raise invalid("spec.model", str(e)) from None
    if body.spec.entrypoint is not None:
        from elastic.train.userjob import check_entrypoint

        try:  # the controller's workers run where this process does: its path, its directory
            check_entrypoint(body.spec.entrypoint, "entrypoint", cwd=os.getcwd())
        except SpecError as e:
            raise invalid("spec.entrypoint", str(e).removeprefix("entrypoint: ")) from None
    if body.spec.min_gpus > pool.total_gpus:
        raise invalid("spec.min_gpus", f"{body.spec.min_gpus} exceeds pool '{pool.name}' ({pool.total_gpus} GPUs)")


def _name_free(api: _Api, s: Any, name: str, kind: str) -> None:
    other = db.get_job(s, name) if kind == "service" else db.get_service(s, name)
    if other is not None:
        raise Problem(409, "name-taken", f"'{name}' is already a {'training job' if kind == 'service' else 'service'}"
                                         "; names are unique across services and jobs")


def _routes_spec_writes(app: FastAPI, api: _Api) -> None:
    """POST/PUT/DELETE of services and jobs: validate, then write + audit in one transaction."""
    for kind, body_t, checker, upsert, getter, deleter in (
        ("service", S.ServiceWrite, _check_service, db.upsert_service, db.get_service, db.delete_service),
        ("job", S.JobWrite, _check_job, db.upsert_job, db.get_job, db.delete_job),
    ):
        _spec_writes(app, api, kind, body_t, checker, upsert, getter, deleter)


def _spec_writes(app: FastAPI, api: _Api, kind: str, body_t: Any, checker: Any, upsert: Any, getter: Any,
                 deleter: Any) -> None:
    plural = kind + "s"
    what = "inference service" if kind == "service" else "training job"

    def _spec_doc(body: Any) -> dict[str, Any]:
        return body.spec.model_dump(mode="json", by_alias=True)

    def create(body: Any, who: Writer) -> S.Workload:
        name = body.spec.name
        api.specs_writable(kind, name)
        checker(api, body)
        with api.audited(who, f"{kind}.create", f"{kind}/{name}", body.model_dump(mode="json", by_alias=True)) as s:
            if getter(s, name) is not None:
                raise Problem(409, "exists", f"{what} '{name}' already exists; PUT {API}/{plural}/{name} replaces it")
            _name_free(api, s, name, kind)
            rec = upsert(s, name, body.pool, _spec_doc(body))
        return _workload(rec)

    def replace(name: Name, body: Any, who: Writer) -> S.Workload:
        api.specs_writable(kind, name)
        if body.spec.name != name:
            raise invalid("spec.name", f"'{body.spec.name}' differs from the path's '{name}'; renaming is not "
                                       "supported (create the new name, delete the old)")
        api.from_config(kind, name, "replace")
        checker(api, body)
        with api.audited(who, f"{kind}.replace", f"{kind}/{name}", body.model_dump(mode="json", by_alias=True)) as s:
            if getter(s, name) is None:
                raise Problem(404, "not-found", f"{what} '{name}' not found; POST {API}/{plural} creates it")
            rec = upsert(s, name, body.pool, _spec_doc(body))
        return _workload(rec)

    # FastAPI reads the body type from the annotation, which must be the concrete model here
    create.__annotations__["body"] = replace.__annotations__["body"] = body_t
    app.post(f"{API}/{plural}", status_code=201, response_model=S.Workload, responses=_errors(*WRITE_ERR),
             tags=[plural], name=f"create_{kind}")(create)
    app.put(f"{API}/{plural}/{{name}}", response_model=S.Workload, responses=_errors(404, *WRITE_ERR),
            tags=[plural], name=f"replace_{kind}")(replace)

    @app.delete(f"{API}/{plural}/{{name}}", status_code=204, responses=_errors(404, *WRITE_ERR), tags=[plural],
                name=f"delete_{kind}")
    def delete(name: Name, who: Writer) -> Response:
        api.specs_writable(kind, name)
        api.from_config(kind, name, "delete")
        with api.audited(who, f"{kind}.delete", f"{kind}/{name}", {}) as s:
            if not deleter(s, name):
                raise Problem(404, "not-found", f"{what} '{name}' not found")
        return Response(status_code=204)


def _api_model(api: _Api, name: str) -> Any:
    """A preset, or a .yaml/.json file inside the model directory; nothing else is looked up."""
    if name not in MODEL_PRESETS and Path(name).suffix not in (".yaml", ".yml", ".json"):
        shown = name[:80] + ("..." if len(name) > 80 else "")
        raise SpecError(f"unknown model {shown!r}: use a preset ({', '.join(MODEL_PRESETS)}) or a .yaml/.json "
                        f"file in {api.model_dir}")
    return load_model(name, base_dir=api.model_dir)
