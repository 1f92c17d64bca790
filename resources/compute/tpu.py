"""TPU accelerators as GKE names them: which topologies a slice type allows, its chips and hosts.

A learner owns one TPU slice. GKE places it by two node labels, the accelerator
(`cloud.google.com/gke-tpu-accelerator`) and the topology (`cloud.google.com/gke-tpu-topology`),
and each host (one Kubernetes node, one pod) exposes its chips as the `google.com/tpu` resource.
A slice of more chips than one host holds is multi-host: one pod per host, started together.
These facts are checked here, before anything is submitted, so that a typo in a region's
topology fails at config time with the field's name instead of as a pod that never schedules.
"""

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class TpuType:
    accelerator: str          # the GKE node label value
    generation: str           # what people call it ("v5p", "v6e")
    dims: int                 # 2-D torus (v5e, v6e) or 3-D (v4, v5p)
    chips_per_host: int       # chips per host of a multi-host slice
    single_host: tuple[str, ...]   # topologies that fit on one host
    multi_host: tuple[str, ...]    # known multi-host topologies; () = any valid 3-D shape


TPU_TYPES = {t.accelerator: t for t in (
    TpuType("tpu-v6e-slice", "v6e", 2, 4, ("1x1", "2x2", "2x4"),
            ("4x4", "4x8", "8x8", "8x16", "16x16")),
    TpuType("tpu-v5-lite-podslice", "v5e", 2, 4, ("1x1", "2x2", "2x4"),
            ("4x4", "4x8", "8x8", "8x16", "16x16")),
    TpuType("tpu-v5p-slice", "v5p", 3, 4, ("2x2x1",), ()),
    TpuType("tpu-v4-podslice", "v4", 3, 4, ("2x2x1",), ()),
)}


@dataclass(frozen=True)
class SliceShape:
    """What a (accelerator, topology) pair means for scheduling."""

    tpu: TpuType
    topology: str
    chips: int
    hosts: int

    @property
    def chips_per_pod(self) -> int:
        return self.chips // self.hosts


def slice_shape(accelerator: str, topology: str) -> SliceShape:
    """Validate a slice and count its chips and hosts; ValueError says what is wrong."""
    tpu = TPU_TYPES.get(accelerator)
    if tpu is None:
        raise ValueError(f"unknown TPU accelerator {accelerator!r}; "
                         f"one of {', '.join(sorted(TPU_TYPES))}")
    parts = topology.split("x")
    if len(parts) != tpu.dims or not all(p.isdigit() and int(p) >= 1 for p in parts):
        example = "2x2x1" if tpu.dims == 3 else "2x4"
        raise ValueError(f"{tpu.generation} topologies have {tpu.dims} positive dimensions "
                         f"like {example!r}, got {topology!r}")
    chips = math.prod(int(p) for p in parts)
    if topology in tpu.single_host:
        return SliceShape(tpu, topology, chips, 1)
    if tpu.multi_host and topology not in tpu.multi_host:
        raise ValueError(f"{topology!r} is not a {tpu.generation} slice topology; one of "
                         f"{', '.join(tpu.single_host + tpu.multi_host)}")
    if chips % tpu.chips_per_host:
        raise ValueError(f"a multi-host {tpu.generation} slice has a multiple of "
                         f"{tpu.chips_per_host} chips, {topology!r} has {chips}")
    return SliceShape(tpu, topology, chips, chips // tpu.chips_per_host)
