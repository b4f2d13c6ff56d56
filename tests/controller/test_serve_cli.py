"""``elastic serve`` as a user runs it (a subprocess): bad configs are one line and exit 2 before anything
starts; a good one serves the admin API (``/readyz`` ready after a tick) and stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from elastic import store as db

ROOT = Path(__file__).resolve().parents[2]
ELASTIC = str(Path(sys.executable).with_name("elastic"))

BASE = yaml.safe_load((ROOT / "examples" / "pool.yaml").read_text())


def _with(**patch) -> dict:
    return {**BASE, **patch}


@pytest.mark.parametrize("data, needle", [
    (_with(services=[{**BASE["services"][0], "min_replicas": 9, "max_replicas": 9}]),
     "inference minimum chat 9x1 = 9 GPUs exceeds the pool's 1x8 = 8 GPUs"),
    (_with(jobs=[{**BASE["jobs"][0], "min_gpus": 8}]),
     "jobs[0].min_gpus=8 cannot fit next to the inference minimum of 1 GPUs"),
    (_with(jobs=[{**BASE["jobs"][0], "model": "gpt-9000"}]), "jobs[0].model: unknown model 'gpt-9000'"),
    (_with(jobs=[{**BASE["jobs"][0], "model": "gpt3-175b"}]),
     "jobs[0] 'gpt-tiny': no layout of model gpt3-175b with global_batch=840 fits h100-80g GPUs"),
    (_with(pool={**BASE["pool"], "hardware": "tpu-v9"}), "hardware"),
    (_with(controller={"tick_seconds": 0}), "controller.tick_seconds"),
    ("pool: [1, 2", "not valid YAML"),
])
def test_bad_config_is_one_line_and_exit_2(tmp_path: Path, data, needle: str) -> None:
    cfg = tmp_path / "pool.yaml"
    cfg.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    p = subprocess.run([ELASTIC, "serve", "--config", str(cfg), "--db", f"sqlite:///{tmp_path}/x.db"],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "400"})
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and needle in lines[0], p.stderr
    assert not (tmp_path / "x.db").exists(), "nothing may start before the config is valid"


def test_missing_config_file_is_one_line(tmp_path: Path) -> None:
    p = subprocess.run([ELASTIC, "serve", "--config", str(tmp_path / "nope.yaml")], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "COLUMNS": "400"})
    assert p.returncode == 2 and "cannot read" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_spares_with_a_ray_cluster_are_refused_before_anything_starts(tmp_path: Path) -> None:
    cfg = tmp_path / "pool.yaml"
    cfg.write_text(yaml.safe_dump(BASE))
    p = subprocess.run([ELASTIC, "serve", "--config", str(cfg), "--db", f"sqlite:///{tmp_path}/x.db",
                        "--ray-address", "127.0.0.1:9", "--spare-workers", "1"],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "400"})
    assert p.returncode == 2 and "spares are kept by the embedded Ray only" in p.stderr, p.stderr
    assert not (tmp_path / "x.db").exists()


def test_reads_behind_a_token_without_tokens_are_refused_before_anything_starts(tmp_path: Path) -> None:
    cfg = tmp_path / "pool.yaml"
    cfg.write_text(yaml.safe_dump(BASE))
    env = {k: v for k, v in os.environ.items() if k != "ELASTIC_API_TOKENS"}
    p = subprocess.run([ELASTIC, "serve", "--config", str(cfg), "--db", f"sqlite:///{tmp_path}/x.db", "--auth-reads"],
                       capture_output=True, text=True, timeout=60, env={**env, "COLUMNS": "400"})
    assert p.returncode == 2 and "nobody could read the API; give --token-file" in p.stderr, p.stderr
    assert not (tmp_path / "x.db").exists()


def test_a_bad_token_file_is_refused_before_anything_starts(tmp_path: Path) -> None:
    cfg, tokens = tmp_path / "pool.yaml", tmp_path / "tokens"
    cfg.write_text(yaml.safe_dump(BASE))
    tokens.write_text("short admin\n")
    p = subprocess.run([ELASTIC, "serve", "--config", str(cfg), "--db", f"sqlite:///{tmp_path}/x.db",
                        "--token-file", str(tokens)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "COLUMNS": "400"})
    assert p.returncode == 2 and "a token must be at least 16 characters" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "x.db").exists(), "nothing may start before the tokens are valid"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_serve_runs_the_loop_with_the_api_and_stops_on_sigterm(tmp_path: Path) -> None:
    cfg = tmp_path / "pool.yaml"
    # inference only: one replica on an embedded local Ray keeps this quick
    cfg.write_text(yaml.safe_dump(_with(jobs=[], controller={"tick_seconds": 1, "lease_seconds": 5})))
    url = f"sqlite:///{tmp_path}/state.db"
    out = tmp_path / "out.log"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "COLUMNS": "400"}
    tokens = tmp_path / "tokens"
    tokens.write_text("read-token-0123456789 read grafana\n")
    # reads behind a token, on the address given (still loopback here)
    proc = subprocess.Popen([ELASTIC, "serve", "--config", str(cfg), "--db", url, "--api-port", "0",
                             "--api-host", "127.0.0.1", "--token-file", str(tokens), "--auth-reads",
                             "--owner", "serve-test"], stdout=open(out, "w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        port = None
        while port is None:
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            m = re.search(r"API on http://127\.0\.0\.1:(\d+)", out.read_text())
            port = int(m.group(1)) if m else None
            time.sleep(0.5)
        ready = None
        while time.monotonic() < deadline:
            ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5)
            if ready.status_code == 200:
                break
            time.sleep(0.5)
        assert ready is not None and ready.status_code == 200, ready.text if ready else None
        # the controller is ready inside its tick; the exporter observes the tick after it returns,
        # so the gauge may trail /readyz by one loop iteration: wait for the exporter's report
        metrics = ""
        while 'elastic_controller_ready{pool="local"}' not in metrics and time.monotonic() < deadline:
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            time.sleep(0.2)
        assert 'elastic_controller_ready{pool="local"} 1.0' in metrics, metrics[-2000:]
        anon = httpx.get(f"http://127.0.0.1:{port}/api/v1/pools", timeout=5)
        assert anon.status_code == 401 and "reads need a bearer token" in anon.text, anon.text
        read = httpx.get(f"http://127.0.0.1:{port}/api/v1/pools", timeout=5,
                         headers={"Authorization": "Bearer read-token-0123456789"})
        assert read.status_code == 200 and read.json()["items"][0]["name"] == "local", read.text
        store = db.Store.from_url(url)
        assert db.list_decisions(store, limit=5, pool="local")
        assert db.lease_holder(store, "local").owner == "serve-test"
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(60) == 0, out.read_text()[-3000:]
        assert db.lease_holder(store, "local") is None, "a clean stop releases the lease"
        store.dispose()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.mark.parametrize(("db", "needle"), [
    ("sqlite:////nonexistent-elastic-dir/x.db", "directory /nonexistent-elastic-dir does not exist"),
    ("postgresql+psycopg://elastic:hunter2@127.0.0.1:1/elastic", "elastic:***@127.0.0.1:1/elastic is unavailable"),
])
def test_an_unusable_database_is_one_line_and_exit_2(tmp_path: Path, db: str, needle: str) -> None:
    cfg = tmp_path / "pool.yaml"
    cfg.write_text(yaml.safe_dump(BASE))
    p = subprocess.run([ELASTIC, "serve", "--config", str(cfg), "--db", db], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "COLUMNS": "400"})
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and needle in lines[0] and "hunter2" not in p.stderr, p.stderr


def test_two_controllers_on_one_host_never_share_a_lease_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    from elastic.cli.serve import default_owner

    monkeypatch.delenv("ELASTIC_CONTROLLER_ID", raising=False)
    a, b = default_owner(), default_owner()
    assert a != b and a.startswith(socket.gethostname())
    monkeypatch.setenv("ELASTIC_CONTROLLER_ID", "ctl-east")
    assert default_owner() == "ctl-east"
