"""Who may write where: the write rules of a learner hold every key a real learner process
writes and no key of another learner or of the control plane; the IAM conditions made from
them are the same rules, and `diloco iam` prints them as a bucket policy."""

import json
import re
import threading
import time
from pathlib import Path

import dagster as dg
import numpy as np
import pytest
from orchestration_harness import Harness, wait_until

from diloco_core.config import ConfigError
from diloco_core.round_records import Heartbeat
from pipelines.commands.cli import main as cli
from resources.learner.runtime import LearnerRuntime
from resources.store.access import LearnerRules, bucket_bindings
from resources.store.artifact_store import ArtifactStore
from resources.store.blobs import BlobInfo, BlobStore, LocalBlobStore

pytestmark = pytest.mark.timeout(300)

FAST = ["orchestration.checkpoint_every_steps=4", "orchestration.poll_seconds=0.05",
        "orchestration.heartbeat_seconds=0.2", "orchestration.round_timeout_seconds=0.5"]


class Recording(BlobStore):
    """Another party's writes to the same store, recorded."""

    def __init__(self, inner: BlobStore):
        self.inner, self.keys = inner, set()

    def write(self, key: str, data: bytes, *, if_generation: int | None = None) -> BlobInfo:
        self.keys.add(key)
        return self.inner.write(key, data, if_generation=if_generation)

    def read(self, key: str) -> bytes:
        return self.inner.read(key)

    def info(self, key: str) -> BlobInfo | None:
        return self.inner.info(key)

    def list(self, prefix: str, *, limit: int | None = None) -> list[str]:
        return self.inner.list(prefix, limit=limit)

    def delete(self, key: str, *, forget: bool = False) -> None:
        self.keys.add(key)
        self.inner.delete(key, forget=forget)

    @property
    def uri(self) -> str:
        return self.inner.uri


def _files(root: Path) -> set[str]:
    """Object keys under a local store (not the local backend's `.{name}.lock` files, which
    have no counterpart in a bucket)."""
    return {p.relative_to(root).as_posix() for p in root.rglob("*")
            if p.is_file() and not (p.name.startswith(".") and p.name.endswith(".lock"))}


def test_a_learner_process_writes_only_where_its_rules_allow(tmp_path):
    """Everything learner-0's process writes in a run (heartbeats, attempt records, Orbax
    checkpoints, an offer) is inside its rules, and none of it inside learner-1's; every key
    the control plane writes meanwhile (a round opened, a merge committed) is outside both."""
    root = tmp_path / "store"
    with dg.instance_for_test() as instance:
        h = Harness(instance, str(root), FAST)
        h.start()
        before = _files(root)
        control = ArtifactStore(Recording(h.store.blobs), h.store.experiment)
        runtime = LearnerRuntime(h.store, "learner-0", 0, max_steps=12)
        thread = threading.Thread(target=runtime.run, daemon=True)
        thread.start()
        beat = lambda: h.store.get_heartbeat("learner-0") or Heartbeat("none", 0.0)  # noqa: E731
        wait_until(lambda: beat().step >= 4, "4 steps", 120)
        control.open_round(0, {"fragment": 0, "opened_at": time.time(), "final": False})
        wait_until(lambda: h.store.list_contributions(0) == ["learner-0"], "an offer", 120)
        g = control.load_global(1)
        control.commit_global(1, 1, {k: v + np.float32(0.001) for k, v in g.params.items()},
                              g.outer_state, {"round": 1})
        wait_until(lambda: beat().versions == (0, 1), "the merged fragment", 120)
        control.request_stop({"reason": "test"})
        thread.join(120)
        assert not thread.is_alive()
    written = _files(root) - before - control.blobs.keys
    exp = h.store.experiment
    mine, theirs = LearnerRules(exp, "learner-0"), LearnerRules(exp, "learner-1")
    kinds = {k.split("/")[4] if k.split("/")[2] == "learners" else k.split("/")[2]
             for k in written}
    assert {"heartbeat.json", "attempts", "checkpoints", "rounds"} <= kinds, kinds
    assert [k for k in written if not mine.allows(k)] == []
    assert [k for k in written if theirs.allows(k)] == []
    assert control.blobs.keys and [k for k in control.blobs.keys
                                   if mine.allows(k) or theirs.allows(k)] == []


@pytest.mark.parametrize(("key", "allowed"), [
    ("experiments/e1/learners/learner-0/heartbeat.json", True),
    ("experiments/e1/learners/learner-0/checkpoints/12/state/x", True),
    ("experiments/e1/rounds/r00000007/contributions/learner-0/manifest.json", True),
    ("experiments/e1/rounds/r00000007/contributions/learner-0/delta-ab.npz", True),
    ("experiments/e1/learners/learner-0-evil/heartbeat.json", False),   # a longer name
    ("experiments/e1/learners/learner-1/heartbeat.json", False),
    ("experiments/e1/rounds/r00000007/contributions/learner-01/manifest.json", False),
    ("experiments/e1/rounds/r00000007/contributions/learner-0", False),  # not inside it
    ("experiments/e1/rounds/r00000007/decision.json", False),
    ("experiments/e1/rounds/OPEN", False),
    ("experiments/e1/global/f000/contributions/learner-0/x", False),     # not under rounds/
    ("experiments/e1/global/f000/CURRENT", False),
    ("experiments/e1/config.json", False),
    ("experiments/e1/faults/tape.json", False),
    ("experiments/e1/STOP_REQUEST", False),
    ("experiments/e1/CAPACITY", False),            # which learners have compute: not theirs
    ("experiments/e1/BUDGET", False),
    ("experiments/e1/faults/fired/k1.json", False),                      # not a chaos run
    ("experiments/e2/learners/learner-0/heartbeat.json", False),         # another experiment
    ("ACTIVE", False),
])
def test_the_rules_of_one_learner(key, allowed):
    assert LearnerRules("e1", "learner-0").allows(key) is allowed


def test_a_chaos_run_also_lets_learners_record_fired_faults():
    assert LearnerRules("e1", "learner-0", chaos=True).allows("experiments/e1/faults/fired/k.json")
    assert not LearnerRules("e1", "learner-0", chaos=True).allows("experiments/e1/faults/tape.json")


def test_names_the_store_layout_uses_are_refused_for_experiments_and_learners(tmp_path):
    """In an experiment named `contributions`, a learner named `rounds` would have been allowed
    the round's decision and its peers' offers: the first `/contributions/` of those keys is
    the experiment's, and the segment after it is `rounds`. Such names are refused where
    they become keys, and by the launch's config validation, naming the field."""
    from pipelines.launch_defaults import require_orchestratable
    from resources.store.names import InvalidName, reserved_names

    assert {"rounds", "contributions", "learners", "syncer", "faults", "checkpoints",
            "attempts", "claims", "global", "evals", "experiments"} <= reserved_names()
    with pytest.raises(InvalidName, match="experiment name 'contributions' is reserved"):
        LearnerRules("contributions", "rounds")
    with pytest.raises(InvalidName, match="learner name 'rounds' is reserved: it is a path "
                                          "segment of the store's layout"):
        LearnerRules("e1", "rounds")
    with pytest.raises(InvalidName, match="experiment name 'syncer' is reserved"):
        ArtifactStore(LocalBlobStore(tmp_path), "syncer")
    assert LearnerRules("e1", "rounds-0").allows("experiments/e1/learners/rounds-0/x")
    from pipelines.commands.cli import load_config

    for overrides, field in ((["learners.names=[learner-0, learners, learner-2, learner-3]"],
                              "learners.names[1]"), (["name=faults"], "name")):
        cfg = load_config(None, overrides)
        with pytest.raises(ConfigError, match=rf"^{re.escape(field)}: .* is reserved"):
            require_orchestratable(cfg)


def test_the_iam_condition_states_the_same_rules():
    condition = LearnerRules("e1", "learner-0").condition("my-bucket", "runs/")
    root = "projects/_/buckets/my-bucket/objects/runs/experiments/e1"
    assert condition == (
        f'resource.name.startsWith("{root}/learners/learner-0/") || '
        f'(resource.name.startsWith("{root}/rounds/") && '
        f'resource.name.extract("/contributions/{{learner}}/") == "learner-0")')
    chaos = LearnerRules("e1", "learner-0", chaos=True).condition("my-bucket")
    assert chaos.endswith('resource.name.startsWith("projects/_/buckets/my-bucket/objects/'
                          'experiments/e1/faults/fired/")')
    # Nothing that could end a quoted string gets in: it would widen the condition.
    for bucket, prefix in (('b" || true || "', ""), ("b", 'p" || true || "'), ("b", "a/../c"),
                           ("b", "a\\b")):
        with pytest.raises(ValueError, match="IAM condition"):
            LearnerRules("e1", "learner-0").condition(bucket, prefix)
    with pytest.raises(ValueError, match="name"):
        LearnerRules("e1", 'learner-0") || ("')


_CEL_ATOM = re.compile(r'resource\.name\.(startsWith|endsWith|matches)\("([^"\\]*)"\)'
                       r'|resource\.name\.extract\("([^"\\{}]*)\{[a-z_]+\}([^"\\{}]*)"\) == '
                       r'"([^"\\]*)"')


def _cel_extract(name: str, before: str, after: str) -> str:
    """IAM's `extract`: the text between the first occurrence of the template's part before
    the variable and the next occurrence of its part after it; "" if either is missing."""
    start = name.find(before)
    if start < 0:
        return ""
    start += len(before)
    if not after:
        return name[start:]
    end = name.find(after, start)
    return "" if end < 0 else name[start:end]


def _cel_allows(expression: str, name: str) -> bool:
    """Evaluate a rendered condition on `resource.name`, by the semantics of the few forms
    it is made of: a disjunction of (parenthesised conjunctions of) startsWith / endsWith /
    matches / extract(...) == "...". Any other form fails here rather than evaluate wrongly."""
    def atom(text: str) -> bool:
        m = _CEL_ATOM.fullmatch(text)
        assert m is not None, f"a form this evaluator does not know: {text!r}"
        fn, arg, before, after, want = m.groups()
        if fn == "startsWith":
            return name.startswith(arg)
        if fn == "endsWith":
            return name.endswith(arg)
        if fn == "matches":
            return re.search(arg, name) is not None
        return _cel_extract(name, before, after) == want

    def term(text: str) -> bool:
        if text.startswith("(") and text.endswith(")"):
            text = text[1:-1]
        assert "(" not in re.sub(r'\.(startsWith|endsWith|matches|extract)\("', "", text)
        return all(atom(a) for a in text.split(" && "))

    return any(term(t) for t in expression.split(" || "))


_RULE_KEYS = [
    "experiments/e1/learners/learner-0/heartbeat.json",
    "experiments/e1/learners/learner-1/heartbeat.json",
    "experiments/e1/learners/learner-0-evil/heartbeat.json",
    "experiments/e1/rounds/r00000007/contributions/learner-0/manifest.json",
    "experiments/e1/rounds/r00000007/contributions/learner-1/manifest.json",
    "experiments/e1/rounds/r00000007/contributions/learner-01/manifest.json",
    "experiments/e1/rounds/r00000007/contributions/learner-0",
    "experiments/e1/rounds/r00000007/contributions/learner-1/contributions/learner-0/x",
    "experiments/e1/rounds/r00000007/decision.json",
    "experiments/e1/rounds/OPEN",
    "experiments/e1/global/f000/CURRENT",
    "experiments/e1/global/f000/contributions/learner-0/x",
    "experiments/e1/config.json",
    "experiments/e1/faults/fired/k1.json",
    "experiments/e1/faults/tape.json",
    "experiments/e2/learners/learner-0/heartbeat.json",
    "experiments/e2/rounds/r00000007/contributions/learner-0/manifest.json",
    "ACTIVE",
]


def test_the_key_predicate_and_the_iam_condition_agree_wherever_the_store_is():
    """For a store at any bucket and prefix, layout words included, the Python predicate (on
    keys relative to the store) and the rendered IAM condition (on the full object name)
    decide alike for every key, or the location is refused. A `contributions` segment in
    the bucket or prefix is what `extract` cannot be anchored past: with the prefix
    `contributions/learner-0` the condition would let learner-0 write a round's decision and
    its peers' offers, and with `a/contributions` deny it its own offers."""
    locations = [("my-bucket", p) for p in (
        "", "runs", "/runs/", "runs/rounds", "rounds", "learners/learner-0",
        "experiments/e1", "experiments/e1/rounds", "faults/fired", "global/f000",
        "x-contributions", "contributions-x/y", "contributionsx", "a/contributions_",
        "contributions/learner-0", "contributions", "a/contributions",
        "team/contributions/learner-0/runs", "/a/contributions/")] + [
        ("contributions", ""), ("contributions", "runs"), ("rounds", "learners")]
    refused, checked = [], 0
    for bucket, prefix in locations:
        for learner in ("learner-0", "learner-1"):
            for chaos in (False, True):
                rules = LearnerRules("e1", learner, chaos)
                try:
                    condition = rules.condition(bucket, prefix)
                except ValueError as err:
                    refused.append((bucket, prefix))
                    assert "'contributions' path segment" in str(err), err
                    continue
                root = f"projects/_/buckets/{bucket}/objects/"
                root += prefix.strip("/") + "/" if prefix.strip("/") else ""
                differ = [(key, rules.allows(key)) for key in _RULE_KEYS
                          if _cel_allows(condition, root + key) != rules.allows(key)]
                assert not differ, (f"gs://{bucket}/{prefix} {learner} chaos={chaos}: "
                                    f"(key, predicate) where the IAM condition differs: {differ}")
                checked += 1
    assert sorted(set(refused)) == sorted({
        ("my-bucket", "contributions"), ("my-bucket", "a/contributions"),
        ("my-bucket", "contributions/learner-0"), ("my-bucket", "/a/contributions/"),
        ("my-bucket", "team/contributions/learner-0/runs"), ("contributions", ""),
        ("contributions", "runs")})
    assert checked == 4 * (len(locations) - 7)
    # The evaluator itself: a key each rule form allows, and the CLI's one-line refusal.
    rules = LearnerRules("e1", "learner-0", chaos=True)
    root = "projects/_/buckets/b/objects/runs/"
    assert [_cel_allows(rules.condition("b", "runs"), root + k) for k in _RULE_KEYS[:4]] == [
        True, False, False, True]
    assert _cel_allows(rules.condition("b", "runs"), root + "experiments/e1/faults/fired/k")


def test_diloco_iam_refuses_a_store_prefix_it_cannot_express(capsys):
    assert cli(["iam", "--store", "gs://b/team/contributions/learner-0", "--project", "p1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("diloco: store prefix 'team/contributions/learner-0': a "
                          "'contributions' path segment") and "\n" not in err


def test_one_identity_per_learner():
    with pytest.raises(ValueError, match="its own IAM member"):
        bucket_bindings("b", "", "e1", {"learner-0": "serviceAccount:a", "learner-1":
                                        "serviceAccount:a"}, ["serviceAccount:c"])


def test_diloco_iam_prints_the_bucket_policy(capsys):
    code = cli(["iam", "--store", "gs://diloco-store/diloco", "--project", "p1",
                "--set", "learners.num_learners=3"])
    assert code == 0
    policy = json.loads(capsys.readouterr().out)
    assert policy["version"] == 3
    viewer, control, *learners = policy["bindings"]
    assert viewer["role"] == "roles/storage.objectViewer" and len(viewer["members"]) == 4
    assert control == {"role": "roles/storage.objectUser",
                       "members": ["serviceAccount:dagster-run@p1.iam.gserviceaccount.com"]}
    assert [b["members"] for b in learners] == [
        [f"serviceAccount:diloco-learner-{i}@p1.iam.gserviceaccount.com"] for i in range(3)]
    assert all(b["role"] == "roles/storage.objectUser" and "learner-" in
               b["condition"]["expression"] for b in learners)
    assert cli(["iam", "--store", "/tmp/store"]) == 2
    assert "gs://bucket" in capsys.readouterr().err


def test_each_learner_runs_as_its_own_service_account():
    from resources.compute.manifests import learner_pod_spec
    from resources.compute.placement import deployment_from_mapping

    region = {"backend": "gke", "channel": "gcs", "bucket": "pipes-east", "project": "proj-one",
              "location": "us-east5", "cluster": "c1", "accelerator": "tpu-v6e-slice",
              "topology": "2x4", "image": "img:1", "service_account": "diloco-{learner}"}
    deployment = deployment_from_mapping({"regions": {"east": region}})
    spec = learner_pod_spec(deployment.placement("east"), {}, "learner-2")
    assert spec["serviceAccountName"] == "diloco-learner-2"

    from diloco_core.config_loading import config_from_mapping

    cfg = config_from_mapping({}, ["learners.num_learners=2", "learners.names=[a_0,b-1]",
                                   "learners.regions=[east,east]"])
    with pytest.raises(ConfigError, match=r"learners.names\[0\]"):
        deployment.check_learners(cfg.learners)
    with pytest.raises(ConfigError, match="service_account"):
        deployment_from_mapping({"regions": {"east": {**region, "service_account": "A{x}"}}})
