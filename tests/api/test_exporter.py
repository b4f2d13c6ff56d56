"""The exporter's numbers against the truth: the fake backend's GPUs and the store's history."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from elastic import store as db
from elastic.model import Layout
from elastic.phases import JobPhase

from .conftest import Env


def _samples(env: Env) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(env.get("/metrics").text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _one(m: dict, name: str, **labels: str) -> float:
    hits = [v for lab, v in m.get(name, []) if all(lab.get(k) == x for k, x in labels.items())]
    assert len(hits) == 1, (name, labels, m.get(name))
    return hits[0]


def test_gpu_split_and_utilisation_match_the_backend(env: Env) -> None:
    for load in (10.0, 40.0, 25.0):
        env.tick(load)
    m = _samples(env)
    chat = len(env.backend.service_gpus("chat"))
    training = sum(len(rt.gpus) for rt in env.backend.jobs.values())
    assert _one(m, "elastic_gpus", pool="p", state="inference") == chat
    assert _one(m, "elastic_gpus", pool="p", state="training") == training
    assert _one(m, "elastic_gpus", pool="p", state="idle") == 8 - chat - training
    assert _one(m, "elastic_gpus", pool="p", state="draining") == 0
    # load 25 on `chat` replicas at target 10 per replica: each replica busy min(1, 25/10) = 1
    expected = (chat * min(1.0, 25.0 / 10.0) + training) / 8
    assert abs(_one(m, "elastic_gpu_utilization", pool="p") - expected) < 1e-9
    assert _one(m, "elastic_service_current_replicas", service="chat") == chat
    assert _one(m, "elastic_service_load", service="chat") == 25.0
    assert _one(m, "elastic_service_load_target", service="chat") == 10.0
    assert _one(m, "elastic_controller_leader", pool="p", owner="ctl-a") == 1
    assert _one(m, "elastic_controller_ready", pool="p") == 1


def test_layout_info_follows_the_current_layout_only(env: Env) -> None:
    env.tick(10.0)
    env.tick(40.0)
    m = _samples(env)
    rows = [lab for lab, v in m["elastic_training_layout_info"] if lab["job"] == "pretrain"]
    layout = str(env.backend.jobs["pretrain"].layout)
    assert len(rows) == 1 and f"tp{rows[0]['tp']}.pp{rows[0]['pp']}.dp{rows[0]['dp']}" in layout
    assert _one(m, "elastic_job_world_size", job="pretrain") == len(env.backend.jobs["pretrain"].gpus)


def test_reshards_decisions_and_ticks_are_counted_once(env: Env) -> None:
    for load in (10.0, 40.0, 10.0, 40.0):
        env.tick(load)
    env.exporter.update_from(env.ctl, env.store)  # a second refresh must not count anything twice
    m = _samples(env)
    reshards = db.list_reshards(env.store, "pretrain", 100)
    done = [r for r in reshards if r.status == "done"]
    assert len(done) >= 3
    assert _one(m, "elastic_job_reshards_total", job="pretrain", status="done") == len(done)
    assert _one(m, "elastic_job_reshard_bytes_total", job="pretrain") == sum(r.bytes_moved for r in done)
    assert _one(m, "elastic_job_reshard_pause_seconds_count", job="pretrain") == len(done)
    decisions = db.list_decisions(env.store, 100)
    assert sum(v for _, v in m["elastic_controller_decisions_total"]) == len(decisions) == 4
    assert _one(m, "elastic_controller_tick_duration_seconds_count", pool="p") == 4
    assert _one(m, "elastic_controller_ticks_total", pool="p", outcome="acted") == 4


def test_missing_metrics_and_unavailable_backend_are_counted(env: Env) -> None:
    env.tick(10.0)
    env.source.clear("chat")
    env.clock.t += 20
    env.exporter.observe_tick(env.ctl.tick(), env.ctl)
    env.backend.set_reachable(False)
    env.clock.t += 20
    env.exporter.observe_tick(env.ctl.tick(), env.ctl)
    m = _samples(env)
    assert _one(m, "elastic_metric_source_errors_total", service="chat", kind="missing") == 1
    assert _one(m, "elastic_metric_source_errors_total", service="chat", kind="stale") == 0
    assert _one(m, "elastic_controller_errors_total", pool="p", kind="unavailable") == 1
    assert _one(m, "elastic_controller_ready", pool="p") == 0


def test_a_called_off_grow_counts_as_cancelled_and_adds_no_duration_or_pause(env: Env) -> None:
    for load in (10.0, 40.0):
        env.tick(load)
    # a grow called off before its directive, on record as the controller writes it
    rid = db.start_reshard(env.store, job="pretrain", pool="p", generation=99, from_layout="tp1.pp1.dp2",
                           to_layout="tp1.pp1.dp4", bytes_planned=0, bytes_lower_bound=0)
    db.finish_reshard(env.store, rid, bytes_moved=None, pause_seconds=None, error="inference wants them back",
                      cancelled=True)
    env.exporter.update_from(env.ctl, env.store)
    m = _samples(env)
    rows = db.list_reshards(env.store, "pretrain", 100)
    done = [r for r in rows if r.status == "done"]
    assert _one(m, "elastic_job_reshards_total", job="pretrain", status="cancelled") == 1
    assert _one(m, "elastic_job_reshards_total", job="pretrain", status="failed") == 0
    assert _one(m, "elastic_job_reshards_total", job="pretrain", status="done") == len(done)
    assert _one(m, "elastic_job_reshard_duration_seconds_count", job="pretrain") == len(done)
    assert _one(m, "elastic_job_reshard_pause_seconds_count", job="pretrain") == len(done)


def test_a_recovery_in_place_is_counted_once_and_the_job_phase_is_exported(env: Env) -> None:
    from dataclasses import replace

    env.tick(10.0)
    m = _samples(env)
    assert _one(m, "elastic_job_recoveries_total", job="pretrain") == 0  # present before any loss
    assert _one(m, "elastic_job_phase", job="pretrain", phase="Running") == 1
    assert _one(m, "elastic_job_phase", job="pretrain", phase="Recovering") == 0
    # the trainer is recovering from a lost worker on its own: the phase says so
    before = env.backend.jobs["pretrain"]
    env.backend.jobs["pretrain"] = replace(before, phase=JobPhase.RECOVERING)
    env.tick(10.0)
    m = _samples(env)
    assert _one(m, "elastic_job_phase", job="pretrain", phase="Recovering") == 1
    assert _one(m, "elastic_job_phase", job="pretrain", phase="Running") == 0
    # ... and resumed on its survivors: the controller records it (WorkerLost), the exporter counts it
    kept = before.gpus[: len(before.gpus) // 2]
    env.backend.jobs["pretrain"] = replace(before, phase=JobPhase.RUNNING, gpus=kept, generation=before.generation + 1,
                                           layout=Layout(1, 1, len(kept)), recovered_from=before.layout,
                                           recovery="lost pretrain-w1 (worker exited with code -9)",
                                           last_pause_seconds=0.1, last_bytes_moved=0)
    for _ in range(3):
        env.tick(10.0)
    env.exporter.update_from(env.ctl, env.store)  # a second refresh counts nothing twice
    m = _samples(env)
    lost = [d for d in db.list_decisions(env.store, 100) if d.reason == "WorkerLost"]
    assert len(lost) == 1 and lost[0].plan["job"] == "pretrain"
    assert _one(m, "elastic_job_recoveries_total", job="pretrain") == 1
    assert _one(m, "elastic_job_recoveries_total", job="big") == 0
    assert _one(m, "elastic_job_phase", job="pretrain", phase="Running") == 1
    # a fresh exporter (a restarted API process) counts the same history from the store
    from elastic.metrics.exporter import Exporter

    again = Exporter()
    again.update_from(None, env.store)
    assert again.registry.get_sample_value("elastic_job_recoveries_total", {"job": "pretrain"}) == 1


def test_replicas_drained_ahead_are_reported_and_count_as_draining(env: Env) -> None:
    for load in (10.0, 40.0):
        env.tick(load)
    chat = len(env.backend.service_gpus("chat"))
    assert chat >= 2
    assert _one(_samples(env), "elastic_service_leaving_replicas", service="chat") == 0
    # the controller recorded one replica drained ahead of a scale-down (ReplicaDecision.leaving)
    rec = next(s for s in db.list_services(env.store) if s.name == "chat")
    db.set_service_status(env.store, "chat", {**rec.status, "desiredReplicas": chat, "leavingReplicas": 1})
    env.exporter.update_from(env.ctl, env.store)
    m = _samples(env)
    assert _one(m, "elastic_service_leaving_replicas", service="chat") == 1
    assert _one(m, "elastic_gpus", pool="p", state="draining") == 1  # out of the balancer: not busy
    assert _one(m, "elastic_gpus", pool="p", state="inference") == chat - 1


def test_the_newest_checkpoint_step_is_exported_only_for_jobs_that_checkpoint(env: Env) -> None:
    from dataclasses import replace

    env.tick(10.0)
    before = env.backend.jobs["pretrain"]
    env.backend.jobs["pretrain"] = replace(before, step=250, checkpoint_step=200)
    env.tick(10.0)
    m = _samples(env)
    assert _one(m, "elastic_job_step", job="pretrain") == 250
    assert _one(m, "elastic_job_checkpoint_step", job="pretrain") == 200
    assert not [k for k in m if k[0] == "elastic_job_checkpoint_step" and ("job", "big") in k[1]], \
        "a job without checkpoints has no series (missing is not 0)"
    assert db.get_job(env.store, "pretrain").status["checkpointStep"] == 200
