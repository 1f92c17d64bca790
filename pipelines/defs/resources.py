"""Resources per deployment, chosen when the code location loads (not at import).

DILOCO_ENV=local (default): the store in a local directory (DILOCO_STORE_URI, default
`runs/store`) and learners as local subprocesses through Dagster Pipes.
DILOCO_ENV=gcp: the store in a GCS bucket (DILOCO_STORE_URI=gs://bucket/prefix, required).
DILOCO_DEPLOYMENT: the deployment file placing each region's learners (local subprocesses, GKE
TPU slices); without one, every learner runs as a local subprocess.
"""

import os

import dagster as dg

from resources.compute import LearnerCompute
from resources.store.resource import ArtifactStoreResource

DEPLOYMENTS = ("local", "gcp")


@dg.definitions
def resources() -> dg.Definitions:
    deployment = os.environ.get("DILOCO_ENV", "local")
    if deployment not in DEPLOYMENTS:
        raise ValueError(f"DILOCO_ENV must be one of {', '.join(DEPLOYMENTS)}, "
                         f"got {deployment!r}")
    if deployment == "gcp":
        store = ArtifactStoreResource(base_uri=dg.EnvVar("DILOCO_STORE_URI"))
    else:
        store = ArtifactStoreResource(base_uri=os.environ.get("DILOCO_STORE_URI", "runs/store"))
    compute = LearnerCompute(deployment_file=os.environ.get("DILOCO_DEPLOYMENT", ""))
    return dg.Definitions(resources={"store": store, "learner_compute": compute})
