"""What the operator keeps per GPUPool and per registered InferenceService or ElasticTrainingJob."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from elastic.backends.kubernetes import KubernetesBackend
from elastic.controller import Controller
from elastic.crds import GPUPoolSpec
from elastic.model import InferenceSpec, PlanStep, TrainingSpec

POOLS, SERVICES, JOBS = "gpupools", "inferenceservices", "elastictrainingjobs"



@dataclass
class Member:
    """One registered InferenceService or ElasticTrainingJob."""

    plural: str
    namespace: str
    name: str
    uid: str | None
    generation: int
    pool: str
    cr: Any  # InferenceServiceSpec | ElasticTrainingJobSpec (last good)
    spec: InferenceSpec | TrainingSpec  # the controller's view of it
    options: dict[str, Any] = field(default_factory=dict)  # from annotations (a service's drain)

    @property
    def workload(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass
class Pool:
    name: str
    uid: str | None
    generation: int
    cr: GPUPoolSpec
    backend: KubernetesBackend
    controller: Controller | None = None
    config_key: str | None = None
    last_tick: float = 0.0
    lock: threading.RLock = field(default_factory=threading.RLock)
    unschedulable: dict[str, str] = field(default_factory=dict)  # workload -> why the config refused it
    # workload -> (retry at, seconds of this back-off, why): a job whose start failed is
    # left out of the pool until then (as a kubelet backs off a crashing container), so a job whose
    # pods exit at once does not churn pods every cycle; the rest of the pool goes on
    backoff: dict[str, tuple[float, float, str]] = field(default_factory=dict)
    not_ready_since: dict[str, float] = field(default_factory=dict)  # service -> when its replicas fell short
    # job -> its start or grow running in the background, until a cycle reads its outcome
    growing: dict[str, Grow] = field(default_factory=dict)
    # every InferenceService and ElasticTrainingJob of the pool that the API server lists has been
    # registered (or refused) here: until then a cycle would plan without some of them (on start,
    # Kopf resumes each kind from its own watch, in no set order)
    synced: bool = False


@dataclass
class Grow:
    """A job's start or grow the controller runs in the background (``Controller(async_grow=True)``)."""

    thread: threading.Thread
    errors: list[str]  # the controller appends the failure here before the thread ends
    step: PlanStep | None  # what the plan said (its reason and message go in the Event once it landed)

    @property
    def running(self) -> bool:
        return self.thread.is_alive()
