"""Two real merge processes race on the same fragments, on local disk and on the loopback GCS
server (which enforces generation preconditions as GCS does): whatever the interleaving, every
decided round is committed exactly once, in round order, and no version is lost or pointed at
while uncommitted. Both processes merge every round (a second merge run of a partition, or the
syncer and a fallback merge run during a hand-over)."""

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


@pytest.mark.parametrize("backend", ["local", "gcs"])
def test_two_merge_processes_racing_commit_every_round_exactly_once(backend, tmp_path,
                                                                    request):
    uri = (str(tmp_path / "store") if backend == "local"
           else f"gs://{BUCKET}/race-{uuid.uuid4().hex[:8]}")
    if backend == "gcs":
        request.getfixturevalue("gcs_server")
    with dg.instance_for_test() as instance:
        h = Harness(instance, uri, ["sync.num_fragments=2", "sync.sync_period=4",
                                    "learners.num_learners=2", "sync.min_quorum=1"])
        h.start()
        _decided_rounds(h)
        start_at = str(time.time() + 12)   # both past their imports, then at once
        procs = [subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "merge_race.py"), uri, h.store.experiment,
             start_at, *map(str, range(ROUNDS))], cwd=REPO, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True) for _ in range(2)]
        outs = []
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(outs))   # which process merged what, and the CAS conflicts it lost
        for r in range(ROUNDS):
            done = [o[str(r)] for o in outs]
            assert not any(d.get("gave_up") for d in done), done
            # Exactly one of the two merged it; the other found that commit.
            assert sum(d["committed"] and not d["already"] for d in done) == 1, (r, done)
        for fragment in (0, 1):
            versions = h.store.versions(fragment)
            assert versions == list(range(ROUNDS // 2 + 1))
            assert h.store.current_version(fragment) == ROUNDS // 2
            rounds = [h.store.version_meta(fragment, v)["round"] for v in versions[1:]]
            assert rounds == list(range(fragment, ROUNDS, 2)), rounds   # each once, in order
            for v in versions:
                h.store.load_global(fragment, v)   # every version whole and verified
