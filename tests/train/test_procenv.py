"""The memory settings every training worker (and benchmark process) starts with."""

from __future__ import annotations

import subprocess
import sys

from elastic.train.procenv import worker_memory_env


def test_defaults_ask_for_huge_pages_for_tensors_and_the_heap():
    env = worker_memory_env({})
    assert env == {"THP_MEM_ALLOC_ENABLE": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


def test_what_the_user_set_wins_and_other_tunables_are_kept():
    env = worker_memory_env({"THP_MEM_ALLOC_ENABLE": "0", "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert env["THP_MEM_ALLOC_ENABLE"] == "0"
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    mine = worker_memory_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0:glibc.malloc.arena_max=2"})
    assert mine["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0:glibc.malloc.arena_max=2"


def test_a_process_starts_and_runs_torch_with_them():
    # glibc rejects nothing loudly, but a malformed value must not break the interpreter or torch
    import os

    env = dict(os.environ, **worker_memory_env(os.environ))
    out = subprocess.run([sys.executable, "-c", "import torch; print(int(torch.ones(1 << 20).sum()))"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(1 << 20)
