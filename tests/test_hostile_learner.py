"""A hostile learner: besides offering honestly, it writes every kind of malformed or
adversarial record its own write rules allow (its heartbeat, an attempt record, contributions
to coming rounds). The syncer service, the quorum sensor and the token ledger refuse each with a
reason; the honest learners' rounds all merge.

Scripted honest learners and the service stepped on the harness's clock, as in
test_syncer_service.py; the soak on the real Dagster path is `benchmarks/chaos_soak.py
--hostile`."""

import dagster as dg
import pytest
from orchestration_harness import Harness

from diloco_core.fault_tape import tape_from_mapping
from pipelines.syncer_service import SyncerService
from pipelines.token_ledger import run_ledger
from resources.faults import LearnerFaults
from resources.hostile_records import (
    CONTRIBUTION_ATTACKS,
    KINDS,
    RECORD_ATTACKS,
    HostileWriter,
    read_log,
)

pytestmark = pytest.mark.timeout(300)

SERVICE = ["orchestration.syncer=service", "orchestration.syncer_timeout_seconds=4"]
HONEST = ("learner-0", "learner-1")
HOSTILE = "learner-2"


def _round(h: Harness, service: SyncerService, r: int) -> None:
    """A round: the honest learners offer, and so does the hostile one where it has not
    planted something already (its honest offers are what it copies its attacks from)."""
    for name in (*HONEST, HOSTILE):
        h.beat(name, 2)
    h.now += 1
    service.step(now=h.now)
    assert service.state["round"] == r, service.state
    for name in HONEST:
        h.offer(name, r)
    if not any(key.endswith(f"/{HOSTILE}/manifest.json") for key in h.store.blobs.list(
            f"experiments/{h.store.experiment}/rounds/r{r:08d}/")):
        h.offer(HOSTILE, r)
    h.now += 1
    service.step(now=h.now)


def test_every_hostile_record_is_refused_and_the_honest_rounds_merge(tmp_path):
    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"), overrides=SERVICE)
        h.start()
        service = SyncerService(h.store, attempt=0, log=lambda _: None)
        service.lease.clock = lambda: h.now
        service.lease.acquire(4)
        for name in (*HONEST, HOSTILE):
            h.beat(name, 0)
        _round(h, service, 0)
        # The hostile learner's fault, as the tape drives it: one record per step.
        tape = tape_from_mapping({"faults": [{"kind": "hostile_records", "learner": HOSTILE,
                                              "at_step": 0, "params": {"every_steps": 1}}]})
        faults = LearnerFaults(h.store, tape, HOSTILE, 0, log=lambda _: None)
        # Rounds go on while it writes: one hostile record per step, a round every 2 steps.
        r, step = 1, 0
        while (len((read_log(h.store, HOSTILE) or {}).get("written", {})) < len(KINDS)
               and step < 20 * len(KINDS)):
            faults.before_step(step, lambda _: None)
            step += 1
            kind = faults.hostile.last_kind
            if kind in RECORD_ATTACKS and RECORD_ATTACKS[kind][0] == "heartbeat":
                beat, reason = h.store.read_heartbeat(HOSTILE)
                assert beat is None and reason, kind
                h.tick()          # the sensors read it too, and carry on
            if step % 2 == 0:
                _round(h, service, r)
                h.tick()          # the sensor mirrors every offer, hostile ones included
                r += 1
        log = read_log(h.store, HOSTILE)
        assert set(log["written"]) == set(KINDS), log
        # A relaunched attempt carries on from the log: counts and planted rounds kept.
        again = HostileWriter(h.store, HOSTILE, 2)
        assert again.written == log["written"] and again.targets == log["planted"]
        # A planted offer is never the template of the next: each attack is its own.
        assert all(t["kind"] in CONTRIBUTION_ATTACKS for t in log["planted"])
        planted = {t["round"]: t["kind"] for t in log["planted"]}
        assert set(planted.values()) == set(CONTRIBUTION_ATTACKS)
        last = max(planted)
        while r <= last:
            _round(h, service, r)
            h.tick()
            r += 1
        for r in range(1, last + 1):
            fragment = r % 2
            found = h.store.find_round_commit(fragment, r, h.store.current_version(fragment),
                                              h.store.version_meta(fragment) or {})
            assert found is not None, f"round {r} was not merged"
            meta = found[1]
            assert meta["members"], (r, meta)
            if r in planted:
                assert HOSTILE not in meta["members"], (r, planted[r], meta)
                decision = h.store.get_decision(r)
                why = (meta.get("rejected", {}).get(HOSTILE)
                       or (HOSTILE in decision.get("late", []) and "late")
                       or (HOSTILE not in decision["members"] and "not admitted"))
                assert why, (r, planted[r], meta, decision)

        ledger, _ = run_ledger(h.store, h.cfg)
        assert any("a99999.json" in r for r in ledger.refused_records), ledger.refused_records
