"""The coordinator's settings: one validated value, built by every launcher from its options."""

from __future__ import annotations

import pytest

from elastic.model import SpecError
from elastic.train.checkpoint import CheckpointSettings
from elastic.train.launch import LaunchOptions, coordinator_settings
from elastic.train.rendezvous import Coordinator, CoordinatorSettings


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"heartbeat_interval_s": 0.0}, "heartbeat_interval_s"),
        ({"heartbeat_interval_s": 2.0, "heartbeat_timeout_s": 2.0}, "heartbeat_timeout_s"),
        ({"join_timeout_s": 0.0}, "join_timeout_s"),
        ({"lookahead_steps": -1}, "lookahead_steps"),
        ({"shrink_lookahead_steps": -1}, "shrink_lookahead_steps"),
        ({"max_steps": -1}, "max_steps"),
        ({"recovery_timeout_s": 0.0}, "recovery_timeout_s"),
        ({"rendezvous_timeout_s": -5.0}, "rendezvous_timeout_s"),
    ],
)
def test_an_invalid_setting_is_refused_naming_its_field(kw, field) -> None:
    with pytest.raises(SpecError, match=field):
        CoordinatorSettings(**kw)


def test_the_defaults_fall_back_to_the_general_setting() -> None:
    s = CoordinatorSettings(heartbeat_timeout_s=9.0, lookahead_steps=2)
    assert (s.shrink_lookahead, s.recovery_timeout) == (2, 9.0)
    s = CoordinatorSettings(
        heartbeat_timeout_s=9.0, lookahead_steps=2, shrink_lookahead_steps=0, recovery_timeout_s=4.0
    )
    assert (s.shrink_lookahead, s.recovery_timeout) == (0, 4.0)


def test_a_coordinator_without_settings_runs_on_the_defaults() -> None:
    assert Coordinator("j", {"model": "tiny"}).settings == CoordinatorSettings()


@pytest.mark.parametrize("user", [False, True])
def test_the_launch_options_decide_the_settings_and_a_user_job_waits_for_the_boundary_to_grow(user) -> None:
    o = LaunchOptions(
        heartbeat_interval_s=0.5,
        heartbeat_timeout_s=7.0,
        join_timeout_s=30.0,
        max_steps=50,
        recover=True,
        pg_timeout_s=40.0,
        checkpoint=CheckpointSettings("/tmp/ck"),
    )
    s = coordinator_settings(o, user=user)
    assert (s.heartbeat_interval_s, s.heartbeat_timeout_s, s.join_timeout_s, s.max_steps, s.recover) == (
        0.5,
        7.0,
        30.0,
        50,
        True,
    )
    assert s.rendezvous_timeout_s == 40.0  # a worker blocks that long in a group's rendezvous
    assert s.shrink_gives_up_step is o.shrink_gives_up_step is True
    # a user's loop cannot hand a step's work over: a grow does not throw it away, nothing is
    # prepared beside the step, and the job keeps its own checkpoints
    assert (s.grow_gives_up_step, s.prepare_beside_step, s.checkpoint is None) == (
        (False, False, True) if user else (True, True, False)
    )
