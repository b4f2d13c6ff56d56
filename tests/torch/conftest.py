"""Fixtures shared by the multi-process torch tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.reshard._mp import Pool


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    """Four spawned gloo workers per test module (``tests/reshard/_mp.py``)."""
    p = Pool(4)
    try:
        yield p
    finally:
        p.close()
