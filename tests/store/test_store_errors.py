"""Bad database URLs: one line naming the URL (password masked), exit 2, fast, nothing written."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic.store import Store, StoreError, StoreUnavailable, mask_url

CLI = [sys.executable, "-c", "from elastic.cli import main; main()"]


def _elastic(*args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, **kw)


@pytest.mark.parametrize(
    ("url", "expect"),
    [
        ("postgresql+psycopg://u:s3cret@127.0.0.1:1/x", "database postgresql+psycopg://u:***@127.0.0.1:1/x is unavailable"),
        ("postgresql://u:s3cret@127.0.0.1:1/x", "postgresql+psycopg://u:***@127.0.0.1:1/x is unavailable"),
        ("not a url", "malformed database URL 'not a url'"),
        ("postgresql://u:s3cret@host:notaport/x", "malformed database URL 'postgresql://u:***@host:notaport/x'"),
        ("mysql://u:s3cret@127.0.0.1/x", "unsupported database 'mysql' in URL 'mysql://u:***@127.0.0.1/x'"),
        ("sqlite:////nonexistent-dir/sub/elastic.db", "directory /nonexistent-dir/sub does not exist"),
    ],
)
def test_cli_bad_url_one_line_exit_2(url: str, expect: str, tmp_path: Path) -> None:
    start = time.monotonic()
    proc = _elastic("db", "upgrade", "--db", url, cwd=tmp_path)
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert expect in lines[0]
    assert "s3cret" not in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr
    assert elapsed < 30, f"took {elapsed:.1f}s"
    assert list(tmp_path.iterdir()) == [], "nothing may be written"


def test_silent_server_times_out_with_connect_timeout() -> None:
    """A port that accepts TCP but never answers the PostgreSQL handshake (a hung server)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        store = Store.from_url(f"postgresql+psycopg://u:pw@127.0.0.1:{port}/x", connect_timeout=1)
        start = time.monotonic()
        with pytest.raises(StoreUnavailable, match=rf"u:\*\*\*@127.0.0.1:{port}/x is unavailable"):
            store.ping()
        elapsed = time.monotonic() - start
        store.dispose()
    assert elapsed < 10, f"ping took {elapsed:.1f}s with connect_timeout=1"


def test_ping_ok(db_url: str) -> None:
    store = Store.from_url(db_url)
    try:
        store.ping()
    finally:
        store.dispose()


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("postgresql+psycopg://user:p%40ss@h:5432/db", "postgresql+psycopg://user:***@h:5432/db"),
        ("postgresql://user@h/db", "postgresql://user@h/db"),
        ("garbage://user:secret@", "garbage://user:***@"),
        ("sqlite:///./elastic.db", "sqlite:///./elastic.db"),
    ],
)
def test_mask_url(url: str, masked: str) -> None:
    assert mask_url(url) == masked


def test_empty_url() -> None:
    with pytest.raises(StoreError, match="empty database URL; pass --db or set ELASTIC_DB_URL"):
        Store.from_url("  ")
