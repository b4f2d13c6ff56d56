"""Fixtures shared by the multi-process torch tests."""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path

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


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A byte-token corpus of three standard-library files (``elastic.torch.data``), per test module."""
    from elastic.torch.data import prepare_corpus

    out = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prepare_corpus(out, [stdlib / "dataclasses.py", stdlib / "functools.py", stdlib / "textwrap.py"])
    return str(out)
