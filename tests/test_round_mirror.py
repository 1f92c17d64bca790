"""What the quorum sensor mirrors into Dagster from the syncer service's records."""

import json

import dagster as dg

from diloco_core.config import ExperimentConfig
from diloco_core.round_records import RoundOpen
from pipelines.round_metadata import mirrored_eval
from pipelines.round_mirror import mirror_tick
from resources.store.artifact_store import ArtifactStore
from resources.store.backends import open_blob_store
from resources.store.summary_records import RoundEval


def _decided(store: ArtifactStore, upto: int) -> None:
    """Rounds 0..upto decided, round upto + 1 open."""
    for r in range(upto + 2):
        if store.get_round_open(r) is None:
            store.open_round(r, RoundOpen(round=r, fragment=r % 2, opened_at=float(r)))
    for r in range(upto + 1):
        if store.get_decision(r) is None:
            store.put_decision(r, {"round": r, "fragment": r % 2, "members": ["learner-0"],
                                   "reason": "quorum", "decided_at": float(r)})


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
    _decided(store, 1)
    store.put_eval(1, RoundEval(loss=2.0, bits_per_byte=2.9, batches=4, by="syncer"))
    first = mirror_tick(store, cfg, None)
    assert [r for r, _, _ in first.evals] == [1]
    cursor = json.loads(json.dumps(first.state))            # as the sensor keeps it

    _decided(store, 3)
    store.put_eval(3, RoundEval(loss=2.2, bits_per_byte=3.2, batches=4, by="syncer"))
    second = mirror_tick(store, cfg, cursor)
    ((round_index, evaluation, previous),) = second.evals
    assert round_index == 3 and previous is not None and previous.loss == 2.0
    check = _check(mirrored_eval("p", 3, evaluation, previous))
    assert not check.passed and check.metadata["previous_loss"].value == 2.0

    # An eval on other batches is another measurement: not compared.
    _decided(store, 5)
    store.put_eval(5, RoundEval(loss=2.6, bits_per_byte=3.8, batches=16, by="syncer"))
    ((_, evaluation, previous),) = mirror_tick(store, cfg, second.state).evals
    assert _check(mirrored_eval("p", 5, evaluation, previous)).passed
