"""The user-job side of a shrink that gives the step in progress up (``Session.before_batch`` /
``Session.give_up``), in one process: the check, the state put back, the request heeded once.
The whole path on live workers is ``test_job.py``'s shrink test."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from elastic.torch.coordinated import Session, StepGivenUp


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = sd["n"]


@pytest.fixture
def one_rank_world() -> Any:
    if dist.is_initialized():
        pytest.fail("a default process group is left over from another test")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _session() -> tuple[Session, Counter, list[int]]:
    s = Session("w0", "http://127.0.0.1:9", job="j")  # no call reaches the coordinator here
    c = Counter()
    asked: list[int] = []
    s.user_state = {"c": c}
    s.phase, s.gen, s._checks = "training", 4, True
    s.ask = lambda step: asked.append(step) or True  # type: ignore[method-assign]
    return s, c, asked


def test_a_requested_step_is_given_up_at_the_next_check_with_the_state_as_it_began(one_rank_world: Any) -> None:
    s, c, asked = _session()
    c.n = 7
    s.begin(5)
    s.before_batch()  # not asked: the micro-batch goes ahead
    c.n += 1  # the user's state moves inside the step
    s._give_up_req = (4, 5)
    with pytest.raises(StepGivenUp) as e:
        s.before_batch()
    assert (e.value.step, e.value.micro) == (5, 1) and not isinstance(e.value, Exception)
    assert s.give_up(e.value) is True and asked == [5]
    assert c.n == 7, "the state objects are put back as the step began"
    assert s._gave_up == {"step": 5, "seconds": round(e.value.seconds, 4), "micro": 1, "kept": False}
    assert (s.in_flight, s.next_step) == (None, 5)
    # the same request again (a late heartbeat, or the old layout redoing the step after an
    # abandoned shrink) is not heeded twice
    s._give_up_req = (4, 5)
    s.begin(5)
    s.before_batch()
    s.before_batch()


def test_a_request_for_another_step_or_generation_or_without_checks_is_not_heeded(one_rank_world: Any) -> None:
    s, _, _ = _session()
    s.begin(6)
    for req in ((4, 5), (3, 6), None):
        s._give_up_req = req
        s.before_batch()
    s._give_up_req, s._checks = (4, 6), False
    s.before_batch()  # a generation posted without checks runs no collective and never gives up
    s._checks = True
    with pytest.raises(StepGivenUp):
        s.before_batch()
