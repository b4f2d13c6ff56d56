"""Controller configuration: the pool, its inference services and training jobs (a YAML file).

Validated as a whole at load time, so a bad file is rejected before anything is started:
unknown keys, an inference minimum that alone exceeds the pool, a job whose minimum cannot
fit next to the inference minimums, an unknown model or hardware, a user job's entrypoint
that does not load. Every error names the field (``services[0].min_replicas``) and says what
to change. Pure but for reading the file handed in and looking up each entrypoint (its script,
its module on the path), whose code it never runs.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from elastic.model import (
    InferenceSpec,
    ModelSpec,
    PoolSpec,
    SpecError,
    TrainingSpec,
    _one_line,
    check_layout,
    load_model,
)

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_LABEL_MAX = 63


def name_problem(name: str) -> str | None:
    """Why ``name`` is not a DNS-1123 label (Kubernetes' rule for names: at most 63 characters,
    lower-case letters, digits and '-', starting and ending with a letter or digit), or None.
    A name goes into URL paths, pod and Deployment names and the store: nothing else is safe."""
    shown = repr(name[:40]) + ("..." if len(name) > 40 else "")
    if len(name) > DNS_LABEL_MAX:
        return f"{shown} has {len(name)} characters; a name has at most {DNS_LABEL_MAX}"
    if not _DNS_LABEL.fullmatch(name):
        return (f"{shown} is not a DNS-1123 label: use lower-case letters, digits and '-', starting and "
                "ending with a letter or digit (e.g. 'chat-7b')")
    return None


class RetentionSettings(BaseModel):
    """How long the state store keeps history, per table, in days (``null``: forever).

    The lease holder deletes older rows in batches of ``batch_rows``, at most every
    ``interval_seconds`` and for at most ``max_seconds`` each time, between ticks. Rows still
    open or in flight (a held allocation, a running reshard or action) are never deleted.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    decisions_days: float | None = Field(default=30.0, gt=0, description="decision log (changes and runs of holds)")
    allocations_days: float | None = Field(default=30.0, gt=0, description="closed allocations (who held which GPUs)")
    actions_days: float | None = Field(default=30.0, gt=0, description="finished backend actions (crash-recovery log)")
    audit_days: float | None = Field(default=365.0, gt=0, description="admin writes (who did what)")
    reshards_days: float | None = Field(default=None, gt=0, description="finished reshard events; null keeps them")
    batch_rows: int = Field(default=500, ge=1, le=10_000, description="rows per DELETE statement")
    interval_seconds: float = Field(default=300.0, gt=0, description="seconds between retention passes")
    max_seconds: float = Field(default=1.0, gt=0, description="time one pass may take; the rest waits for the next")

    def days(self) -> dict[str, float | None]:
        """Retention name (as ``elastic.store.HISTORY``) -> days kept (None: forever)."""
        return {"decisions": self.decisions_days, "allocations": self.allocations_days,
                "actions": self.actions_days, "audit": self.audit_days, "reshards": self.reshards_days}


class ControllerSettings(BaseModel):
    """How the loop runs (not what it schedules)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tick_seconds: float = Field(default=5.0, gt=0, description="seconds between reconcile cycles")
    lease_seconds: float = Field(default=15.0, gt=0, description="leader lease; another controller takes over after it")
    metrics_max_age_seconds: float = Field(default=30.0, gt=0, description="older samples count as stale (never shrink)")
    rescale_timeout_seconds: float = Field(default=120.0, gt=0)
    metrics_timeout_seconds: float | None = Field(
        default=None, gt=0, description="a metric read not answered by then is missing data (never a shrink); "
                                        "below lease_seconds; null: a third of the lease, at most 5 s")
    backend_timeout_seconds: float | None = Field(
        default=None, gt=0, description="a cluster read (ping, inventory) not answered by then makes the tick stop "
                                        "acting; below lease_seconds; null: a third of the lease, at most 5 s")
    start_backoff_seconds: float = Field(default=10.0, gt=0, description="wait after a job's first failed start or "
                                                                          "grow; doubles with each failure in a row")
    start_backoff_max_seconds: float = Field(default=300.0, gt=0, description="the longest such wait; a job running "
                                                                              "this long after a failure starts afresh")
    retention: RetentionSettings = Field(default_factory=RetentionSettings)

    @model_validator(mode="after")
    def _bounded(self) -> ControllerSettings:
        for name in ("metrics_timeout_seconds", "backend_timeout_seconds"):
            v = getattr(self, name)
            if v is not None and v >= self.lease_seconds:
                raise ValueError(f"controller.{name}={v:g} must be below lease_seconds={self.lease_seconds:g} (a "
                                 "call waited on that long would outlast the lease); lower it")
        if self.start_backoff_max_seconds < self.start_backoff_seconds:
            raise ValueError(f"controller.start_backoff_max_seconds={self.start_backoff_max_seconds:g} must be at "
                             f"least start_backoff_seconds={self.start_backoff_seconds:g}")
        return self

    def metrics_timeout(self) -> float:
        return self.metrics_timeout_seconds or min(5.0, self.lease_seconds / 3)

    def backend_timeout(self) -> float:
        return self.backend_timeout_seconds or min(5.0, self.lease_seconds / 3)

    def backoff_after(self, failures: int) -> float:
        """Seconds to wait after ``failures`` failed starts in a row: 10, 20, 40, ... up to the cap."""
        return min(self.start_backoff_max_seconds, self.start_backoff_seconds * 2.0 ** min(failures - 1, 60))


class ControllerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    pool: PoolSpec = Field(default_factory=PoolSpec)
    services: tuple[InferenceSpec, ...] = ()
    jobs: tuple[TrainingSpec, ...] = ()
    controller: ControllerSettings = Field(default_factory=ControllerSettings)

    @model_validator(mode="after")
    def _fits(self) -> ControllerConfig:
        names = [s.name for s in self.services] + [j.name for j in self.jobs]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"workload names must be unique across services and jobs; repeated: {', '.join(dup)}")
        total = self.pool.total_gpus
        for i, s in enumerate(self.services):
            if s.gpus_per_replica > self.pool.gpus_per_node and s.gpus_per_replica % self.pool.gpus_per_node:
                raise ValueError(
                    f"services[{i}].gpus_per_replica={s.gpus_per_replica}: a replica larger than a node "
                    f"({self.pool.gpus_per_node} GPUs) must take whole nodes"
                )
        inf_min = sum(s.min_replicas * s.gpus_per_replica for s in self.services)
        if inf_min > total:
            detail = " + ".join(f"{s.name} {s.min_replicas}x{s.gpus_per_replica}" for s in self.services)
            raise ValueError(
                f"services: inference minimum {detail} = {inf_min} GPUs exceeds the pool's "
                f"{self.pool.nodes}x{self.pool.gpus_per_node} = {total} GPUs; lower min_replicas or add nodes"
            )
        for i, j in enumerate(self.jobs):
            if inf_min + j.min_gpus > total:
                raise ValueError(
                    f"jobs[{i}].min_gpus={j.min_gpus} cannot fit next to the inference minimum of {inf_min} GPUs "
                    f"in a pool of {total}; lower min_gpus to at most {total - inf_min} or lower the services' minimums"
                )
        return self

    def models(self) -> dict[str, ModelSpec]:
        return {j.name: load_model(j.model) for j in self.jobs}


def load_config(path: str | Path | None = None, data: dict[str, Any] | None = None) -> ControllerConfig:
    """Read and validate a config file (or mapping). Raises SpecError with one clear line."""
    source = str(path) if path else "config"
    if data is None:
        if path is None:
            return ControllerConfig()
        p = Path(path)
        try:
            from elastic.model import load_yaml

            data = load_yaml(p.read_text()) or {}
        except OSError as e:
            raise SpecError(f"config {p}: cannot read ({e.strerror})") from None
        except Exception as e:  # noqa: BLE001 - YAML errors become one line
            raise SpecError(f"config {p}: not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{source}: expected a mapping with pool/services/jobs/controller")
    try:
        cfg = ControllerConfig.model_validate(data)
    except ValidationError as e:
        raise SpecError(f"{source}: {_located(e) or _one_line(e)}") from None
    names = [("pool.name", cfg.pool.name)] + [(f"services[{i}].name", s.name) for i, s in enumerate(cfg.services)] \
        + [(f"jobs[{i}].name", j.name) for i, j in enumerate(cfg.jobs)]
    for where, name in names:
        if (why := name_problem(name)) is not None:
            raise SpecError(f"{source}: {where}: {why}")
    for i, j in enumerate(cfg.jobs):
        try:
            model = load_model(j.model)  # a user job too: the planner sizes it from the declared model
        except SpecError as e:
            raise SpecError(f"{source}: jobs[{i}].model: {e}") from None
        if j.entrypoint is not None:
            _check_user_code(source, i, j)
        for field_name, values in (("allowed_tp", j.allowed_tp), ("allowed_pp", j.allowed_pp)):
            for v in values or ():
                if v < 1:
                    raise SpecError(f"{source}: jobs[{i}].{field_name} contains {v}; degrees must be >= 1")
        if j.allowed_tp:
            from elastic.model import Layout

            for tp in j.allowed_tp:
                try:
                    check_layout(model, Layout(tp=tp, pp=1, dp=1))
                except SpecError as e:
                    raise SpecError(f"{source}: jobs[{i}].allowed_tp: {e}") from None
    return cfg


def _located(e: ValidationError) -> str | None:
    """``jobs[0].checkpoint: ...`` for errors that name their field in ``ctx["field"]`` (a job's
    cross-field checks); None when some error does not (``_one_line`` words those)."""
    parts = []
    for err in e.errors():
        name = (err.get("ctx") or {}).get("field")
        if not name:
            return None
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
        msg = err["msg"] if err["msg"].startswith(name) else f"{name}: {err['msg']}"
        parts.append(f"{where}.{msg}" if where else msg)
    return "; ".join(parts) or None


def _check_user_code(source: str, i: int, job: TrainingSpec) -> None:
    """Refuse a job whose entrypoint this process can tell will not load (a missing script, a module
    not on the path), before anything starts; the workers run from this process's directory."""
    from elastic.train.userjob import check_entrypoint

    try:
        check_entrypoint(job.entrypoint or "", f"jobs[{i}].entrypoint", cwd=os.getcwd())
    except SpecError as e:
        raise SpecError(f"{source}: {e}") from None
