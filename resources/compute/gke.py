"""A learner on a GKE TPU slice, through the Kubernetes API of the region's cluster.

`workload: pod`: dagster-k8s's `PipesK8sClient` submits the learner's Pod, waits for it, and
deletes it when it ends or when the Dagster run is interrupted (termination forwarded). The
Pipes context and messages go through the region's bucket, not the pod's logs, so they survive
the pod and cross regions.

`workload: jobset`: a `JobSetProcess` (`gcs_channel.RemoteProcess`) creates, watches and deletes
the learner's JobSet; deleting it deletes its Jobs and pods with it.

Either manifest is validated against the Kubernetes object model before it is submitted, so a
bad field fails the Dagster run with the field's path instead of being dropped by the API
server. A failed learner is relaunched by the learner supervisor sensor, not by the cluster.
"""

from typing import Any

import dagster as dg

from resources.compute.gcs_channel import channel_env, gcs_injector_and_reader
from resources.compute.k8s_schema import validate, validate_jobset
from resources.compute.manifests import (
    JOBSET_API,
    learner_jobset,
    learner_labels,
    learner_pod_spec,
)
from resources.compute.placement import RegionPlacement


def run_gke_pod(context: dg.OpExecutionContext, placement: RegionPlacement, extras: dict,
                region: str) -> dg.PipesClientCompletedInvocation:
    """The learner as one Pod on the region's TPU node pool, through dagster-k8s Pipes."""
    from dagster_k8s import PipesK8sClient

    env = channel_env(placement, {})      # the client adds Pipes' bootstrap variables itself
    spec = learner_pod_spec(placement, env, extras["learner"])
    validate(spec, "V1PodSpec")
    meta = {"labels": learner_labels(extras["experiment"], extras["learner"], region,
                                     int(extras["attempt"]))}
    injector, reader = gcs_injector_and_reader(placement)
    client = PipesK8sClient(load_incluster_config=False, kube_context=placement.context_name,
                            context_injector=injector, message_reader=reader,
                            poll_interval=placement.pipes_interval_seconds)
    context.log.info(f"learner pod on {placement.context_name} ({placement.accelerator} "
                     f"{placement.topology}, Pipes over gs://{placement.bucket})")
    return client.run(context=context, extras=extras, namespace=placement.namespace,
                      base_pod_meta=meta, base_pod_spec=spec)


def jobset_outcome(status: dict[str, Any] | None) -> int | None:
    """None while the JobSet runs; 0 when it completed, 1 when it failed (from its status:
    `terminalState` in JobSet >= 0.5, else its Completed/Failed conditions)."""
    status = status or {}
    terminal = status.get("terminalState")
    if terminal:
        return 0 if terminal == "Completed" else 1
    for condition in status.get("conditions") or []:
        if condition.get("status") == "True" and condition.get("type") in ("Completed",
                                                                          "Failed"):
            return 0 if condition["type"] == "Completed" else 1
    return None


class JobSetProcess:
    def __init__(self, placement: RegionPlacement, *, experiment: str, learner: str,
                 region: str, attempt: int, env: dict[str, str], api=None):
        self.manifest = learner_jobset(placement, experiment=experiment, learner=learner,
                                       region=region, attempt=attempt, env=env)
        validate_jobset(self.manifest)
        self.namespace = placement.namespace
        self.name = self.manifest["metadata"]["name"]
        self.where = f"JobSet {self.namespace}/{self.name} on {placement.context_name}"
        if api is None:
            from kubernetes import client, config

            api = client.CustomObjectsApi(
                config.new_client_from_config(context=placement.context_name))
        self.api = api
        group, version, plural = JOBSET_API
        self.api.create_namespaced_custom_object(group, version, self.namespace, plural,
                                                 self.manifest)

    def poll(self) -> int | None:
        group, version, plural = JOBSET_API
        obj = self.api.get_namespaced_custom_object(group, version, self.namespace, plural,
                                                    self.name)
        return jobset_outcome(obj.get("status"))

    def terminate(self) -> None:
        group, version, plural = JOBSET_API
        self.api.delete_namespaced_custom_object(group, version, self.namespace, plural,
                                                 self.name,
                                                 body={"propagationPolicy": "Foreground"})

    def describe(self) -> str:
        return self.where
