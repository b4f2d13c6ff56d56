"""How one job's coordinator times and decides: one validated value, built once per job by the
launcher (:func:`elastic.train.launch.coordinator_settings`) and passed whole (as JSON, with
:meth:`CoordinatorSettings.to_json`, to a coordinator in a process of its own)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from elastic.model import SpecError

if TYPE_CHECKING:  # a field's type only: the settings carry the value, they write nothing
    from elastic.train.checkpoint import CheckpointSettings


@dataclass(frozen=True)
class CoordinatorSettings:
    """The coordinator's timing and rescale rules. Invalid combinations raise ``SpecError`` naming
    the field."""

    heartbeat_interval_s: float = 1.0
    # a worker silent this long is lost (a few beats of slack over the interval)
    heartbeat_timeout_s: float = 15.0
    # a directive's joiners must be polling within this, or the rescale is abandoned
    join_timeout_s: float = 60.0
    # steps between a directive and its switch: members see it a step early and prepare while they train
    lookahead_steps: int = 1
    # a shrink's own lookahead (members only leave); None: as ``lookahead_steps``
    shrink_lookahead_steps: int | None = None
    max_steps: int | None = None
    # a lost member's generation is recovered from the survivors (else the job fails)
    recover: bool = False
    # rescales of a recoverable generation roll back on a loss mid-exchange (Directive.rollback)
    transactional: bool = True
    # survivors must report within this after a loss; None: the heartbeat timeout
    recovery_timeout_s: float | None = None
    # how long a worker may block inside a group's rendezvous (its pg_timeout_s): gloo's C++
    # rendezvous cannot be given up from Python, so a survivor that still beats and says it is
    # building groups is waited for that long before it is given up (None: not at all)
    rendezvous_timeout_s: float | None = None
    # periodic checkpoints (the workers write them; a start begins at the newest complete one)
    checkpoint: CheckpointSettings | None = None
    # a shrink (with no lookahead, on one pipeline stage) asks its members to give the step in
    # progress up instead of finishing it: the GPUs go a step sooner, the partial step is lost
    shrink_gives_up_step: bool = False
    # a grow (same: no lookahead, one pipeline stage; and the same TP split, so the work is kept)
    # asks the same: its joiners' GPUs idle until the switch; the members keep the step's work and
    # the new layout, joiners included, finishes it. Needs engines that check (generations posted
    # with shrink_gives_up_step)
    grow_gives_up_step: bool = False
    # members hear of a posted rescale on their heartbeat and prepare beside the step in progress
    # (False: at the switch, or during the lookahead steps; for A/B measurements)
    prepare_beside_step: bool = True

    def __post_init__(self) -> None:
        if not self.heartbeat_interval_s > 0:
            raise SpecError(f"heartbeat_interval_s={self.heartbeat_interval_s}: must be > 0")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise SpecError(
                f"heartbeat_timeout_s={self.heartbeat_timeout_s} must exceed heartbeat_interval_s="
                f"{self.heartbeat_interval_s} (a worker needs a few beats of slack)"
            )
        if not self.join_timeout_s > 0:
            raise SpecError(f"join_timeout_s={self.join_timeout_s}: must be > 0")
        if min(self.lookahead_steps, self.shrink_lookahead) < 0:
            raise SpecError(
                f"lookahead_steps={self.lookahead_steps}, shrink_lookahead_steps="
                f"{self.shrink_lookahead_steps}: a lookahead counts steps, >= 0"
            )
        if self.max_steps is not None and self.max_steps < 0:
            raise SpecError(f"max_steps={self.max_steps}: must be >= 0 (or None: no limit)")
        for name in ("recovery_timeout_s", "rendezvous_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise SpecError(f"{name}={value}: must be > 0 (or None for its default)")

    @property
    def shrink_lookahead(self) -> int:
        """The lookahead of a shrink, its own or the general one."""
        return self.lookahead_steps if self.shrink_lookahead_steps is None else self.shrink_lookahead_steps

    @property
    def recovery_timeout(self) -> float:
        """How long survivors have to report after a loss."""
        return self.heartbeat_timeout_s if self.recovery_timeout_s is None else self.recovery_timeout_s

    def to_json(self) -> dict[str, Any]:
        """Every field as JSON (``checkpoint``: its fields too, or None); the coordinator host reads it
        back (:func:`elastic.train.rendezvous.host.settings_from_json`)."""
        return asdict(self)
