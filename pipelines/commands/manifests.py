"""`diloco manifests`: the Pod or JobSet each GKE-placed learner will be submitted as, for review
or a `kubectl apply --dry-run=server`, validated against the Kubernetes object model first.

The Pipes bootstrap variables are only known when a run starts (they name that run's context
object and message prefix), so they appear as placeholders, and a Pod's name is chosen by
dagster-k8s from the run; everything else is what the learner run submits.
"""

import sys

import yaml

from diloco_core.config import ExperimentConfig
from resources.compute.gcs_channel import channel_env
from resources.compute.k8s_schema import validate_workload
from resources.compute.manifests import learner_workload
from resources.compute.placement import Deployment

PLACEHOLDER = "<set by the learner run at launch>"
PIPES_BOOTSTRAP = ("DAGSTER_PIPES_CONTEXT", "DAGSTER_PIPES_MESSAGES")


def learner_manifests(cfg: ExperimentConfig, deployment: Deployment, attempt: int = 0
                      ) -> tuple[list[dict], list[str]]:
    """The Pods and JobSets of the GKE-placed learners, and the names of the local ones."""
    deployment.check_learners(cfg.learners)
    manifests, local = [], []
    for name, region in zip(cfg.learners.learner_names, cfg.learners.learner_regions,
                            strict=True):
        placement = deployment.placement(region)
        if placement.backend != "gke":
            local.append(name)
            continue
        env = channel_env(placement, dict.fromkeys(PIPES_BOOTSTRAP, PLACEHOLDER))
        manifest = learner_workload(placement, experiment=cfg.name, learner=name, region=region,
                                  attempt=attempt, env=env)
        validate_workload(manifest)
        manifests.append(manifest)
    return manifests, local


def print_manifests(cfg: ExperimentConfig, deployment: Deployment, attempt: int = 0) -> int:
    manifests, local = learner_manifests(cfg, deployment, attempt)
    if local:
        print(f"# not on GKE (local subprocesses): {', '.join(local)}", file=sys.stderr)
    print(yaml.safe_dump_all(manifests, sort_keys=False), end="")
    return 0
