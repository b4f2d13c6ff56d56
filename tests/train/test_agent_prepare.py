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
    from types import SimpleNamespace

    from elastic.train.rendezvous import Directive

    agent = _bare_agent()
    calls: list[Directive] = []

    def plan(d: Directive, state: dict, **_kw) -> SimpleNamespace:
        calls.append(d)
        return SimpleNamespace(d=d, error="", deferred="", old_state={})

    agent._plan_and_prepare = plan
    first = directive("tp1.pp1.dp4", ("w0", "w1", "w2", "w3"))
    retry = directive("tp2.pp1.dp1", ("w0", "w1"))
    agent._prepare_early(first)
    assert agent._take_prep(retry).d == retry and calls == [first, retry]
    agent._prepare_early(retry)
    agent._prepare_early(retry)  # told again with every step's "pending": prepared once
    assert agent._take_prep(Directive.from_json(retry.to_json())).d == retry and calls == [first, retry, retry]
    agent._pool.shutdown()


def directive(layout: str, workers: tuple[str, ...], generation: int = 2):
    from elastic.model import Layout
    from elastic.train.rendezvous import Directive

    return Directive(job="j", generation=generation, layout=Layout.parse(layout), workers=workers, remap=True,
                     old_layout=Layout.parse("tp1.pp1.dp2"), old_ranks={"w0": 0, "w1": 1}, switch_step=5,
                     store_host="127.0.0.1", store_port=1, join_timeout_s=10.0)


def _bare_agent():
    """A WorkerAgent with only the fields the preparation methods use: generation 1, an engine."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from elastic.train.agent import WorkerAgent

    agent = WorkerAgent.__new__(WorkerAgent)
    agent.worker, agent.generation, agent._broken = "w0", 1, False
    agent.engine = SimpleNamespace(state=lambda: {})
    agent._prep, agent._prep_d, agent._prep_at, agent._taken = None, None, 0.0, None
    agent._engine_lock, agent._prep_lock = threading.Lock(), threading.Lock()
    agent._pool = ThreadPoolExecutor(max_workers=1)
    return agent


def test_a_heartbeat_begins_the_preparation_of_its_own_generation_once_and_never_after_the_switch() -> None:
    # The heartbeat thread hears of a rescale mid-step (no lookahead: the step loop would only at
    # the switch). It prepares for the generation the beat was sent from, never for a newer or a
    # broken one, and not once the step loop has taken that rescale over (buffers nobody uses).
    import time
    from types import SimpleNamespace

    agent = _bare_agent()
    calls: list = []

    def plan(d, state, **_kw):
        calls.append(d)
        return SimpleNamespace(d=d, error="", deferred="", old_state={}, waited=0.0, ahead=0.0)

    agent._plan_and_prepare = plan
    grow = directive("tp1.pp1.dp3", ("w0", "w1", "w2"))
    agent._prepare_early(grow, told_on=0)  # the beat was sent before a transition: stale
    agent._broken = True
    agent._prepare_early(grow, told_on=1)  # broken: the recovery directive comes as a switch
    agent._broken = False
    agent._pool.submit(lambda: None).result()
    assert calls == []
    agent._prepare_early(grow, told_on=1)
    agent._prepare_early(grow, told_on=1)  # the step loop's "go" or a repeated beat: prepared once
    agent._pool.submit(lambda: None).result()
    assert calls == [grow]
    time.sleep(0.05)
    taken = agent._take_prep(grow)
    assert taken.d == grow and calls == [grow] and taken.ahead >= 0.05  # begun before the switch
    assert taken.waited < 0.05  # done beside the step: nothing left for the pause
    agent._prepare_early(grow, told_on=1)  # a beat answered before the switch, handled after it
    agent._pool.submit(lambda: None).result()
    assert calls == [grow] and agent._prep is None
    # prepared at the switch when nobody said so before: ahead 0
    shrink = directive("tp1.pp1.dp1", ("w0",), generation=3)
    assert agent._take_prep(shrink).ahead == 0.0 and calls == [grow, shrink]
    agent._pool.shutdown()


def test_a_preparation_for_a_rescale_that_was_abandoned_is_let_go_at_the_next_plain_step() -> None:
    import time
    from types import SimpleNamespace

    agent = _bare_agent()
    agent._plan_and_prepare = lambda d, state, **_kw: SimpleNamespace(d=d, error="", deferred="", old_state={})
    agent._prepare_early(directive("tp1.pp1.dp3", ("w0", "w1", "w2")), told_on=1)
    begun = time.monotonic()
    agent._drop_stale_prep(begun - 1.0)  # a "go" asked for before it began: the directive may be new
    assert agent._prep is not None
    agent._drop_stale_prep(time.monotonic())  # asked after it: the coordinator has nothing pending
    assert agent._prep is None and agent._prep_d is None
    agent._pool.shutdown()


def test_a_preparation_that_would_not_fit_beside_the_step_is_redone_at_the_switch_not_abandoned() -> None:
    # On a GPU the early preparation may allocate only what no allocator has reserved; over that
    # (or out of memory) it is deferred, and the switch prepares after the step, activations gone.
    from types import SimpleNamespace

    from elastic.reshard.execute import AllocBudgetExceeded
    from elastic.train.agent import _early_alloc_budget

    assert _early_alloc_budget("cpu") is None  # host memory: no budget
    agent = _bare_agent()
    agent.opts = SimpleNamespace(device="cpu")
    agent.config = {}
    calls: list = []

    def plan_or_raise(d, state, *, max_alloc_bytes=None):
        calls.append(max_alloc_bytes)
        if len(calls) == 1:
            raise AllocBudgetExceeded(100 * 2**20, 10 * 2**20)
        return SimpleNamespace(d=d, error="", deferred="", old_state={}, waited=0.0, ahead=0.0)

    agent._plan_and_prepare_or_raise = plan_or_raise
    grow = directive("tp1.pp1.dp3", ("w0", "w1", "w2"))
    agent._prepare_early(grow, told_on=1)
    agent._pool.submit(lambda: None).result()
    early = agent._prep.result()
    assert early.deferred.startswith("AllocBudgetExceeded") and not early.error
    prep = agent._take_prep(grow)
    assert prep.d == grow and not prep.error and prep.ahead == 0.0 and len(calls) == 2
    # at the switch (not early) the same failure is an error: the rescale is abandoned, nothing moved
    calls.clear()
    late = agent._plan_and_prepare(grow, {})
    assert late.error.startswith("AllocBudgetExceeded") and not late.deferred
    agent._pool.shutdown()
