"""Two real merge processes race on the same fragments, on local disk and on the loopback GCS
server (which enforces generation preconditions as GCS does): whatever the interleaving, every
decided round is committed exactly once, in round order, and no version is lost or pointed at
while uncommitted. Both processes merge every round (a second merge run of a partition, or the
syncer and a fallback merge run during a hand-over).

The second test has them merge in opposite orders, the later-round merger stalled between
writing its version and moving the pointer (choreographed, not left to timing): the other then
finds a later decided round's version pending while it merges an earlier round, and must adopt
it (never delete it and commit its own in its place, which left the stalled merger reporting a
commit the store does not hold)."""

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import dagster as dg
import pytest
from gcs_emulator import BUCKET
from orchestration_harness import Harness

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parent.parent
ROUNDS = 8   # 4 rounds for each of 2 fragments


def _decided_rounds(h: Harness) -> None:
    for r in range(ROUNDS):
        for learner in ("learner-0", "learner-1"):
            h.offer(learner, r, seed=r, fragment=r % 2)
        h.store.open_round(r, {"fragment": r % 2, "opened_at": h.now, "final": False})
        h.instance.add_dynamic_partitions("rounds", [h.key(r)])
        h.store.put_decision(r, {
            "round": r, "fragment": r % 2, "members": ["learner-0", "learner-1"], "late": [],
            "missing": [], "reason": f"test decision {r}", "quorum_at": h.now,
            "decided_at": h.now})


def _store_uri(backend: str, tmp_path, request) -> str:
    if backend == "gcs":
        request.getfixturevalue("gcs_server")
        return f"gs://{BUCKET}/race-{uuid.uuid4().hex[:8]}"
    return str(tmp_path / "store")


def _race(h: Harness, uri: str, barrier: Path, *runs: list[str]) -> list[dict]:
    """One merge process per entry of `runs` (its rounds and options), all started at once:
    each says it is ready in `barrier` once past its imports, then all go together."""
    barrier.mkdir()
    procs = [subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "merge_race.py"), uri, h.store.experiment,
         str(barrier), *run], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for run in runs]
    deadline = time.monotonic() + 240
    while len(list(barrier.glob("ready-*"))) < len(procs):
        assert time.monotonic() < deadline, "the merge processes never got ready"
        assert all(p.poll() is None for p in procs), [p.communicate()[1][-3000:]
                                                      for p in procs if p.poll() is not None]
        time.sleep(0.05)
    (barrier / "go").touch()
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    print(json.dumps(outs))   # which process merged what, and the CAS conflicts it lost
    return outs


def _harness(instance, uri: str) -> Harness:
    h = Harness(instance, uri, ["sync.num_fragments=2", "sync.sync_period=4",
                                "learners.num_learners=2", "sync.min_quorum=1"])
    h.start()
    _decided_rounds(h)
    return h


@pytest.mark.parametrize("backend", ["local", "gcs"])
def test_two_merge_processes_racing_commit_every_round_exactly_once(backend, tmp_path,
                                                                    request):
    uri = _store_uri(backend, tmp_path, request)
    with dg.instance_for_test() as instance:
        h = _harness(instance, uri)
        outs = _race(h, uri, tmp_path / "barrier", list(map(str, range(ROUNDS))),
                     list(map(str, range(ROUNDS))))
        for r in range(ROUNDS):
            done = [o[str(r)] for o in outs]
            assert not any(d.get("gave_up") for d in done), done
            # Exactly one of the two merged it; the other found that commit.
            assert sum(d["committed"] and not d["already"] for d in done) == 1, (r, done)
        for fragment in (0, 1):
            versions = h.store.versions(fragment)
            assert versions == list(range(ROUNDS // 2 + 1))
            assert h.store.current_version(fragment) == ROUNDS // 2
            rounds = [h.store.version_meta(fragment, v).round for v in versions[1:]]
            assert rounds == list(range(fragment, ROUNDS, 2)), rounds   # each once, in order
            for v in versions:
                h.store.load_global(fragment, v)   # every version whole and verified


@pytest.mark.parametrize("backend", ["local", "gcs"])
def test_a_merge_adopts_a_later_rounds_version_pending_under_it(backend, tmp_path, request):
    """Process A merges rounds 0..7, process B 7..0; B stalls after writing each version until
    A has tried a round of each fragment. So A, merging round 2 (say), finds B's round-6 version
    of that fragment written and not yet pointed at. Whatever else happens, every commit a
    process reports is in the store, the store holds each fragment's rounds once and in order,
    the pointers are at the last version, and a round neither process committed was skipped
    by both (a later round of its fragment was merged first)."""
    uri = _store_uri(backend, tmp_path, request)
    progress = tmp_path / "a-progress"
    with dg.instance_for_test() as instance:
        h = _harness(instance, uri)
        a, b = _race(h, uri, tmp_path / "barrier",
                     [*map(str, range(ROUNDS)), "--progress", str(progress)],
                     [*map(str, reversed(range(ROUNDS))), "--hold-for", str(progress)])
        assert b["holds"] and "timed out" not in b["holds"], b["holds"]
        stored = {}
        for fragment in (0, 1):
            versions = h.store.versions(fragment)
            assert versions == list(range(len(versions)))
            assert h.store.current_version(fragment) == versions[-1]
            rounds = [h.store.version_meta(fragment, v).round for v in versions[1:]]
            assert rounds == sorted(set(rounds)), rounds         # each once, in order
            assert rounds[-1] == ROUNDS - 2 + fragment           # the last round is merged
            stored.update({(fragment, v): r for v, r in enumerate(rounds, 1)})
            for v in versions:
                h.store.load_global(fragment, v)   # every version whole and verified
        for name, out in (("A", a), ("B", b)):
            for r in range(ROUNDS):
                d = out[str(r)]
                assert not d.get("gave_up"), (name, r, d)
                if d["committed"]:
                    # A commit reported is a commit held: not another round's version.
                    assert stored.get((d["fragment"], d["version"])) == r, (
                        f"{name} reports round {r} committed as version {d['version']} of "
                        f"fragment {d['fragment']}, which holds round "
                        f"{stored.get((d['fragment'], d['version']))}")
        committed_rounds = set(stored.values())
        for r in range(ROUNDS):
            assert (r in committed_rounds) == (a[str(r)]["committed"] or b[str(r)]["committed"])
