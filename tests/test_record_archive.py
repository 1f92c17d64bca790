"""Round records beyond retention packed into archive blocks (`resources/store/record_archive.py`):
every reader answers as before, from any process, while the archiver deletes under it."""

import dataclasses
import gzip
import json
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import pytest

from diloco_core.fragments import plan_fragments, split_params
from diloco_core.learner import LearnerSync
from resources.store import layout
from resources.store.artifact_store import ArtifactStore, Pruned, RejectedArtifact
from resources.store.backends import open_blob_store
from resources.store.blobs import LocalBlobStore
from resources.store.record_archive import (
    BLOCK_ROUNDS,
    Family,
    RecordArchiver,
    encode_block,
)

EXP = "arch"
LEARNERS = ("learner-0", "learner-1")
PARAMS = {"a/kernel": jnp.arange(12, dtype=jnp.float32).reshape(3, 4) / 7,
          "b/scale": jnp.ones(5, jnp.float32)}
PLAN = plan_fragments({k: v.shape for k, v in PARAMS.items()}, 2)


def _rounds(store: ArtifactStore, count: int, stranger: bool = False) -> None:
    """`count` decided and pruned rounds: both learners offer, learner-1's offer is late in
    every third round, every fifth is not merged; `stranger`: a foreign writer leaves an offer
    in round 1."""
    sync = LearnerSync.start("learner-0", split_params(PARAMS, PLAN), [0, 0]).after_step(256)
    offer = sync.contribution({k: v + 0.1 for k, v in PARAMS.items()}, PLAN, 0, 0, 1, 12.5,
                              "int4", 4)
    for r in range(count):
        store.open_round(r, {"fragment": r % 2, "opened_at": 100.0 + r, "reason": "quorum"})
        for learner in LEARNERS + (("stranger",) if stranger and r == 1 else ()):
            store.put_contribution(dataclasses.replace(offer, round=r, learner=learner,
                                                       tokens=256 + r),
                                   {"attempt": 0, "claim": 256 + r})
        members = ["learner-0"] if r % 3 == 0 else list(LEARNERS)
        store.put_decision(r, {"round": r, "fragment": r % 2, "members": members,
                               "reason": "quorum", "decided_at": 110.0 + r})
        if r % 5 == 0:
            store.put_round_not_merged(r, {"round": r, "rejected": {"learner-0": "nan"}})
        store.prune_round(r, "test")


def _answers(store: ArtifactStore, rounds) -> dict:
    """What every round reader says of each round."""
    out = {}
    for r in rounds:
        digests = {n: store.contribution_digest(r, n) for n in LEARNERS}
        with pytest.raises(Pruned):
            store.load_contribution(r, "learner-0")
        out[r] = (store.get_round_open(r), store.get_decision(r), store.get_round_not_merged(r),
                  store.list_contributions(r), digests,
                  store.contribution_manifest(r, "learner-1"))
    return out


def _live_round_objects(root: Path) -> list[str]:
    rounds = root / layout.rounds_dir(EXP)
    return sorted(str(p.relative_to(rounds)) for p in rounds.rglob("*")
                  if p.is_file() and p.parts[len(rounds.parts)].startswith("r0"))


@pytest.fixture
def store(tmp_path):
    s = ArtifactStore(open_blob_store(str(tmp_path / "store")), EXP)
    s.put_config({"name": EXP, "learners": {"num_learners": 2}})
    return s


def test_archived_rounds_read_as_before_and_leave_no_objects(store, tmp_path):
    count = 2 * BLOCK_ROUNDS + 5
    _rounds(store, count, stranger=True)
    before = _answers(store, range(count))
    live_before = len(_live_round_objects(tmp_path / "store"))
    archiver = RecordArchiver(store.archive, LEARNERS)
    for _ in range(1000):
        archiver.step(count, 4)
    assert (archiver.through, archiver.cleaned) == (2 * BLOCK_ROUNDS, 2 * BLOCK_ROUNDS)
    left = _live_round_objects(tmp_path / "store")
    # Only the rounds past the last whole block keep their objects (and no lock file remains).
    assert {name.split("/")[0] for name in left} == {f"r{r:08d}" for r in range(
        2 * BLOCK_ROUNDS, count)}
    assert len(left) < live_before / 10
    # The foreign writer's offer to round 1 is not packed; the learners' are, byte for byte
    # (their digests are the ones a decision admitted).
    assert before[1][3] == ["learner-0", "learner-1", "stranger"]
    before[1] = before[1][:3] + (list(LEARNERS),) + before[1][4:]
    assert _answers(store, range(count)) == before                 # the archiver's own view
    fresh = ArtifactStore(open_blob_store(str(tmp_path / "store")), EXP)
    assert _answers(fresh, range(count)) == before                 # another process's view
    blocks = sorted(p.name for p in (tmp_path / "store" / layout.rounds_dir(EXP) /
                                     "archive").iterdir() if not p.name.startswith("."))
    assert blocks == ["b00000000.json.gz", f"b{BLOCK_ROUNDS:08d}.json.gz"]


def test_pruned_versions_are_archived_and_version_0_stays(store, tmp_path):
    from diloco_core.config import OuterOptConfig
    from diloco_core.outer import build_outer_optimizer

    tx = build_outer_optimizer(OuterOptConfig())
    frag = split_params(PARAMS, PLAN)[0]
    state = tx.init(frag)
    count = BLOCK_ROUNDS + 3
    for version in range(count):
        store.commit_global(0, version, {k: v + version for k, v in frag.items()}, state,
                            {"round": 2 * version - 2 if version else None})
    for version in range(1, count - 1):
        store.prune_version(0, version, "test")
    metas = [store.version_meta(0, v) for v in range(count)]
    archiver = RecordArchiver(store.version_archive(0))
    archiver.step(count - 1, 10_000)
    assert (archiver.through, archiver.cleaned) == (BLOCK_ROUNDS, BLOCK_ROUNDS)
    fresh = ArtifactStore(open_blob_store(str(tmp_path / "store")), EXP)
    assert fresh.versions(0) == list(range(count))
    assert [fresh.version_meta(0, v) for v in range(count)] == metas
    with pytest.raises(Pruned, match="fragment 0 version 5 was deleted by retention"):
        fresh.load_global(0, 5)
    assert fresh.load_global(0, 0).params.keys() == frag.keys()       # in place, whole
    left = sorted({k.split("/")[4] for k in fresh.blobs.list(layout.fragment_dir(EXP, 0) + "/v")})
    assert left == ["v00000000"] + [f"v{v:08d}" for v in range(BLOCK_ROUNDS, count)]


def test_a_relaunched_archiver_carries_on_where_the_pointer_says(store, tmp_path):
    count = BLOCK_ROUNDS + 1
    _rounds(store, count)
    before = _answers(store, range(count))
    first = RecordArchiver(store.archive, LEARNERS)
    first.step(count, BLOCK_ROUNDS // 2)                         # packed half: nothing written
    assert first.through == 0
    again = RecordArchiver(ArtifactStore(store.blobs, EXP).archive, LEARNERS)
    again.step(count, BLOCK_ROUNDS + 1 + 3)                      # packed, sealed, 3 cleaned
    assert (again.through, again.cleaned) == (BLOCK_ROUNDS, 3)
    last = RecordArchiver(ArtifactStore(store.blobs, EXP).archive, LEARNERS)
    assert (last.through, last.cleaned) == (BLOCK_ROUNDS, 3)
    last.step(count, 1000)
    assert last.cleaned == BLOCK_ROUNDS and _live_round_objects(tmp_path / "store")[0].startswith(
        f"r{BLOCK_ROUNDS:08d}/")
    assert _answers(ArtifactStore(store.blobs, EXP), range(count)) == before


def test_a_block_carries_its_archivers_digest_of_each_round(store):
    """The archiver's `digest(round, records)` of each round it packs (given the records it
    packed, keys inside the round's directory) is stored in the block and read back; a round
    it cannot digest (None) leaves its block without one, whose records still answer."""
    _rounds(store, 2 * BLOCK_ROUNDS + 1, stranger=True)
    given = {}

    def digest(r, records):
        given[r] = sorted(records)
        return None if r == BLOCK_ROUNDS + 1 else {"round": r, "offers": len(
            [k for k in records if k.startswith("contributions/")])}

    RecordArchiver(store.archive, LEARNERS, digest=digest).step(2 * BLOCK_ROUNDS + 1, 10**6)
    # (the rest of a block past a round without a digest is not asked)
    assert store.archive.through() == 2 * BLOCK_ROUNDS and sorted(given) == list(
        range(BLOCK_ROUNDS + 2))
    assert "contributions/learner-1/manifest.json" in given[1]
    assert not any("stranger" in k for k in given[1])        # what is packed, not what is there
    reader = ArtifactStore(store.blobs, EXP)
    assert reader.archive.digest(0) == {r: {"round": r, "offers": 2}
                                        for r in range(BLOCK_ROUNDS)}
    assert reader.archive.digest(BLOCK_ROUNDS) is None
    assert reader.get_decision(BLOCK_ROUNDS + 1).round == BLOCK_ROUNDS + 1

    # A digest that does not cover its block round for round reads as none.
    family = Family.rounds(EXP)
    objects = {f"r{r:08d}/x.json": b"{}" for r in range(BLOCK_ROUNDS)}
    store.blobs.write(family.block(0), encode_block(
        EXP, family, 0, objects, {r: {} for r in range(1, BLOCK_ROUNDS)}))
    assert ArtifactStore(store.blobs, EXP).archive.digest(0) is None


class _Reads(LocalBlobStore):
    """The local store, remembering every key read."""

    def __init__(self, root):
        super().__init__(root)
        self.keys: list[str] = []

    def read(self, key: str) -> bytes:
        self.keys.append(key)
        return super().read(key)


def test_the_ledgers_digest_reads_a_round_from_the_bytes_being_packed(store, tmp_path):
    """`ledger_digest` takes each round's decision, not-merged record and manifests from the
    records the archiver packs, through the store's own readers, and the fates come out as
    from the records in place. (It used to read each again from the store: M + 3 reads a
    round, 3 * 64 + 2 here.)"""
    from pipelines.token_ledger import ledger_digest, offer_fates

    _rounds(store, BLOCK_ROUNDS)
    for r in range(BLOCK_ROUNDS):      # every round settled: nothing committed, recorded so
        store.put_round_not_merged(r, {"round": r, "rejected": {"learner-0": "nan"}})
    by_records = offer_fates(store, 2, LEARNERS, [], digests=False)
    reads = _Reads(tmp_path / "store")
    RecordArchiver(store.archive, LEARNERS,
                   digest=ledger_digest(ArtifactStore(reads, EXP), LEARNERS)
                   ).step(BLOCK_ROUNDS, 10**6)
    assert store.archive.through() == BLOCK_ROUNDS
    assert [k for k in reads.keys if k.startswith(layout.rounds_dir(EXP))] == []
    reader = ArtifactStore(store.blobs, EXP)
    assert reader.archive.digest(0) is not None
    assert offer_fates(reader, 2, LEARNERS, [], digests=True) == by_records


def test_nothing_is_archived_before_a_whole_block_is_pruned(store):
    _rounds(store, BLOCK_ROUNDS)
    archiver = RecordArchiver(store.archive, LEARNERS)
    archiver.step(BLOCK_ROUNDS - 1, 1000)          # round 63 not pruned yet
    assert archiver.through == 0 and store.blobs.info(Family.rounds(EXP).pointer) is None


def test_a_late_write_into_an_archived_round_is_never_read(store):
    _rounds(store, BLOCK_ROUNDS)
    RecordArchiver(store.archive, LEARNERS).step(BLOCK_ROUNDS, 1000)
    decision = store.get_decision(7)
    store.blobs.write(layout.decision(EXP, 7), b'{"round": 7, "members": ["x"]}')
    assert ArtifactStore(store.blobs, EXP).get_decision(7) == decision


def test_an_unusable_block_is_refused_by_name_and_replaced_before_it_counts(store):
    _rounds(store, BLOCK_ROUNDS)
    key = Family.rounds(EXP).block(0)
    # A block someone else put there before the archiver sealed: not used, replaced.
    store.blobs.write(key, gzip.compress(json.dumps({"format": 1, "objects": {}}).encode()))
    before = _answers(store, range(BLOCK_ROUNDS))
    RecordArchiver(store.archive, LEARNERS).step(BLOCK_ROUNDS, 1000)
    assert _answers(ArtifactStore(store.blobs, EXP), range(BLOCK_ROUNDS)) == before
    # Spoiled after the fact: every read of its rounds is refused, naming the block.
    for body in (b"not gzip", gzip.compress(b"[1]"), gzip.compress(json.dumps(
            {"format": 1, "experiment": EXP, "first": 0, "rounds": BLOCK_ROUNDS,
             "objects": {"r00000099/decision.json": "{}"}}).encode())):
        store.blobs.write(key, body)
        with pytest.raises(RejectedArtifact, match="archive block"):
            ArtifactStore(store.blobs, EXP).get_decision(3)
    store.blobs.write(key, gzip.compress(b"0" * (65 * 2**20)))      # a bomb: bounded
    with pytest.raises(RejectedArtifact, match="inflates past"):
        ArtifactStore(store.blobs, EXP).get_decision(3)


READER = """
import json, os, sys
from resources.store.artifact_store import ArtifactStore
from resources.store.backends import open_blob_store
from resources.store.blobs import LocalBlobStore
root, done, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
expected = json.loads(sys.argv[4])
store = ArtifactStore(open_blob_store(root), "arch")     # one store: its pointer goes stale
passes, wrong = 0, []
while True:
    finished = os.path.exists(done)
    for r in range(count):
        listed = store.list_contributions(r)
        decision = store.get_decision(r)
        manifest = store.contribution_manifest(r, "learner-1")
        got = [listed, None if decision is None else list(decision.members),
               None if manifest is None else manifest.tokens]
        if got != expected[r]:
            wrong.append([r, got])
    passes += 1
    if finished:
        break
print(json.dumps({"passes": passes, "wrong": wrong[:5], "wrong_count": len(wrong)}))
"""


def test_a_reader_in_another_process_sees_every_round_while_the_archiver_deletes(store, tmp_path):
    """The archiver packs, moves the pointer and deletes, round after round, while a reader
    process that read the pointer long before walks every round again and again: a record
    deleted under it must still be found (in the block), a listing taken while its round's
    records went must not come back short."""
    count = 3 * BLOCK_ROUNDS
    _rounds(store, count)
    expected = [[list(store.list_contributions(r)), list(store.get_decision(r).members),
                 store.contribution_manifest(r, "learner-1").tokens] for r in range(count)]
    done = tmp_path / "done"
    reader = subprocess.Popen([sys.executable, "-c", READER, str(tmp_path / "store"), str(done),
                               str(count), json.dumps(expected)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    time.sleep(2.0)                                   # the reader is walking by now
    archiver = RecordArchiver(ArtifactStore(open_blob_store(str(tmp_path / "store")), EXP).archive,
                             LEARNERS)
    while archiver.cleaned < count:
        archiver.step(count, 1)
    done.touch()
    out, err = reader.communicate(timeout=300)
    assert reader.returncode == 0, err
    result = json.loads(out)
    assert result["passes"] >= 2
    assert result["wrong_count"] == 0, result["wrong"]


@pytest.mark.parametrize("body", [b"x" * 5000, b"[1]", b'{"through": 63}', b'{"through": -64}',
                                  b'{"through": true}'])
def test_a_malformed_pointer_reads_as_nothing_archived(store, body):
    _rounds(store, 2)
    store.blobs.write(Family.rounds(EXP).pointer, body)
    fresh = ArtifactStore(store.blobs, EXP)
    assert fresh.archive.pointer() == {"through": 0, "cleaned": 0}
    assert fresh.get_decision(1).round == 1           # read in place
