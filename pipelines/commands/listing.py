"""`diloco list`: the experiments in a store, each with its state (`experiment_state`), its
rounds merged so far and its token budget, read from the store alone."""

import json
from dataclasses import asdict, dataclass

from rich.console import Console
from rich.table import Table

from pipelines.experiment_state import experiment_state
from resources.store.artifact_store import ArtifactStore, RejectedArtifact, active_experiment
from resources.store.catalog import experiment_names


@dataclass(frozen=True)
class ExperimentRow:
    experiment: str
    state: str
    open_round: int | None
    rounds_merged: int | None
    final_eval_loss: float | None
    token_budget: int | None


def list_experiments(blobs) -> list[ExperimentRow]:
    active = active_experiment(blobs)
    rows = []
    for name in experiment_names(blobs):
        store = ArtifactStore(blobs, name)
        config = store.get_config() or {}
        try:
            summary = store.get_summary()
        except RejectedArtifact:
            summary = None      # a broken summary: the row says what the rest of the store does
        latest = store.latest_open_round()
        budget = config.get("token_budget")
        rows.append(ExperimentRow(
            experiment=name, state=experiment_state(store, active),
            open_round=None if latest is None else latest.round,
            rounds_merged=None if summary is None else summary.outcome.rounds_merged,
            final_eval_loss=None if summary is None else summary.outcome.final_eval_loss,
            token_budget=budget if isinstance(budget, int) else None))
    return rows


def print_experiments(rows: list[ExperimentRow], store_uri: str, as_json: bool,
                      console: Console | None = None) -> None:
    if as_json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
        return
    console = console or Console()
    if not rows:
        console.print(f"no experiments in the store {store_uri}")
        return
    table = Table(title=f"experiments in {store_uri}")
    # The name is what the user copies into --experiment: never cut to fit the terminal.
    table.add_column("experiment", no_wrap=True, min_width=max(len(r.experiment) for r in rows))
    for column in ("state", "last round", "rounds merged", "final loss", "token budget"):
        table.add_column(column)
    colour = {"active": "green", "stopping": "yellow", "inactive": "red"}
    for r in rows:
        table.add_row(r.experiment, f"[{colour.get(r.state, 'white')}]{r.state}[/]",
                      "" if r.open_round is None else str(r.open_round),
                      "" if r.rounds_merged is None else str(r.rounds_merged),
                      "" if r.final_eval_loss is None else f"{r.final_eval_loss:.3f}",
                      "" if r.token_budget is None else f"{r.token_budget:,}")
    console.print(table)
