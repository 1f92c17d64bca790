"""The production deployment files are valid where they can be checked without a cluster: the
Dagster instance against Dagster's own config schemas, the Kubernetes objects against the
Kubernetes object model, and the run-queue rules identical to the local instance's."""

import inspect
import json
from pathlib import Path

import pytest
import yaml
from dagster._config import process_config, resolve_to_config_type
from dagster._core.instance.config import dagster_instance_config
from dagster._core.run_coordinator import QueuedRunCoordinator
from dagster_k8s import K8sRunLauncher
from postgres_server import materialize_one_run

from diloco_core.config_loading import config_from_mapping
from pipelines.commands.cli import CONTROL_MEMBER
from pipelines.commands.dagster_dev import instance_yaml
from resources.compute.k8s_schema import validate
from resources.compute.manifests import JOBSET_API
from resources.compute.placement import load_deployment

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"


def _camel(key: str) -> str:
    head, *rest = key.split("_")
    return head + "".join(part.title() for part in rest)


def test_the_production_instance_passes_dagsters_own_schemas(tmp_path, monkeypatch):
    (tmp_path / "dagster.yaml").write_text((DEPLOY / "dagster.yaml").read_text())
    for name in ("HOST", "PORT", "USER", "PASSWORD", "DB"):
        monkeypatch.setenv(f"DAGSTER_PG_{name}", "5432" if name == "PORT" else "x")
    config, _ = dagster_instance_config(str(tmp_path))
    assert "postgres" in config["storage"]
    for cls, key in ((K8sRunLauncher, "run_launcher"), (QueuedRunCoordinator,
                                                         "run_coordinator")):
        assert config[key]["class"] == cls.__name__
        result = process_config(resolve_to_config_type(cls.config_type()),
                                config[key]["config"])
        assert result.success, [e.message for e in result.errors]


def test_production_and_helm_queue_rules_match_the_local_instance():
    local = instance_yaml(10)["run_coordinator"]["config"]["tag_concurrency_limits"]
    production = yaml.safe_load((DEPLOY / "dagster.yaml").read_text())
    assert production["run_coordinator"]["config"]["tag_concurrency_limits"] == local
    assert production["retention"] == instance_yaml(10)["retention"]
    helm = yaml.safe_load((DEPLOY / "helm" / "values.yaml").read_text())
    helm_limits = helm["dagsterDaemon"]["runCoordinator"]["config"]["queuedRunCoordinator"][
        "tagConcurrencyLimits"]
    assert helm_limits == [{_camel(k): v for k, v in rule.items()} for rule in local]
    assert helm["runLauncher"]["type"] == "K8sRunLauncher"
    assert helm["dagster-user-deployments"]["deployments"][0]["dagsterApiGrpcArgs"] == [
        "-m", "pipelines.definitions"]


def test_the_regional_cluster_objects_are_valid_and_grant_what_dispatch_uses():
    docs = list(yaml.safe_load_all((DEPLOY / "k8s" / "learners.yaml").read_text()))
    models = {"Namespace": "V1Namespace", "ServiceAccount": "V1ServiceAccount",
              "Role": "V1Role", "RoleBinding": "V1RoleBinding"}
    assert {d["kind"] for d in docs} == set(models)
    for doc in docs:
        validate(doc, models[doc["kind"]])
    by_kind = {d["kind"]: d for d in docs}
    accounts = {d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"}
    (jobsets,) = [r for r in by_kind["Role"]["rules"] if "jobsets" in r["resources"]]
    assert jobsets["apiGroups"] == [JOBSET_API[0]]
    (pods,) = [r for r in by_kind["Role"]["rules"] if r["resources"] == ["pods"]]
    used = {"create", "get", "delete"}   # what gke.JobSetProcess and PipesK8sClient call
    assert used <= set(jobsets["verbs"]) and used <= set(pods["verbs"])
    # The example's learners each run as their own service account, in this namespace.
    deployment = load_deployment(str(ROOT / "examples" / "deploy" / "four_regions.yaml"))
    cfg = config_from_mapping(yaml.safe_load(
        (ROOT / "examples" / "deploy" / "four_regions_experiment.yaml").read_text()))
    deployment.check_learners(cfg.learners)
    wanted = {deployment.placement(region).service_account_for(name)
              for name, region in zip(cfg.learners.learner_names, cfg.learners.learner_regions,
                                      strict=True)}
    assert wanted == accounts and len(wanted) == cfg.learners.num_learners
    for placement in deployment.regions.values():
        assert placement.namespace == by_kind["Namespace"]["metadata"]["name"]


def _gcp_account(service_account: dict) -> str:
    return service_account["annotations"]["iam.gke.io/gcp-service-account"]


def test_the_dagster_cluster_gives_the_ui_and_the_control_plane_their_own_identities():
    """The webserver and daemon run as one account, the code server and its runs as another
    (the control plane: the identity `diloco iam` lets write the store, and the one the
    regional clusters let dispatch learners), the learners as their own: no account shared
    across those roles, and no chart-wide override that would force one on every pod."""
    helm = yaml.safe_load((DEPLOY / "helm" / "values.yaml").read_text())
    assert "serviceAccountName" not in (helm.get("global") or {})
    ui, control = helm["serviceAccount"], helm["dagster-user-deployments"]["serviceAccount"]
    assert ui["create"] and control["create"] and ui["name"] != control["name"]
    assert _gcp_account(ui) != _gcp_account(control)
    project = _gcp_account(control).split("@")[1].split(".")[0]
    assert f"serviceAccount:{_gcp_account(control)}" == CONTROL_MEMBER.format(project=project)
    # Without the chart, the instance file runs its runs as the same Kubernetes account.
    production = yaml.safe_load((DEPLOY / "dagster.yaml").read_text())
    assert production["run_launcher"]["config"]["service_account_name"] == control["name"]
    # In the regional clusters only the control plane may dispatch, and learners are neither.
    regional = list(yaml.safe_load_all((DEPLOY / "k8s" / "learners.yaml").read_text()))
    (binding,) = [d for d in regional if d["kind"] == "RoleBinding"]
    assert [s["name"] for s in binding["subjects"]] == [_gcp_account(control)]
    learners = {d["metadata"]["annotations"]["iam.gke.io/gcp-service-account"]
                for d in regional if d["kind"] == "ServiceAccount"}
    assert not learners & {_gcp_account(ui), _gcp_account(control)}


def test_both_webservers_sit_behind_identity_aware_proxy_and_one_is_read_only():
    helm = yaml.safe_load((DEPLOY / "helm" / "values.yaml").read_text())
    webserver = helm["dagsterWebserver"]
    assert webserver["enableReadOnly"] is True
    annotations = webserver["service"]["annotations"]
    backend = json.loads(annotations["cloud.google.com/backend-config"])["default"]
    assert json.loads(annotations["cloud.google.com/neg"]) == {"ingress": True}
    (iap,) = yaml.safe_load_all((DEPLOY / "k8s" / "dagster-iap.yaml").read_text())
    assert (iap["apiVersion"], iap["kind"]) == ("cloud.google.com/v1", "BackendConfig")
    assert iap["metadata"]["name"] == backend
    assert iap["metadata"]["namespace"] == helm["runLauncher"]["config"]["k8sRunLauncher"][
        "jobNamespace"]
    assert iap["spec"]["iap"]["enabled"] is True
    assert iap["spec"]["iap"]["oauthclientCredentials"]["secretName"]
    # The health check path is one the webserver answers without a session.
    from dagster_webserver.webserver import DagsterWebserver
    assert iap["spec"]["healthCheck"]["requestPath"] in inspect.getsource(DagsterWebserver)
    ingress = helm["ingress"]
    hosts = {ingress[k]["host"] for k in ("dagsterWebserver", "readOnlyDagsterWebserver")}
    assert ingress["enabled"] and len(hosts) == 2


@pytest.mark.parametrize("doc", ["dagster.yaml", "helm/values.yaml", "k8s/learners.yaml",
                                 "k8s/dagster-iap.yaml"])
def test_deploy_files_parse_as_yaml(doc):
    assert list(yaml.safe_load_all((DEPLOY / doc).read_text()))


def test_the_production_instance_keeps_its_runs_in_a_real_postgres(tmp_path, monkeypatch,
                                                                   postgres_url):
    """The storage section as shipped (postgres_db from DAGSTER_PG_* variables) against a real
    server; the K8s run launcher is swapped for the default one (no cluster here)."""
    import urllib.parse

    import dagster as dg
    from dagster_postgres import PostgresRunStorage

    url = urllib.parse.urlsplit(postgres_url)
    for name, value in (("HOST", url.hostname), ("PORT", str(url.port)),
                        ("USER", url.username), ("PASSWORD", url.password or ""),
                        ("DB", url.path.lstrip("/"))):
        monkeypatch.setenv(f"DAGSTER_PG_{name}", value)
    config = yaml.safe_load((DEPLOY / "dagster.yaml").read_text())
    del config["run_launcher"]
    (tmp_path / "dagster.yaml").write_text(yaml.safe_dump(config))

    with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
        assert isinstance(instance.run_storage, PostgresRunStorage)
        assert instance.get_run_by_id(materialize_one_run(instance)).is_success


def test_the_instance_purges_sensor_ticks(tmp_path):
    """Dagster reads the retention block (its schema is checked on load) and would purge
    successful sensor ticks, which it keeps forever by default."""
    import dagster as dg
    from dagster._core.definitions.run_request import InstigatorType
    from dagster._core.scheduler.instigation import TickStatus

    (tmp_path / "dagster.yaml").write_text(yaml.safe_dump(instance_yaml(4)))
    with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
        settings = instance.get_tick_retention_settings(InstigatorType.SENSOR)
    assert settings[TickStatus.SUCCESS] == 7 and settings[TickStatus.SKIPPED] == 1
