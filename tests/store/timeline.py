"""Fixed instants for store tests: the store never needs the wall clock when callers pass ``now``."""

from __future__ import annotations

from datetime import UTC, datetime

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
