"""``Layout``: a 3D-parallel layout (tp, pp, dp, with ep, vpp and ZeRO), its text form and rank order.

A pure value object: it validates itself (with messages that show the arithmetic) and builds no
runtime (process groups and device meshes are built elsewhere from it). Whether a model can take a
layout is :func:`elastic.model.check_layout`.

Conventions (see docs/DESIGN.md):

* ``Layout(tp, pp, dp, ep=1, vpp=1, zero=0)`` prints as ``tp2.pp2.dp4``; extra
  axes only when not default (``tp1.pp4.dp8.ep8.vpp2.z1``).
* Rank order is Megatron's default: tp fastest, then dp, then pp:
  ``rank = tp_rank + tp * (dp_rank + dp * pp_rank)``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from elastic.errors import SpecError, _clip

_AXES = ("tp", "pp", "dp", "ep", "vpp", "z")

# ASCII digits only (\d also takes other scripts' digits, which int() reads), and few of them: a degree
# of thousands of digits is no layout, only work for whoever reads it
_LAYOUT_RE = re.compile(r"^(tp|pp|dp|ep|vpp|z)([0-9]{1,6})$")


@dataclass(frozen=True, order=True)
class Layout:
    """A 3D-parallel layout. ``zero`` is 0 (replicated optimizer) or 1 (ZeRO-1 / distributed optimizer)."""

    tp: int
    pp: int
    dp: int
    ep: int = 1
    vpp: int = 1
    zero: int = 0

    def __post_init__(self) -> None:
        for axis in ("tp", "pp", "dp", "ep", "vpp"):
            v = getattr(self, axis)
            if not isinstance(v, int) or v < 1:
                raise SpecError(f"layout {axis}={v!r}: every parallel degree must be an integer >= 1")
        if self.zero not in (0, 1):
            raise SpecError(f"layout zero={self.zero!r}: only 0 (off) and 1 (ZeRO-1) are supported")
        if self.ep > 1 and (self.dp % self.ep):
            raise SpecError(
                f"layout ep={self.ep} must divide dp={self.dp} (experts are sharded inside the data-parallel group)"
            )
        if self.vpp > 1 and self.pp == 1:
            raise SpecError(f"layout vpp={self.vpp} needs pp > 1 (interleaving splits pipeline stages)")

    # ---- text form ----------------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str) -> Layout:
        """``tp2.pp2.dp4`` (tp, pp, dp required; ep/vpp/z optional)."""
        if isinstance(text, Layout):  # a value where text belongs: the caller has the layout already
            raise TypeError(f"Layout.parse takes a layout's text; got the Layout {text} itself (use it as it is)")
        if not isinstance(text, str) or not text.strip():
            raise SpecError("layout: empty; expected e.g. 'tp2.pp2.dp4'")
        vals: dict[str, int] = {}
        for part in text.strip().lower().split("."):
            m = _LAYOUT_RE.match(part)
            if not m:
                raise SpecError(f"layout '{_clip(text)}': cannot read '{_clip(part)}'; expected e.g. 'tp2.pp2.dp4' (axes "
                                f"{', '.join(_AXES)}, each with a degree of 1 to 6 ASCII digits)")
            axis, num = m.group(1), int(m.group(2))
            if axis in vals:
                raise SpecError(f"layout '{text}': axis '{axis}' given twice")
            vals[axis] = num
        missing = [a for a in ("tp", "pp", "dp") if a not in vals]
        if missing:
            raise SpecError(f"layout '{text}': missing {', '.join(missing)}; expected e.g. 'tp2.pp2.dp4'")
        for axis, v in vals.items():
            if v < 1 and axis != "z":
                raise SpecError(f"layout '{text}': {axis}{v} is invalid; every degree must be >= 1")
        return cls(tp=vals["tp"], pp=vals["pp"], dp=vals["dp"], ep=vals.get("ep", 1), vpp=vals.get("vpp", 1),
                   zero=vals.get("z", 0))

    def __str__(self) -> str:
        s = f"tp{self.tp}.pp{self.pp}.dp{self.dp}"
        if self.ep != 1:
            s += f".ep{self.ep}"
        if self.vpp != 1:
            s += f".vpp{self.vpp}"
        if self.zero:
            s += f".z{self.zero}"
        return s

    def held(self) -> Layout:
        """How keepers hold a paused job's state: the same model-parallel split, one data-parallel copy
        (``tp.pp.dp1``; ZeRO-1 shards gather into it)."""
        return Layout(self.tp, self.pp, 1, vpp=self.vpp)

    # ---- ranks --------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(tp_rank, dp_rank, pp_rank)`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise SpecError(f"rank {rank} outside layout {self} (world size {self.world_size})")
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return tp_rank, dp_rank, pp_rank

    def tp_group(self, rank: int) -> list[int]:
        _, d, p = self.coords(rank)
        return [self.rank(t, d, p) for t in range(self.tp)]

    def dp_group(self, rank: int) -> list[int]:
        t, _, p = self.coords(rank)
        return [self.rank(t, d, p) for d in range(self.dp)]

    def pp_group(self, rank: int) -> list[int]:
        t, d, _ = self.coords(rank)
        return [self.rank(t, d, p) for p in range(self.pp)]

    def ep_group(self, rank: int) -> list[int]:
        """Ranks that together hold all experts: consecutive dp ranks within one block of ``ep``."""
        t, d, p = self.coords(rank)
        base = d - d % self.ep
        return [self.rank(t, base + e, p) for e in range(self.ep)]

    def all_tp_groups(self) -> list[list[int]]:
        return [self.tp_group(self.rank(0, d, p)) for p in range(self.pp) for d in range(self.dp)]

    def all_dp_groups(self) -> list[list[int]]:
        return [self.dp_group(self.rank(t, 0, p)) for p in range(self.pp) for t in range(self.tp)]

    def all_pp_groups(self) -> list[list[int]]:
        return [self.pp_group(self.rank(t, d, 0)) for d in range(self.dp) for t in range(self.tp)]


def padded_layers(layers: int, pp: int, vpp: int = 1) -> int:
    """Layer slots after virtual padding: the next multiple of ``pp*vpp`` at or above ``layers``,
    allowing at most ``pp*vpp - 1`` virtual (empty) slots. DeepSeek-V3: 61 layers, pp16 -> 64 slots."""
    chunks = pp * vpp
    return math.ceil(layers / chunks) * chunks
