"""A hostile learner: besides offering honestly, it writes every kind of malformed or
adversarial record its own write rules allow (its heartbeat, an attempt record, contributions
to coming rounds). The syncer service, the quorum sensor and the token ledger refuse each with a
reason; the honest learners' rounds all merge.

Scripted honest learners and the service stepped on the harness's clock, as in
test_syncer_service.py; the soak on the real Dagster path is `benchmarks/chaos_soak.py
--hostile`."""

from collections.abc import Callable

import dagster as dg
import pytest
from orchestration_harness import Harness

from diloco_core.fault_tape import tape_from_mapping
from diloco_core.stored_merge import StoredMerge
from pipelines.syncer.service import SyncerService
from pipelines.token_ledger import run_ledger
from resources.chaos.faults import LearnerFaults
from resources.chaos.hostile_records import (
    HEARTBEAT_KINDS,
    KINDS,
    OFFER_KINDS,
    RECORD_ATTACKS,
    HostileWriter,
    read_log,
)

pytestmark = pytest.mark.timeout(300)

SERVICE = ["orchestration.syncer=service", "orchestration.syncer_timeout_seconds=4",
           "token_budget=1000000"]
HONEST = ("learner-0", "learner-1")
HOSTILE = "learner-2"


# Where each attack must be stopped: the reason recorded for the hostile learner in the
# decision (refused on arrival) or the merge record (refused by the store or the merge).
STORE = "refused by the store"
EXPECTED = {
    "tensors is a string": ("no tensors",), "objects is a list": ("objects: must be",),
    "object name climbs": ("plain file name",), "tokens of 400 digits": ("tokens: must be",),
    # Padded to the declared size: each reaches the check meant for it.
    "npy header of 10^13 values": ("declares shape",),
    "manifest declares 10^13 values": ("array bytes in a",),
    "zip bomb": ("inflates to",), "pickle instead of arrays": ("not a plain array bundle",),
    "right size, wrong dtype": ("payload must be",),
    # Its honest payload again, with a bigger claim: the payload gives it away.
    "more tokens than its steps": ("a replay",),
    "a trillion steps and a huge delta": ("outer-gradient norm per step",),
    "fresh payload on version 0": ("base version 0",),
    "replay of its own old offer": ("a replay",),
    "train loss of 400 digits": ("a replay",), "extra is a list": ("extra: must be",),
    "fragment -1": ("fragment: must be",), "fragment 10^300": ("fragment: must be",),
    "copy of a peer's offer": ("a copy",),
}


def _round(h: Harness, service: SyncerService, r: int,
           attack: Callable[[], None] = lambda: None) -> None:
    """A round: it opens; one honest learner offers and the syncer sees it; the hostile
    learner attacks the round (`attack`); the other honest learner offers, and so does the
    hostile one where it has not planted something already."""
    for name in (*HONEST, HOSTILE):
        h.beat(name, 2)
    h.now += 1
    service.step(now=h.now)
    assert service.state["round"] == r, service.state
    h.offer(HONEST[0], r)
    h.now += 1
    service.step(now=h.now)   # its offer has arrived (what a copy is told apart by)
    attack()
    h.offer(HONEST[1], r)
    if HOSTILE not in h.store.list_contributions(r):
        h.offer(HOSTILE, r)
    h.now += 1
    service.step(now=h.now)
    assert not service.state["stop"], f"round {r}: the run was stopped"


def _why_not_merged(h: Harness, r: int) -> str:
    decision = h.store.get_decision(r)
    fragment = r % 2
    found = h.store.find_round_commit(fragment, r, h.store.current_version(fragment),
                                      h.store.version_meta(fragment) or StoredMerge())
    meta = found[1] if found else (h.store.get_round_not_merged(r) or StoredMerge())
    assert HOSTILE not in meta.members, (r, meta)
    return str(decision.refused.get(HOSTILE) or meta.rejected.get(HOSTILE))


def test_every_hostile_record_is_refused_and_the_honest_rounds_merge(tmp_path):
    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"), overrides=SERVICE)
        h.start()
        service = SyncerService(h.store, attempt=0)
        service.lease.clock = lambda: h.now
        service.lease.acquire(4)
        for name in (*HONEST, HOSTILE):
            h.beat(name, 0)
        _round(h, service, 0)
        _round(h, service, 1)
        # The hostile learner's fault, as the tape drives it: one record per step.
        tape = tape_from_mapping({"faults": [{"kind": "hostile_records", "learner": HOSTILE,
                                              "at_step": 0, "params": {"every_steps": 1}}]})
        faults = LearnerFaults(h.store, tape, HOSTILE, 0)
        state = {"step": 0}

        def attack():
            """Steps of the hostile learner while the round is open: each writes one record
            (heartbeat attacks are read by the sensor's tick in between, and by the syncer's
            step that decides the round: refused, or not believed)."""
            for _ in range(2):
                faults.before_step(state["step"], lambda _: None)
                state["step"] += 1
                kind = faults.hostile.last_kind
                if kind in RECORD_ATTACKS and RECORD_ATTACKS[kind][0] == "heartbeat":
                    beat, reason = h.store.read_heartbeat(HOSTILE)
                    assert beat is None and reason, kind
                if kind in HEARTBEAT_KINDS:
                    h.tick()          # the sensor reads it too, and carries on

        r = 2
        while (len((read_log(h.store, HOSTILE) or {}).get("written", {})) < len(KINDS)
               and r < 20 * len(KINDS)):
            # Every other round: its honest offers in between are what it copies from.
            _round(h, service, r, attack if r % 4 < 2 else (lambda: None))
            result = h.tick()         # the sensor mirrors every offer, hostile ones included
            assert isinstance(result, dg.SensorResult), result
            r += 1
        log = read_log(h.store, HOSTILE)
        assert set(log["written"]) == set(KINDS), log
        assert set(EXPECTED) == set(OFFER_KINDS)
        # A relaunched attempt carries on from the log: counts and planted rounds kept.
        again = HostileWriter(h.store, HOSTILE, 2)
        assert again.written == log["written"] and again.targets == log["planted"]
        planted = {t["round"]: t["kind"] for t in log["planted"]}
        assert set(planted.values()) == set(OFFER_KINDS)
        for k in range(r):
            fragment = k % 2
            found = h.store.find_round_commit(fragment, k, h.store.current_version(fragment),
                                              h.store.version_meta(fragment) or StoredMerge())
            assert found is not None and found[1].members, f"round {k} was not merged"
            if k in planted:
                why = _why_not_merged(h, k)
                assert any(e in why for e in EXPECTED[planted[k]]), (k, planted[k], why)
        # Nothing the hostile learner claimed moved the global model beyond the honest range.
        for p in range(2):
            for values in h.store.load_global(p).params.values():
                assert float(abs(values).max()) < 10.0
        assert h.store.stop_requested() is None

        ledger, _ = run_ledger(h.store, h.cfg)
        assert any("a99999.json" in r for r in ledger.refused_records), ledger.refused_records
