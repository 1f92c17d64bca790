"""`diloco simulate`: Decoupled DiLoCo and its baselines on the real corpus (or the digits
images, with task=digits), one fake clock."""

import json
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from diloco_core.config import ExperimentConfig
from diloco_core.config_loading import config_to_mapping
from pipelines.reporting import optional_plot, plot_loss, results_table, write_results

BASELINES = ("data_parallel", "synchronous_diloco")


def simulate(cfg: ExperimentConfig, baselines: str, out_dir: Path, as_json: bool) -> int:
    from diloco_core.baselines import run_data_parallel, run_synchronous_diloco
    from diloco_core.simulator import run_simulation
    from resources.task_data import load_task_data

    chosen = [] if baselines in ("", "none") else [b.strip() for b in baselines.split(",")]
    unknown = [b for b in chosen if b not in BASELINES]
    if unknown:
        raise SystemExit(f"diloco: unknown baseline(s) {unknown}; choose from {BASELINES}")
    console = Console(stderr=True)
    data = load_task_data(cfg)
    console.print(data.description)
    runners = {"decoupled_diloco": run_simulation, "data_parallel": run_data_parallel,
               "synchronous_diloco": run_synchronous_diloco}
    results = []
    with Progress(TextColumn("{task.description:<20}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=as_json) as bar:
        for method in ["decoupled_diloco", *chosen]:
            task = bar.add_task(method, total=cfg.token_budget)

            def progress(done: int, total: int, task=task, method=method) -> None:
                bar.update(task, completed=min(done, total))
                if not console.is_terminal:  # logs and CI: a live line every 10%
                    decile = 10 * done // total
                    if decile > bar.tasks[task].fields.get("decile", -1):
                        bar.update(task, decile=decile)
                        console.print(f"{method}: {min(done, total):,}/{total:,} tokens")

            result = runners[method](cfg, data.learner_streams, data.heldout_stream,
                                     progress=progress)
            result.method = method
            results.append(result)
    path = write_results(results, config_to_mapping(cfg), out_dir)
    plot = optional_plot(lambda: plot_loss(results, out_dir / "heldout_loss.png"))
    rows = results_table(results)
    if as_json:
        print(json.dumps({"table": rows, "results": str(path),
                          "plot": str(plot) if plot else None}, indent=2))
        return 0
    table = Table(title=f"{cfg.name}: {cfg.token_budget:,} tokens, M={cfg.learners.num_learners}")
    for column in rows[0]:
        table.add_column(column)
    for row in rows:
        table.add_row(*["" if v is None else str(v) for v in row.values()])
    Console(width=max(Console().width, 140)).print(table)
    console.print(f"results: {path}" + (f"\nplot:    {plot}" if plot else ""))
    return 0
