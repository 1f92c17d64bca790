"""The reference simulation as a Dagster asset, until the orchestrated learners land.

Runs Decoupled DiLoCo in the in-process simulator (real model, data and merges; simulated clock)
and records the figures as asset metadata. JAX is imported inside the asset body so that loading
the code location stays fast.
"""

import dagster as dg


class SimulationRunConfig(dg.Config):
    config_path: str | None = None
    overrides: list[str] = []


@dg.asset(group_name="diloco", kinds={"jax", "python"},
          description="Decoupled DiLoCo on the reference simulator: held-out loss, goodput, "
                      "uptime, merges and bytes for one experiment config.")
def reference_simulation(context: dg.AssetExecutionContext,
                         config: SimulationRunConfig) -> dg.MaterializeResult:
    from diloco_core.simulator import run_simulation
    from pipelines.commands.config_layers import load_config
    from resources.task_data import load_task_data

    cfg = load_config(config.config_path, list(config.overrides))
    data = load_task_data(cfg)
    result = run_simulation(cfg, data.learner_streams, data.heldout_stream)
    summary = result.summary()
    context.log.info(f"final held-out loss {summary['final_heldout_loss']:.4f}")
    last = result.merges[-1] if result.merges else None
    return dg.MaterializeResult(metadata={
        "heldout_loss": dg.MetadataValue.float(summary["final_heldout_loss"]),
        **({"accuracy": dg.MetadataValue.float(summary["final_accuracy"])}
           if summary["final_accuracy"] is not None else
           {"bits_per_byte": dg.MetadataValue.float(summary["final_bits_per_byte"])}),
        "goodput": dg.MetadataValue.float(summary["goodput"]),
        "uptime": dg.MetadataValue.float(summary["uptime"]),
        "rounds_merged": dg.MetadataValue.int(summary["rounds_merged"]),
        "tokens_processed": dg.MetadataValue.int(summary["tokens_processed"]),
        "bytes_up": dg.MetadataValue.int(summary["bytes_up"]),
        "last_decision": dg.MetadataValue.text(last.reason if last else "no merge"),
    })
