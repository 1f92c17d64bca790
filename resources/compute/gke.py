"""A learner on a GKE TPU slice: its JobSet, created, watched and deleted through the
Kubernetes API of the region's cluster (`gcs_channel.RemoteProcess`).

The manifest is validated against the Kubernetes object model before it is submitted, so a bad
field fails the Dagster run with the field's path instead of being dropped by the API server.
Deleting the JobSet (on cancel, or when the run's process is interrupted) deletes its Jobs and
pods with it: the slice is released, and the learner supervisor decides about a relaunch.
"""

from typing import Any

from resources.compute.k8s_schema import validate_jobset
from resources.compute.manifests import JOBSET_API, learner_jobset
from resources.compute.placement import RegionPlacement


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
