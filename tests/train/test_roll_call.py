"""``roll_call``: before a gloo group is built, members wait for each other in a way they can give up.

The job's TCPStore as the coordinator hosts it, members as threads of this process, then a
real gloo group on loopback built on the same store."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

from elastic.train.abortable import RendezvousAborted, roll_call
from elastic.train.agent import _is_comm_error

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def master():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _members(master, ranks, world, aborted, timeout_s=60.0, build=False):
    """Ranks ``ranks`` of ``world`` take the roll call (then, with ``build``, build a gloo group on the
    same store) concurrently; returns rank -> (group, None, seconds) or (None, exception, seconds)."""
    out: dict[int, tuple] = {}

    def one(r):
        base = dist.TCPStore("127.0.0.1", master.port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=60))
        store = dist.PrefixStore("job/g2/reshard/", base)
        t0 = time.monotonic()
        try:
            roll_call(store, "roll-call", r, world, aborted, timeout_s)
            pg = dist.ProcessGroupGloo(store, r, world, datetime.timedelta(seconds=30)) if build else None
            out[r] = (pg, None, time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - what the test looks at
            out[r] = (None, e, time.monotonic() - t0)

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    return out, threads


def test_when_every_member_answers_the_group_is_built_and_works(master) -> None:
    out, threads = _members(master, [0, 1, 2], 3, lambda: None, build=True)
    for t in threads:
        t.join(60)
    assert set(out) == {0, 1, 2} and all(e is None for _, e, _ in out.values()), out
    tensors = {r: torch.tensor([float(r + 1)]) for r in out}
    works = [out[r][0].allreduce([tensors[r]]) for r in out]
    for w in works:
        w.wait()
    assert [float(t) for t in tensors.values()] == [6.0, 6.0, 6.0]


def test_a_missing_member_no_longer_holds_the_others_once_the_generation_is_given_up(master) -> None:
    why: list[str] = []
    out, threads = _members(master, [0, 1], 3, lambda: why[0] if why else None)
    time.sleep(0.5)
    assert not out, "rank 2 never came: nobody may have passed the roll call"
    given_up = time.monotonic()
    why.append("job j: generation 2 rolled back (worker w2 lost)")
    for t in threads:
        t.join(10)
    assert set(out) == {0, 1}
    for r, (_, e, _) in out.items():
        assert isinstance(e, RendezvousAborted), (r, e)
        assert "w2 lost" in str(e) and "rank 2 missing" in str(e), e
        assert _is_comm_error(e), e  # the agent takes it for a lost peer: report and wait for the recovery
    assert time.monotonic() - given_up < 2.0


def test_without_an_abort_a_missing_member_times_out_as_the_store_would(master) -> None:
    out, threads = _members(master, [0, 1], 3, lambda: None, timeout_s=0.5)
    for t in threads:
        t.join(10)
    assert set(out) == {0, 1}
    for r, (_, e, took) in out.items():
        assert isinstance(e, RuntimeError) and not isinstance(e, RendezvousAborted), (r, e)
        assert "timed out" in str(e) and "rank 2 missing" in str(e) and took < 5.0, (r, e, took)
