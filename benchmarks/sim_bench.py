"""A 7-day simulation of the built-in ``deepseek-day`` pool (278 nodes x 8 H800) under ``cosched``.

Goal (issue 10): under 60 s on the development machine. Prints wall time, ticks per second and
the day's figures. The planner's throughput tables are built once before the clock starts
(they are memoised per model and shared by every policy).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic.sim import load_scenario, simulate  # noqa: E402


def main() -> None:
    sc, base = load_scenario("deepseek-day")
    simulate(sc, base, "cosched", days=0.01, keep_timeline=False)  # warm the planner tables
    t0 = time.perf_counter()
    r = simulate(sc, base, "cosched", days=7, keep_timeline=False)
    wall = time.perf_counter() - t0
    ticks = 7 * 86400 / sc.tick_seconds
    print(f"7-day deepseek-day simulation (cosched, {ticks:.0f} ticks of {sc.tick_seconds:g}s): {wall:.1f} s "
          f"({ticks / wall:.0f} ticks/s); goal < 60 s")
    print(f"  utilisation {r.gpu_utilization:.2%}, SLO {r.slo_attainment:.3%}, rescales {r.rescales}, "
          f"throughput tables from {r.throughput_source}")
    sys.exit(0 if wall < 60 else 1)


if __name__ == "__main__":
    main()
