"""Suite-wide configuration. Area fixtures live in tests/fixtures/ and are loaded here."""

from __future__ import annotations

import os

# Keep every process group and Ray on loopback (see DEVELOPERS.md).
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

pytest_plugins = [p for p in ("tests.fixtures.postgres", "tests.fixtures.prometheus")
                  if os.path.exists(os.path.join(os.path.dirname(__file__), "fixtures", p.split(".")[-1] + ".py"))]


# A crash (segfault, abort) kills the pytest process and its dump scrolls by in the middle
# of the output. With ELASTIC_FAULT_LOG set (`make test` sets it), the dump of every thread
# and the test that was running go to that file, and `make test` prints them at the end.
_fault_log = None


def pytest_sessionstart(session) -> None:  # noqa: ANN001 - pytest hook
    global _fault_log
    path = os.environ.get("ELASTIC_FAULT_LOG")
    if path:
        import faulthandler

        _fault_log = open(path, "w")  # noqa: SIM115 - must outlive the session for the handler
        faulthandler.enable(_fault_log, all_threads=True)


def pytest_runtest_logstart(nodeid: str, location) -> None:  # noqa: ANN001 - pytest hook
    if _fault_log is not None:
        _fault_log.seek(0)
        _fault_log.truncate()
        _fault_log.write(f"running: {nodeid}\n")
        _fault_log.flush()
