"""A job backing off from failed starts shows why and until when in the admin API and ``/metrics``."""

from __future__ import annotations

from elastic.backends.base import BackendError

from .conftest import Env


def test_backoff_shows_in_the_api_and_the_metrics(env: Env) -> None:
    def fail(spec, gpus, layout):  # noqa: ANN001, ANN202
        raise BackendError(f"{spec.name}: workers OOM-killed while starting")

    env.backend.set_job_gpus = fail  # type: ignore[method-assign]
    env.clock.t += 20
    env.source.set("chat", 10.0, env.clock.t)
    assert env.ctl.tick().error  # the start failed: on record as ApplyFailed
    status = env.get("/api/v1/controller").json()
    b = status["backoff"]["pretrain"]
    assert b["failures"] == 1 and "OOM-killed" in b["reason"] and b["next_attempt_at"]
    env.clock.t += 1
    env.source.set("chat", 10.0, env.clock.t)
    env.ctl.tick()  # a hold while backing off records the job's status
    job = env.get("/api/v1/jobs/pretrain").json()
    assert job["status"]["backoff"]["failures"] == 1 and job["status"]["reason"] == "BackingOff"
    text = env.get("/metrics").text
    assert 'elastic_job_start_failures{job="pretrain",pool="p"} 1.0' in text
    assert 'elastic_job_next_start_attempt_timestamp_seconds{job="pretrain",pool="p"}' in text
