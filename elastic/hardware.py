"""``HardwareSpec``: one accelerator type and its links, and the presets the planner knows. Pure."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from elastic.errors import SpecError


class HardwareSpec(BaseModel):
    """One accelerator type and the links between them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    memory_bytes: int = Field(gt=0, description="device memory per GPU")
    peak_flops: float = Field(gt=0, description="dense bf16 peak FLOP/s per GPU")
    intra_node_bandwidth: float = Field(gt=0, description="bytes/s per GPU inside a node (NVLink)")
    inter_node_bandwidth: float = Field(gt=0, description="bytes/s per GPU across nodes (IB/RoCE)")
    host_memory_bytes: int = Field(default=2 * 1024**4, gt=0, description="host RAM per node")
    gpus_per_node: int = Field(default=8, gt=0)


GiB = 1024**3
GB = 10**9

HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    h.name: h
    for h in [
        HardwareSpec(name="a100-80g", memory_bytes=80 * GiB, peak_flops=312e12, intra_node_bandwidth=300 * GB,
                     inter_node_bandwidth=25 * GB),
        HardwareSpec(name="h100-80g", memory_bytes=80 * GiB, peak_flops=989e12, intra_node_bandwidth=450 * GB,
                     inter_node_bandwidth=50 * GB),
        HardwareSpec(name="h800-80g", memory_bytes=80 * GiB, peak_flops=989e12, intra_node_bandwidth=200 * GB,
                     inter_node_bandwidth=50 * GB),
        HardwareSpec(name="h200-141g", memory_bytes=141 * GB, peak_flops=989e12, intra_node_bandwidth=450 * GB,
                     inter_node_bandwidth=50 * GB),
        HardwareSpec(name="cpu", memory_bytes=16 * GiB, peak_flops=0.2e12, intra_node_bandwidth=4 * GB,
                     inter_node_bandwidth=1 * GB, host_memory_bytes=24 * GiB),
    ]
}


def load_hardware(name: str) -> HardwareSpec:
    try:
        return HARDWARE_PRESETS[name]
    except KeyError:
        raise SpecError(f"unknown hardware '{name}': use one of {', '.join(HARDWARE_PRESETS)}") from None
