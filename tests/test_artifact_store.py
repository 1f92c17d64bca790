"""The artifact store, one suite over a local directory and a real GCS API server on loopback."""

import io
import json
import pickle
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco_core.compression import decode
from diloco_core.config import OuterOptConfig
from diloco_core.fragments import plan_fragments, split_params
from diloco_core.learner import LearnerSync
from diloco_core.outer import build_outer_optimizer
from diloco_core.stored_merge import StoredMerge
from resources.store import layout
from resources.store.artifact_store import ArtifactStore, Conflict, Pruned, RejectedArtifact
from resources.store.backends import open_blob_store
from resources.store.names import InvalidName
from resources.store.summary_records import RoundEval, RunOutcome, RunSummary, RunTiming

EXP = "exp-1"


@pytest.fixture(params=["local", "gcs"])
def store(request, tmp_path):
    if request.param == "local":
        blobs = open_blob_store(str(tmp_path / "store"))
    else:
        request.getfixturevalue("gcs_server")
        blobs = open_blob_store(f"gs://diloco-test/t-{uuid.uuid4().hex[:12]}")
    return ArtifactStore(blobs, EXP)


PARAMS = {"a/kernel": jnp.arange(12, dtype=jnp.float32).reshape(3, 4) / 7,
          "b/scale": jnp.ones(5, jnp.float32)}
PLAN = plan_fragments({k: v.shape for k, v in PARAMS.items()}, 2)


def _contribution(learner="learner-0", round_index=3, encoding="int4", shift=0.1):
    sync = LearnerSync.start(learner, split_params(PARAMS, PLAN), [0, 0]).after_step(256)
    trained = {k: v + shift for k, v in PARAMS.items()}
    return sync.contribution(trained, PLAN, 0, round_index, 1, 12.5, encoding, 4)


def test_config_is_write_once_and_idempotent(store):
    assert store.get_config() is None
    store.put_config({"name": EXP, "seed": 0})
    store.put_config({"name": EXP, "seed": 0})          # same again: fine
    with pytest.raises(Conflict):
        store.put_config({"name": EXP, "seed": 1})
    assert store.get_config() == {"name": EXP, "seed": 0}


def test_global_versions_pointer_and_outer_state(store):
    tx = build_outer_optimizer(OuterOptConfig())
    frag = split_params(PARAMS, PLAN)[0]
    state = tx.init(frag)
    store.commit_global(0, 0, frag, state, {"round": None})
    moved = {k: v - 1 for k, v in frag.items()}
    store.commit_global(0, 1, moved, state, {"round": 0, "members": ["learner-0"]})
    store.commit_global(0, 1, moved, state, {"round": 0, "members": ["learner-0"]})  # retry
    assert store.current_version(0) == 1 and store.versions(0) == [0, 1]
    got = store.load_global(0, outer_template=state)
    assert got.version == 1 and list(got.meta.members) == ["learner-0"]
    for k in frag:
        np.testing.assert_array_equal(got.params[k], np.asarray(moved[k]))
    assert type(got.outer_state) is type(state)
    # Scalar leaves (the momentum warm-up's step count) come back as scalars, values intact.
    for a, b in zip(jax.tree_util.tree_leaves(got.outer_state), jax.tree_util.tree_leaves(state),
                    strict=True):
        assert np.shape(a) == np.shape(b)
        np.testing.assert_array_equal(a, np.asarray(b))
    old = store.load_global(0, version=0)
    np.testing.assert_array_equal(old.params["a/kernel"], np.asarray(frag["a/kernel"]))
    with pytest.raises(Conflict, match="cannot move the pointer from version 1 to 3"):
        store.commit_global(0, 3, moved, state)
    with pytest.raises(Conflict):                    # same version, different content
        store.commit_global(0, 1, frag, state)
    assert store.current_version(1) is None


def test_contribution_round_trip_listing_and_idempotence(store):
    c = _contribution()
    size = store.put_contribution(c)
    assert size > 0
    assert store.put_contribution(c) == size             # written twice: no-op
    store.put_contribution(_contribution("learner-1"))
    store.put_contribution(_contribution("learner-2", round_index=4))
    assert store.list_contributions(3) == ["learner-0", "learner-1"]
    assert store.list_contributions(4) == ["learner-2"]
    assert store.list_contributions(5) == []
    back = store.load_contribution(3, "learner-0")
    assert (back.learner, back.round, back.fragment, back.tokens, back.steps, back.clock) == \
        (c.learner, c.round, c.fragment, c.tokens, c.steps, c.clock)
    assert back.nbytes == c.nbytes
    for name in c.delta:
        np.testing.assert_array_equal(decode(back.delta[name]), decode(c.delta[name]))
    with pytest.raises(Conflict):
        store.put_contribution(_contribution(shift=0.5))  # different content, same round


def _delta_key(store, round_index, learner):
    directory = layout.contribution_dir(EXP, round_index, learner)
    manifest = json.loads(store.blobs.read(f"{directory}/manifest.json"))
    return f"{directory}/{manifest['objects']['delta']['name']}", manifest


def test_truncated_and_tampered_payloads_are_rejected_with_a_reason(store):
    store.put_contribution(_contribution("learner-0"))
    store.put_contribution(_contribution("learner-1"))
    key0, _ = _delta_key(store, 3, "learner-0")
    data = store.blobs.read(key0)
    store.blobs.write(key0, data[: len(data) // 2])
    with pytest.raises(RejectedArtifact, match="truncated"):
        store.load_contribution(3, "learner-0")
    key1, _ = _delta_key(store, 3, "learner-1")
    data = bytearray(store.blobs.read(key1))
    data[-30] ^= 0xFF
    store.blobs.write(key1, bytes(data))
    with pytest.raises(RejectedArtifact, match="checksum mismatch"):
        store.load_contribution(3, "learner-1")


def test_missing_manifest_means_invisible_and_manifest_without_payload_is_rejected(store):
    store.put_contribution(_contribution("learner-0"))
    key, _ = _delta_key(store, 3, "learner-0")
    directory = layout.contribution_dir(EXP, 3, "learner-0")
    # A payload without its manifest (a writer died before committing) is not listed.
    store.blobs.delete(f"{directory}/manifest.json")
    assert store.list_contributions(3) == []
    # A manifest whose payload is gone is listed but refused with a reason.
    store.put_contribution(_contribution("learner-0"))
    store.blobs.delete(key)
    with pytest.raises(RejectedArtifact, match="does not exist"):
        store.load_contribution(3, "learner-0")


UNPICKLED = []


def _explode():
    UNPICKLED.append(True)


class _Exploding:
    def __reduce__(self):
        return (_explode, ())


def test_hostile_payloads_are_never_deserialized(store):
    store.put_contribution(_contribution("learner-0"))
    key, manifest = _delta_key(store, 3, "learner-0")
    # A pickle whose size and checksum the manifest "commits": still refused, never unpickled.
    evil = pickle.dumps(_Exploding())
    from resources.store.array_bundle import sha256
    manifest["objects"]["delta"].update(size=len(evil), sha256=sha256(evil))
    directory = layout.contribution_dir(EXP, 3, "learner-0")
    store.blobs.write(key, evil)
    store.blobs.write(f"{directory}/manifest.json", json.dumps(manifest).encode())
    with pytest.raises(RejectedArtifact, match="not a plain array bundle"):
        store.load_contribution(3, "learner-0")
    assert not UNPICKLED
    # A manifest that lies about who wrote it, or about its shape.
    manifest["learner"] = "learner-9"
    store.blobs.write(f"{directory}/manifest.json", json.dumps(manifest).encode())
    with pytest.raises(RejectedArtifact, match="manifest says learner"):
        store.load_contribution(3, "learner-0")
    # Oversized objects are refused before they are read.
    small = ArtifactStore(store.blobs, EXP, max_object_bytes=64)
    store.put_contribution(_contribution("learner-1"))
    with pytest.raises(RejectedArtifact, match="oversized"):
        small.load_contribution(3, "learner-1")
    # Names that would escape their prefix never become keys.
    for bad in ("../x", "a/b", "A", "", ".."):
        with pytest.raises(InvalidName):
            store.load_contribution(3, bad)
    with pytest.raises(InvalidName):
        ArtifactStore(store.blobs, "../other")


def test_several_learners_write_at_once_and_readers_never_see_partial_state(store):
    learners = [f"learner-{i}" for i in range(8)]
    stop = threading.Event()
    seen: list[str] = []
    errors: list[Exception] = []

    def reader():
        while not stop.is_set():
            for learner in store.list_contributions(3):
                try:
                    store.load_contribution(3, learner)
                    seen.append(learner)
                except Exception as err:  # noqa: BLE001 - any failure is the test's failure
                    errors.append(err)

    thread = threading.Thread(target=reader)
    thread.start()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda name: store.put_contribution(_contribution(name)), learners))
    stop.set()
    thread.join()
    assert not errors, errors[:3]
    assert store.list_contributions(3) == sorted(learners)


def test_decisions_evals_summary_and_checkpoint_location(store):
    decision = {"round": 3, "fragment": 1, "members": ["learner-0"], "reason": "quorum",
                "decided_at": 10.0}
    store.put_decision(3, decision)
    store.put_decision(3, decision)             # the same record again: a retry, accepted
    with pytest.raises(Conflict):
        store.put_decision(3, {**decision, "members": []})
    assert store.get_decision(3).reason == "quorum"
    evaluation = RoundEval(loss=2.5, bits_per_byte=3.6, versions=(1, 2), batches=4, by="syncer")
    store.put_eval(3, evaluation)
    assert store.get_eval(3) == evaluation and store.get_eval(4) is None
    store.put_summary(RunSummary(outcome=RunOutcome(rounds_merged=3)))
    summary = RunSummary(outcome=RunOutcome(rounds_merged=4, final_eval_loss=2.0),
                         timing=RunTiming(decided_by={"syncer-a0": 4}))
    store.put_summary(summary)                          # the one record that is rewritten
    assert store.get_summary() == summary
    # Its groups' fields sit at the top level of the JSON, as every reader of it knows them.
    written = json.loads(store.blobs.read(layout.summary(store.experiment)))
    assert written["rounds_merged"] == 4 and written["decided_by"] == {"syncer-a0": 4}
    # A summary or an eval that is not what its record says is refused, naming the field.
    store.blobs.write(layout.summary(store.experiment),
                      b'{"rounds_merged": 4, "ledger": {"balanced": "maybe"}}')
    with pytest.raises(RejectedArtifact, match=r"ledger\.balanced"):
        store.get_summary()
    store.blobs.write(layout.evaluation(store.experiment, 4), b'{"loss": "low"}')
    with pytest.raises(RejectedArtifact, match="loss"):
        store.get_eval(4)
    assert store.checkpoint_uri("learner-0").endswith(
        "experiments/exp-1/learners/learner-0/checkpoints")


def test_retention_deletes_old_arrays_and_keeps_every_manifest(store):
    tx = build_outer_optimizer(OuterOptConfig())
    frag = split_params(PARAMS, PLAN)[0]
    state = tx.init(frag)
    for version in range(4):
        store.commit_global(0, version, {k: v + version for k, v in frag.items()}, state,
                            {"round": version - 1 if version else None})
    assert store.prune_version(0, 1, "keep 2") == 2          # params and outer state
    assert store.prune_version(0, 1, "keep 2") == 0          # nothing left: a no-op
    assert store.versions(0) == [0, 1, 2, 3]                 # every manifest stays
    assert store.version_meta(0, 1) == StoredMerge(round=0)
    with pytest.raises(Pruned, match="fragment 0 version 1 was deleted by retention .keep 2."):
        store.load_global(0, 1)
    assert store.load_global(0, 0).params["a/kernel"][0, 0] == pytest.approx(
        float(frag["a/kernel"][0, 0]))
    assert store.load_global(0).version == 3
    for refused in (0, 3, 4):     # the initial parameters, the current version, a future one
        with pytest.raises((ValueError, Conflict)):
            store.prune_version(0, refused, "no")
    # A lost payload that retention did not delete still reads as a rejected artifact.
    directory = layout.version_dir(EXP, 0, 2)
    lost = next(k for k in store.blobs.list(directory + "/") if "/params-" in k)
    store.blobs.delete(lost)
    with pytest.raises(RejectedArtifact, match="does not exist"):
        store.load_global(0, 2)


def test_retention_of_a_round_needs_its_decision_and_keeps_the_manifests(store):
    store.put_contribution(_contribution("learner-0"))
    store.put_contribution(_contribution("learner-1"))
    with pytest.raises(Conflict, match="not decided"):
        store.prune_round(3, "too early")
    store.put_decision(3, {"round": 3, "fragment": 0, "members": ["learner-0"],
                           "reason": "quorum", "decided_at": 10.0})
    assert store.prune_round(3, "keep 64 rounds") == 2
    assert store.list_contributions(3) == ["learner-0", "learner-1"]
    if not store.blobs.uri.startswith("gs://"):
        # The deleted arrays leave nothing behind, not even their keys' lock files.
        root = Path(store.blobs.uri) / layout.round_dir(EXP, 3)
        assert not [p.name for p in root.rglob("*") if ".npz" in p.name]
    assert store.contribution_manifest(3, "learner-1").tokens > 0
    assert list(store.get_decision(3).members) == ["learner-0"]
    with pytest.raises(Pruned, match="contribution of learner-0 to round 3 was deleted"):
        store.load_contribution(3, "learner-0")
    assert store.get_retention() is None
    store.put_retention({"versions_from": [2], "rounds_from": 4})
    assert store.get_retention() == {"versions_from": [2], "rounds_from": 4}


def test_plain_tools_can_read_what_the_store_wrote(store):
    """Interoperability: the documented layout is readable without this project's code."""
    c = _contribution("learner-0", encoding="fp32")
    store.put_contribution(c)
    directory = layout.contribution_dir(EXP, 3, "learner-0")
    if store.blobs.uri.startswith("gs://"):
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        bucket, _, prefix = store.blobs.uri[len("gs://"):].partition("/")
        client = storage.Client(project="test", credentials=AnonymousCredentials())
        read = lambda key: client.bucket(bucket).blob(f"{prefix}/{key}").download_as_bytes()  # noqa: E731
    else:
        from pathlib import Path

        read = lambda key: (Path(store.blobs.uri) / key).read_bytes()  # noqa: E731
    manifest = json.loads(read(f"{directory}/manifest.json"))
    assert manifest["learner"] == "learner-0" and manifest["tokens"] == 256
    npz = np.load(io.BytesIO(read(f"{directory}/{manifest['objects']['delta']['name']}")),
                  allow_pickle=False)
    name = manifest["tensors"][0]["name"]
    np.testing.assert_array_equal(npz["t0000.payload"], np.asarray(c.delta[name].payload))


def test_gcs_conditional_writes_send_preconditions_and_map_412(gcs_server, monkeypatch):
    from google.api_core import exceptions as gexc
    from google.cloud.storage import Blob

    store = ArtifactStore(open_blob_store(f"gs://diloco-test/t-{uuid.uuid4().hex[:12]}"), EXP)
    sent = []
    original = Blob.upload_from_string

    def recording(self, data, **kwargs):
        sent.append((self.name.rsplit("/", 1)[-1], kwargs.get("if_generation_match")))
        return original(self, data, **kwargs)

    monkeypatch.setattr(Blob, "upload_from_string", recording)
    tx = build_outer_optimizer(OuterOptConfig())
    frag = split_params(PARAMS, PLAN)[0]
    store.commit_global(0, 0, frag, tx.init(frag))
    store.commit_global(0, 1, frag, tx.init(frag))
    store.put_contribution(_contribution())
    conditions = dict(sent)
    # Payloads and manifests are create-only; the pointer moves from the generation it read.
    assert all(cond == 0 for name, cond in sent if name != "CURRENT")
    pointer_moves = [cond for name, cond in sent if name == "CURRENT"]
    assert pointer_moves[0] == 0 and pointer_moves[1] > 0
    assert "manifest.json" in conditions

    # What real GCS answers to a lost race (HTTP 412) becomes a Conflict for different content.
    def precondition_failed(self, data, **kwargs):
        if self.name.endswith(("CURRENT", "decision.json")):
            raise gexc.PreconditionFailed("conditionNotMet")
        return original(self, data, **kwargs)

    monkeypatch.setattr(Blob, "upload_from_string", precondition_failed)
    with pytest.raises(Conflict, match="pointer moved concurrently"):
        store.commit_global(0, 2, frag, tx.init(frag))
    with pytest.raises(Conflict, match="already committed with different content"):
        store.put_decision(5, {"round": 5, "fragment": 0, "members": [], "reason": "r",
                               "decided_at": 1.0})  # the "existing" object is absent -> differs


def test_dagster_resource_opens_the_store(tmp_path):
    from resources.store.resource import ArtifactStoreResource

    resource = ArtifactStoreResource(base_uri=str(tmp_path / "s"), experiment="exp-2")
    store = resource.store()
    store.put_config({"name": "exp-2"})
    assert store.get_config() == {"name": "exp-2"}
    with pytest.raises(InvalidName):
        ArtifactStoreResource(base_uri=str(tmp_path), experiment="../up").store()


def test_ledger_claims_are_sealed_in_segments_and_read_back_whole(store):
    from resources.store.learner_records import CLAIMS_PER_SEGMENT

    def record(claims):
        return {"learner": "learner-0", "attempt": 3, "status": "training", "final": False,
                "ledger": {"processed": 7, "unclaimed": [0], "superseded": [0],
                           "claims": claims}}

    claims = [[r, r % 4, 100 + r] for r in range(2 * CLAIMS_PER_SEGMENT + 600)]
    # One offer per round: the rounds the claims name are open (what bounds the segments).
    store.open_round(len(claims) - 1, {"fragment": 0, "opened_at": 1.0})
    key = layout.attempt(EXP, "learner-0", 3)
    for n in (700, 2 * CLAIMS_PER_SEGMENT + 600, len(claims)):   # the run goes on
        store.put_attempt_record("learner-0", 3, record(claims[:n]))
        stored = json.loads(store.blobs.read(key))
        # What is rewritten every heartbeat is only the tail: bounded however long the run.
        assert len(stored["ledger"]["claims"]) < CLAIMS_PER_SEGMENT
        assert stored["ledger"]["claim_segments"] == n // CLAIMS_PER_SEGMENT
        assert len(store.blobs.read(key)) < 48 * 1024
        (back,) = store.attempt_records("learner-0")
        assert back == record(claims[:n])       # whole again, in order
    # A fresh store object (another process, e.g. the run summary) reads the same.
    again = ArtifactStore(store.blobs, EXP)
    assert again.attempt_records("learner-0") == [record(claims)]
    again.put_attempt_record("learner-0", 3, record(claims))   # a retried write: no conflict


@pytest.mark.parametrize("change, reason", [
    ({"claim_segments": 10**9}, "claim_segments must be an integer"),
    ({"claim_segments": "2"}, "claim_segments must be an integer"),
    ({"claim_segments": 1}, "claim segment 0 is missing or malformed"),
    ({"claim_segments": 0, "claims": "x"}, "claim_segments must be an integer"),
])
def test_a_forged_claim_segment_count_is_refused_with_the_reason(store, change, reason):
    key = layout.attempt(EXP, "learner-1", 0)
    ledger = {"processed": 0, "unclaimed": [0], "superseded": [0], "claims": [], **change}
    store.blobs.write(key, json.dumps({"learner": "learner-1", "attempt": 0,
                                       "ledger": ledger}).encode())
    refused = []
    assert store.attempt_records("learner-1", refused) == []
    assert [r["key"] for r in refused] == [key] and reason in refused[0]["reason"]


def _count_reads(store) -> list[str]:
    reads, read = [], store.blobs.read

    def counting(key):
        reads.append(key)
        return read(key)

    store.blobs.read = counting
    return reads


def _forged_record(store, learner, segments, claims=()):
    key = layout.attempt(EXP, learner, 0)
    store.blobs.write(key, json.dumps({"learner": learner, "attempt": 0, "ledger": {
        "processed": segments * 1024 + len(claims), "unclaimed": [0], "superseded": [0],
        "claims": list(claims), "claim_segments": segments}}).encode())
    return key


def test_claim_segments_beyond_what_the_opened_rounds_justify_are_refused_unread(store):
    """A learner could write 100,000 well-formed claim segments and a record counting them:
    all were accepted, and every ledger build read them (~2.7 GiB). A learner offers at most
    once per opened round, so that bounds the segments an attempt can have: past it the
    record is refused before any segment is read."""
    from resources.store.learner_records import CLAIMS_PER_SEGMENT

    store.open_round(99, {"fragment": 0, "opened_at": 1.0})   # 100 rounds: 1 segment (+1)
    part = json.dumps({"claims": [[r, 0, 1] for r in range(CLAIMS_PER_SEGMENT)]}).encode()
    for k in range(3):
        store.blobs.write(layout.claim_segment(EXP, "learner-1", 0, k), part)
    key = _forged_record(store, "learner-1", 3)
    reads = _count_reads(store)
    refused = []
    assert store.attempt_records("learner-1", refused) == []
    assert refused == [{"key": key, "reason": (
        "claim_segments 3: more than the 2 that 100 opened rounds justify (one offer per "
        "round, 1024 claims per segment); none read")}]
    assert [k for k in reads if "/claims/" in k] == []
    # Once the rounds justify them, the same segments are read back.
    store.open_round(3 * CLAIMS_PER_SEGMENT - 1, {"fragment": 0, "opened_at": 2.0})
    (record,) = store.attempt_records("learner-1")
    assert len(record["ledger"]["claims"]) == 3 * CLAIMS_PER_SEGMENT


def test_an_oversized_claim_segment_or_attempt_record_is_refused_unread(store):
    from resources.store.learner_records import (
        CLAIMS_PER_SEGMENT,
        MAX_ATTEMPT_RECORD_BYTES,
        MAX_CLAIM_SEGMENT_BYTES,
    )

    store.open_round(5000, {"fragment": 0, "opened_at": 1.0})
    # Well-formed, padded with whitespace: each one as large as a learner may make it.
    segment = json.dumps({"claims": [[r, 0, 1] for r in range(CLAIMS_PER_SEGMENT)]}).encode()
    store.blobs.write(layout.claim_segment(EXP, "learner-1", 0, 0),
                      segment.ljust(MAX_CLAIM_SEGMENT_BYTES + 1))
    key = _forged_record(store, "learner-1", 1)
    big = layout.attempt(EXP, "learner-2", 0)
    store.blobs.write(big, json.dumps({"learner": "learner-2", "attempt": 0, "ledger": {
        "processed": 0, "unclaimed": [0], "superseded": [0], "claims": []}}).encode().ljust(
        MAX_ATTEMPT_RECORD_BYTES + 1))
    reads = _count_reads(store)
    refused = []
    assert store.attempt_records("learner-1", refused) == []
    assert store.attempt_records("learner-2", refused) == []
    assert refused == [
        {"key": key, "reason": f"claim segment 0: {MAX_CLAIM_SEGMENT_BYTES + 1} bytes: larger "
                               f"than it may be ({MAX_CLAIM_SEGMENT_BYTES}); not read"},
        {"key": big, "reason": f"{MAX_ATTEMPT_RECORD_BYTES + 1} bytes: larger than it may be "
                               f"({MAX_ATTEMPT_RECORD_BYTES}); not read"}]
    assert [k for k in reads if "/claims/" in k or k == big] == []   # neither was read


def test_junk_under_a_learners_contributions_bounds_the_round_listing(store):
    """20,000 junk objects a learner wrote under its contribution directory made every
    control-plane tick list them all (0.7 ms -> 280 ms). The listing stops past 4 objects per
    learner of the config (+64), and each learner's manifest is then looked up on its own:
    the round's offers are all still found, the hostile learner's included."""
    store.put_config({"name": EXP, "learners": {"num_learners": 3}})
    for name in ("learner-0", "learner-1", "learner-2"):
        store.put_contribution(_contribution(name))
    junk = layout.contribution_dir(EXP, 3, "learner-1")
    for i in range(100):
        store.blobs.write(f"{junk}/junk/{i:04d}", b"")
    fresh = ArtifactStore(store.blobs, EXP)   # e.g. a sensor tick's
    listed, list_ = [], store.blobs.list

    def recording(prefix, **kw):
        keys = list_(prefix, **kw)
        listed.append(len(keys))
        return keys

    store.blobs.list = recording
    assert fresh.list_contributions(3) == ["learner-0", "learner-1", "learner-2"]
    assert listed == []             # the listing stopped (it used to return all 106 keys)
    prefix = layout.contributions_prefix(EXP, 3)
    assert fresh.listing_refusals[prefix].startswith(
        "more than 76 objects (4 per learner of 3): a learner wrote junk there")
    assert fresh.list_contributions(3) == ["learner-0", "learner-1", "learner-2"]
    assert listed == []             # and is not tried again for that round
    assert fresh.list_contributions(4) == [] and listed == [0]   # other rounds: listed


@pytest.mark.parametrize("overrides", [
    [], ["learners.num_learners=3"], ["learners.num_learners=3", "learners.standby=1"],
    ["learners.num_learners=2", "learners.names=[a, b]"]])
def test_the_roster_that_bounds_the_round_listing_is_the_configs(overrides):
    from diloco_core.config_loading import config_from_mapping, config_to_mapping
    from resources.store.store_base import _roster_of

    cfg = config_from_mapping({}, overrides)
    assert _roster_of(config_to_mapping(cfg)) == cfg.learners.learner_names


def test_junk_under_a_learners_attempts_or_the_fired_faults_bounds_their_listing(
        store, monkeypatch):
    from resources.store import learner_records, run_records

    monkeypatch.setattr(learner_records, "MAX_ATTEMPTS_LISTED", 8)
    monkeypatch.setattr(run_records, "MAX_FIRED_LISTED", 8)
    good = {"learner": "learner-1", "attempt": 1, "status": "done", "final": True,
            "ledger": {"processed": 4, "unclaimed": [4], "superseded": [0], "claims": []}}
    store.put_attempt_record("learner-1", 1, good)
    store.put_attempt_record("learner-0", 1, {**good, "learner": "learner-0"})
    prefix = layout.attempts_prefix(EXP, "learner-1")
    for i in range(9):
        store.blobs.write(f"{prefix}junk-{i}", b"")
    refused = []
    assert store.attempt_records("learner-1", refused) == []
    assert refused == [{"key": prefix, "reason": "more than 8 objects: junk under the "
                        "learner's attempt records; none of them is read"}]
    assert store.attempt_records("learner-0") == [{**good, "learner": "learner-0"}]
    # The fired faults (learners write them in a chaos run): unreadable ones are left out,
    # and past the bound none is read; firing stays once per fault.
    assert store.mark_fault_fired("f1", {"id": "f1", "time": 2.0})
    store.blobs.write(layout.fired_fault(EXP, "f0") + ".json", b'{"id": "f0", "time": "x"}')
    store.blobs.write(layout.fired_fault(EXP, "f2") + ".json", b"not json")
    assert [f["id"] for f in store.fired_faults()] == ["f0", "f1"]
    for i in range(8):
        store.blobs.write(layout.fired_fault(EXP, f"junk-{i}") + ".json", b"{}")
    assert store.fired_faults() == []
    assert "more than 8 objects" in store.listing_refusals[layout.fired_prefix(EXP)]
    assert not store.mark_fault_fired("f1", {"id": "f1", "time": 3.0})


@pytest.mark.parametrize("body, reason", [
    (b"\x00 not json", "not valid JSON"),
    (json.dumps({"learner": "learner-0", "attempt": 0}).encode(), "record of learner"),
    (json.dumps({"learner": "learner-1", "attempt": 7}).encode(), "does not match"),
    (json.dumps({"learner": "learner-1", "attempt": 0,
                 "ledger": {"processed": "all"}}).encode(), "ledger.processed"),
    (json.dumps({"learner": "learner-1", "attempt": 0, "ledger": {
        "processed": 1, "unclaimed": [0], "superseded": [0], "claims": "many"}}).encode(),
     "ledger.claims"),
    (json.dumps({"learner": "learner-1", "attempt": 0, "ledger": {
        "processed": 1, "unclaimed": [-5], "superseded": [0], "claims": []}}).encode(),
     "ledger.unclaimed"),
])
def test_a_malformed_attempt_record_is_left_out_with_the_reason(store, body, reason):
    """The token ledger reads every learner's attempt records: one that is garbage, lies about
    whose it is, or cannot be accounted is refused, and the learner's good records still count
    (before, it stopped the ledger and with it the run summary)."""
    good = {"learner": "learner-1", "attempt": 1, "status": "done", "final": True,
            "ledger": {"processed": 4, "unclaimed": [4], "superseded": [0], "claims": []}}
    store.put_attempt_record("learner-1", 1, good)
    store.blobs.write(layout.attempt(EXP, "learner-1", 0), body)
    refused = []
    assert store.attempt_records("learner-1", refused) == [good]
    assert len(refused) == 1 and reason in refused[0]["reason"]


def test_bundles_decode_without_evaluating_python_on_many_threads(monkeypatch):
    """numpy's .npy reader evaluates each header with `ast.literal_eval`, which on CPython 3.11
    fails at random ("SystemError: AST constructor recursion depth mismatch") when threads
    parse at once, and the syncer reads a round's offers on several threads: a long haul saw
    an honest offer refused as unreadable. Bundles are decoded without it, the same arrays
    back, from many threads at once; a header numpy would accept but `np.savez` never writes
    (Fortran order) is refused."""
    import ast

    import ml_dtypes

    from resources.store.array_bundle import BadBundle, decode_bundle, encode_bundle

    def forbidden(*args, **kwargs):
        raise AssertionError("a bundle's header was evaluated as Python")

    monkeypatch.setattr(ast, "literal_eval", forbidden)
    rng = np.random.default_rng(0)
    arrays = {"w": rng.standard_normal((3, 5)).astype(np.float32),
              "b": rng.standard_normal(7).astype(ml_dtypes.bfloat16),
              "codes": rng.integers(0, 255, 33, dtype=np.uint8),
              "step": np.asarray(4, np.int32), "empty": np.zeros((0, 4), np.float32)}
    bundle = encode_bundle(arrays)

    def decode(_):
        return decode_bundle(bundle.data, expected_sha256=bundle.sha256,
                             expected_size=len(bundle.data), dtypes=bundle.dtypes,
                             shapes=bundle.shapes)

    with ThreadPoolExecutor(8) as pool:
        for out in pool.map(decode, range(64)):
            assert set(out) == set(arrays)
            for name, value in arrays.items():
                assert out[name].dtype == value.dtype and out[name].shape == value.shape
                np.testing.assert_array_equal(out[name], value)

    buffer = io.BytesIO()
    np.savez(buffer, w=np.asfortranarray(arrays["w"]))
    data = buffer.getvalue()
    from resources.store.array_bundle import sha256
    with pytest.raises(BadBundle, match="fortran_order True"):
        decode_bundle(data, expected_sha256=sha256(data), expected_size=len(data),
                      dtypes={"w": "float32"}, shapes={"w": [3, 5]})
