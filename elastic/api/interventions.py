"""The admin API's interventions: pin a job's layout, ask for a checkpoint, pin a service's
replicas, pause and resume the controller.

Each one records operator intent on the controller (and in the audit log, in the same
transaction); the controller's next tick acts on it. A layout is validated by the planner first.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import FastAPI, Response

from elastic import store as db
from elastic.api import schemas as S
from elastic.api.context import API, WRITE_ERR, Name, _Api, _epoch, _errors
from elastic.api.middleware import Writer
from elastic.api.problems import Problem, invalid
from elastic.api.reads import _controller_status
from elastic.api.writes import _api_model
from elastic.backends.base import BackendError, CheckpointNotSaved
from elastic.model import (
    InferenceSpec,
    Layout,
    SpecError,
    TrainingSpec,
    check_layout,
    load_hardware,
    load_model,
)


def _routes_interventions(app: FastAPI, api: _Api) -> None:
    @app.post(f"{API}/jobs/{{name}}/rescale", status_code=202, response_model=S.RescaleResult,
              responses=_errors(404, *WRITE_ERR), tags=["jobs"])
    def rescale(name: Name, body: S.RescaleRequest, who: Writer) -> S.RescaleResult:
        ctl = api.controller()
        rec = db.get_job(api.store, name)
        if rec is None:
            raise Problem(404, "not-found", f"training job '{name}' not found")
        planned = None if body.layout is None else _feasible(api, rec, body.layout)
        layout = None if planned is None else planned.layout
        with api.serial, _restoring(ctl.pinned, name), _restoring(ctl.intervened, ("pin", name)), \
                api.audited(who, "job.rescale", f"job/{name}", body.model_dump()) as s:
            try:
                ctl.pin_layout(name, layout, actor=who.name, store=s)
            except KeyError:
                raise Problem(409, "not-managed", f"training job '{name}' is not managed by the running controller "
                                                  "(it was added after the controller started); restart it") from None
        if layout is None:
            return S.RescaleResult(job=name, layout=None, world_size=None, tokens_per_second=None,
                                   gpu_memory_bytes=None, message="unpinned; the co-scheduler chooses the layout")
        return S.RescaleResult(job=name, layout=str(layout), world_size=layout.world_size,
                               tokens_per_second=planned.tokens_per_second,
                               gpu_memory_bytes=planned.memory.total,
                               message=f"pinned to {layout}; the controller rescales at its next tick when "
                                       f"{layout.world_size} GPUs are free for it")

    @app.post(f"{API}/jobs/{{name}}/checkpoint", response_model=S.CheckpointResult,
              responses={**_errors(404, *WRITE_ERR, 502, 504), 202: {"model": S.CheckpointResult,
                                                                   "description": "Asked for, not waited for"}},
              tags=["jobs"])
    def checkpoint(name: Name, body: S.CheckpointRequest, who: Writer, response: Response) -> S.CheckpointResult:
        """Save the job's state at its next step boundary (before maintenance, a risky change):
        a sharded checkpoint in its checkpoint directory, as the periodic ones."""
        ctl = api.controller()
        if db.get_job(api.store, name) is None:
            raise Problem(404, "not-found", f"training job '{name}' not found")
        with api.audited(who, "job.checkpoint", f"job/{name}", body.model_dump()):
            pass  # on record before it is asked for; nothing to undo if the audit cannot be written
        try:
            out = ctl.checkpoint_job(name, body.wait_seconds)
        except KeyError:
            raise Problem(409, "not-managed", f"training job '{name}' is not managed by the running controller "
                                              "(it was added after the controller started); restart it") from None
        except SpecError as e:
            raise Problem(409, "no-checkpoint", f"{e}") from None
        except CheckpointNotSaved as e:
            raise Problem(502, "checkpoint-failed", f"{e}") from None
        except BackendError as e:
            raise Problem(409, "not-running", f"{e}") from None
        except TimeoutError as e:
            raise Problem(504, "checkpoint-timeout", f"{e}; it is still taken once allowed: watch the job's "
                                                     "checkpointStep") from None
        if out.step is None:
            response.status_code = 202
            msg = (f"asked for; the next step boundary that allows it saves it (newest complete now: "
                   f"{'step ' + str(out.previous_step) if out.previous_step >= 0 else 'none'})")
        else:
            msg = f"saved at step {out.step} on every rank"
        return S.CheckpointResult(job=name, previous_step=out.previous_step, step=out.step, message=msg)

    @app.put(f"{API}/services/{{name}}/override", response_model=S.Override, responses=_errors(404, *WRITE_ERR),
             tags=["services"])
    def set_override(name: Name, body: S.OverrideRequest, who: Writer) -> S.Override:
        ctl = api.controller()
        spec = _managed_service(api, ctl, name)
        until, now = body.until.timestamp(), api.now()
        if until <= now:
            raise invalid("until", f"{body.until.isoformat()} is not in the future (now {_epoch(now).isoformat()}); "
                                   "give a later RFC 3339 time")
        if not spec.min_replicas <= body.replicas <= spec.max_replicas:
            raise invalid("replicas", f"{body.replicas} is outside [{spec.min_replicas}, {spec.max_replicas}] "
                                      f"(min_replicas, max_replicas) of '{name}'")
        with api.serial, _restoring(ctl.overrides, name), _restoring(ctl.intervened, ("override", name)), \
                api.audited(who, "service.override", f"service/{name}", body.model_dump(mode="json")) as s:
            try:
                ctl.set_override(name, body.replicas, until, actor=who.name, store=s)
            except ValueError as e:
                raise invalid("replicas", str(e)) from None
        return S.Override(service=name, replicas=body.replicas, until=body.until,
                          message=f"'{name}' pinned to {body.replicas} replicas until {body.until.isoformat()}")

    @app.delete(f"{API}/services/{{name}}/override", response_model=S.Override, responses=_errors(404, *WRITE_ERR),
                tags=["services"])
    def clear_override(name: Name, who: Writer) -> S.Override:
        ctl = api.controller()
        _managed_service(api, ctl, name)
        with api.serial, _restoring(ctl.overrides, name), _restoring(ctl.intervened, ("override", name)), \
                api.audited(who, "service.override.clear", f"service/{name}", {}) as s:
            ctl.clear_override(name, store=s)
        return S.Override(service=name, replicas=None, until=None, message="override cleared; the policy decides")

    for verb in ("pause", "resume"):
        _pause_route(app, api, verb)


def _pause_route(app: FastAPI, api: _Api, verb: str) -> None:
    @app.post(f"{API}/controller/{verb}", response_model=S.ControllerStatus, responses=_errors(*WRITE_ERR),
              tags=["controller"], name=f"controller_{verb}")
    def act(who: Writer) -> S.ControllerStatus:
        ctl = api.controller()
        before = ctl.paused
        try:
            with api.serial, _restoring(ctl.intervened, ("pause", ctl.pool)), \
                    api.audited(who, f"controller.{verb}", f"pool/{ctl.pool}", {}) as s:
                ctl.pause(actor=who.name, store=s) if verb == "pause" else ctl.resume(store=s)
        except BaseException:
            ctl.paused = before  # the audit write failed: undo, so the DB and the controller agree
            raise
        return _controller_status(ctl)


@contextmanager
def _restoring(mapping: dict[Any, Any], key: Any) -> Iterator[None]:
    """Put ``mapping[key]`` back as it was if the block fails (e.g. the audit commit)."""
    had, old = key in mapping, mapping.get(key)
    try:
        yield
    except BaseException:
        if had:
            mapping[key] = old
        else:
            mapping.pop(key, None)
        raise


def _managed_service(api: _Api, ctl: Any, name: str) -> InferenceSpec:
    if db.get_service(api.store, name) is None:
        raise Problem(404, "not-found", f"inference service '{name}' not found")
    for s in ctl.cfg.services:
        if s.name == name:
            return s
    raise Problem(409, "not-managed", f"inference service '{name}' is not managed by the running controller "
                                      "(it was added after the controller started); restart it")


def _feasible(api: _Api, rec: db.JobRecord, text: str) -> Any:
    """Validate ``text`` for the job with the planner; 422 naming ``layout`` and the reason otherwise.

    Steps: 1. parse; 2. the job's bounds and allowed degrees; 3. the pool's size; 4. the model's
    structure (``check_layout``) and, for a user job, its mesh (``check_axes``); 5. memory and batch
    (``evaluate``).
    """
    from elastic.parallel.planner import evaluate  # the planner is pure but heavy: import on use

    try:
        layout = Layout.parse(text)
    except SpecError as e:
        raise invalid("layout", str(e)) from None
    job = TrainingSpec.model_validate(rec.spec)
    for d in (rec.status or {}).get("droppedLayouts") or []:
        if isinstance(d, dict) and d.get("layout") == str(layout):
            raise invalid("layout", f"{layout} was dropped for job '{rec.name}' for the rest of its life "
                                    f"({d.get('reason')}: {d.get('message')}); pin another layout")
    pool = api.pool_spec(rec.pool, field="pool")
    n = layout.world_size
    if not job.min_gpus <= n <= job.max_gpus:
        raise invalid("layout", f"{layout} uses {n} GPUs, outside the job's [{job.min_gpus}, {job.max_gpus}] "
                                "(min_gpus, max_gpus)")
    if n > pool.total_gpus:
        raise invalid("layout", f"{layout} needs {n} GPUs; pool '{pool.name}' has {pool.total_gpus}")
    for axis, allowed in (("tp", job.allowed_tp), ("pp", job.allowed_pp)):
        if allowed and getattr(layout, axis) not in allowed:
            raise invalid("layout", f"{axis}={getattr(layout, axis)} is not in the job's allowed_{axis} {allowed}")
    try:
        model = _job_model(api, job)
        check_layout(model, layout, pool.gpus_per_node)
        if job.entrypoint is not None:  # the user's mesh: tp, pp, dp only, each axis above 1 named
            from elastic.train.userjob import from_spec

            from_spec(job, model).check_axes(layout)
        planned = evaluate(model, layout, load_hardware(pool.hardware), gpus_per_node=pool.gpus_per_node,
                           global_batch=job.global_batch)
    except SpecError as e:
        raise invalid("layout", str(e)) from None
    if not planned.fits:
        raise invalid("layout", f"{layout} is infeasible on {pool.hardware}: {planned.reason}")
    return planned


def _job_model(api: _Api, job: TrainingSpec) -> Any:
    """The job's model: a preset, a file the controller's config named (trusted, as the controller
    reads it), or else a file inside the model directory."""
    ctl = api.ctl
    if ctl is not None and any(j.name == job.name and j.model == job.model for j in ctl.cfg.jobs):
        return load_model(job.model)
    return _api_model(api, job.model)
