"""The Grafana dashboards: well-formed classic JSON, shipped in sync as a ConfigMap, and every
query of every panel answered by a REAL Prometheus scraping a controller with live data."""

from __future__ import annotations

import importlib.util
import json
import re
import threading
import time
from pathlib import Path

import httpx
import pytest

from .conftest import close_env, make_env

ROOT = Path(__file__).resolve().parents[2]
BOARDS = sorted((ROOT / "dashboards").glob("*.json"))
RATE_INTERVAL = "15s"  # what Grafana would pick for $__rate_interval with a short scrape interval
VARIABLES = {"pool": ".*", "job": ".*"}


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _queries() -> list[tuple[str, str, str]]:
    """(dashboard, panel title, PromQL with Grafana's variables substituted)."""
    out = []
    for path in BOARDS:
        for panel in _load(path)["panels"]:
            for t in panel["targets"]:
                expr = t["expr"].replace("$__rate_interval", RATE_INTERVAL)
                for name, value in VARIABLES.items():
                    expr = expr.replace(f"${name}", value)
                assert "$" not in expr, (path.name, panel["title"], expr)
                out.append((path.name, panel["title"], expr))
    return out


def test_the_three_dashboards_exist() -> None:
    assert [p.name for p in BOARDS] == ["cluster-overview.json", "controller-health.json", "training-elasticity.json"]


@pytest.mark.parametrize("path", BOARDS, ids=lambda p: p.name)
def test_dashboard_is_classic_json_with_a_datasource_variable(path: Path) -> None:
    d = _load(path)
    assert d["schemaVersion"] == 39 and d["uid"].startswith("elastic-") and d["title"].startswith("elastic / ")
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids, types = set(), set()
    for p in d["panels"]:
        assert p["type"] in ("timeseries", "stat"), p["title"]
        assert p["id"] not in ids, p["title"]
        ids.add(p["id"])
        types.add(p["type"])
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
            # every range vector in a rate()/increase() uses Grafana's $__rate_interval
            for _fn, window in re.findall(r"\b(rate|increase|irate)\(\s*[^\[]*\[([^\]]+)\]", t["expr"]):
                assert window == "$__rate_interval", (p["title"], t["expr"])
            assert re.search(r"\belastic_", t["expr"]), (p["title"], t["expr"])
    assert types == {"timeseries", "stat"}, path.name


def test_configmap_is_in_sync_with_the_dashboards() -> None:
    spec = importlib.util.spec_from_file_location("dashboards_configmap", ROOT / "dashboards" / "configmap.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    committed = (ROOT / "manifests" / "grafana" / "dashboards-configmap.yaml").read_text()
    assert committed == mod.render(), "run: python dashboards/configmap.py"
    import yaml

    cm = yaml.safe_load(committed)
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert {k: json.loads(v) for k, v in cm["data"].items()} == {p.name: _load(p) for p in BOARDS}


def _measured(rt) -> dict:
    """What a trainer reports of its worst rank's step on ``rt``'s layout (1 GiB a component: well
    under an H100's budget), as the fake backend's ``JobRuntime.memory``."""
    from elastic.parallel.memory_report import MeasuredMemory

    layout = rt.layout
    gib = 1024**3
    return MeasuredMemory(model="gpt-1.3b", layout=layout, rank=0, pp_rank=0, step=rt.step, dtype="bfloat16",
                          micro_batch=1, grad_accum=64 // layout.dp, weights=gib, gradients=gib, optimizer=gib,
                          activations=gib, weight_elements=1, gradient_elements=1, optimizer_elements=1,
                          optimizer_kinds=2).as_json()


def _drive(env, stop: threading.Event) -> None:
    """Ticks on the wall clock with the load swinging, so services scale and jobs reshard; the
    pretraining job reports its measured memory."""
    from dataclasses import replace

    loads = [10.0, 40.0, 25.0, 5.0]
    i = 0
    while not stop.is_set():
        env.source.set("chat", loads[i % len(loads)], time.time())
        rt = env.backend.jobs.get("pretrain")
        if rt is not None and rt.layout and (rt.memory or {}).get("layout") != str(rt.layout):
            env.backend.jobs["pretrain"] = replace(rt, memory=_measured(rt))
        res = env.ctl.tick()
        env.exporter.observe_tick(res, env.ctl)
        i += 1
        stop.wait(0.5)


def _honour_labels(prometheus, job: str) -> None:
    """Scrape with honor_labels, as dashboards/README.md tells users to: our metrics' `job` label
    (the training job) must win over the scrape job's."""
    prometheus.jobs[job]["honor_labels"] = True
    prometheus._write_config()
    assert httpx.post(f"{prometheus.url}/-/reload", timeout=10).status_code == 200


def test_every_panel_query_returns_series_from_a_real_prometheus(prometheus, tmp_path: Path) -> None:
    env = make_env(f"sqlite:///{tmp_path / 'live.db'}", clock=time.time)
    stop = threading.Event()
    driver = threading.Thread(target=_drive, args=(env, stop), daemon=True)
    try:
        driver.start()
        prometheus.scrape("elastic-api", [env.url])
        _honour_labels(prometheus, "elastic-api")
        prometheus.wait_for_targets("elastic-api", 1)
        queries = _queries()
        # each query must return a series once: not all at the same instant (the job's memory series
        # come and go with its GPUs as the load swings, while other panels need it to swing)
        deadline, empty = time.monotonic() + 60, queries
        while empty and time.monotonic() < deadline:
            time.sleep(1.0)
            empty = [q for q in empty if not _series(prometheus.url, q[2])]
        assert not empty, "queries without a series:\n" + "\n".join(f"{d} / {t}: {e}" for d, t, e in empty)
        jobs = {s["metric"].get("job") for s in _series(prometheus.url, "elastic_job_world_size")}
        assert jobs == {"pretrain", "big"}, jobs  # the training job's label survived the scrape
        # memory: what the job measured beside the planner's bytes for it and the budget; nothing for
        # the job that measured nothing (missing is not 0)
        # (the series go while the job holds no GPU as the load swings: read them while it runs)
        def memory_now() -> tuple[dict, dict, list] | None:
            measured = {(s["metric"]["job"], s["metric"]["component"]): float(s["value"][1])
                        for s in _series(prometheus.url, "elastic_job_memory_bytes")}
            predicted = {s["metric"]["component"]: float(s["value"][1])
                         for s in _series(prometheus.url, 'elastic_job_memory_predicted_bytes{job="pretrain"}')}
            budget = _series(prometheus.url, 'elastic_job_memory_budget_bytes{job="pretrain"}')
            whole = ("pretrain", "peak") in measured and len(predicted) == 5 and budget
            return (measured, predicted, budget) if whole else None

        deadline, got = time.monotonic() + 60, None
        while got is None and time.monotonic() < deadline:
            got = memory_now()
            if got is None:
                time.sleep(1.0)
        assert got is not None, "no whole reading of the pretraining job's memory series in 60 s"
        measured, predicted, budget = got
        assert measured.get(("pretrain", "weights")) == 1024**3 and measured.get(("pretrain", "peak")) == 4 * 1024**3
        assert {j for j, _ in measured} == {"pretrain"}, measured
        assert predicted["total"] == sum(predicted[c] for c in ("weights", "gradients", "optimizer", "activations"))
        assert float(budget[0]["value"][1]) == 80 * 1024**3 - int(2 * 1024**3 + 0.05 * 80 * 1024**3), budget
        print(f"{len(queries)} panel queries over {len(BOARDS)} dashboards all returned series")
    finally:
        stop.set()
        driver.join(10)
        close_env(env)


def _series(base: str, expr: str) -> list[dict]:
    r = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=5)
    body = r.json()
    assert body.get("status") == "success", (expr, body)
    return body["data"]["result"]
