"""Goodput at scale as a Dagster asset: the goodput-vs-chips plot and its figures in the UI."""

import base64
from pathlib import Path

import dagster as dg


class GoodputConfig(dg.Config):
    learners: int = 8
    min_quorum: int = 1
    mtbi_years: float = 1.0
    seeds: int = 5
    plot_path: str = "runs/goodput.png"


@dg.asset(group_name="planning", kinds={"python"},
          description="Goodput of data-parallel (static and elastic) and Decoupled DiLoCo under "
                      "chip failures, 150k to 2.4M chips, from the calibrated failure simulator.")
def goodput_at_scale(context: dg.AssetExecutionContext,
                     config: GoodputConfig) -> dg.MaterializeResult:
    from diloco_core.goodput import GoodputParams, goodput_with_ci
    from pipelines.reporting import GOODPUT_CHIPS, optional_plot, plot_goodput

    cache: dict[int, dict] = {}

    def at(chips: int) -> dict:
        if chips not in cache:
            cache[chips] = goodput_with_ci(GoodputParams(
                chips=chips - chips % 256, learners=config.learners,
                min_quorum=config.min_quorum, mtbi_years=config.mtbi_years), seeds=config.seeds)
        return cache[chips]

    for chips in GOODPUT_CHIPS:      # the figures, with or without the `plots` extra
        at(chips)
    path = optional_plot(lambda: plot_goodput(at, Path(config.plot_path)), context.log.warning)
    rows = ["| chips | data-parallel | elastic | sync DiLoCo | Decoupled | uptime |",
            "|---|---|---|---|---|---|"]
    for chips, r in sorted(cache.items()):
        rows.append(f"| {chips:,} | {100 * r['data_parallel']['mean']:.1f}% | "
                    f"{100 * r['data_parallel_elastic']['mean']:.1f}% | "
                    f"{100 * r['synchronous_diloco']['mean']:.1f}% | "
                    f"{100 * r['decoupled']['mean']:.1f}% | "
                    f"{100 * r['decoupled_uptime']['mean']:.1f}% |")
    plot = {}
    if path is not None:
        image = base64.b64encode(path.read_bytes()).decode()
        context.log.info(f"goodput plot written to {path}")
        plot = {"plot": dg.MetadataValue.md(f"![goodput vs chips](data:image/png;base64,{image})"),
                "plot_path": dg.MetadataValue.path(str(path))}
    largest = cache[max(cache)]
    return dg.MaterializeResult(metadata={
        "table": dg.MetadataValue.md("\n".join(rows)),
        **plot,
        "decoupled_at_largest": dg.MetadataValue.float(largest["decoupled"]["mean"]),
        "data_parallel_at_largest": dg.MetadataValue.float(largest["data_parallel"]["mean"]),
    })
