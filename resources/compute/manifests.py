"""The Kubernetes objects that run one learner on a GKE TPU slice: a Pod or a JobSet.

One learner is one slice. On a single-host slice that is one Pod (`workload: pod`, the default),
submitted and watched by dagster-k8s's Pipes client. A JobSet (`workload: jobset`) is the form
a slice of H hosts needs, H pods that start and fail together: one replicated Job with H indexed
completions, DNS hostnames so the hosts find each other, and the exclusive topology annotation
so that the pods of one slice land on one node pool (one physical slice).

`failurePolicy.maxRestarts` is 0 on purpose: a failed learner is relaunched by the learner
supervisor sensor (with backoff and a restart budget, recorded in Dagster), not by a second,
invisible restart loop inside the cluster.
"""

import hashlib
import re
from typing import Any

from resources.compute.placement import RegionPlacement

JOBSET_API = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
TPU_RESOURCE = "google.com/tpu"
ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
SPOT_LABEL = "cloud.google.com/gke-spot"
NODE_POOL_LABEL = "cloud.google.com/gke-nodepool"
EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
CONTAINER = "learner"
REPLICATED_JOB = "slice"
LEARNER_MODULE = "pipelines.learner_entry"
# jax.distributed's coordination service, run by process 0 (host 0 of the slice).
COORDINATOR_PORT = 8476
# The index Kubernetes gives each pod of an Indexed Job: its process id in the learner.
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def workload_name(experiment: str, learner: str, attempt: int) -> str:
    """A DNS-1035 label, unique per (experiment, learner, attempt), at most 40 characters so
    that the names JobSet derives from it (job, pod, service) stay within 63."""
    base = re.sub(r"[^a-z0-9-]", "-", f"{learner}-a{attempt}".lower()).strip("-")
    digest = hashlib.sha256(f"{experiment}/{learner}/{attempt}".encode()).hexdigest()[:8]
    return f"dl-{base[:27].strip('-')}-{digest}"


def learner_labels(experiment: str, learner: str, region: str, attempt: int) -> dict[str, str]:
    return {"app.kubernetes.io/name": "decoupled-diloco",
            "app.kubernetes.io/component": "learner",
            "diloco/experiment": _label_value(experiment), "diloco/learner": learner,
            "diloco/region": region, "diloco/attempt": str(attempt)}


def learner_pod_spec(placement: RegionPlacement, env: dict[str, str], learner: str
                     ) -> dict[str, Any]:
    """The pod of one host of the learner's slice: the slice's node labels, all its chips,
    the TPU (and Spot) taints tolerated, the learner image and its environment, and the
    learner's Kubernetes service account."""
    shape = placement.slice
    if shape is None:
        raise ValueError("a learner pod needs a gke placement (accelerator and topology)")
    chips = str(shape.chips_per_pod)
    full_env = {**env, **placement.extra_env, "PYTHONUNBUFFERED": "1"}
    node_selector = {ACCELERATOR_LABEL: shape.tpu.accelerator, TOPOLOGY_LABEL: shape.topology}
    tolerations = [{"key": TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    if placement.spot:
        node_selector[SPOT_LABEL] = "true"
        tolerations.append({"key": SPOT_LABEL, "operator": "Equal", "value": "true",
                            "effect": "NoSchedule"})
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "nodeSelector": node_selector,
        "tolerations": tolerations,
        "containers": [{
            "name": CONTAINER,
            "image": placement.image,
            "imagePullPolicy": "IfNotPresent",
            "command": ["python", "-m", LEARNER_MODULE],
            "env": [{"name": k, "value": v} for k, v in sorted(full_env.items())],
            "resources": {"requests": {TPU_RESOURCE: chips}, "limits": {TPU_RESOURCE: chips}},
        }],
    }
    if placement.service_account:
        spec["serviceAccountName"] = placement.service_account_for(learner)
    return spec


def learner_pod(placement: RegionPlacement, *, experiment: str, learner: str, region: str,
                attempt: int, env: dict[str, str]) -> dict[str, Any]:
    """The learner as one Pod (`workload: pod`, what dagster-k8s's Pipes client submits; it
    names the pod after the Dagster run, so the name here is only for previews)."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": workload_name(experiment, learner, attempt),
                         "namespace": placement.namespace,
                         "labels": learner_labels(experiment, learner, region, attempt)},
            "spec": learner_pod_spec(placement, env, learner)}


def learner_jobset(placement: RegionPlacement, *, experiment: str, learner: str, region: str,
                   attempt: int, env: dict[str, str]) -> dict[str, Any]:
    """The learner as a JobSet (`workload: jobset`; a plain dict, as `kubectl apply` or the
    custom-objects API takes it)."""
    hosts = placement.slice.hosts if placement.slice is not None else 1
    labels = learner_labels(experiment, learner, region, attempt)
    name = workload_name(experiment, learner, attempt)
    pod_spec = learner_pod_spec(placement, env, learner)
    if hosts > 1:
        # One learner program over every host (`resources/learner/distributed.py`): each pod is
        # process <its completion index>; process 0 (pod 0 of job 0, reachable by the DNS name
        # JobSet gives it) runs the coordination service and alone talks to the store.
        pod_spec["containers"][0]["env"] += [
            {"name": "DILOCO_NUM_PROCESSES", "value": str(hosts)},
            {"name": "DILOCO_COORDINATOR",
             "value": f"{name}-{REPLICATED_JOB}-0-0.{name}:{COORDINATOR_PORT}"},
            {"name": "DILOCO_PROCESS_ID",
             "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}}]
    return {
        "apiVersion": f"{JOBSET_API[0]}/{JOBSET_API[1]}",
        "kind": "JobSet",
        "metadata": {"name": name,
                     "namespace": placement.namespace, "labels": labels,
                     "annotations": {EXCLUSIVE_TOPOLOGY: NODE_POOL_LABEL}},
        "spec": {
            "failurePolicy": {"maxRestarts": 0},
            "network": {"enableDNSHostnames": True},
            "replicatedJobs": [{
                "name": REPLICATED_JOB,
                "replicas": 1,
                "template": {
                    "metadata": {"labels": dict(labels)},
                    "spec": {
                        "parallelism": hosts,
                        "completions": hosts,
                        "completionMode": "Indexed",
                        "backoffLimit": 0,
                        "template": {"metadata": {"labels": dict(labels)},
                                     "spec": pod_spec},
                    },
                },
            }],
        },
    }


def learner_workload(placement: RegionPlacement, **kw) -> dict[str, Any]:
    """The learner's Pod or JobSet, as its region's `workload` says."""
    return (learner_jobset if placement.workload == "jobset" else learner_pod)(placement, **kw)


def _label_value(value: str) -> str:
    """Kubernetes label values: at most 63 characters of [A-Za-z0-9_.-], alphanumeric ends."""
    cleaned = re.sub(r"[^A-Za-z0-9_.-]", "-", value)[:63]
    return cleaned.strip("-_.") or "x"
