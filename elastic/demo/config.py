"""The demo's set-up: its pool, service and job (the reference trainer's or a user's), and the goals."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

for _k, _v in (("RAY_AUTH_MODE", "disabled"), ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"),
               ("RAY_USAGE_STATS_ENABLED", "0"), ("GLOO_SOCKET_IFNAME", "lo"), ("MASTER_ADDR", "127.0.0.1")):
    os.environ.setdefault(_k, _v)


log = logging.getLogger("elastic.demo")


SERVICE = "chat"


JOB = "gpt-tiny"  # the reference trainer's job


USER_JOB = "user-job"  # the job of a user's own loop (--job)


REFERENCE = "reference trainer"


GPUS = 8


# A reference replica batches 16 requests; a request holds a slot for max_tokens /
# tokens_per_second = 32 / 5 = 6.4 s. The service is sized (the policy's target, the
# replica's SLO capacity) for 13 concurrent requests: above it the queue makes
# time-to-first-token miss 1 s when few replicas run.
SLOTS, TOKENS_PER_SECOND, MAX_TOKENS, TARGET = 16, 5.0, 32, 13.0


# The reference trainer's per-GPU memory limit (tensors only, fp32): between what its model holds at dp 3
# with ZeRO-1 (22.56 MB at the micro-batch of 35 it runs there) and at dp 2 with ZeRO-1 (22.84 MB)
DEMO_MEMORY_LIMIT = 22_700_000


# the training job's first start, before the day's load begins (seven processes importing torch)
JOB_START_TIMEOUT_S = 180.0


# the demo's goals: GPU utilisation as defined above, and the share of the day's requests answered in
# full with their first token within the TTFT SLO
GOALS = {"gpu_utilization": 0.90, "slo_attainment": 0.99}


# what a user job of the demo trains on (``--corpus DIR``): byte tokens of these standard-library files
CORPUS_FILES = ("dataclasses.py", "functools.py", "textwrap.py")


@dataclass(frozen=True)
class UserJob:
    """The demo's training side as a user's own loop (``elastic demo --job``): what its TrainingSpec
    names besides the demo's sizing. Its workers get ``--corpus DIR`` (the corpus the demo prepares)
    and then ``args``; ``spec`` holds further TrainingSpec fields (mesh_dims, dp_replicas, ...)."""

    entrypoint: str
    model: str  # the declared model file the planner sizes the job from
    args: tuple[str, ...] = ()
    spec: Mapping[str, Any] = field(default_factory=dict)

    @property
    def trainer(self) -> str:
        return f"user job {self.entrypoint}"


# The example Llama as DDP-style replicas (dp_replicate): gradients are averaged once a step, where
# its FSDP2 alternative (dp_shard) gathers and scatters the parameters at every one of a step's many
# micro-batches, several times slower on gloo over shared cores; and a replica lets --kill-worker-at
# recover in place. tp is named (the example's parallelize code needs a tp or dp_shard dim in the
# mesh) but held at 1: it too would add collectives to every micro-batch. torchtitan's example
# (examples/titan) shards over dp_shard only and is 17 times the size: its steps, which a shrink
# waits for, would hold inference back, so it has no alias (--job examples.titan.job:main runs it).
EXAMPLE_JOBS: dict[str, UserJob] = {
    "llama": UserJob("examples.llama.job:main", "examples/llama/model.json", ("--dtype", "float32"),
                     {"mesh_dims": {"dp": "dp_replicate", "tp": "tp"}, "dp_replicas": True, "allowed_tp": [1]}),
}


def resolve_job(entry: str, model: str | None = None, args: Sequence[str] = ()) -> UserJob:
    """``--job``: an example's alias (``llama``), entrypoint or script path (``examples/llama/job.py``)
    takes the example's settings; any other entrypoint needs ``model``, its declared model file.
    ``model`` and ``args`` (appended to the example's) override. ValueError names the option."""
    example = EXAMPLE_JOBS.get(entry)
    if example is None:
        example = next((j for j in EXAMPLE_JOBS.values() if entry == j.entrypoint or _same_file(entry, j)), None)
        entry_point = entry
    else:
        entry_point = example.entrypoint
    if example is None:
        if not model:
            raise ValueError(f"--job {entry}: not one of the examples ({', '.join(EXAMPLE_JOBS)}); "
                             "give its declared model file with --job-model PATH")
        return UserJob(entry_point, model, tuple(args))
    return UserJob(entry_point, model or example.model, (*example.args, *args), example.spec)


def _same_file(path: str, job: UserJob) -> bool:
    """``path`` is the script of ``job``'s ``module:function`` entrypoint (relative to this directory)."""
    if not path.endswith(".py"):
        return False
    script = Path(*job.entrypoint.partition(":")[0].split(".")).with_suffix(".py")
    return Path(path).resolve() == script.resolve()


def demo_config(minutes: float, tick_seconds: float, job: UserJob | None = None, *,
                corpus: str = "", replicated: bool = False) -> dict[str, Any]:
    """The demo's controller config; with ``job`` its training job is that user loop reading ``corpus``;
    ``replicated``: the reference trainer keeps a whole optimizer state per data-parallel replica (see
    :func:`_job_spec`)."""
    return {**_service_config(minutes, tick_seconds), "jobs": [_job_spec(job, corpus, replicated)]}


def job_name(job: UserJob | None) -> str:
    return JOB if job is None else USER_JOB


def _demo_corpus() -> Any:
    """A ``TemporaryDirectory`` holding a byte-token corpus of :data:`CORPUS_FILES` (``--corpus DIR``
    of a user job); ``cleanup()`` removes it."""
    import tempfile

    from elastic.torch.data import prepare_corpus, stdlib_root

    tmp = tempfile.TemporaryDirectory(prefix="elastic-demo-corpus-")
    prepare_corpus(tmp.name, [stdlib_root() / f for f in CORPUS_FILES])
    return tmp


def _service_config(minutes: float, tick_seconds: float) -> dict[str, Any]:
    return {
        "pool": {"name": "local", "nodes": 1, "gpus_per_node": GPUS, "hardware": "h100-80g",
                 # a compressed day: rescale at most every other tick, and only for a real gain. A longer
                 # interval leaves a GPU that a replica gave back idle until it ends; a grow costs its
                 # members a fraction of a second of pause
                 "rescale_interval_seconds": 2 * tick_seconds, "gain_threshold": 0.05},
        "services": [{
            "name": SERVICE, "gpus_per_replica": 1, "min_replicas": 1, "max_replicas": 6, "priority": 100,
            # shrink on the mean of the last seconds' readings (grow on the latest): the running-requests
            # gauge jitters by +-sqrt(load), and holding its peaks holds replicas nobody needs
            # (a longer mean keeps a replica long after the load fell; a shorter one, with a shorter
            # scale-down window, scales down on dips that are undone seconds later)
            # noiseMargin 0.5: a scale-down to n replicas needs load + 0.5 sqrt(load) <= 13 n, so the
            # plateau drops a replica only on a dip of two standard deviations of one reading, while the
            # evening's step-downs still pass with room to spare.
            "metric": {"preset": "vllm-requests", "target": TARGET, "windowSeconds": max(3, 1.5 * tick_seconds),
                       "noiseMargin": 0.5},
            # a leaving replica hands its requests off (the balancer resumes them on the replicas that
            # stay) when the window lets it go, and its GPU goes to training within a second; it serves
            # until then instead of idling out of the balancer while it drains.
            "drain_ahead_seconds": 0.0, "handoff": True,
            # the trend forecast: a line through the running-requests gauge, a few seconds ahead. A line
            # over few readings extrapolates the gauge's jitter and starts replicas nobody needs (each then
            # held for the scale-down window while training shrinks and grows back); over 30 s (15
            # readings) the night's and the evening's jitter start no replica and the morning ramp is still
            # seen. After an evening step the line runs above the load for a few seconds and holds a
            # replica a tick or two longer; that is kept, since ignoring a falling line lets a dip right
            # after the step drain a replica whose requests then miss their TTFT on those left.
            # startup_seconds, the forecast's horizon: from a decision to the replica serving (a shrink
            # at the next micro-batch, a spare's lease) plus a tick; several seconds on a loaded machine's ramp
            "startup_seconds": 5.0, "forecast": "trend", "forecast_window_seconds": max(30.0, 15 * tick_seconds),
            "behavior": {
                "scaleUp": {"stabilizationWindowSeconds": 0,
                            "policies": [{"type": "Pods", "value": 2, "periodSeconds": 1}]},
                # longer than a scale-up takes to land (a shrink that gives its step up, then the replica
                # on the GPU handed over with its lease), so a replica started for a ramp is not drained
                # on the next dip before the ramp arrives. The window counts from when a scale-up landed
                # (policy.replicas.landed). A longer one holds a replica longer at each evening
                # step-down; a shorter one drains a replica on a dip and its requests miss their TTFT on
                # those left
                "scaleDown": {"stabilizationWindowSeconds": int(max(4, 2 * tick_seconds)),
                              "policies": [{"type": "Pods", "value": 1, "periodSeconds": 1}]},
            },
        }],
        "controller": {"tick_seconds": tick_seconds, "lease_seconds": max(15.0, 5 * tick_seconds)},
    }


def _job_spec(job: UserJob | None, corpus: str, replicated: bool = False) -> dict[str, Any]:
    """The demo's training job: the reference trainer's small GPT, or ``job`` reading ``corpus``."""
    bounds = {"min_gpus": 1, "max_gpus": GPUS - 1, "priority": 0}
    if job is None:
        # global batch 420 = lcm(1..7): every GPU count training can get (inference keeps >= 1) has a layout.
        # A rank's share of the 420 samples in the fewest micro-batches of at most 36 (2 at dp 7, 12 at dp 1):
        # few passes keep a step short, and a shrink gives the step in progress up at the next micro-batch.
        # The trainer runs fp32 and keeps what the planner's selective count does (flash attention).
        ref = {"name": JOB, "model": "tiny", **bounds, "global_batch": 420, "micro_batch": 1, "micro_batch_cap": 36,
               "precision": "fp32", "recompute": "selective", "offload": False}
        if replicated:
            # no ZeRO-1 and no memory limit: every replica a full copy, so a lost worker is recovered
            # from its replica (--kill-worker-at); the layouts are data-parallel only
            return {**ref, "replicate_optimizer": True}
        # Each GPU may hold DEMO_MEMORY_LIMIT bytes of tensors: from 3 GPUs up the optimizer state sharded
        # over the replicas (ZeRO-1) leaves room for a whole model per rank; 2 GPUs cannot shard enough,
        # so the planner splits the layers over them (pp2, or tp2 where that were faster). The job thus
        # changes its pipeline depth, its ZeRO sharding and its data-parallel width in place.
        return {**ref, "memory_limit_bytes": DEMO_MEMORY_LIMIT}
    # The same micro-batches as the reference trainer's (micro_batch_cap): a rank's share of the 420
    # samples in the fewest passes of at most 36 (2 at dp 7, 12 at dp 1). Fewer passes keep the step
    # short, and that matters: a user loop cannot give its step up half-way, so a rescale waits for
    # the step in progress.
    # on_below_minimum left at pause: inference's six replicas at most never take it below its minimum
    # of one GPU.
    return {"name": USER_JOB, "model": job.model, **bounds, "global_batch": 420, "micro_batch": 36,
            "entrypoint": job.entrypoint, "args": ["--corpus", corpus, *job.args], **job.spec}
