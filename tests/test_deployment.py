"""The deployment file and the learners' GKE manifests (Pods and JobSets), checked against the
Kubernetes object model (the official client's models), with no cluster: every region of the
four-region example (v5p and v6e in one run), the pod dagster-k8s's Pipes client really builds,
the TPU facts behind them, and field-named errors for bad input."""

from pathlib import Path

import pytest
import yaml

from diloco_core.config import ConfigError
from pipelines.commands.cli import load_config
from pipelines.launch_defaults import ORCHESTRATED_DEFAULTS
from resources.compute.gke import jobset_outcome
from resources.compute.k8s_schema import (
    ManifestError,
    validate,
    validate_jobset,
    validate_workload,
)
from resources.compute.manifests import (
    ACCELERATOR_LABEL,
    TOPOLOGY_LABEL,
    TPU_RESOURCE,
    learner_jobset,
    learner_labels,
    learner_pod_spec,
    learner_workload,
    workload_name,
)
from resources.compute.placement import deployment_from_mapping, load_deployment
from resources.compute.tpu import slice_shape

ROOT = Path(__file__).resolve().parent.parent
DEPLOYMENT = ROOT / "examples" / "deploy" / "four_regions.yaml"
EXPERIMENT = ROOT / "examples" / "deploy" / "four_regions_experiment.yaml"
GKE = {"backend": "gke", "channel": "gcs", "bucket": "pipes-bucket", "project": "my-project",
       "location": "us-east5", "cluster": "c1", "accelerator": "tpu-v6e-slice",
       "topology": "2x4", "image": "learner:1"}


def _pod(manifest: dict) -> dict:
    if manifest["kind"] == "Pod":
        return manifest["spec"]
    return manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def _manifests() -> dict[str, dict]:
    cfg = load_config(str(EXPERIMENT), [], base=ORCHESTRATED_DEFAULTS)
    deployment = load_deployment(str(DEPLOYMENT))
    deployment.check_learners(cfg.learners)
    env = {"DAGSTER_PIPES_CONTEXT": "x", "DAGSTER_PIPES_MESSAGES": "y",
           "DILOCO_PIPES_CHANNEL": "gcs"}
    return {name: learner_workload(deployment.placement(region), experiment=cfg.name,
                                   learner=name, region=region, attempt=0, env=env)
            for name, region in zip(cfg.learners.learner_names, cfg.learners.learner_regions,
                                    strict=True)}


def test_every_region_of_the_four_region_example_gives_a_valid_pod_or_jobset():
    manifests = _manifests()
    assert {n: m["kind"] for n, m in manifests.items()} == {
        "central": "Pod", "east5": "Pod", "east1": "JobSet", "south": "Pod"}
    for manifest in manifests.values():
        validate_workload(manifest)                # raises with every problem's path
        validate(_pod(manifest), "V1PodSpec")
    jobset = manifests["east1"]
    validate_jobset(jobset)
    validate(jobset["spec"]["replicatedJobs"][0]["template"], "V1JobTemplateSpec")
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] == 0     # Dagster relaunches


def test_the_pod_dagster_k8s_builds_from_our_spec_is_a_valid_tpu_pod():
    """What `PipesK8sClient.run` submits: its own pod body from our metadata and spec, plus the
    Pipes bootstrap variables, converted to the client's V1Pod model and back."""
    from dagster_k8s.pipes import build_pod_body
    from kubernetes.client import ApiClient

    placement = load_deployment(str(DEPLOYMENT)).placement("us-central1")
    spec = learner_pod_spec(placement, {"DILOCO_PIPES_CHANNEL": "gcs"}, "learner-0")
    pod = build_pod_body(pod_name="dagster-run-0123", image=None, command=None,
                         env_vars={"DAGSTER_PIPES_CONTEXT": "c", "DAGSTER_PIPES_MESSAGES": "m"},
                         base_pod_meta={"labels": learner_labels("e", "central", "us-central1",
                                                                 0)},
                         base_pod_spec=spec)
    body = ApiClient().sanitize_for_serialization(pod)
    validate(body, "V1Pod")
    (container,) = body["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert {"DAGSTER_PIPES_CONTEXT", "DAGSTER_PIPES_MESSAGES", "DILOCO_PIPES_CHANNEL"} <= set(env)
    assert container["resources"]["limits"][TPU_RESOURCE] == "4"
    assert body["spec"]["nodeSelector"][TOPOLOGY_LABEL] == "2x2x1"
    assert body["spec"]["restartPolicy"] == "Never"
    assert body["metadata"]["labels"]["diloco/learner"] == "central"


def test_one_run_mixes_v5p_and_v6e_slices_with_their_own_selectors_and_chip_limits():
    seen = {}
    for name, manifest in _manifests().items():
        pod = _pod(manifest)
        (container,) = pod["containers"]
        accelerator = pod["nodeSelector"][ACCELERATOR_LABEL]
        topology = pod["nodeSelector"][TOPOLOGY_LABEL]
        chips = container["resources"]["limits"][TPU_RESOURCE]
        assert container["resources"]["requests"][TPU_RESOURCE] == chips
        seen[accelerator] = (topology, chips)
        assert pod["serviceAccountName"] == f"diloco-{name}"    # its own identity
        assert pod["tolerations"][0]["key"] == TPU_RESOURCE
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["DILOCO_PIPES_CHANNEL"] == "gcs" and "DAGSTER_PIPES_CONTEXT" in env
        assert container["command"] == ["python", "-m", "pipelines.learner_entry"]
    assert seen == {"tpu-v5p-slice": ("2x2x1", "4"), "tpu-v6e-slice": ("2x4", "8")}


def test_spot_regions_select_and_tolerate_spot_nodes_and_extra_env_reaches_the_learner():
    manifests = _manifests()
    spot = _pod(manifests["east1"])
    assert spot["nodeSelector"]["cloud.google.com/gke-spot"] == "true"
    assert any(t["key"] == "cloud.google.com/gke-spot" for t in spot["tolerations"])
    assert "cloud.google.com/gke-spot" not in _pod(manifests["east5"])["nodeSelector"]
    env = {e["name"]: e["value"] for e in _pod(manifests["south"])["containers"][0]["env"]}
    assert env["JAX_COMPILATION_CACHE_DIR"] == "/tmp/jax-cache"


def test_workload_names_are_short_dns_labels_unique_per_attempt():
    names = {workload_name("exp", "learner_with-a-rather-long-name-0", a) for a in range(3)}
    assert len(names) == 3
    for name in names:
        assert len(name) <= 40 and name[0].isalpha() and "_" not in name
    assert workload_name("a", "l", 0) != workload_name("b", "l", 0)   # experiment in the digest


def test_the_schema_check_reports_typos_wrong_types_and_missing_required_fields():
    manifest = _manifests()["east1"]
    pod = _pod(manifest)
    pod["nodeSelecter"] = pod.pop("nodeSelector")                 # a typo the API would drop
    pod["containers"][0]["resources"]["limits"][TPU_RESOURCE] = 8   # quantities are strings
    del pod["containers"][0]["name"]                               # required
    manifest["spec"]["replicatedJobs"][0]["replicas"] = 0
    with pytest.raises(ManifestError) as err:
        validate_jobset(manifest)
    problems = "\n".join(err.value.problems)
    assert "template.spec.template.spec.nodeSelecter: unknown field of V1PodSpec" in problems
    assert f"limits.{TPU_RESOURCE}: must be str" in problems
    assert "`name`, must not be `None`" in problems
    assert "replicas: must be an int >= 1" in problems
    with pytest.raises(ManifestError, match="kind: must be JobSet"):
        validate_jobset({**manifest, "kind": "Job"})


def test_manifests_round_trip_through_yaml_as_kubectl_would_read_them():
    for manifest in _manifests().values():
        validate_workload(yaml.safe_load(yaml.safe_dump(manifest)))


@pytest.mark.parametrize(("accelerator", "topology", "chips", "hosts"), [
    ("tpu-v6e-slice", "1x1", 1, 1), ("tpu-v6e-slice", "2x4", 8, 1),
    ("tpu-v6e-slice", "4x4", 16, 4), ("tpu-v5p-slice", "2x2x1", 4, 1),
    ("tpu-v5p-slice", "2x2x4", 16, 4), ("tpu-v5-lite-podslice", "2x2", 4, 1)])
def test_tpu_slices_count_their_chips_and_hosts(accelerator, topology, chips, hosts):
    shape = slice_shape(accelerator, topology)
    assert (shape.chips, shape.hosts) == (chips, hosts)
    assert shape.chips_per_pod * shape.hosts == chips


@pytest.mark.parametrize(("accelerator", "topology", "message"), [
    ("tpu-v6e-slice", "2x2x1", "2 positive dimensions"),
    ("tpu-v6e-slice", "3x3", "not a v6e slice topology"),
    ("tpu-v5p-slice", "2x4", "3 positive dimensions"),
    ("tpu-v5p-slice", "1x1x2", "multiple of 4 chips"),
    ("tpu-v9-slice", "2x2", "unknown TPU accelerator")])
def test_bad_slices_are_refused_with_the_reason(accelerator, topology, message):
    with pytest.raises(ValueError, match=message):
        slice_shape(accelerator, topology)


@pytest.mark.parametrize(("change", "field", "reason"), [
    ({"topology": "2x2x1"}, "regions.r1.topology", "2 positive dimensions"),
    ({"topology": "4x4"}, "regions.r1.workload", "needs workload: jobset"),
    ({"backend": "gcp"}, "regions.r1.backend", "must be one of local, gke"),
    ({"channel": "local"}, "regions.r1.channel", "must be gcs for the gke backend"),
    ({"image": ""}, "regions.r1.image", "is required"),
    ({"bucket": "gs://b"}, "regions.r1.bucket", "bucket name"),
    ({"project": "X"}, "regions.r1.project", "GCP project id"),
    ({"env": ["NOEQUALS"]}, "regions.r1.env[0]", "NAME=value"),
    ({"spot": "yes"}, "regions.r1.spot", "true or false"),
    ({"nodeSelector": {}}, "regions.r1.nodeSelector", "unknown field")])
def test_a_bad_region_is_refused_naming_its_field(change, field, reason):
    with pytest.raises(ConfigError) as err:
        deployment_from_mapping({"regions": {"r1": {**GKE, **change}}})
    assert err.value.field == f"deployment.{field}" and reason in err.value.reason


def test_learners_in_regions_the_deployment_lacks_are_refused_before_anything_starts():
    cfg = load_config(str(EXPERIMENT), [], base=ORCHESTRATED_DEFAULTS)
    deployment = deployment_from_mapping({"regions": {"us-east5": GKE}})
    with pytest.raises(ConfigError) as err:
        deployment.check_learners(cfg.learners)
    assert err.value.field == "learners.regions[0]" and "us-central1" in err.value.reason
    # No deployment at all: only the local region exists, and the defaults use it.
    load_deployment("").check_learners(load_config(None, [], base=()).learners)
    with pytest.raises(ConfigError, match="does not exist"):
        load_deployment("/no/such/deployment.yaml")


def test_jobset_status_maps_to_an_exit_status():
    assert jobset_outcome(None) is None
    assert jobset_outcome({"conditions": [{"type": "StartupPolicyCompleted",
                                           "status": "True"}]}) is None
    assert jobset_outcome({"terminalState": "Completed"}) == 0
    assert jobset_outcome({"terminalState": "Failed"}) == 1
    assert jobset_outcome({"conditions": [{"type": "Failed", "status": "True"}]}) == 1
    assert jobset_outcome({"conditions": [{"type": "Completed", "status": "False"}]}) is None


def test_the_manifests_command_prints_every_gke_learners_workload(capsys, monkeypatch):
    from pipelines.commands.cli import main

    monkeypatch.delenv("DILOCO_DEPLOYMENT", raising=False)
    assert main(["manifests", "--deployment", str(DEPLOYMENT), "--config", str(EXPERIMENT)]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["metadata"]["labels"]["diloco/learner"] for d in docs] == [
        "central", "east5", "east1", "south"]
    for doc in docs:
        validate_workload(doc)
    # A learner left in the local region is named, not rendered; a bad region is refused.
    assert main(["manifests", "--deployment", str(DEPLOYMENT), "--config", str(EXPERIMENT),
                 "--set", "learners.regions=[us-east5, local, us-east1, us-south1]"]) == 0
    out = capsys.readouterr()
    rendered = [d["metadata"]["labels"]["diloco/learner"] for d in yaml.safe_load_all(out.out)]
    assert rendered == ["central", "east1", "south"] and out.err.rstrip().endswith(": east5")
    assert main(["manifests", "--deployment", str(DEPLOYMENT), "--config", str(EXPERIMENT),
                 "--set", "learners.regions=[mars, local, us-east1, us-south1]"]) == 2
    assert "learners.regions[0]" in capsys.readouterr().err
    assert main(["manifests"]) == 2                         # no deployment file at all


class _RecordingJobSetApi:
    """Stands in for the Kubernetes custom-objects API (no cluster in CI): records what the
    learner run asks of it and answers with the status it is given."""

    def __init__(self):
        self.calls, self.status = [], {}

    def create_namespaced_custom_object(self, group, version, namespace, plural, body):
        self.calls.append(("create", group, version, namespace, plural, body["metadata"]["name"]))
        self.body = body

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        self.calls.append(("get", namespace, name))
        return {"metadata": {"name": name}, "status": self.status}

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name, body):
        self.calls.append(("delete", namespace, name, body["propagationPolicy"]))


def test_a_gke_learner_is_submitted_watched_and_deleted_as_its_jobset():
    from resources.compute.gke import JobSetProcess

    placement = deployment_from_mapping({"regions": {"us-east5": GKE}}).placement("us-east5")
    api = _RecordingJobSetApi()
    process = JobSetProcess(placement, experiment="exp", learner="east5", region="us-east5",
                            attempt=2, env={"DILOCO_PIPES_CHANNEL": "gcs"}, api=api)
    name = workload_name("exp", "east5", 2)
    assert api.calls == [("create", "jobset.x-k8s.io", "v1alpha2", "diloco", "jobsets", name)]
    validate_jobset(api.body)
    assert process.poll() is None                       # running
    api.status = {"terminalState": "Failed"}
    assert process.poll() == 1
    process.terminate()                                 # deletes its Jobs and pods with it
    assert api.calls[-1] == ("delete", "diloco", name, "Foreground")
    assert name in process.describe() and "gke_my-project_us-east5_c1" in process.describe()


class _Log:
    def __init__(self):
        self.lines = []

    def info(self, m):
        self.lines.append(("info", m))

    warning = error = info


def _jobset(api):
    from resources.compute.gke import JobSetProcess

    placement = deployment_from_mapping({"regions": {"us-east5": GKE}}).placement("us-east5")
    return JobSetProcess(placement, experiment="exp", learner="east5", region="us-east5",
                         attempt=0, env={}, api=api)


class _FlakyApi(_RecordingJobSetApi):
    """The API server failing `failures` polls in a row (e.g. a 403 after a credential
    rotation, a network partition), then answering with the status it is given."""

    def __init__(self, failures, error=None):
        super().__init__()
        self.failures = failures
        self.error = error or RuntimeError("503 Service Unavailable")

    def get_namespaced_custom_object(self, *args):
        if self.failures:
            self.failures -= 1
            raise self.error
        return super().get_namespaced_custom_object(*args)


def test_a_watcher_that_cannot_poll_its_jobset_deletes_it_before_failing():
    from resources.compute.gcs_channel import wait_for_exit

    api = _FlakyApi(failures=100)
    with pytest.raises(RuntimeError, match="503"):
        wait_for_exit(_jobset(api), _Log(), poll_seconds=0, failures_tolerated=3)
    assert [c[0] for c in api.calls] == ["create", "delete"]   # not left on the slice

    # A few failed polls in a row are ridden out: the learner goes on, nothing is deleted.
    api = _FlakyApi(failures=3)
    api.status = {"terminalState": "Completed"}
    log = _Log()
    assert wait_for_exit(_jobset(api), log, poll_seconds=0, failures_tolerated=3) == 0
    assert "delete" not in [c[0] for c in api.calls]
    assert sum("retrying" in m for _, m in log.lines) == 3

    # Interrupted (the run cancelled): stopped, and the interrupt goes on.
    api = _FlakyApi(failures=1, error=KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        wait_for_exit(_jobset(api), _Log(), poll_seconds=0)
    assert api.calls[-1][0] == "delete"


def test_a_failed_delete_is_reported_and_the_original_error_still_raised():
    from resources.compute.gcs_channel import wait_for_exit

    class _Undeletable(_FlakyApi):
        def delete_namespaced_custom_object(self, *args, **kwargs):
            raise RuntimeError("403 Forbidden")

    log = _Log()
    with pytest.raises(RuntimeError, match="503"):
        wait_for_exit(_jobset(_Undeletable(failures=100)), log, poll_seconds=0,
                      failures_tolerated=0)
    assert any("could not stop" in m and "403" in m for _, m in log.lines)


@pytest.mark.parametrize(("accelerator", "topology", "hosts"), [
    ("tpu-v6e-slice", "4x4", 4), ("tpu-v5p-slice", "2x2x2", 2)])
def test_a_multi_host_slice_is_one_jobset_whose_pods_form_one_learner(accelerator, topology,
                                                                       hosts):
    placement = deployment_from_mapping({"regions": {"r1": {
        **GKE, "accelerator": accelerator, "topology": topology,
        "workload": "jobset"}}}).placement("r1")
    manifest = learner_jobset(placement, experiment="exp", learner="east5", region="r1",
                              attempt=1, env={"DILOCO_PIPES_CHANNEL": "gcs"})
    validate_jobset(manifest)
    job = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["parallelism"] == job["completions"] == hosts
    assert job["completionMode"] == "Indexed" and manifest["spec"]["network"][
        "enableDNSHostnames"]
    pod = _pod(manifest)
    assert pod["containers"][0]["resources"]["limits"]["google.com/tpu"] == "4"
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    name = manifest["metadata"]["name"]
    assert env["DILOCO_NUM_PROCESSES"]["value"] == str(hosts)
    # Process 0 is pod 0 of job 0: JobSet's DNS name for it, under the JobSet's subdomain.
    assert env["DILOCO_COORDINATOR"]["value"] == f"{name}-slice-0-0.{name}:8476"
    assert env["DILOCO_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']")
    # What the learner entry reads from them (resources/learner/distributed.py): every pod
    # joins the same program; the variables it needs are all there.
    assert {"DILOCO_NUM_PROCESSES", "DILOCO_COORDINATOR", "DILOCO_PROCESS_ID"} <= set(env)


def test_a_single_host_jobset_stays_a_single_process_learner():
    placement = deployment_from_mapping({"regions": {"r1": {
        **GKE, "workload": "jobset"}}}).placement("r1")
    manifest = learner_jobset(placement, experiment="exp", learner="east5", region="r1",
                              attempt=0, env={})
    names = {e["name"] for e in _pod(manifest)["containers"][0]["env"]}
    assert "DILOCO_NUM_PROCESSES" not in names
