"""Trace-driven cluster simulator: the real replica policy and co-scheduler on a simulated clock.

Pure: time is a number the simulator advances; nothing here reads the wall clock, a database
or a backend. Scenario files are read only when a caller names one (``load_scenario``).
"""

from __future__ import annotations

from elastic.sim.engine import POLICIES, SimResult, simulate
from elastic.sim.scenario import Scenario, load_scenario, read_trace

__all__ = ["POLICIES", "Scenario", "SimResult", "load_scenario", "read_trace", "simulate"]
