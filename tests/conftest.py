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
