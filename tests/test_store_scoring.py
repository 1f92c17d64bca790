"""Scoring an orchestrated run's final global model on the held-out test slice (the soaks'
loss figure) and comparing two runs batch by batch."""

import math
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quality.scoring import SliceSizes, score_slices  # noqa: E402
from benchmarks.quality.store_scoring import paired_difference, score_store  # noqa: E402
from diloco_core.config_loading import config_to_mapping  # noqa: E402
from diloco_core.fragments import plan_fragments, split_params  # noqa: E402
from diloco_core.model import init_model  # noqa: E402
from diloco_core.outer import outer_optimizer_for  # noqa: E402
from pipelines.commands.cli import load_config  # noqa: E402
from resources.store.resource import ArtifactStoreResource  # noqa: E402
from resources.task_data import load_task_data  # noqa: E402


def test_a_paired_difference_cancels_what_the_batches_share():
    ref = [1.0, 2.0, 3.0, 4.0]
    # 10% worse on every batch: the ratio is certain, however different the batches are.
    worse = paired_difference([1.1 * x for x in ref], ref)
    assert worse["mean"] == pytest.approx(0.25)
    assert worse["ratio"] == pytest.approx(1.1)
    assert worse["ratio_standard_error"] == pytest.approx(0.0, abs=1e-12)
    # Level on average, +-0.1 per batch: differences +-0.1, sample stdev 0.1155 over sqrt(4);
    # far smaller than either run's own error over batches (stdev 1.29 / 2).
    level = paired_difference([1.1, 1.9, 3.1, 3.9], ref)
    assert level["mean"] == pytest.approx(0.0, abs=1e-12)
    assert level["standard_error"] == pytest.approx(math.sqrt(0.04 / 3) / 2)
    assert level["ratio"] == pytest.approx(1.0)
    assert level["ratio_standard_error"] == pytest.approx(math.sqrt(0.04 / 3) / 2 / 2.5)
    assert level["batches"] == 4
    with pytest.raises(ValueError):
        paired_difference([1.0, 2.0], ref)        # not the same batches
    with pytest.raises(ValueError):
        paired_difference([1.0], [1.0])


def test_a_store_is_scored_on_its_current_global_model(tmp_path):
    """Every fragment at its current version (fragment 1 moved on by a merge), on the held-out
    stream of the run's own config: the figures the quality benchmarks give those parameters."""
    cfg = load_config(None, ["name=score-test", "model.preset=tiny", "sync.num_fragments=2",
                             "data.batch_size=4", "data.seq_len=32"])
    artifacts = ArtifactStoreResource(base_uri=str(tmp_path / "store")).store(cfg.name)
    artifacts.put_config(config_to_mapping(cfg))
    _, params = init_model(cfg.model, cfg.seed)
    plan = plan_fragments({k: v.shape for k, v in params.items()}, cfg.sync.num_fragments)
    tx = outer_optimizer_for(cfg)
    fragments = split_params(params, plan)
    for p, fragment in enumerate(fragments):
        artifacts.commit_global(p, 0, jax.device_get(fragment), tx.init(fragment),
                                {"round": None, "initial": True})
    moved = {k: np.asarray(v) * 0.5 + 0.01 for k, v in jax.device_get(fragments[1]).items()}
    artifacts.commit_global(1, 1, moved, tx.init(fragments[1]), {"round": 1})

    sizes = SliceSizes(validation=3, test=5)
    got = score_store(artifacts, sizes)
    current = {**jax.device_get(fragments[0]), **moved}
    expected = score_slices(cfg, current, load_task_data(cfg).heldout_stream, sizes)["test"]
    assert got["versions"] == [0, 1]
    assert (got["batches"], got["batch_size"], got["seq_len"]) == (5, 4, 32)
    assert got["batch_losses"] == expected["batch_losses"]
    assert got["loss"] == pytest.approx(expected["loss"])
    initial = score_slices(cfg, params, load_task_data(cfg).heldout_stream, sizes)["test"]
    assert got["batch_losses"] != initial["batch_losses"]    # not the initial model


def _run(test_loss: float, small_loss: float) -> dict:
    return {"test_slice": {"loss": test_loss, "standard_error": 0.01, "batches": 100,
                           "batch_size": 4, "seq_len": 32},
            "test_paired_vs_fault_free": {"mean": 0.0, "standard_error": 0.001},
            "final_eval_loss": small_loss, "planted": [], "sensor_ticks": {},
            "rounds_opened": 10, "rounds_merged": 10, "tokens_processed": 1000}


def test_the_hostile_soak_judges_loss_on_the_test_slice_not_the_small_eval():
    from benchmarks.hostile_soak import verdict

    # The small eval 4% apart (its noise), the test slice level: met.
    pairs = [{"fault_free": _run(2.0, 2.0), "hostile": _run(2.01, 1.92)} for _ in range(3)]
    v = verdict(pairs)
    assert v["met"]
    assert v["hostile_loss_ratio_median"] == pytest.approx(1.005)
    assert v["small_eval"]["hostile_loss_ratio_median"] == pytest.approx(0.96)
    assert len(v["paired_hostile_minus_fault_free"]) == 3
    # One hostile run 3% worse on the test slice, the small eval level: not met.
    pairs[1] = {"fault_free": _run(2.0, 2.0), "hostile": _run(2.06, 2.0)}
    assert not verdict(pairs)["met"]
