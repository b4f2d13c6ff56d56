"""``ReshardError``: a reshard that cannot be planned or run, in a module of its own.

The planner (``plan.py`` and its steps), the generic planner (``plan_regions.py``) and the executor
(``execute.py``) all raise it; here it loads nothing but ``elastic.errors``. ``plan.py`` and
``execute.py`` re-export it.
"""

from __future__ import annotations

from elastic.errors import SpecError


class ReshardError(SpecError):
    """The reshard cannot be planned (raised before any byte moves; the old state stays intact)."""
