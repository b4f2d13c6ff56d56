"""Memory settings for a training worker's process environment (read at process start).

A worker holds GBs of CPU tensors (on GPU machines: pinned staging, the optimizer's CPU
offload; here: all of its state), and its exit is inside a rescale's pause when it leaves.
Both first touch of new memory and the kernel's teardown of an exiting process cost per
page mapped, so fewer, larger pages make both cheaper:

* ``THP_MEM_ALLOC_ENABLE=1``: PyTorch's CPU allocator aligns big tensors to 2 MiB and asks
  for transparent huge pages (prepare's first touch and a leaver's exit of GBs: about half
  the time);
* ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``: glibc's malloc asks for them for its own heap
  too (the interpreter's and torch's small objects, ~150 MB after ``import torch``): a
  leaver's exit ~20% faster (median 19 ms instead of 24 ms for two leavers exiting at once).

Both are only requests (``madvise``): with THP off on the host nothing changes. A value the
user set wins. Used for local worker processes and Kubernetes pods (``launch.py``) and for
the local Ray cluster (``ray_handle.init_local_ray``: its raylet passes them to every Ray
worker process).

Not set: ``PYTHONMALLOC=malloc``. It would put the interpreter's small objects on that heap
too (pymalloc's arenas are plain 4 KiB pages): 4 KiB anonymous memory after ``import torch``
15 MB instead of 79 MB and an exit of 8.6 ms instead of 14.4 ms (measured on one idle
process holding 540 MB of state), but a Python-bound training step (the tiny model on CPU)
ran ~6% slower (27.1 ms instead of 25.6 ms, median of 4 alternating runs): every step pays
for what only a rescale's leaver gains.
"""

from __future__ import annotations

from collections.abc import Mapping


def _with_tunable(current: str | None, name: str, value: str) -> str:
    """``GLIBC_TUNABLES`` (``a=1:b=2``) with ``name=value`` added unless ``name`` is already set."""
    items = [t for t in (current or "").split(":") if t]
    if any(t.split("=", 1)[0] == name for t in items):
        return ":".join(items)
    return ":".join([*items, f"{name}={value}"])


def worker_memory_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The memory variables for a worker started from ``environ`` (merge into its environment)."""
    return {
        "THP_MEM_ALLOC_ENABLE": environ.get("THP_MEM_ALLOC_ENABLE", "1"),
        "GLIBC_TUNABLES": _with_tunable(environ.get("GLIBC_TUNABLES"), "glibc.malloc.hugetlb", "1"),
    }
