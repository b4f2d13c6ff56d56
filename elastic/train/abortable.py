"""A roll call before a gloo group is built, which a worker can give up: no survivor hangs on a dead peer.

Building a gloo group (``init_process_group``, ``ProcessGroupGloo``) is a rendezvous: every
member writes its address under a key of the job's TCPStore and waits, inside C++, for every
other member's key. A member that dies before it wrote its key leaves the others blocked
there until the group's timeout (``pg_timeout_s``, minutes), where no interrupt reaches them;
the job's recovery meanwhile waits for their reports.

``roll_call`` runs first, in Python: each member marks itself present under ``prefix`` and
waits until every member has, polling the keys (``check``, which never blocks in the store)
and asking ``aborted()`` between polls. When that names a reason (the coordinator is
recovering or rolling back the generation the group is for) it raises
:class:`RendezvousAborted` at once, on the same path as a peer lost in a collective. Once the
roll call is complete every member is alive and at the group's door, so the C++ rendezvous
that follows finishes in milliseconds. (A Python ``torch.distributed.Store`` that gloo would
call back into was the first idea; ``PrefixStore.clone()`` over one is not implemented.)

The communicators a new engine builds over its default group (TP, DP, PP: ``elastic.train.groups``)
are rendezvous too, after the default group exists: a member lost between them left a peer
waiting for its key until the timeout (the soak: a joiner killed after a rescale's commit).
Inside :func:`abortable_groups` (the agent wraps the engine's construction in it) each of them
holds a roll call of its own first (:func:`before_group`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

POLL_MAX_S = 0.005  # a member not marked yet is looked for again after at most this long (adds <= 5 ms)


_GROUPS: ContextVar[tuple[Callable[[], str | None], float, Callable[[], None] | None] | None] = ContextVar(
    "elastic_abortable_groups", default=None)


@contextmanager
def abortable_groups(aborted: Callable[[], str | None], timeout_s: float,
                     before: Callable[[], None] | None = None) -> Iterator[None]:
    """Groups built inside hold a roll call first (:func:`before_group`), given up when ``aborted()``
    names a reason. ``before``: called before each one (fault injection for tests)."""
    token = _GROUPS.set((aborted, timeout_s, before))
    try:
        yield
    finally:
        _GROUPS.reset(token)


def before_group(store: Any, rank: int, world: int) -> None:
    """Called by a group's builder before its rendezvous, on a store of that group's own: inside
    :func:`abortable_groups` a roll call of its ``world`` members; elsewhere nothing."""
    ctx = _GROUPS.get()
    if ctx is None or world <= 1:
        return
    aborted, timeout_s, before = ctx
    if before is not None:
        before()
    roll_call(store, "roll-call", rank, world, aborted, timeout_s)


class RendezvousAborted(RuntimeError):
    """A group's rendezvous was given up because its generation is being recovered or rolled back."""


def roll_call(store: Any, prefix: str, rank: int, world: int, aborted: Callable[[], str | None],
              timeout_s: float) -> None:
    """Mark ``rank`` present under ``prefix`` in ``store`` and return once all ``world`` ranks are.

    Raises :class:`RendezvousAborted` as soon as ``aborted()`` gives a reason, and a
    ``RuntimeError`` that says "timed out" after ``timeout_s`` (as the store's own wait would).
    Both messages name the ranks still missing and say "gloo", so the agent takes them for a
    lost peer. ``prefix`` must be unique to the group being built (generation and purpose).
    """
    store.set(f"{prefix}/{rank}", b"1")
    keys = [f"{prefix}/{r}" for r in range(world)]
    deadline = time.monotonic() + timeout_s
    delay = 0.0005
    while not store.check(keys):
        why = aborted()
        if why:
            raise RendezvousAborted(f"gloo rendezvous given up ({_missing(store, keys)} missing): {why}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"gloo rendezvous timed out after {timeout_s:g} s: {_missing(store, keys)} missing")
        time.sleep(delay)
        delay = min(2 * delay, POLL_MAX_S)


def _missing(store: Any, keys: list[str]) -> str:
    absent = [k.rsplit("/", 1)[1] for k in keys if not store.check([k])]
    return "rank " + ", ".join(absent) if absent else "nobody"
