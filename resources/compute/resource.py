"""The `learner_compute` resource: start a learner on its region's compute, through Pipes.

One interface for every backend. The learner's region (from the experiment config) selects its
placement in the deployment file (`DILOCO_DEPLOYMENT`; without one every learner runs locally):

| backend | channel | what runs the learner |
|---|---|---|
| local | local | a subprocess, Pipes through local files (the laptop and CI default) |
| local | gcs | a subprocess that talks to the run only through a bucket (a remote host's path) |
| gke (workload pod) | gcs | a Pod on the region's GKE TPU node pool, through dagster-k8s Pipes |
| gke (workload jobset) | gcs | a JobSet on the region's GKE TPU node pool |
"""

from typing import Any

import dagster as dg
from pydantic import Field

from resources.compute.local import (
    DEFAULT_XLA_FLAGS,
    SYNCER_MODULE,
    LocalProcess,
    local_env,
    run_local,
)
from resources.compute.placement import Deployment, load_deployment


class LearnerCompute(dg.ConfigurableResource):
    """Where learners run: per region, from the deployment file."""

    deployment_file: str = Field(
        default="", description="YAML deployment file (region -> backend, cluster, TPU "
                                "topology, image, bucket); empty: every learner runs locally")
    xla_flags: str = Field(default=DEFAULT_XLA_FLAGS,
                           description="XLA_FLAGS for local learner processes")
    extra_env: dict[str, str] = Field(default={},
                                      description="extra environment for local learners")

    def deployment(self) -> Deployment:
        """The parsed, validated deployment (ConfigError names the bad field)."""
        return load_deployment(self.deployment_file)

    def launch_syncer(self, context: dg.OpExecutionContext, extras: dict[str, Any]
                      ) -> dg.PipesClientCompletedInvocation:
        """The syncer service: a subprocess of its run, through Pipes files. Under the
        production instance (K8sRunLauncher) the run is a pod of the Dagster cluster, so the
        syncer lives there, next to the store's bucket rather than on any learner's slice."""
        env = local_env(self.xla_flags, self.extra_env)
        return run_local(context, extras, env, module=SYNCER_MODULE)

    def launch(self, context: dg.OpExecutionContext, extras: dict[str, Any], region: str
               ) -> dg.PipesClientCompletedInvocation:
        placement = self.deployment().placement(region)
        env = local_env(self.xla_flags, self.extra_env)
        if placement.backend == "local" and placement.channel == "local":
            return run_local(context, extras, env)
        from resources.extras import require_extra

        require_extra("gcp", f"region {region!r} (Pipes through a bucket)",
                      ("dagster_gcp", "google.cloud.storage"))
        from resources.compute.gcs_channel import run_over_gcs

        if placement.backend == "local":
            return run_over_gcs(context, placement, extras,
                                lambda boot: LocalProcess({**env, **placement.extra_env,
                                                           **boot}))
        require_extra("k8s", f"region {region!r} (GKE)", ("dagster_k8s", "kubernetes"))
        from resources.compute.gke import JobSetProcess, run_gke_pod

        if placement.workload == "pod":
            return run_gke_pod(context, placement, extras, region)
        return run_over_gcs(
            context, placement, extras, poll_seconds=10.0,
            launch=lambda boot: JobSetProcess(
                placement, experiment=extras["experiment"], learner=extras["learner"],
                region=region, attempt=int(extras["attempt"]), env=boot))
