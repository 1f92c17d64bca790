"""What the quorum sensor mirrors into Dagster from the syncer service's records."""

import json

import dagster as dg
from mirror_store_setup import commit_rounds, decide_rounds

from diloco_core.config import ExperimentConfig
from pipelines.round_metadata import mirrored_eval
from pipelines.round_mirror import MAX_ROUNDS_PER_TICK, mirror_tick
from resources.store.artifact_store import ArtifactStore
from resources.store.backends import open_blob_store
from resources.store.summary_records import RoundEval


def _check(events) -> dg.AssetCheckEvaluation:
    (check,) = [e for e in events if isinstance(e, dg.AssetCheckEvaluation)]
    return check


def test_the_mirrored_eval_regression_check_compares_with_the_syncers_previous_eval(tmp_path):
    # The syncer stores an eval every few rounds; the sensor mirrors each, checking it against
    # the one before, across ticks (its cursor is JSON). The cursor used to keep only the
    # previous loss, not its batches, so the comparison was always skipped as "other batches"
    # and a 10% rise passed.
    store = ArtifactStore(open_blob_store(str(tmp_path / "store")), "exp")
    cfg = ExperimentConfig()
    decide_rounds(store, 1)
    store.put_eval(1, RoundEval(loss=2.0, bits_per_byte=2.9, batches=4, by="syncer"))
    first = mirror_tick(store, cfg, None)
    assert [r for r, _, _ in first.evals] == [1]
    cursor = json.loads(json.dumps(first.state))            # as the sensor keeps it

    decide_rounds(store, 3)
    store.put_eval(3, RoundEval(loss=2.2, bits_per_byte=3.2, batches=4, by="syncer"))
    second = mirror_tick(store, cfg, cursor)
    ((round_index, evaluation, previous),) = second.evals
    assert round_index == 3 and previous is not None and previous.loss == 2.0
    check = _check(mirrored_eval("p", 3, evaluation, previous))
    assert not check.passed and check.metadata["previous_loss"].value == 2.0

    # An eval on other batches is another measurement: not compared.
    decide_rounds(store, 5)
    store.put_eval(5, RoundEval(loss=2.6, bits_per_byte=3.8, batches=16, by="syncer"))
    ((_, evaluation, previous),) = mirror_tick(store, cfg, second.state).evals
    assert _check(mirrored_eval("p", 5, evaluation, previous)).passed


def test_a_mirror_far_behind_reads_each_version_once_and_finds_every_fate(tmp_path):
    # A daemon down for a while comes back to thousands of rounds to mirror. Each round's
    # fate was found by walking back from the fragment's current version: as many reads as
    # versions since the round, for each of 64 rounds a tick, so the catch-up was quadratic
    # (a haul 1,000 rounds ahead: 30,000 reads and 17 s a tick on a local disk; on GCS the
    # mirror never caught up). Searching forward from where the last round's search ended
    # reads each version about once over the whole catch-up.
    rounds = 640
    store = ArtifactStore(open_blob_store(str(tmp_path / "store")), "exp")
    expected = commit_rounds(store, rounds, not_merged={5, 100, 101, 301},
                          skipped={7, 8, 250, 555})
    reads = []
    version_meta = store.version_meta
    store.version_meta = lambda f, v=None: reads.append((f, v)) or version_meta(f, v)

    state, found, ticks = None, {}, 0
    while len(found) < rounds:
        tick = mirror_tick(store, ExperimentConfig(), state)
        state = json.loads(json.dumps(tick.state))          # as the sensor keeps it
        for r, record, decision, version in tick.merges:     # what the sensor reports
            assert record.round == r and decision.round == r
            found[r] = ("merged", version) if record.merged else ("not_merged", None)
        # Skipped rounds are passed over without an event.
        found.update({r: expected[r] for r in range(state["fates"])
                      if expected[r][0] == "skipped"})
        ticks += 1
        assert ticks <= rounds // MAX_ROUNDS_PER_TICK + 1
    assert found == expected
    # About one read a version (plus the current one's, once a round); it was ~100,000.
    assert len(reads) < 3 * rounds, len(reads)


def test_a_cursor_from_before_the_forward_search_walks_back_once_then_goes_forward(tmp_path):
    store = ArtifactStore(open_blob_store(str(tmp_path / "store")), "exp")
    expected = commit_rounds(store, 400, not_merged={301}, skipped={303})
    first = mirror_tick(store, ExperimentConfig(), None)
    state = {k: v for k, v in first.state.items() if k != "searched"}   # an older cursor
    state["fates"] = 300
    reads = []
    version_meta = store.version_meta
    store.version_meta = lambda f, v=None: reads.append((f, v)) or version_meta(f, v)
    tick = mirror_tick(store, ExperimentConfig(), state)
    assert {r: ("merged", v) if m.merged else ("not_merged", None)
            for r, m, _, v in tick.merges} == {
        r: f for r, f in expected.items() if 300 <= r < 364 and f[0] != "skipped"}
    assert tick.state["fates"] == 364 and set(tick.state["searched"]) == {"0", "1"}
    assert len(reads) < 2 * 50 + 2 * MAX_ROUNDS_PER_TICK, len(reads)   # was ~3,000
