"""``elastic demo``'s embedded configuration is valid and sized as its docstring says."""

from __future__ import annotations

import math

import pytest

from elastic.config import load_config
from elastic.demo import GPUS, MAX_TOKENS, SLOTS, TARGET, TOKENS_PER_SECOND, demo_config
from elastic.serve.profiles import diurnal_rate


@pytest.mark.parametrize("minutes,tick", [(5.0, 2.0), (2.0, 1.0), (30.0, 5.0)])
def test_demo_config_loads(minutes: float, tick: float) -> None:
    cfg = load_config(data=demo_config(minutes, tick))
    svc, job = cfg.services[0], cfg.jobs[0]
    assert cfg.pool.total_gpus == GPUS
    assert (svc.min_replicas, svc.max_replicas, svc.gpus_per_replica) == (1, 6, 1)
    assert svc.metric.target == TARGET < SLOTS  # headroom between the SLO capacity and the batch
    assert svc.metric.window_seconds > 0  # shrink on the window mean, grow on the latest reading
    # every GPU count training can get next to the inference minimum has a data-parallel layout
    assert all(job.global_batch % n == 0 for n in range(1, GPUS - svc.min_replicas + 1))


def test_the_day_fits_the_service() -> None:
    # Little's law: concurrency = rate x request time; the peak must fit max_replicas x target
    request_seconds = MAX_TOKENS / TOKENS_PER_SECOND
    peak = 11.0  # the CLI default
    need = max(diurnal_rate(f / 96, peak) for f in range(96)) * request_seconds / TARGET
    assert need <= 6, f"the default day needs {need:.2f} replicas of capacity {TARGET}, more than max 6"
    assert math.ceil(need) == 6  # ... and uses the pool at its peak (a pool sized for the peak)
