"""``elastic demo``: the whole product on one machine, on a compressed day.

A local Ray with 8 logical GPUs; one inference service of reference replicas (1 GPU
each, min 1, max 6) under the load generator's diurnal day compressed to ``--minutes``;
one training job that starts on whatever is free and is rescaled in place as traffic moves:
the reference trainer's small GPT, or with ``--job`` a user's own loop under
``elastic.torch.Manager`` (:class:`UserJob`, e.g. the example Llama, on a byte-token corpus of a
few standard-library files prepared before the controller starts); the controller ticking in
between, SQLite state in ``./elastic.db``. Everything below is measured the same way for both.

GPU utilisation is measured as docs/DESIGN.md defines it, sampled every second: each ready
replica counts ``min(1, running / capacity)``, where the capacity is the load a replica is
sized for at its SLO (the service's target: 13 concurrent requests of its 16 batch slots;
above it the queue makes time-to-first-token miss 1 s); each training GPU counts 1 while
its worker is stepping: the GPUs of the coordinator's current layout (a rescale's pause,
pause x the larger of the two world sizes, is subtracted; GPUs whose joiners are still
starting count 0, a shrink's leavers count 0 from the switch step on); idle, starting and draining GPUs (a replica out
of the balancer, finishing its requests) count 0. The sum over
time is divided by 8 x elapsed time. A request counts as served only when its stream ends
as the replica meant it to: one cut short (a replica stopped under it) is a failed request.
"""

from elastic.demo.config import (
    CORPUS_FILES,
    GOALS,
    GPUS,
    JOB,
    JOB_START_TIMEOUT_S,
    MAX_TOKENS,
    REFERENCE,
    SERVICE,
    SLOTS,
    TARGET,
    TOKENS_PER_SECOND,
    USER_JOB,
    UserJob,
    demo_config,
    job_name,
    resolve_job,
)
from elastic.demo.measure import (
    _goals_line,
    _layouts_line,
    _summary,
    clairvoyant_on_arrivals,
    utilization_bound,
)
from elastic.demo.report import _write_timeline
from elastic.demo.run import (
    _collect_reshards,
    _first_tick,
    _sample_loop,
    _wait_job_started,
    day_offset,
    last_reshard_id,
    run_demo,
)
from elastic.demo.samples import DemoRun, Sample

__all__ = [
    "CORPUS_FILES", "GOALS", "GPUS", "JOB", "JOB_START_TIMEOUT_S", "MAX_TOKENS", "REFERENCE", "SERVICE", "SLOTS",
    "TARGET", "TOKENS_PER_SECOND", "USER_JOB", "DemoRun", "Sample", "UserJob", "_collect_reshards", "_first_tick",
    "_goals_line", "_layouts_line", "_sample_loop", "_summary", "_wait_job_started", "_write_timeline",
    "clairvoyant_on_arrivals", "day_offset", "demo_config", "job_name", "last_reshard_id", "resolve_job", "run_demo",
    "utilization_bound",
]
