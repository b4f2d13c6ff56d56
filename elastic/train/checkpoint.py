"""Periodic sharded checkpoints: the safety net for a loss that no surviving replica covers.

What it is for: a rescale needs no checkpoint (the state moves between live workers), and a
worker lost while training is recovered from its data-parallel replicas. Where no replica
holds what was lost -- ``dp = 1``, ZeRO-1's optimizer slices, two losses in one replica
group -- the job fails. With checkpoints on, its next start begins at the newest complete
checkpoint instead of step 0, on whatever layout it is started on: every new rank reads its
boxes out of the saved layout's files by intersection, as the resharder moves them over the
wire (:mod:`elastic.reshard.spec` is the contract for both).

On disk, one directory per job::

    <dir>/step-00000120-tp2.pp1.dp2/rank-00000.pt ... rank-00003.pt

``step`` is the step the job continues at (the state after steps ``0 .. step - 1``; the Adam
step count is the training step and the data is a function of the step, so nothing else is
needed). Each rank writes one file with the boxes it *owns* (:func:`owned_pieces`): one copy
of the state in all, spread evenly over the data-parallel replicas (each writes ``1/dp`` of
what they all hold, split on dim 0). A rank file is written to a temporary name, flushed to
disk and renamed; a checkpoint is *complete* when every rank of its layout has its file.
Incomplete ones (a worker died while writing) are ignored and later pruned.

What it must not do: decide when to save (the coordinator does, for every rank of a
generation at once: every ``every_steps`` steps, every ``every_seconds``, or when asked; see
:mod:`elastic.train.rendezvous`) or block a step on disk (the agent copies the tensors, then
writes in a background thread). ``latest`` and ``prune`` touch only file names (no torch):
the coordinator and, where it cannot see the directory, the workers call them.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic.model import Layout, ModelSpec, SpecError
from elastic.reshard.spec import split_range

log = logging.getLogger(__name__)

FORMAT = 1
_DIR = re.compile(r"^step-(\d{8,})-(tp\d+\.pp\d+\.dp\d+(?:\.[a-z]+\d+)*)$")
_RANK = re.compile(r"^rank-(\d{5,})\.pt$")


class CheckpointError(SpecError):
    """A checkpoint cannot be used for this job or layout (nothing was changed)."""


@dataclass(frozen=True)
class CheckpointSettings:
    """A job's checkpointing: where, how often, how many complete ones to keep.

    How often: at every multiple of ``every_steps`` steps and/or once ``every_seconds`` have
    passed since the last one (whichever comes first; ``None`` turns that rule off, one must
    stay on). A checkpoint is never begun while the previous one is still being written or a
    rescale is in flight; a postponed one is taken at the first step that allows it."""

    dir: str
    every_steps: int | None = 100
    keep: int = 2
    # False where the coordinator runs without the workers' volume (the Kubernetes operator): it then
    # starts a job at the newest complete checkpoint its workers report when they register
    coordinator_sees: bool = True
    every_seconds: float | None = None

    def __post_init__(self) -> None:
        if not self.dir:
            raise SpecError("checkpoint dir is empty; give a directory every worker can write (a shared volume)")
        if self.every_steps is not None and self.every_steps < 1:
            raise SpecError(f"checkpoint every_steps={self.every_steps}: must be >= 1 (or unset, with every_seconds)")
        if self.every_seconds is not None and not self.every_seconds > 0:
            raise SpecError(f"checkpoint every_seconds={self.every_seconds}: must be > 0 (or unset)")
        if self.every_steps is None and self.every_seconds is None:
            raise SpecError("checkpoint: neither every_steps nor every_seconds is set; give at least one "
                            "(e.g. every_steps: 100)")
        if self.keep < 1:
            raise SpecError(f"checkpoint keep={self.keep}: must be >= 1 (the newest complete one is what a "
                            "restart begins at)")

    def to_json(self) -> dict[str, Any]:
        return {"dir": self.dir, "every_steps": self.every_steps, "every_seconds": self.every_seconds,
                "keep": self.keep}

    def check_writable(self) -> None:
        """Create the directory and write a file in it, or raise SpecError naming it (a job must
        not train for hours believing it is protected)."""
        probe = Path(self.dir) / f".probe-{os.getpid()}"
        try:
            Path(self.dir).mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise SpecError(f"checkpoint dir {self.dir!r} is not writable here ({e.strerror or e}); give "
                            "checkpoint.dir a directory every worker and the coordinator can write") from e

    @classmethod
    def from_json(cls, d: Mapping[str, Any] | None) -> CheckpointSettings | None:
        if not d:
            return None
        steps, secs = d.get("every_steps", 100), d.get("every_seconds")
        return cls(str(d["dir"]), None if steps is None else int(steps), int(d.get("keep", 2)),
                   every_seconds=None if secs is None else float(secs))


@dataclass(frozen=True)
class CheckpointRef:
    """One complete checkpoint: the step the job continues at, the layout it was saved under."""

    path: str
    step: int
    layout: str

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "step": self.step, "layout": self.layout}

    @classmethod
    def from_json(cls, d: Mapping[str, Any] | None) -> CheckpointRef | None:
        return None if not d else cls(str(d["path"]), int(d["step"]), str(d["layout"]))


def dir_name(step: int, layout: Layout | str) -> str:
    return f"step-{step:08d}-{layout}"


def rank_file(path: str | Path, rank: int) -> Path:
    return Path(path) / f"rank-{rank:05d}.pt"


def _scan(root: str | Path) -> list[tuple[CheckpointRef, bool]]:
    """Every checkpoint directory under ``root`` (oldest first) and whether it is complete."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for d in root.iterdir():
        m = _DIR.match(d.name)
        if not m or not d.is_dir():
            continue
        step, layout = int(m.group(1)), m.group(2)
        try:
            world = Layout.parse(layout).world_size
        except SpecError:
            continue
        ranks = {int(r.group(1)) for f in d.iterdir() if (r := _RANK.match(f.name))}
        out.append((CheckpointRef(str(d), step, layout), ranks >= set(range(world))))
    out.sort(key=lambda x: (x[0].step, x[0].path))
    return out


def latest(root: str | Path) -> CheckpointRef | None:
    """The newest complete checkpoint under ``root`` (None: there is none)."""
    done = [ref for ref, complete in _scan(root) if complete]
    return done[-1] if done else None


def prune(root: str | Path, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints, and incomplete ones older than the
    newest complete one (an incomplete newer one may still be being written). Returns what went."""
    scanned = _scan(root)
    done = [ref for ref, complete in scanned if complete]
    if not done:
        return []
    kept = {ref.path for ref in done[-keep:]}
    newest = done[-1].step
    gone = []
    for ref, complete in scanned:
        if ref.path in kept or (not complete and ref.step >= newest):
            continue
        shutil.rmtree(ref.path, ignore_errors=True)
        gone.append(ref.path)
    return gone


# ---- what a rank writes and reads (torch from here on) ------------------------------------------

def owned_pieces(spec: Any, rank: int) -> dict[tuple[str, str], tuple[tuple[int, int], ...]]:
    """The boxes ``rank`` writes: one copy of the state over all ranks, spread evenly.

    What data-parallel replicas all hold is split on dim 0 among them (as ZeRO-1 splits the
    optimizer state), so every replica copies and writes ``1/dp`` of it; ZeRO-1's slices are
    each their replica's own; what TP replicates (norms) is written by TP rank 0 and a tied
    embedding by the first stage."""
    tp_rank, dp_rank, pp_rank = spec.layout.coords(rank)
    out = {}
    for (name, kind), box in spec.rank_pieces(rank).items():
        t = spec.tensor(name)
        if spec.pp_ranks_of(t)[0] != pp_rank:
            continue  # a tied embedding's copy on the last stage
        if t.tp_dim is None and tp_rank:
            continue  # replicated across TP (norms, row-parallel biases)
        if kind != "param" and spec.layout.zero:
            out[(name, kind)] = box  # already this replica's own slice
            continue
        replica, count = spec.replica_group(t, dp_rank)
        a, b = box[0]
        lo, hi = split_range(b - a, count, replica)
        if hi > lo:
            out[(name, kind)] = ((a + lo, a + hi),) + tuple(box[1:])
    return out


def _owned_views(spec: Any, rank: int, state: Mapping[tuple[str, str], Any]) -> dict[tuple[str, str], Any]:
    """The parts of ``rank``'s tensors that are the boxes it owns (views, dim-0 slices)."""
    held = spec.rank_pieces(rank)
    out = {}
    for key, box in owned_pieces(spec, rank).items():
        a = box[0][0] - held[key][0][0]
        out[key] = state[key].detach()[a:a + box[0][1] - box[0][0]]
    return out


def buffer_shapes(spec: Any, rank: int, state: Mapping[tuple[str, str], Any]) -> dict[tuple[str, str], Any]:
    """(shape, dtype, pinned) of each host buffer :func:`snapshot` fills for ``rank`` (metadata only)."""
    return {k: (tuple(v.shape), v.dtype, bool(v.is_cuda)) for k, v in _owned_views(spec, rank, state).items()}


def host_buffers(shapes: Mapping[tuple[str, str], Any]) -> dict[tuple[str, str], Any]:
    """Host buffers of :func:`buffer_shapes`, their pages touched: a snapshot into them is a refill.
    Meant for a background thread right after a layout change (fresh memory faults in slowly, and
    the copy into it is what a step waits for)."""
    import torch

    out = {}
    for key, (shape, dtype, pinned) in shapes.items():
        buf = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pinned)
        if not pinned:  # pinned memory is resident already
            buf.zero_()
        out[key] = buf
    return out


def snapshot(spec: Any, rank: int, state: Mapping[tuple[str, str], Any],
             into: dict[tuple[str, str], Any] | None = None) -> dict[tuple[str, str], Any]:
    """Copies (on the host) of the boxes ``rank`` owns: the step after this one may go on at once.

    ``into``: buffers of an earlier snapshot of the same layout no longer being written, or from
    :func:`host_buffers`, filled in place (fresh host memory costs page faults: on ``gpt-100m``
    here a first copy runs at ~0.7 GB/s, a refill several times faster); buffers for CUDA
    tensors are pinned."""
    import torch

    views = _owned_views(spec, rank, state)
    reuse = into is not None and into.keys() == views.keys()
    out = {}
    for key, src in views.items():
        buf = into[key] if reuse else None
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=src.is_cuda)
        buf.copy_(src, non_blocking=src.is_cuda)
        out[key] = buf
    if any(t.is_cuda for t in state.values()):
        torch.cuda.synchronize()
    return out


def write_rank(root: str | Path, step: int, spec: Any, rank: int, pieces: Mapping[tuple[str, str], Any], *,
               job: str = "") -> Path:
    """Write one rank's file of the checkpoint at ``step`` (temporary name, fsync, rename)."""
    import torch

    d = Path(root) / dir_name(step, spec.layout)
    d.mkdir(parents=True, exist_ok=True)
    boxes = owned_pieces(spec, rank)
    doc = {
        "format": FORMAT, "job": job, "step": step, "layout": str(spec.layout), "rank": rank,
        "model": spec.model.model_dump(mode="json"),
        "pieces": {f"{name}|{kind}": [list(map(list, boxes[(name, kind)])), t]
                   for (name, kind), t in pieces.items()},
    }
    final = rank_file(d, rank)
    tmp = final.with_name(final.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(doc, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    return final


def _intersect(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...] | None:
    inter = tuple((max(x, u), min(y, v)) for (x, y), (u, v) in zip(a, b, strict=True))
    return None if any(lo >= hi for lo, hi in inter) else inter


def _numel(box: tuple[tuple[int, int], ...]) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


def load_rank(ref: CheckpointRef, model: ModelSpec, layout: Layout, rank: int,
              kind_dtypes: Mapping[str, Any], device: str = "cpu") -> dict[tuple[str, str], Any]:
    """The state ``rank`` of ``layout`` holds, read out of checkpoint ``ref`` (any saved layout).

    Only the saved ranks whose boxes meet this rank's are opened. A file this rank needs most of
    is read whole (sequential, and a saved box that is exactly a wanted one is used as it is);
    one it needs a little of is memory-mapped, so only those pages are read. Raises
    :class:`CheckpointError` naming the tensor when the checkpoint does not cover it (another
    model, a state kind it was not saved with, a damaged file)."""
    import torch

    from elastic.reshard.spec import box_shape, sharding_spec

    kinds = tuple(kind_dtypes)
    new = sharding_spec(model, layout, kinds).rank_pieces(rank)
    old_spec = sharding_spec(model, Layout.parse(ref.layout), kinds)
    files: dict[int, dict[str, Any]] = {}
    for r in range(old_spec.layout.world_size):
        owned = owned_pieces(old_spec, r)
        need = sum(_numel(i) for k, b in owned.items() if k in new and (i := _intersect(new[k], b)) is not None)
        if not need:
            continue
        path = rank_file(ref.path, r)
        try:
            doc = torch.load(path, map_location="cpu", mmap=need < sum(map(_numel, owned.values())) / 2,
                             weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file is the same error to the user
            raise CheckpointError(f"checkpoint {ref.path}: cannot read {path.name}: {type(e).__name__}: {e}") from e
        if doc.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint {ref.path}: {path.name} has format {doc.get('format')!r}, "
                                  f"this version reads {FORMAT}")
        saved = ModelSpec.model_validate(doc["model"])
        if saved != model:
            raise CheckpointError(f"checkpoint {ref.path} was saved for model {saved.name!r} "
                                  f"(hidden {saved.hidden}, {saved.layers} layers), not this job's "
                                  f"{model.name!r}: point checkpoint dir at this job's own directory")
        files[r] = doc["pieces"]
    out = {}
    for (name, kind), box in new.items():
        dtype = kind_dtypes[kind]
        found = [(tuple(tuple(x) for x in got[0]), got[1]) for p in files.values()
                 if (got := p.get(f"{name}|{kind}")) is not None]
        whole = [t for sbox, t in found if sbox == box and t.dtype == dtype]
        if whole:  # saved exactly as wanted: no copy (on the host)
            out[(name, kind)] = whole[0].to(device)
            continue
        buf = torch.empty(box_shape(box), dtype=dtype, device=device)
        covered = 0
        for sbox, t in found:
            inter = _intersect(box, sbox)
            if inter is None:
                continue
            dst = tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inter, box, strict=True))
            src = tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inter, sbox, strict=True))
            buf[dst].copy_(t[src])
            covered += _numel(inter)
        if covered != buf.numel():
            raise CheckpointError(
                f"checkpoint {ref.path} does not hold all of {name!r} ({kind}): {covered} of {buf.numel()} "
                f"elements" + ("" if found else f" (no '{kind}' state saved: the job's dtype differs from the "
                                                "checkpoint's?)"))
        out[(name, kind)] = buf
    return out
