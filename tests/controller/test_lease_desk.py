"""``LeaseDesk``: GPU leases kept between two holders of a GPU, on real local Ray (8 logical GPUs).
Ray's free-GPU count is the witness: a parked lease keeps its GPU booked; a taken one is the same
actor, still booked; an expired, released or mis-sized one is killed and Ray frees its GPU."""

from __future__ import annotations

import time

import pytest

from tests.fakes import Clock

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def ray_local():
    from elastic.train.ray_handle import init_local_ray

    ray = init_local_ray(num_gpus=8, num_cpus=2)
    yield ray
    ray.shutdown()



def _free(expect: float, timeout: float = 15.0) -> float:
    """Ray's free GPU count once it reads ``expect`` (Ray frees a dead actor's GPUs asynchronously)."""
    import ray

    deadline = time.monotonic() + timeout
    while (n := ray.available_resources().get("GPU", 0.0)) != expect and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


def _leases(n: int, gpus: float = 1) -> list:
    import ray

    from elastic.ray_gpu_lease import lease_actor

    out = [lease_actor(gpus, None) for _ in range(n)]
    for lease in out:
        assert ray.get(lease.gpu_ids.remote(), timeout=60)  # granted: its GPUs are booked
    return out


def test_a_parked_lease_keeps_its_gpu_booked_until_the_next_holder_of_that_gpu_takes_it(ray_local) -> None:
    import ray

    from elastic.model import GPU
    from elastic.ray_gpu_lease import LeaseDesk

    clock = Clock(1000.0)
    desk = LeaseDesk(hold_seconds=10, clock=clock)
    g1, g2 = GPU("local", 1), GPU("local", 2)
    (lease,) = _leases(1)
    ids = ray.get(lease.gpu_ids.remote())
    desk.park(g1, lease, 1)
    assert desk.parked() == {g1} and desk.gpus_parked() == 1.0
    assert _free(7.0) == 7.0  # still booked while parked
    assert desk.take(g2, 1) is None  # another GPU's holder does not get it
    clock.t += 9.9
    got = desk.take(g1, 1)
    assert got is lease and desk.parked() == set() and desk.handed_over == 1
    assert ray.get(got.gpu_ids.remote(), timeout=10) == ids  # the same lease, the same device, no new actor
    assert _free(7.0) == 7.0
    assert desk.take(g1, 1) is None  # taken once
    ray.kill(got, no_restart=True)
    assert _free(8.0) == 8.0


def test_leases_not_taken_in_time_released_or_of_another_size_go_back_to_ray(ray_local) -> None:
    from elastic.model import GPU
    from elastic.ray_gpu_lease import LeaseDesk

    clock = Clock(1000.0)
    desk = LeaseDesk(hold_seconds=5, clock=clock)
    g = [GPU("local", i) for i in range(4)]
    a, b, c, d = _leases(4)
    for gpu, lease in zip(g, (a, b, c, d), strict=True):
        desk.park(gpu, lease, 1)
    assert _free(4.0) == 4.0 and desk.gpus_parked(g[:2]) == 2.0
    assert desk.release([g[0], GPU("local", 7)]) == 1  # only what is parked
    assert _free(5.0) == 5.0 and desk.parked() == set(g[1:])
    assert desk.take(g[1], 2) is None  # a holder needing two GPUs: this one is given back, not handed over
    assert _free(6.0) == 6.0 and desk.parked() == set(g[2:]) and desk.handed_over == 0
    clock.t += 3
    (e,) = _leases(1)
    desk.park(g[2], e, 1)  # a newer lease for the same GPU: the older one (c) goes back
    assert _free(6.0) == 6.0 and desk.parked() == {g[2], g[3]}
    clock.t += 2.5  # d (parked at 1000) is past its 5 s, e (parked at 1003) is not
    assert desk.expire() == 1 and desk.parked() == {g[2]}
    assert _free(7.0) == 7.0
    clock.t += 3
    assert desk.take(g[2], 1) is None  # expired on the way in
    assert _free(8.0) == 8.0 and desk.given_back == 5


def test_a_lease_desk_refuses_a_hold_time_that_is_not_positive() -> None:
    from elastic.ray_gpu_lease import LeaseDesk

    with pytest.raises(ValueError, match="hold_seconds must be > 0"):
        LeaseDesk(hold_seconds=0)
