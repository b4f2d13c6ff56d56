"""The early reshard preparation is kept when the engine's tensors are unchanged."""

from __future__ import annotations

import torch

from elastic.train.agent import _same_tensors


def test_param_data_views_are_the_same_tensors() -> None:
    # ``param.data`` is a new tensor object on every call: identity would call every early
    # preparation stale and redo it inside the pause (the bug this guards against).
    p = torch.nn.Parameter(torch.randn(4, 3))
    m = torch.zeros(4, 3)
    a = {("w", "param"): p.data, ("w", "exp_avg"): m}
    b = {("w", "param"): p.data, ("w", "exp_avg"): m}
    assert a[("w", "param")] is not b[("w", "param")]
    assert _same_tensors(a, b)


def test_replaced_or_reshaped_tensors_are_not_the_same() -> None:
    p = torch.nn.Parameter(torch.randn(4, 3))
    a = {("w", "param"): p.data}
    assert not _same_tensors(a, {("w", "param"): p.data.clone()})  # new memory
    assert not _same_tensors(a, {("w", "param"): p.data.view(3, 4)})  # same memory, other shape
    assert not _same_tensors(a, {("w", "param"): p.data[1:]})  # a slice of it
    assert not _same_tensors(a, {("w", "param"): p.data, ("w", "exp_avg"): torch.zeros(4, 3)})  # other keys


def test_retired_groups_outlive_the_pause_and_die_on_the_reaper_thread() -> None:
    # A gloo group's destructor holds the GIL for ~20 ms: retired groups must not die inside
    # the pause (kept by _retire) and must not die on the main thread (dropped by _bury).
    import gc
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from elastic.train.agent import WorkerAgent

    agent = WorkerAgent.__new__(WorkerAgent)  # only the two fields these methods use
    agent._graveyard, agent._reaper = [], ThreadPoolExecutor(max_workers=1, thread_name_prefix="reaper-test")
    died: list[str] = []

    class Group:
        def __del__(self) -> None:
            died.append(threading.current_thread().name)

    agent._retire([Group(), Group()])
    gc.collect()
    assert died == []  # held through the rest of the rescale
    agent._bury()
    agent._reaper.shutdown(wait=True)
    assert len(died) == 2 and all(name.startswith("reaper-test") for name in died), died
    assert agent._graveyard == []
    agent._bury()  # nothing left: a no-op


def test_an_early_preparation_serves_only_the_directive_it_was_made_for() -> None:
    # A rescale abandoned before its switch step leaves its generation number to the next try.
    # The old members' early preparation for the first try must not serve the retry (other workers,
    # another layout): they would meet with a stale plan and wait for joiners that never come.
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from elastic.train.agent import WorkerAgent
    from elastic.train.rendezvous import Directive

    def directive(layout: str, workers: tuple[str, ...]) -> Directive:
        return Directive(job="j", generation=2, layout=layout, workers=workers, remap=True,
                         old_layout="tp1.pp1.dp2", old_ranks={"w0": 0, "w1": 1}, switch_step=5,
                         store_host="127.0.0.1", store_port=1, join_timeout_s=10.0)

    agent = WorkerAgent.__new__(WorkerAgent)  # only the fields these methods use
    agent.engine, agent.worker, agent._prep, agent._prep_d = None, "w0", None, None
    agent._pool = ThreadPoolExecutor(max_workers=1)
    calls: list[Directive] = []

    def plan(d: Directive, state: dict) -> SimpleNamespace:
        calls.append(d)
        return SimpleNamespace(d=d, error="", old_state={})

    agent._plan_and_prepare = plan
    first = directive("tp1.pp1.dp4", ("w0", "w1", "w2", "w3"))
    retry = directive("tp2.pp1.dp1", ("w0", "w1"))
    agent._prepare_early(first)
    assert agent._take_prep(retry).d == retry and calls == [first, retry]
    agent._prepare_early(retry)
    agent._prepare_early(retry)  # told again with every step's "pending": prepared once
    assert agent._take_prep(Directive.from_json(retry.to_json())).d == retry and calls == [first, retry, retry]
    agent._pool.shutdown()
