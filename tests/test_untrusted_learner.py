"""Everything a learner writes is untrusted: its payload's bytes, every field of its records and
every counter it reports. Each test plays one hostile learner using only what its own write
rules allow (its own offers, heartbeat and records), and checks that the syncer, the merge and
the sensor refuse exactly that learner's input with a reason, while the honest learners' rounds
merge and the global parameters stay bounded.

Scripted learners on the harness's clock, as in test_syncer_service.py; the soak on the real
Dagster path is `benchmarks/hostile_soak.py`."""

import dataclasses

import dagster as dg
import numpy as np
import pytest
from orchestration_harness import Harness

from diloco_core.compression import encode
from diloco_core.round_records import RoundDecision
from pipelines.syncer.service import SyncerService
from resources.chaos.hostile_records import damage_offer
from resources.store.artifact_store import RejectedArtifact

pytestmark = pytest.mark.timeout(300)

SERVICE = ["orchestration.syncer=service", "orchestration.syncer_timeout_seconds=4"]
HONEST = ("learner-0", "learner-1")
HOSTILE = "learner-2"
NAMES = (*HONEST, HOSTILE)


def _harness(instance, tmp_path, overrides=()) -> Harness:
    h = Harness(instance, str(tmp_path / "store"), overrides=[*SERVICE, *overrides])
    h.start()
    return h


def _service(h: Harness) -> SyncerService:
    service = SyncerService(h.store, attempt=0)
    service.lease.clock = lambda: h.now
    service.lease.acquire(4)
    return service


def _started(instance, tmp_path, overrides=()) -> tuple[Harness, SyncerService]:
    """An experiment, its syncer holding the lease, and every learner's first heartbeat."""
    h = _harness(instance, tmp_path, overrides)
    service = _service(h)
    for name in h.cfg.learners.learner_names:
        h.beat(name, 0)
    return h, service


def _open(h: Harness, service: SyncerService, r: int, steps: int = 2) -> None:
    for name in NAMES:
        h.beat(name, steps)
    h.now += 1
    service.step(now=h.now)
    assert service.state["round"] == r, service.state


def _decide(h: Harness, service: SyncerService) -> None:
    h.now += 1
    service.step(now=h.now)


def _rounds(h: Harness, service: SyncerService, rounds, offerers=NAMES) -> None:
    """Rounds in which `offerers` offer honestly and the syncer decides and merges."""
    for r in rounds:
        _open(h, service, r)
        for name in offerers:
            h.offer(name, r)
        _decide(h, service)


@pytest.mark.parametrize("encoding", ["fp32", "bf16", "int8"])
def test_a_payload_of_the_right_size_and_wrong_dtype_is_refused_by_the_store(tmp_path,
                                                                               encoding):
    with dg.instance_for_test() as instance:
        h = _harness(instance, tmp_path, [f"sync.encoding={encoding}"])
        h.store.open_round(0, {"round": 0, "fragment": 0, "opened_at": h.now})
        h.offer(HOSTILE, 0)
        damage_offer(h.store, 0, HOSTILE, "right size, wrong dtype")
        with pytest.raises(RejectedArtifact) as refused:
            h.store.load_contribution(0, HOSTILE)
        assert f"{encoding} payload must be" in refused.value.reason, refused.value.reason


def test_an_undecodable_contribution_costs_only_its_own_learner_the_round(tmp_path):
    """The merge itself refuses arrays that are not the wire form of the plan's tensors (the
    store's check bypassed, as a bug in it would), and the honest members merge."""
    with dg.instance_for_test() as instance:
        h, service = _started(instance, tmp_path)
        _open(h, service, 0)
        for name in NAMES:
            h.offer(name, 0)
        real_load = h.store.load_contribution

        def load_without_the_store_check(round_index, learner, **kw):
            c = real_load(round_index, learner, **kw)
            if learner != HOSTILE:
                return c
            # Same bytes, read as float32: half the elements (reshaping them raised a
            # TypeError out of the merge, and the honest members' round was lost).
            delta = {name: dataclasses.replace(enc, payload=np.frombuffer(
                np.asarray(enc.payload).tobytes(), dtype=np.float32))
                for name, enc in c.delta.items()}
            return dataclasses.replace(c, delta=delta)

        h.store.load_contribution = load_without_the_store_check
        _decide(h, service)
        meta = h.store.version_meta(0)
        assert meta.round == 0 and sorted(meta.members) == sorted(HONEST), meta
        assert "payload must be" in meta.rejected[HOSTILE], meta.rejected


def test_a_merge_that_raises_records_the_round_and_the_syncer_moves_on(tmp_path, monkeypatch):
    """Whatever still raises inside a merge would raise again in every relaunched syncer: the
    round is recorded as not merged with the error, and the next rounds merge."""
    import pipelines.syncer.store_merge as store_merge

    with dg.instance_for_test() as instance:
        h, service = _started(instance, tmp_path)
        real_merge = store_merge.merge_fragment

        def merge_that_fails_round_1(current, names, num_fragments, round_index, *args, **kw):
            if round_index == 1:
                raise TypeError("cannot reshape array of size 7 into shape (3,)")
            return real_merge(current, names, num_fragments, round_index, *args, **kw)

        monkeypatch.setattr(store_merge, "merge_fragment", merge_that_fails_round_1)
        _rounds(h, service, range(4), HONEST)
        outcome = h.store.get_round_not_merged(1)
        assert outcome is not None and "merge failed: TypeError" in outcome.reason, outcome
        assert set(outcome.rejected) == set(HONEST)
        for r in (0, 2, 3):
            assert h.store.get_round_not_merged(r) is None
        assert h.store.version_meta(1).round == 3
        assert service.progress.merged == 3 and service.progress.not_merged == 1


def test_encoded_arrays_that_are_not_their_wire_form_are_refused_before_decoding():
    from diloco_core.compression import WireError, decode, encoded_problem

    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    for encoding in ("fp32", "bf16", "int8", "int4", "int2"):
        e = encode(x, encoding, 4)
        assert encoded_problem(e) is None
        np.testing.assert_allclose(decode(e), x, atol=6.0)
    fp32 = encode(x, "fp32")
    wrong = {
        "float64 values": dataclasses.replace(fp32, payload=np.zeros(6, np.float64)),
        "int8 codes as floats": dataclasses.replace(
            encode(x, "int8", 4), payload=np.zeros(3, np.float32)),
        "scales missing": dataclasses.replace(encode(x, "int4", 4), scales=None),
        "scales of another count": dataclasses.replace(encode(x, "int8", 4),
                                                       scales=np.zeros(2, np.float32)),
    }
    for what, e in wrong.items():
        assert encoded_problem(e) is not None, what
        with pytest.raises(WireError):
            decode(e)


def _max_abs_global(store, num_fragments: int) -> float:
    return max(float(np.max(np.abs(v))) for p in range(num_fragments)
               for v in store.load_global(p).params.values())


def test_a_learner_claiming_a_trillion_steps_does_not_take_the_merge(tmp_path):
    """w = tokens^2 / steps and the norm screen per step both read the claimed steps: 10^12
    steps (tokens to match) took weight 1.0 and passed a delta of 10^6 a value through the
    screen. Credited steps are bounded by the protocol's pace and the delta is screened."""
    with dg.instance_for_test() as instance:
        h, service = _started(instance, tmp_path)
        before = _max_abs_global(h.store, 2)
        for r in range(4):
            _open(h, service, r)
            for name in HONEST:
                h.offer(name, r)
            h.offer(HOSTILE, r, steps=10 ** 12, scale=1e6)
            _decide(h, service)
            meta = h.store.version_meta(r % 2)
            assert meta.round == r and sorted(meta.members) == sorted(HONEST), meta
            assert "outer-gradient norm per step" in meta.rejected[HOSTILE], meta
        after = _max_abs_global(h.store, 2)
        assert after < 2 * before + 1.0, (before, after)


def test_no_member_outweighs_the_others_whatever_its_counters(tmp_path):
    """Within what the syncer credits (its own pace), a learner's weight is still capped:
    with three members none takes more than max_weight_share."""
    with dg.instance_for_test() as instance:
        h, service = _started(instance, tmp_path, ["sync.max_norm_ratio=inf",
                                                   "sync.max_weight_share=0.5"])
        _open(h, service, 0)
        for name in HONEST:
            h.offer(name, 0, steps=1)
        h.offer(HOSTILE, 0, steps=10 ** 12)
        _decide(h, service)
        meta = h.store.version_meta(0)
        weights = dict(zip(meta.members, meta.weights, strict=True))
        assert set(weights) == set(NAMES), meta
        assert weights[HOSTILE] == pytest.approx(0.5), weights
        assert "credited" in meta.clipped[HOSTILE], meta.clipped
        # Its credited steps are the protocol's bound, not its claim.
        steps = dict(zip(meta.members, meta.steps, strict=True))
        assert steps[HOSTILE] <= 4 * h.cfg.sync.sync_period, steps


def test_a_heartbeat_claiming_2_to_the_62_tokens_does_not_stop_the_run(tmp_path):
    with dg.instance_for_test() as instance:
        h, service = _started(instance, tmp_path)
        for r in range(3):
            _open(h, service, r)
            for name in HONEST:
                h.offer(name, r)
            h.store.put_heartbeat(HOSTILE, {"learner": HOSTILE, "status": "training",
                                            "time": h.now, "step": 2 ** 62 // 128,
                                            "tokens_total": 2 ** 62, "compute_seconds": 1.0})
            _decide(h, service)
        assert h.store.stop_requested() is None
        assert not service.state["stop"], service.state
        assert h.store.version_meta(0).round == 2


def test_with_two_learners_a_2_to_the_62_claim_is_held_by_the_syncers_own_account(tmp_path):
    """M = 2: no other live learner to compare a heartbeat with, so what held the claim above
    (the peers' totals) cannot. The syncer's account of what the learner offered does: the
    claim is clipped with a reason, the run goes on, and its rounds merge both learners."""
    with dg.instance_for_test() as instance:
        h, service = _started(instance, tmp_path, ["learners.num_learners=2",
                                                   "sync.min_quorum=2"])
        names = h.cfg.learners.learner_names
        liar = names[1]
        reasons = []
        for r in range(4):
            for name in names:
                h.beat(name, 2)
            h.store.put_heartbeat(liar, {"learner": liar, "status": "training",
                                         "time": h.now, "step": 2 ** 62 // 128,
                                         "tokens_total": 2 ** 62, "compute_seconds": 1.0})
            h.now += 1
            reasons.append(service.step(now=h.now))
            assert service.state["round"] == r, service.state
            for name in names:
                h.offer(name, r)
            _decide(h, service)
        assert h.store.stop_requested() is None
        assert not service.state["stop"], service.state
        assert any(f"{liar} (claims {2 ** 62} tokens, credited" in why for why in reasons)
        assert h.store.version_meta(1).members == tuple(names)


@pytest.mark.parametrize("compute_seconds", [1e300, 1.7e308])
def test_a_heartbeats_step_time_cannot_hold_rounds_open(tmp_path, compute_seconds):
    """The step-time estimate sets the grace window: 1e300 seconds a step held the round open
    forever with two learners; 1.7e308 with overlap 2 made the decision record raise."""
    with dg.instance_for_test() as instance:
        h = _harness(instance, tmp_path, ["learners.num_learners=2", "sync.min_quorum=1",
                                          "sync.grace_gamma=0.8", "sync.overlap_steps=2"])
        service = _service(h)
        names = ("learner-0", "learner-1")
        for name in names:
            h.beat(name, 0)
        for r in range(3):
            for name in names:
                h.beat(name, 2)
            h.now += 1
            service.step(now=h.now)
            assert service.state["round"] == r, service.state
            h.offer("learner-0", r)
            h.store.put_heartbeat("learner-1", {
                "learner": "learner-1", "status": "training", "time": h.now, "step": 10,
                "tokens_total": h.tokens["learner-1"], "compute_seconds": compute_seconds})
            for _ in range(12):     # the grace window: a few honest steps
                _decide(h, service)
            assert h.store.get_decision(r) is not None, service.state


def _raw_offer(h: Harness, src_round: int, src_learner: str, dst_round: int,
               dst_learner: str, **fields) -> None:
    """Copy a committed offer, payload bytes and all, to another round or learner's name (as
    the writer of `dst_learner`'s prefix can), with manifest fields changed."""
    import json

    from resources.store import layout

    src = layout.contribution_dir(h.store.experiment, src_round, src_learner)
    dst = layout.contribution_dir(h.store.experiment, dst_round, dst_learner)
    manifest = json.loads(h.store.blobs.read(f"{src}/{layout.MANIFEST}"))
    name = manifest["objects"]["delta"]["name"]
    h.store.blobs.write(f"{dst}/{name}", h.store.blobs.read(f"{src}/{name}"))
    manifest.update({"learner": dst_learner, "round": dst_round, **fields})
    h.store.blobs.write(f"{dst}/{layout.MANIFEST}", json.dumps(manifest).encode())


def _replaying_round_0(h: Harness, service: SyncerService, r: int) -> RoundDecision | None:
    """Round r (of fragment 0): the honest learners offer, the hostile one replays its own
    offer to round 0 byte for byte on the current base; the decision."""
    _open(h, service, r)
    for name in HONEST:
        h.offer(name, r)
    _raw_offer(h, 0, HOSTILE, r, HOSTILE, base_version=h.store.current_version(0))
    _decide(h, service)
    return h.store.get_decision(r)


def test_replayed_and_copied_offers_are_refused(tmp_path):
    with dg.instance_for_test() as instance:
        h, service = _started(instance, tmp_path)
        _rounds(h, service, range(2))
        # Round 2 (fragment 0): the hostile learner replays its own offer to round 0.
        decision = _replaying_round_0(h, service, 2)
        assert HOSTILE not in decision.members, decision
        assert "a replay" in decision.refused[HOSTILE], decision
        assert "a replay" in h.store.version_meta(0).rejected[HOSTILE]
        # Round 3 (fragment 1): it copies learner-0's offer once that has arrived.
        _open(h, service, 3)
        h.offer("learner-0", 3)
        _decide(h, service)         # learner-0's offer seen: quorum not yet reached
        _raw_offer(h, 3, "learner-0", 3, HOSTILE)
        h.offer("learner-1", 3)
        _decide(h, service)
        decision = h.store.get_decision(3)
        assert sorted(decision.members) == sorted(HONEST), decision
        assert "a copy" in decision.refused[HOSTILE], decision
        assert decision.digests.keys() == set(HONEST)


@pytest.mark.parametrize("original,copier", [("learner-0", HOSTILE), (HOSTILE, "learner-0")],
                         ids=["copy-listed-after", "copy-listed-first"])
def test_a_copy_first_seen_in_the_same_poll_as_its_original_is_refused(tmp_path, original,
                                                                       copier):
    """The copier writes its copy between two syncer polls, right after the original landed:
    the store's creation times, not the order of the listing, say which is the copy."""
    import time

    with dg.instance_for_test() as instance:
        h, service = _started(instance, tmp_path)
        _open(h, service, 0)
        h.offer(original, 0)
        time.sleep(0.05)            # the copier reads the original before it writes
        _raw_offer(h, 0, original, 0, copier)
        third = next(n for n in NAMES if n not in (original, copier))
        h.offer(third, 0)
        _decide(h, service)
        decision = h.store.get_decision(0)
        assert sorted(decision.members) == sorted([original, third]), decision
        assert "a copy (the store created it later)" in decision.refused[copier], decision
        assert decision.digests.keys() == {original, third}
        assert copier in h.store.version_meta(0).rejected


def test_a_file_made_early_cannot_pass_for_the_original_of_a_same_poll_copy(tmp_path):
    """The copier makes a junk file before the honest offer exists, then names it in a
    manifest that claims the honest payload's digest: the store's creation time counts only
    for bytes that hash to that digest, so the honest learner is never refused as the copy
    (the copier's offer fails the merge's own digest check)."""
    import json
    import time

    from resources.store import layout

    with dg.instance_for_test() as instance:
        h, service = _started(instance, tmp_path)
        _open(h, service, 0)
        mine = layout.contribution_dir(h.store.experiment, 0, "learner-0")
        h.store.blobs.write(f"{mine}/early.npz", b"junk made before the original")
        time.sleep(0.05)
        h.offer(HOSTILE, 0)
        src = layout.contribution_dir(h.store.experiment, 0, HOSTILE)
        manifest = json.loads(h.store.blobs.read(f"{src}/{layout.MANIFEST}"))
        manifest["objects"]["delta"] = {**manifest["objects"]["delta"], "name": "early.npz"}
        manifest.update({"learner": "learner-0"})
        h.store.blobs.write(f"{mine}/{layout.MANIFEST}", json.dumps(manifest).encode())
        h.offer("learner-1", 0)
        _decide(h, service)
        decision = h.store.get_decision(0)
        assert HOSTILE in decision.members and HOSTILE not in decision.refused, decision
        assert "learner-0" not in h.store.version_meta(0).members


def test_an_offer_changed_after_the_decision_is_refused(tmp_path, monkeypatch):
    """The decision commits to each member's manifest digest; a learner that swaps its offer
    between the decision and the merge is refused,
    and the others merge."""
    import json

    import pipelines.syncer.service as syncer_service
    from resources.store import layout

    with dg.instance_for_test() as instance:
        h, service = _started(instance, tmp_path)
        _open(h, service, 0)
        for name in NAMES:
            h.offer(name, 0)
        real_merge = syncer_service.merge_from_store

        def swap_then_merge(store, round_index, *args, **kw):
            key = (f"{layout.contribution_dir(store.experiment, round_index, HOSTILE)}/"
                   f"{layout.MANIFEST}")
            manifest = json.loads(store.blobs.read(key))
            # A bigger claim on the same payload, consistent with itself (twice the steps and
            # the tokens to match): nothing but the decision's digest tells it apart.
            store.blobs.write(key, json.dumps({**manifest, "steps": 2 * manifest["steps"],
                                               "tokens": 2 * manifest["tokens"]}).encode())
            return real_merge(store, round_index, *args, **kw)

        monkeypatch.setattr(syncer_service, "merge_from_store", swap_then_merge)
        _decide(h, service)
        assert HOSTILE in h.store.get_decision(0).members
        meta = h.store.version_meta(0)
        assert sorted(meta.members) == sorted(HONEST), meta
        assert "changed after the decision" in meta.rejected[HOSTILE], meta.rejected


@pytest.mark.parametrize("mode", ["sensor", "service"])
@pytest.mark.parametrize("field", [("extra", {"train_loss": 10 ** 400}), ("fragment", -1),
                                   ("fragment", 10 ** 300), ("extra", [1, 2]),
                                   ("extra", {"train_loss": float("nan")})])
def test_one_offer_field_does_not_stall_the_quorum_sensor(tmp_path, mode, field):
    """The sensor describes every offer for Dagster, in both its modes (deciding while no
    syncer is live, mirroring one that is): a field it cannot use is dropped or named as the
    offer's problem, and the tick goes on."""
    import json

    from resources.store import layout

    with dg.instance_for_test() as instance:
        if mode == "service":
            h = _harness(instance, tmp_path)
            service = _service(h)
        else:
            h = Harness(instance, str(tmp_path / "store"))   # the sensor decides
            h.start()
            service = None
        for name in NAMES:
            h.beat(name, 0)
        for name in NAMES:
            h.beat(name, 2)
        if service is not None:
            h.now += 1
            service.step(now=h.now)
        else:
            h.tick()
        for name in NAMES:
            h.offer(name, 0)
        key = f"{layout.contribution_dir(h.store.experiment, 0, HOSTILE)}/{layout.MANIFEST}"
        manifest = json.loads(h.store.blobs.read(key))
        manifest[field[0]] = field[1]
        h.store.blobs.write(key, json.dumps(manifest).encode())
        if service is not None:
            _decide(h, service)
        for _ in range(3):
            result = h.tick()
            assert isinstance(result, dg.SensorResult), result
        assert h.store.get_decision(0) is not None
        events = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("learner_update")), limit=100).records
        described = [e for e in events if HOSTILE in str(e.asset_materialization.partition)]
        assert described, "the hostile offer was never described"


def test_an_offer_on_a_base_already_merged_from_it_is_a_replay(tmp_path):
    """A fresh payload on the base version its own merged offer used (e.g. version 0, pulling
    the fragment back towards the initial weights under the "global" anchor): refused."""
    with dg.instance_for_test() as instance:
        h, service = _started(instance, tmp_path)
        _rounds(h, service, range(2))
        assert HOSTILE in h.store.version_meta(0).members
        _open(h, service, 2)
        _decide(h, service)          # the merge of round 0 is seen published
        for name in HONEST:
            h.offer(name, 2)
        h.offer(HOSTILE, 2, base_version=0, seed=7)
        _decide(h, service)
        decision = h.store.get_decision(2)
        assert sorted(decision.members) == sorted(HONEST), decision
        assert "base version 0" in decision.refused[HOSTILE], decision


def test_a_replayed_base_is_refused_across_a_syncer_restart(tmp_path):
    """The bases of the merges a fragment's current version holds are in the decisions, so a
    syncer that rebuilt its state from the store refuses the replay too (before, the first
    offer after a restart could replay a base)."""
    with dg.instance_for_test() as instance:
        h, service = _started(instance, tmp_path)
        _rounds(h, service, range(2))
        assert HOSTILE in h.store.version_meta(0).members
        _open(h, service, 2)
        h.now += 10                              # the syncer is gone; its lease runs out
        successor = SyncerService(h.store, attempt=1)
        successor.lease.clock = lambda: h.now
        successor.lease.acquire(4)
        for name in HONEST:
            h.offer(name, 2)
        h.offer(HOSTILE, 2, base_version=0, seed=7)
        _decide(h, successor)
        decision = h.store.get_decision(2)
        assert decision.decided_by == "syncer-a1", decision
        assert sorted(decision.members) == sorted(HONEST), decision
        assert "base version 0" in decision.refused[HOSTILE], decision


def test_offers_planted_before_their_round_opened_are_refused(tmp_path):
    with dg.instance_for_test() as instance:
        h, service = _started(instance, tmp_path)
        _open(h, service, 0)
        for name in NAMES:
            h.offer(name, 0)
        h.offer(HOSTILE, 2)          # round 2 is not open yet
        _decide(h, service)
        _open(h, service, 1)
        for name in HONEST:
            h.offer(name, 1)
        _decide(h, service)
        _open(h, service, 2)
        for name in HONEST:
            h.offer(name, 2)
        _decide(h, service)
        decision = h.store.get_decision(2)
        assert sorted(decision.members) == sorted(HONEST), decision
        assert "planted" in decision.refused[HOSTILE], decision


def test_a_replay_from_many_rounds_back_is_still_refused(tmp_path):
    """The soak found one: its own offer from 10 rounds back (5 versions of the fragment),
    on the current base, merged once the syncer forgot payloads after 2P rounds."""
    with dg.instance_for_test() as instance:
        h, service = _started(instance, tmp_path)
        _rounds(h, service, range(10))
        decision = _replaying_round_0(h, service, 10)
        assert "learner-2's offer to round 0: a replay" in decision.refused[HOSTILE], decision
