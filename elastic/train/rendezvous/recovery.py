"""Recovering a job from its surviving workers: the coordinator's decision as a pure function.

Once every survivor of a broken generation reported what it holds (or the timeout gave the
silent ones up), :func:`plan_recovery` picks the step they resume at and the layout they resume
on, or says why no consistent recovery exists. The coordinator (its liveness half) gathers the
reports under its lock, calls it, and applies the answer: it posts the directive, fails the
job, or finishes it. No lock, no clock, no I/O here; the model checks that decide whether a
layout fits come in as ``validator``.

1. **The step**: a survivor that applied step ``r`` passed ``r``'s commit, so every rank had
   reduced ``r``'s gradients; the others hold them ready and apply them alone. A survivor
   broken inside an optimizer update (its state at two steps), or a step behind without the
   gradients to catch up, leaves no consistent state.
2. **The layout**: the same model-parallel split, as many replicas as the survivors fill (the
   most the validator and the batch accept); a replica slot takes one survivor of every
   model-parallel coordinate, from whichever broken replicas hold them, intact replicas first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from elastic.model import Layout, SpecError

Validator = Callable[[Layout, Sequence[str]], None]


def recovery_candidates(
    old: Layout, ranks: dict[str, int]
) -> tuple[dict[tuple[int, int], list[str]], list[str]]:
    """The survivors of ``old`` (worker -> old rank) by the model-parallel coordinate ``(tp rank,
    pp rank)`` whose shards they hold, each list with the workers of intact replicas first (a
    replica whose every coordinate survived), then by replica and rank; and the coordinates no
    survivor holds, as text (a recovery from these survivors is impossible while any is missing).

    Example: ``tp2.pp1.dp2`` with ranks ``{w0: 0, w1: 1, w2: 2, w3: 3}`` that lost ``w1`` and
    ``w2`` has ``(0, 0): [w0]`` and ``(1, 0): [w3]``: one complete set, from two broken replicas.
    """
    per = old.tp * old.pp
    replica_of = {w: old.coords(r)[1] for w, r in ranks.items()}
    size = {d: sum(1 for x in replica_of.values() if x == d) for d in set(replica_of.values())}
    out: dict[tuple[int, int], list[str]] = {(t, p): [] for p in range(old.pp) for t in range(old.tp)}
    for w in sorted(ranks, key=lambda w: (size[replica_of[w]] < per, replica_of[w], ranks[w])):
        t, _, p = old.coords(ranks[w])
        out[(t, p)].append(w)
    missing = [f"tp rank {t}, pp rank {p}" for (t, p), ws in out.items() if not ws]
    return out, missing


def recovery_members(old: Layout, new: Layout, candidates: dict[tuple[int, int], list[str]]) -> list[str]:
    """The workers of ``new`` (``old``'s model-parallel split, fewer replicas) in its rank order:
    the rank of ``(t, k, p)`` is the ``k``-th candidate of coordinate ``(t, p)``, so that every
    survivor keeps the shard it holds. ``new.dp`` must not exceed the shortest candidate list."""
    out = []
    for i in range(new.world_size):
        t, k, p = new.coords(i)
        out.append(candidates[(t, p)][k])
    return out


@dataclass(frozen=True)
class Resume:
    """Resume at ``step`` on ``layout`` with ``members`` (its rank order); ``commit_step`` is the
    last step every member applied or holds ready."""

    step: int
    layout: Layout
    members: tuple[str, ...]
    commit_step: int


@dataclass(frozen=True)
class Stop:
    """No recovery: ``finished`` (the job reached its last step) or the job fails for ``reason``."""

    reason: str
    finished: bool = False


def consistent_step(reports: Mapping[str, Mapping[str, Any]], *, oom: bool = False) -> tuple[int, str]:
    """The step every reporting worker can stand at (the last one any applied: the others hold its
    reduced gradients, ready to apply alone), and why there is none ("" when there is). ``oom``: the
    members ran out of memory rather than lost a peer (the wording of the reason)."""
    r = max(int(x["applied"]) for x in reports.values())
    for w, x in reports.items():  # the caller's order: the first worker found is the one named
        applied, ready = int(x["applied"]), x.get("ready")
        if x.get("dirty"):
            what = "ran out of memory" if oom else "broke"
            return r, f"worker {w} {what} inside an optimizer update (state at two steps); cannot " + (
                "go on" if oom else "recover"
            )
        if applied != r and not (applied == r - 1 and ready == r and x.get("local_apply")):
            return r, (
                f"worker {w} holds step {applied} (ready {ready}) while others applied {r}; "
                + ("no consistent state to go on from" if oom else "cannot recover a consistent state")
            )
    return r, ""


def recovery_layout(
    old: Layout,
    survivor_ranks: Mapping[str, int],
    validator: Validator | None,
    *,
    global_batch: int | None,
    micro_batch: int,
) -> tuple[list[str], Layout | None, list[str]]:
    """The most replicas the survivors (worker -> old rank) fill whose layout ``validator`` and the
    batch accept, with its members in rank order; intact replicas first. With a model-parallel
    coordinate no survivor holds, none. Also every layout refused on the way, with why."""
    candidates, missing = recovery_candidates(old, dict(survivor_ranks))
    if missing:
        return (
            [],
            None,
            [
                f"no survivor holds {', '.join(missing)} of {old} (every worker that held it was "
                "lost); the state cannot be rebuilt from the survivors"
            ],
        )
    refusals: list[str] = []
    for dp in range(min(len(ws) for ws in candidates.values()), 0, -1):
        # an interleaved pipeline needs a micro-batch count that pp divides: where the smaller dp
        # leaves none, the same stages run without interleaving
        for vpp in dict.fromkeys((old.vpp, 1)):
            lay = Layout(old.tp, old.pp, dp, vpp=vpp)
            members = recovery_members(old, lay, candidates)
            try:
                if validator is not None:
                    validator(lay, members)
                if global_batch is not None and global_batch % (dp * micro_batch):
                    raise SpecError(
                        f"global_batch={global_batch} does not split into dp={dp} x micro_batch={micro_batch}"
                    )
                if global_batch is not None and vpp > 1 and (global_batch // (dp * micro_batch)) % old.pp:
                    raise SpecError(
                        f"{global_batch // (dp * micro_batch)} micro-batches per replica is not a "
                        f"multiple of pp={old.pp} (interleaved)"
                    )
            except SpecError as e:
                refusals.append(f"{lay}: {e}")
                continue
            return members, lay, refusals
    return [], None, refusals


def plan_recovery(
    old: Layout,
    ranks: Mapping[str, int],
    reports: Mapping[str, Mapping[str, Any]],
    lost: Mapping[str, str],
    *,
    why: str,
    rollback: bool,
    max_steps: int | None,
    validator: Validator | None,
    global_batch: int | None,
    micro_batch: int,
    first_reason: str,
) -> Resume | Stop:
    """How generation ``old`` (worker -> rank ``ranks``) goes on after a loss: every worker of it is
    either ``lost`` (worker -> why) or has reported (``reports``: worker -> what it holds). ``why``
    says what happened (the reasons of the losses); ``rollback``: a rescale rolled back onto these
    workers, where every old member may be alive; ``first_reason``: why the recovery began."""
    survivors = sorted((w for w in ranks if w not in lost), key=ranks.__getitem__)
    if (
        not lost and not rollback
    ):  # every worker is alive: a bug or a network fault, which a retry would repeat
        return Stop(
            f"{first_reason}; every worker reported back alive, so no worker was lost: failing rather "
            "than retrying the step"
        )
    if not survivors:
        return Stop(f"{why}; no survivor to recover from")
    r, inconsistent = consistent_step({w: reports[w] for w in survivors})  # in rank order
    if inconsistent:
        return Stop(f"{why}; {inconsistent}")
    members, lay, refusals = recovery_layout(
        old, {w: ranks[w] for w in survivors}, validator, global_batch=global_batch, micro_batch=micro_batch
    )
    if lay is None:
        return Stop(f"{why}; no layout fits the {len(survivors)} survivor(s): {'; '.join(refusals)}")
    if max_steps is not None and r + 1 >= max_steps:
        return Stop(f"reached max_steps={max_steps} ({why})", finished=True)
    return Resume(r + 1, lay, tuple(members), r)
