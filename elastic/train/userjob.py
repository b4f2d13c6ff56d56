"""A user's own training code as an elastic job: what the launcher runs and what every worker is told.

What it is for: a job whose workers run the user's entrypoint (``module:function`` or a script
path) under :class:`elastic.torch.Manager` instead of the reference trainer. The controller
plans it like any job (layouts ``tp.pp.dp`` from the declared model's shapes); this config
says how such a layout becomes the user's device mesh, and it travels to every worker as the
job config the coordinator hands out at registration (:meth:`UserJobConfig.to_json`).

A layout ``tp{t}.pp{p}.dp{d}`` is the mesh of shape ``(p, d, t)`` over the generation's ranks
``0..n-1`` (Megatron's rank order: tp fastest, then dp, then pp), its dims named by
``mesh_dims`` (e.g. ``{"dp": "dp_shard", "tp": "tp"}``). An axis ``mesh_dims`` does not name
must stay 1: a job without a ``tp`` name never gets tensor parallelism.

Must not: import torch or the user's code (the controller validates jobs without either),
choose layouts, or touch processes.
"""

from __future__ import annotations

import importlib.util
import keyword
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from elastic.model import Layout, ModelSpec, SpecError, load_model

__all__ = ["AXES", "DEFAULT_MESH_DIMS", "UserJobConfig", "check_mesh_dims", "check_entrypoint", "is_user_config", "parse_entrypoint"]

AXES = ("pp", "dp", "tp")
"""The controller's axes in mesh order (outermost first): rank = tp + tp * (dp + dp * pp)."""

DEFAULT_MESH_DIMS: dict[str, str] = {"dp": "dp_shard", "tp": "tp"}


def parse_entrypoint(entrypoint: str, field_name: str = "entrypoint") -> tuple[str, str]:
    """``("module", "module.path:function")`` or ``("script", "path/to/train.py")``; SpecError naming the field."""
    e = (entrypoint or "").strip()
    if not e:
        raise SpecError(f"{field_name}: empty; give 'package.module:function' or a script path ending in .py")
    if e.endswith(".py"):
        return "script", e
    mod, sep, fn = e.partition(":")
    parts = mod.split(".") if mod else []
    if not sep or not fn or not parts or not all(p.isidentifier() and not keyword.iskeyword(p) for p in parts) \
            or not fn.isidentifier():
        raise SpecError(f"{field_name}: {entrypoint!r} is neither 'package.module:function' nor a script path "
                        "ending in .py; e.g. 'examples.llama.job:main' or 'train.py'")
    return "module", e


def check_entrypoint(entrypoint: str, field_name: str = "entrypoint", *, cwd: str | None = None) -> None:
    """Refuse an entrypoint this process can tell will not load: a script that does not exist, a module
    Python cannot find. Finding a module imports its parent packages, not the module itself (no
    user code runs here but packages' ``__init__``). Where the code lives in another image (a
    Kubernetes pod template), do not call this: the worker reports the import error instead."""
    kind, e = parse_entrypoint(entrypoint, field_name)
    if kind == "script":
        path = e if os.path.isabs(e) or cwd is None else os.path.join(cwd, e)
        if not os.path.isfile(path):
            raise SpecError(f"{field_name}: script {e!r} does not exist (looked in {os.path.abspath(path)!r}); "
                            "give a path the workers can read")
        return
    mod = e.partition(":")[0]
    import sys

    # the workers find modules under the launcher's directory too (ELASTIC_CODE_DIR): so does the check
    added = cwd is not None and cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)  # type: ignore[arg-type]
    try:
        found = importlib.util.find_spec(mod)
    except (ImportError, ValueError) as err:
        raise SpecError(f"{field_name}: {entrypoint!r} does not import: {type(err).__name__}: {err}") from None
    finally:
        if added:
            sys.path.remove(cwd)  # type: ignore[arg-type]
    if found is None:
        raise SpecError(f"{field_name}: {entrypoint!r} does not import: no module named {mod!r} on the path; "
                        "install the package or fix the name")


def check_mesh_dims(mesh_dims: Mapping[str, str]) -> dict[str, str]:
    """``mesh_dims`` as a dict, or SpecError naming the field: axes among :data:`AXES`, ``dp`` named,
    names distinct identifiers."""
    dims = dict(mesh_dims)
    bad = sorted(set(dims) - set(AXES))
    if bad:
        raise SpecError(f"mesh_dims: unknown axis {bad[0]!r}; name the dims of axes {list(AXES)}, "
                        "e.g. {dp: dp_shard, tp: tp}")
    if "dp" not in dims:
        raise SpecError("mesh_dims: needs a name for the data-parallel axis 'dp' (e.g. dp_shard or dp_replicate)")
    names = list(dims.values())
    if any(not isinstance(n, str) or not n.isidentifier() for n in names) or len(set(names)) != len(names):
        raise SpecError(f"mesh_dims: {dims}: names must be distinct identifiers (e.g. dp_shard, tp)")
    return dims


@dataclass(frozen=True)
class UserJobConfig:
    """What a user job computes and how it is run; identical for every layout of the job.

    ``model`` is declared (a preset or a model file): the planner sizes layouts from its shapes.
    ``global_batch`` samples per optimizer step at every layout (every allowed ``dp`` must divide
    it); ``micro_batch`` the most samples a rank computes at once: a rank's share of a step is
    cut into the fewest near-equal micro-batches of at most that size.
    ``dp_replicas``: every data-parallel rank holds a full copy of its model-parallel shard's
    state (DDP, replicated parameters): a lost worker is then recovered in place from a copy.
    False (FSDP, ``dp_shard``): no copy exists, and a lost worker fails the job.
    """

    model: ModelSpec
    global_batch: int
    entrypoint: str
    args: tuple[str, ...] = ()
    micro_batch: int = 1
    seed: int = 0
    mesh_dims: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_MESH_DIMS))
    dp_replicas: bool = False

    def __post_init__(self) -> None:
        parse_entrypoint(self.entrypoint)
        if self.global_batch < 1 or self.micro_batch < 1:
            raise SpecError(f"global_batch={self.global_batch}, micro_batch={self.micro_batch}: both must be >= 1")
        object.__setattr__(self, "mesh_dims", check_mesh_dims(self.mesh_dims))
        object.__setattr__(self, "args", tuple(str(a) for a in self.args))

    # ---- the validator's view (what the reference trainer's TrainConfig answers) ----------------
    def _per_rank(self, layout: Layout) -> int:
        self.check_axes(layout)
        if self.global_batch % layout.dp:
            lo = self.global_batch // layout.dp * layout.dp
            raise SpecError(
                f"global_batch={self.global_batch} does not split over dp={layout.dp} under layout {layout} "
                f"({self.global_batch} % {layout.dp} = {self.global_batch % layout.dp}); choose a global batch that "
                f"every allowed dp divides (e.g. {lo or layout.dp} or {lo + layout.dp})")
        return self.global_batch // layout.dp

    def grad_accum(self, layout: Layout) -> int:
        """Micro-batches per step and rank: the rank's ``global_batch / dp`` samples in the fewest
        pieces of at most ``micro_batch`` (``elastic.torch.micro_batches`` cuts them so); raises
        SpecError when ``dp`` does not divide the global batch."""
        return -(-self._per_rank(layout) // self.micro_batch)

    def micro_batch_for(self, layout: Layout) -> int:
        """The largest micro-batch a rank computes under ``layout`` (pieces differ by at most one)."""
        per = self._per_rank(layout)
        return -(-per // self.grad_accum(layout))

    def check_axes(self, layout: Layout) -> None:
        """A layout the user's mesh can express: every axis above 1 has a mesh dim name."""
        if layout.ep != 1 or layout.vpp != 1 or layout.zero:
            raise SpecError(f"layout {layout}: a user job runs tp, pp and dp only (no ep, vpp or z)")
        for axis in AXES:
            n = getattr(layout, axis)
            if n > 1 and axis not in self.mesh_dims:
                raise SpecError(f"layout {layout}: {axis}={n} but mesh_dims {dict(self.mesh_dims)} names no "
                                f"{axis} dim; add one (e.g. {axis}: {axis}) or allow {axis}=1 only")

    def mesh_of(self, layout: Layout) -> tuple[tuple[str, int], ...]:
        """The user's mesh dims for ``layout``: ``((name, size), ...)`` outermost first."""
        self.check_axes(layout)
        return mesh_of_json({"mesh_dims": self.mesh_dims}, layout)

    # ---- on the wire --------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        from elastic.model import MODEL_PRESETS

        m = self.model
        return {"kind": "user", "model": m.name if MODEL_PRESETS.get(m.name) == m else m.model_dump(mode="json"),
                "global_batch": self.global_batch, "micro_batch": self.micro_batch, "seed": self.seed,
                "entrypoint": self.entrypoint, "args": list(self.args), "mesh_dims": dict(self.mesh_dims),
                "dp_replicas": self.dp_replicas}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> UserJobConfig:
        m = d.get("model")
        model = m if isinstance(m, ModelSpec) else (
            ModelSpec.from_mapping(m, source="job config 'model'") if isinstance(m, dict) else load_model(str(m)))
        return cls(model=model, global_batch=int(d["global_batch"]), entrypoint=str(d["entrypoint"]),
                   args=tuple(d.get("args") or ()), micro_batch=int(d.get("micro_batch") or 1),
                   seed=int(d.get("seed") or 0), mesh_dims=dict(d.get("mesh_dims") or DEFAULT_MESH_DIMS),
                   dp_replicas=bool(d.get("dp_replicas", False)))


def is_user_config(config: Any) -> bool:
    """A job config (an object or its JSON) of a user job rather than the reference trainer."""
    if isinstance(config, UserJobConfig):
        return True
    return isinstance(config, Mapping) and config.get("kind") == "user"


def mesh_of_json(config: Mapping[str, Any], layout: Layout) -> tuple[tuple[str, int], ...]:
    """:meth:`UserJobConfig.mesh_of` from the job config's JSON (what a worker holds), without the model."""
    dims = dict(config.get("mesh_dims") or DEFAULT_MESH_DIMS)
    out = []
    for axis in AXES:
        n = getattr(layout, axis)
        if axis in dims:
            out.append((dims[axis], n))
        elif n > 1:
            raise SpecError(f"layout {layout}: {axis}={n} but the job's mesh_dims {dims} name no {axis} dim")
    return tuple(out)


def from_spec(spec: Any, model: ModelSpec | None = None) -> UserJobConfig:
    """The config of a ``TrainingSpec`` that names an ``entrypoint`` (``model``: the loaded model spec,
    when the caller has it)."""
    if not getattr(spec, "entrypoint", None):
        raise SpecError(f"job {spec.name}: no entrypoint; it runs the reference trainer")
    return UserJobConfig(model=model or load_model(spec.model), global_batch=spec.global_batch,
                         entrypoint=spec.entrypoint, args=tuple(spec.args), micro_batch=spec.micro_batch,
                         seed=int(getattr(spec, "seed", 0) or 0),
                         mesh_dims=dict(spec.mesh_dims or DEFAULT_MESH_DIMS), dp_replicas=bool(spec.dp_replicas))
