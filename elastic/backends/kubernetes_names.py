"""Names, annotations and targets the Kubernetes backend and its training half share."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from elastic.backends.base import (
    JobRuntime,
    RescaleOutcome,
)
from elastic.model import GPU

GPU_RESOURCE = "nvidia.com/gpu"
FIELD_MANAGER = "elastic-operator"
LABEL_JOB = "elastic.dev/job"
LABEL_WORKER = "elastic.dev/worker"
LABEL_MANAGED = "app.kubernetes.io/managed-by"
LABEL_KEEPER = "elastic.dev/keeper"
LABEL_COORDINATOR = "elastic.dev/coordinator"  # on a job's coordinator pod: the job's name
COORDINATOR_PORT = 29400  # the coordinator pod serves workers and the operator here
LABEL_SERVING = "elastic.dev/serving"  # "false": drained, out of a Service that selects "true"
ANN_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
ANN_DRAIN_UNTIL = "elastic.dev/drained-until"  # unix time: back into the balancer unless asked again
DRAINED_COST = "-1000"
ANN_GENERATION = "elastic.dev/generation"
SECRET_KEY = "secret"  # the key of the job's Secret that holds its coordinator secret
ANN_LAYOUT = "elastic.dev/layout"
ANN_GPU = "elastic.dev/gpu"
APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"


@dataclass(frozen=True)
class ServiceTarget:
    """Where an inference service's replicas live: ``namespace/deployment``.

    ``drain``: replicas leave the load balancer before a scale-down removes them (opt-in, the
    InferenceService's annotation ``elastic.dev/drain``): the backend relabels the chosen pods
    ``elastic.dev/serving=false`` (a Service selecting ``elastic.dev/serving: "true"`` drops them),
    gives them the lowest ``controller.kubernetes.io/pod-deletion-cost`` (the ReplicaSet removes
    exactly them) and scales once they are idle (their ``/metrics`` report no running or waiting
    request) or ``drain_seconds`` have passed."""

    namespace: str
    deployment: str
    drain: bool = False
    drain_seconds: float = 30.0
    gpus_per_replica: int = 1


@dataclass(frozen=True)
class JobTarget:
    """Where a training job's pods go and how they run (from the ElasticTrainingJob CR)."""

    namespace: str
    name: str
    template: dict[str, Any]  # WorkerTemplate fields in camelCase (image, command, args, env, resources, ...)
    uid: str | None = None  # the CR's uid: pods get an ownerReference, so deleting the CR collects them
    api_version: str = "elastic.dev/v1alpha1"
    kind: str = "ElasticTrainingJob"


@dataclass
class _Job:
    handle: Any = None  # KubernetesJobHandle in coordinator mode
    workers: dict[GPU, str] = field(default_factory=dict)
    next_id: int = 0
    last: RescaleOutcome | None = None
    seen: JobRuntime | None = None  # the last reading of the job (coordinator runtime)


def _now() -> str:
    return datetime.now(tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_gpu(text: str) -> GPU:
    node, _, index = text.rpartition("/")
    return GPU(node, int(index))
