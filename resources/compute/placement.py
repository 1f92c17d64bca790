"""Where each region's learners run: the deployment file.

The experiment config names a region per learner (`learners.regions`); the deployment says what
a region is: its compute backend, GCP project and location, GKE cluster, TPU accelerator and
topology, container image, service account, and the bucket that carries its Pipes channel. It is
kept apart from the experiment because it describes infrastructure, not the algorithm: the same
experiment runs on a laptop (no deployment file: every region is a local subprocess) or across
four regions (a deployment file), unchanged.

    regions:
      us-east5:
        backend: gke
        project: my-project
        location: us-east5
        cluster: diloco-us-east5
        accelerator: tpu-v6e-slice
        topology: 2x4
        image: us-docker.pkg.dev/my-project/diloco/learner:0.1.0
        service_account: diloco-{learner}
        bucket: diloco-pipes-us-east5

Every value is checked when the file is loaded, and every learner's region against it before a
run starts, so a typo fails with its field path (`deployment.regions.us-east5.topology`) rather
than as a pod that never schedules.
"""

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco_core.config import ConfigError, LearnersConfig
from diloco_core.config_loading import parse_config_text
from diloco_core.config_section import Flag, Number, build_section, config_section
from diloco_core.config_section import require as _require
from resources.compute.tpu import SliceShape, slice_shape

BACKENDS = ("local", "gke")
WORKLOADS = ("pod", "jobset")
CHANNELS = ("local", "gcs")
LOCAL_REGION = "local"   # a region every deployment has: a subprocess on the Dagster host
LEARNER_PLACEHOLDER = "{learner}"   # in service_account: the learner's name

_DNS_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")
_GCP_PROJECT = re.compile(r"[a-z][a-z0-9-]{4,28}[a-z0-9]")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@config_section
class RegionPlacement:
    """One region's compute. `local` runs the learner as a subprocess of the Dagster run (the
    laptop and CI); `gke` runs it as a JobSet on a GKE TPU node pool, one pod per host of its
    slice."""

    backend: str = "local"
    # gke: the learner as one Pod through dagster-k8s's Pipes client, or as a JobSet (the form a
    # multi-host slice needs; exclusive node-pool placement).
    workload: str = "pod"
    # How the learner talks to its Dagster run. "local": files on the shared machine (only for
    # the local backend). "gcs": objects in `bucket`, which needs no inbound connection to
    # either side, so it works across regions and clouds; GKE learners always use it.
    channel: str = "local"
    bucket: str = ""                 # the Pipes channel's bucket (name, no gs://)
    pipes_interval_seconds: Number = 10.0   # how often messages are flushed and read
    project: str = ""                # GCP project of the cluster
    location: str = ""               # GCP region or zone of the cluster, e.g. us-east5
    cluster: str = ""                # GKE cluster name
    kube_context: str = ""           # kubeconfig context; default: gcloud's gke_<p>_<l>_<c>
    namespace: str = "diloco"
    accelerator: str = ""            # GKE TPU accelerator, e.g. tpu-v6e-slice, tpu-v5p-slice
    topology: str = ""               # TPU topology, e.g. 2x4 (v6e) or 2x2x1 (v5p)
    image: str = ""                  # the learner image (this project installed, see docs)
    # Kubernetes service account of the learner pods (Workload Identity to GCS). "{learner}"
    # in it is the learner's name, e.g. diloco-{learner}: one identity per learner, which the
    # store bucket's per-learner IAM conditions need (`diloco iam`).
    service_account: str = ""
    spot: Flag = False               # schedule on Spot TPU capacity
    env: tuple[str, ...] = ()        # extra NAME=value environment variables for the learner

    def service_account_for(self, learner: str) -> str:
        """The learner's Kubernetes service account (the template filled in)."""
        return self.service_account.replace(LEARNER_PLACEHOLDER, learner)

    def __post_init__(self):
        _require(self.backend in BACKENDS, "backend",
                 f"must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        _require(self.workload in WORKLOADS, "workload",
                 f"must be one of {', '.join(WORKLOADS)}, got {self.workload!r}")
        _require(self.channel in CHANNELS, "channel",
                 f"must be one of {', '.join(CHANNELS)}, got {self.channel!r}")
        _require(self.pipes_interval_seconds > 0, "pipes_interval_seconds",
                 f"must be > 0, got {self.pipes_interval_seconds!r}")
        if self.backend == "gke":
            _require(self.channel == "gcs", "channel",
                     "must be gcs for the gke backend (a pod shares no files with the run)")
            for name in ("project", "location", "cluster", "accelerator", "topology", "image"):
                _require(bool(getattr(self, name)), name, "is required for the gke backend")
            _require(_GCP_PROJECT.fullmatch(self.project) is not None, "project",
                     f"is not a GCP project id, got {self.project!r}")
            _require(_DNS_LABEL.fullmatch(self.namespace) is not None, "namespace",
                     f"must be a DNS label, got {self.namespace!r}")
            if self.service_account:
                _require(_DNS_LABEL.fullmatch(self.service_account.replace(
                    LEARNER_PLACEHOLDER, "x")) is not None, "service_account",
                    f"must be a DNS label (optionally with {LEARNER_PLACEHOLDER}), got "
                    f"{self.service_account!r}")
            try:
                shape = slice_shape(self.accelerator, self.topology)
            except ValueError as err:
                raise ConfigError("topology", str(err)) from None
            # A multi-host slice runs one learner program over all its hosts, one pod each,
            # started and failed together: only a JobSet does that (a Pod is one host).
            _require(shape.hosts == 1 or self.workload == "jobset", "workload",
                     f"{self.topology!r} is a {shape.hosts}-host {shape.tpu.generation} slice: "
                     "it needs workload: jobset (one pod per host), got "
                     f"{self.workload!r}")
        if self.channel == "gcs":
            _require(_BUCKET.fullmatch(self.bucket) is not None, "bucket",
                     f"must be a bucket name (no gs://) for the gcs channel, got {self.bucket!r}")
        for i, item in enumerate(self.env):
            name, sep, _ = item.partition("=")
            _require(bool(sep) and _ENV_NAME.fullmatch(name) is not None, f"env[{i}]",
                     f"must look like NAME=value, got {item!r}")

    @property
    def slice(self) -> SliceShape | None:
        """The TPU slice of a gke region (None for a local one)."""
        return slice_shape(self.accelerator, self.topology) if self.backend == "gke" else None

    @property
    def context_name(self) -> str:
        return self.kube_context or f"gke_{self.project}_{self.location}_{self.cluster}"

    @property
    def extra_env(self) -> dict[str, str]:
        return dict(item.split("=", 1) for item in self.env)


@dataclass(frozen=True)
class Deployment:
    """Region name -> placement. The region `local` always exists (a local subprocess)."""

    regions: Mapping[str, RegionPlacement] = field(default_factory=dict)

    def placement(self, region: str) -> RegionPlacement:
        if region in self.regions:
            return self.regions[region]
        if region == LOCAL_REGION:
            return RegionPlacement()
        raise ConfigError(f"deployment.regions.{region}", "is not defined")

    def check_learners(self, learners: LearnersConfig) -> None:
        """Every learner's region must be placed; raises naming the learner's config field."""
        known = sorted({*self.regions, LOCAL_REGION})
        for i, (name, region) in enumerate(zip(learners.learner_names,
                                                learners.learner_regions, strict=True)):
            _require(region in known, f"learners.regions[{i}]",
                     f"region {region!r} is not in the deployment (regions: {', '.join(known)})")
            account = self.regions[region].service_account_for(name) if (
                region in self.regions) else ""
            _require(not account or _DNS_LABEL.fullmatch(account) is not None,
                     f"learners.names[{i}]", f"learner {name!r} makes the service account "
                     f"{account!r} of region {region!r}, which is not a DNS label")


def deployment_from_mapping(mapping: Mapping[str, Any] | None) -> Deployment:
    """Strict: unknown keys, wrong types and bad values raise `ConfigError` with the path."""
    mapping = dict(mapping or {})
    unknown = sorted(set(mapping) - {"regions"})
    _require(not unknown, f"deployment.{unknown[0] if unknown else ''}",
             "unknown field; the deployment file has one field, regions")
    regions = mapping.get("regions") or {}
    _require(isinstance(regions, Mapping), "deployment.regions",
             f"must be a mapping of region name to placement, got {regions!r}")
    placed = {}
    for name, spec in regions.items():
        path = f"deployment.regions.{name}"
        _require(isinstance(name, str) and _DNS_LABEL.fullmatch(name) is not None, path,
                 "a region name must be a DNS label (lowercase letters, digits, '-')")
        _require(isinstance(spec, Mapping), path, f"must be a mapping, got {spec!r}")
        placed[name] = build_section(RegionPlacement, dict(spec), path)
    return Deployment(placed)


def load_deployment(path: str | None) -> Deployment:
    """The deployment file (YAML), or the all-local deployment when `path` is empty."""
    if not path:
        return Deployment()
    file = Path(path)
    _require(file.is_file(), "deployment", f"file {path!r} does not exist")
    return deployment_from_mapping(parse_config_text(file.read_text(), "yaml"))
