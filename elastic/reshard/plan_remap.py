"""Step 2 of the reshard planner: the rank remap. Pure.

Give surviving workers the new ranks whose state they already hold most of: a max-weight
bipartite assignment over ``W[old_rank, new_rank]`` (elements already local), where staying on
one's rank only breaks ties; with ``nodes``, whole TP groups per node so that no TP group spans
nodes. Never worse than the identity map.

This module must not import torch, ray or anything that does I/O, and never reads the clock.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.optimize import linear_sum_assignment

from elastic.model import Layout
from elastic.reshard.errors import ReshardError
from elastic.reshard.plan_boxes import Signature, _LayoutView, _signature
from elastic.reshard.spec import Kind, TensorSpec


def _local_bytes_matrix(tensors: Sequence[TensorSpec], kinds: Sequence[Kind], old: _LayoutView,
                        new: _LayoutView) -> np.ndarray:
    """``W[old_rank, new_rank]`` = elements of state a worker at ``old_rank`` already holds of what
    ``new_rank`` needs. Built as a sum over signatures of (stage-pair counts) x (position overlaps):
    ``W[(po, qo), (pn, qn)] = sum_sig C_sig[po, pn] * OV_sig[qo, qn]``."""
    Po, Pn = old.layout.pp, new.layout.pp
    counts: dict[Signature, np.ndarray] = {}
    rep: dict[Signature, TensorSpec] = {}
    for t in tensors:
        sig = _signature(t)
        c = counts.get(sig)
        if c is None:
            c = counts[sig] = np.zeros((Po, Pn), dtype=np.int64)
            rep[sig] = t
        c[np.ix_(old.stages(t), new.stages(t))] += 1
    sigs = list(counts)
    C = np.stack([counts[sig].reshape(-1) for sig in sigs]).astype(np.float64)  # [S, Po*Pn]
    OV = np.zeros((len(sigs), old.Q, new.Q), dtype=np.float64)
    for n, sig in enumerate(sigs):
        for k in kinds:
            a, b = old.pos(rep[sig], k), new.pos(rep[sig], k)
            ext = np.minimum(a.hi[:, None, :], b.hi[None, :, :]) - np.maximum(a.lo[:, None, :], b.lo[None, :, :])
            OV[n] += np.prod(np.clip(ext, 0, None), axis=2)
    # One matmul over signatures (exact: integers far below 2**53), then (po, pn, qo, qn) -> (po, qo, pn, qn).
    W = (C.T @ OV.reshape(len(sigs), -1)).reshape(Po, Pn, old.Q, new.Q).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(W).reshape(Po * old.Q, Pn * new.Q)


def _remap(
    W: np.ndarray,
    old_ranks: dict[str, int],
    new_layout: Layout,
    new_workers: Sequence[str],
    nodes: dict[str, str] | None,
    remap: bool,
) -> dict[str, int]:
    identity = {w: r for r, w in enumerate(new_workers)}
    if nodes is not None:
        _check_tp_nodes(identity, new_layout, nodes, required=not remap)
    if not remap:
        return identity
    survivors = [w for w in new_workers if w in old_ranks]
    if nodes is not None:
        chosen = _assign_by_node(W, old_ranks, new_layout, new_workers, nodes, identity)
    elif survivors:
        chosen = _assign_free(W, old_ranks, survivors, new_workers, identity)
    else:
        return identity
    # Safety net: never worse than the identity map (the node heuristic is not exact). The identity
    # map keeps every survivor on its rank, so at equal local elements it wins the tie-break.
    def local(m: dict[str, int]) -> int:
        return sum(int(W[old_ranks[w], m[w]]) for w in survivors)
    if local(chosen) <= local(identity) and (nodes is None or _check_tp_nodes(identity, new_layout, nodes, False)):
        return identity
    return chosen


def _assign_free(W: np.ndarray, old_ranks: dict[str, int], survivors: list[str], new_workers: Sequence[str],
                 identity: dict[str, int]) -> dict[str, int]:
    rows = np.array([old_ranks[w] for w in survivors])
    # Among the maps that keep the most elements local, keep the most workers where they are: the
    # optimum is then never worse than the identity map, which is one of the candidates.
    bonus = np.zeros((len(survivors), len(new_workers)))
    bonus[np.arange(len(survivors)), [identity[w] for w in survivors]] = 1
    r, c = _lex_max_assignment(W[rows, :], bonus, len(survivors))
    out = {survivors[i]: int(j) for i, j in zip(r.tolist(), c.tolist(), strict=True)}
    free = sorted(set(range(len(new_workers))) - set(out.values()))
    joiners = [w for w in new_workers if w not in out]
    out.update(zip(joiners, free, strict=True))
    return out


def _lex_max_assignment(W: np.ndarray, bonus: np.ndarray, max_bonus: int,
                        exact_below: int = 2**53) -> tuple[np.ndarray, np.ndarray]:
    """Rows -> distinct columns with the largest total ``W`` and, among those, the largest total
    ``bonus`` (``W`` and ``bonus`` hold non-negative integers, ``rows <= columns``; no assignment
    collects more than ``max_bonus``).

    One solve of ``W * (max_bonus + 1) + bonus`` is lexicographic: a unit of ``W`` outweighs any
    bonus. The solver (scipy's shortest augmenting path) works in float64; with entries of
    magnitude at most ``C``, its row and column potentials move by at most ``C`` per row added,
    so every value it forms is an integer of magnitude below ``(2 * size + 4) * C``: exact while
    ``4 * (size + 1) * C`` stays under ``exact_below``. Past that (GPT-3 175B's fp32 Adam state
    at tp8.pp16 is 4.3e9 elements per rank: past ~700 survivors), ``W`` alone is solved as well
    (no scale factor: exact far longer) and the scaled solution is kept only if its totals,
    summed as Python integers, are at least as high: the elements kept local stay the most, the
    bonus is then best effort.
    """
    n = max(W.shape)
    top = float(W.max()) if W.size else 0.0
    if max_bonus == 0 or not bonus.any():
        return linear_sum_assignment(W, maximize=True)
    scale = max_bonus + 1
    lex = linear_sum_assignment(W * scale + bonus, maximize=True)
    if 4 * (n + 1) * (top * scale + max_bonus) < exact_below:
        return lex
    plain = linear_sum_assignment(W, maximize=True)

    def total(m: np.ndarray, rc: tuple[np.ndarray, np.ndarray]) -> int:
        return sum(int(x) for x in m[rc])

    return lex if (total(W, lex), total(bonus, lex)) >= (total(W, plain), total(bonus, plain)) else plain


def _check_tp_nodes(ranks: dict[str, int], layout: Layout, nodes: dict[str, str], required: bool) -> bool:
    by_group: dict[int, set[str]] = {}
    for w, r in ranks.items():
        by_group.setdefault(r // layout.tp, set()).add(nodes[w])
    for g, ns in by_group.items():
        if len(ns) > 1:
            if required:
                raise ReshardError(
                    f"with remap off, TP group {g} of {layout} (ranks {g * layout.tp}..{g * layout.tp + layout.tp - 1}) "
                    f"spans nodes {', '.join(sorted(ns))}; a TP group never spans nodes: reorder new_workers or allow remap"
                )
            return False
    return True


def _assign_by_node(W: np.ndarray, old_ranks: dict[str, int], layout: Layout, new_workers: Sequence[str],
                    nodes: dict[str, str], identity: dict[str, int]) -> dict[str, int]:
    """Assign whole TP groups: each node's members are cut into bundles of ``tp`` workers (survivors
    in old-rank order, then joiners), and bundles are assigned to new TP groups by max weight."""
    tp = layout.tp
    per_node: dict[str, list[str]] = {}
    for w in new_workers:
        per_node.setdefault(nodes[w], []).append(w)
    bundles: list[list[str]] = []
    for node, ws in per_node.items():
        if len(ws) % tp:
            raise ReshardError(
                f"node {node} has {len(ws)} workers in the new layout {layout}, not a multiple of tp={tp}; "
                "a TP group never spans nodes: add or remove workers on that node"
            )
        surv = sorted((w for w in ws if w in old_ranks), key=lambda w: old_ranks[w])
        ws = surv + [w for w in ws if w not in old_ranks]
        bundles += [ws[i:i + tp] for i in range(0, len(ws), tp)]
    n_groups = layout.world_size // tp
    B = np.zeros((len(bundles), n_groups), dtype=np.float64)
    bonus = np.zeros((len(bundles), n_groups), dtype=np.float64)
    n_surv = 0
    for b, members in enumerate(bundles):
        for j, w in enumerate(members):
            if w in old_ranks:
                n_surv += 1
                # new rank of TP slot j in group g is g*tp + j
                B[b] += W[old_ranks[w], j::tp][:n_groups]
                if identity[w] % tp == j:
                    bonus[b, identity[w] // tp] += 1
    # Staying on one's rank only breaks ties between bundle maps that keep as many elements local.
    r, c = _lex_max_assignment(B, bonus, n_surv)
    out: dict[str, int] = {}
    for b, g in zip(r.tolist(), c.tolist(), strict=True):
        for j, w in enumerate(bundles[b]):
            out[w] = g * tp + j
    return out
