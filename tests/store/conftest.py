"""Fixtures for store tests: a migrated ``Store`` on each backend (via ``db_url``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from elastic.store import Store, upgrade


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store.from_url(db_url)
    upgrade(s)
    try:
        yield s
    finally:
        s.dispose()
