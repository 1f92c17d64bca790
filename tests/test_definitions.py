"""The Dagster code location loads, and its asset materializes on a real (ephemeral) instance."""

import dagster as dg

from pipelines.definitions import defs
from pipelines.defs.simulation import reference_simulation


def test_code_location_loads():
    definitions = defs()
    dg.Definitions.validate_loadable(definitions)
    keys = {key for a in definitions.assets for key in a.keys}
    assert dg.AssetKey("reference_simulation") in keys


def test_reference_simulation_materializes_with_metadata():
    overrides = ["model.preset=tiny", "data.seq_len=32", "data.batch_size=4",
                 "learners.num_learners=2", "sync.num_fragments=2", "sync.sync_period=4",
                 "token_budget=4096", "simulation.eval_batches=1"]
    result = dg.materialize(
        [reference_simulation],
        run_config={"ops": {"reference_simulation": {"config": {"overrides": overrides}}}})
    assert result.success
    (mat,) = result.asset_materializations_for_node("reference_simulation")
    meta = mat.metadata
    assert meta["tokens_processed"].value >= 4096
    assert 0 < meta["heldout_loss"].value < 10
    assert meta["rounds_merged"].value >= 1
    assert "final round" in meta["last_decision"].value


def test_goodput_asset_materializes_table_and_plot(tmp_path):
    from pipelines.defs.goodput import goodput_at_scale

    result = dg.materialize(
        [goodput_at_scale],
        run_config={"ops": {"goodput_at_scale": {"config": {
            "seeds": 2, "plot_path": str(tmp_path / "g.png")}}}})
    assert result.success
    (mat,) = result.asset_materializations_for_node("goodput_at_scale")
    assert "| 1,200,128 |" in mat.metadata["table"].value
    assert mat.metadata["decoupled_at_largest"].value > mat.metadata[
        "data_parallel_at_largest"].value
    assert (tmp_path / "g.png").stat().st_size > 1000
