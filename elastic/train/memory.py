"""Memory one training rank holds, measured by component, once per step.

What it is for: checking the planner's per-GPU memory model (``elastic.parallel.memory``)
against what the reference trainer really holds, and reporting it (``elastic plan --report
... --measured FILE``). :class:`MemoryMeter` is what the engine calls: ``track()`` around a
step, ``measure()`` after it, giving a :class:`MeasuredMemory` (declared with the report, in
``elastic.parallel.memory_report``, so that reading a measurement needs no torch).

How each component is measured:

* weights, gradients, optimizer: exact, from the tensors (``numel * element_size`` of the
  rank's parameters, of their ``.grad`` after the step's reduction, and of its Adam moments
  plus the fp32 master copy in mixed precision). Element counts are kept as well, because
  the planner counts bf16 weights, fp32 gradients and 12 bytes of optimizer state per
  element while a CPU run holds float32 or float64: elements compare across dtypes, bytes
  do not.
* activations: the high-water mark, during the step, of the bytes autograd saved for
  backward (``torch.autograd.graph.saved_tensors_hooks``). Each saved tensor is counted by
  its storage, once however many ops saved it or views of it, from the moment it is saved
  until autograd frees it after its backward; parameters (saved by every matmul) are left
  out, they are the weights. This is what the planner's activation term models: the tensors
  the pipeline schedule keeps for its micro-batches in flight. Not counted: the pipeline's
  own reference to each stage output it has sent (Megatron frees those once sent, and the
  planner does not count them), temporaries that die inside one op, and communication
  buffers.
* on a GPU also ``torch.cuda.max_memory_allocated`` over the step (``device_peak``), which
  sees everything the caching allocator handed out, fragmentation not included.

A per-rank limit (``TrainConfig.memory_limit_bytes``, a test and rehearsal aid that stands in for
a device's capacity on CPU): :meth:`MemoryMeter.track` is given the bytes the rank holds
throughout the step (weights, optimizer state, and gradients as large as the weights) and the
limit; a tensor autograd saves that would take them over it raises ``torch.OutOfMemoryError``
where it is saved, as the CUDA allocator raises at the allocation that does not fit. A step
therefore fails exactly when its measured peak (:func:`~elastic.parallel.memory_report.measured_peak`,
the components' sum) would exceed the limit. ``refused`` keeps the activation bytes the step had
reached with the one refused, for the failure's report.

Must not: change what the step computes (the hooks hand every saved tensor back as it was),
or hold a reference to the engine between calls (a meter must not keep a resharded-away
engine's tensors alive).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch

from elastic.model import Layout
from elastic.parallel.memory_report import MeasuredMemory

__all__ = ["MeasuredMemory", "MemoryMeter", "write_measured"]


def write_measured(path: str | Path, records: Iterable[MeasuredMemory]) -> None:
    """Write ``records`` (e.g. every rank's of a step) as the JSON list ``elastic plan --measured`` reads."""
    Path(path).write_text(json.dumps([r.as_json() for r in records], indent=1) + "\n")


class _Engine(Protocol):
    """What :meth:`MemoryMeter.measure` reads of a ``TrainEngine``."""

    params: dict[str, torch.nn.Parameter]
    layout: Layout
    rank: int
    pp_rank: int
    micro_batch: int
    grad_accum: int

    @property
    def cfg(self) -> Any: ...

    def state(self) -> dict[tuple[str, str], torch.Tensor]: ...


def _nbytes(ts: Iterable[torch.Tensor]) -> tuple[int, int]:
    n = b = 0
    for t in ts:
        n += t.numel()
        b += t.numel() * t.element_size()
    return n, b


class _Saved:
    """One tensor autograd saved: counted while it lives (autograd drops it after its backward)."""

    __slots__ = ("meter", "key", "tensor")

    def __init__(self, meter: MemoryMeter, key: int, nbytes: int, tensor: torch.Tensor) -> None:
        self.meter, self.key, self.tensor = meter, key, tensor
        meter._add(key, nbytes)

    def __del__(self) -> None:
        self.meter._drop(self.key)


class MemoryMeter:
    """The high-water mark of saved activation bytes during a step, and the other components after it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[int, list[int]] = {}  # storage address -> [saved tensors using it, its bytes]
        self._skip: frozenset[int] = frozenset()
        self.current = 0
        self.peak = 0
        self._limit: int | None = None  # bytes the rank may hold in all (None: no limit)
        self._base = 0  # bytes held throughout the step besides the activations
        self.refused: int | None = None  # activation bytes with the save the limit refused (None: none)

    def _add(self, key: int, nbytes: int) -> None:
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                self._live[key] = [1, nbytes]
                self.current += nbytes
                self.peak = max(self.peak, self.current)
            else:
                entry[0] += 1

    def _drop(self, key: int) -> None:
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                return
            entry[0] -= 1
            if entry[0] == 0:
                del self._live[key]
                self.current -= entry[1]

    def _pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or key in self._skip:
            return t
        if self._limit is not None and key not in self._live and self._base + self.current + nbytes > self._limit:
            self.refused = self.current + nbytes
            raise torch.OutOfMemoryError(
                f"out of memory: saving {nbytes} bytes for backward would hold {self._base + self.current + nbytes} "
                f"bytes on this rank (weights, gradients and optimizer state {self._base}, activations "
                f"{self.current + nbytes}), over its limit of {self._limit} bytes (TrainConfig.memory_limit_bytes)")
        # detached: the saved object must not hold the tensor's autograd history (a cycle
        # through its grad_fn would keep the whole graph alive)
        return _Saved(self, key, nbytes, t.detach())

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    @contextmanager
    def track(self, params: Iterable[torch.Tensor], device: str = "cpu", *, limit: int | None = None,
              base: int = 0) -> Iterator[None]:
        """Count the activations saved inside the block (one step); ``params`` are not activations.
        ``limit``: refuse (``torch.OutOfMemoryError``) a save that takes ``base`` (what the rank holds
        besides activations) plus the activations over it."""
        self._skip = frozenset(p.untyped_storage().data_ptr() for p in params)
        self._limit, self._base, self.refused = limit, base, None
        with self._lock:
            self.peak = self.current  # anything still alive from an abandoned step counts from the start
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats(device)
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def measure(self, engine: _Engine, step: int) -> MeasuredMemory:
        """The components of ``engine`` after ``step`` (its gradients are still held then)."""
        cfg = engine.cfg
        params = list(engine.params.values())
        wn, wb = _nbytes(params)
        gn, gb = _nbytes(p.grad for p in params if p.grad is not None)
        opt = [t for (_, kind), t in engine.state().items() if kind != "param"]
        kinds = {kind for (_, kind) in engine.state() if kind != "param"}
        on, ob = _nbytes(opt)
        device = str(cfg.device)
        peak = int(torch.cuda.max_memory_allocated(device)) if device.startswith("cuda") else None
        return MeasuredMemory(
            model=cfg.model.name, layout=engine.layout, rank=engine.rank, pp_rank=engine.pp_rank, step=step,
            dtype=str(cfg.dtype).removeprefix("torch."), micro_batch=engine.micro_batch,
            grad_accum=engine.grad_accum, weights=wb, gradients=gb, optimizer=ob, activations=self.peak,
            weight_elements=wn, gradient_elements=gn, optimizer_elements=on // max(1, len(kinds)),
            optimizer_kinds=len(kinds), device_peak=peak)
