"""The Dagster UI as the cockpit, in a real browser (headless Chromium through Selenium).

`dagster dev` on a temporary DAGSTER_HOME and store; a small training run (2 learners, the tiny
model, emulated 0.1 s steps) is launched FROM THE UI: the `train` job's launchpad gets its YAML
(overrides under ops.start_experiment.config) and Launch Run is clicked. Once the run has
finished (its rounds merged, the summary written), the test looks at what a person would:

- the Runs list: the train, learner and syncer runs;
- `global_params` → Partitions: every merged round is a materialized partition;
- Overview → Metadata (Table): the decision table of the latest merge;
- Overview → Metadata → Plots: one plot per numeric metadata key, each drawing a series;
- Lineage (all depths): the diloco assets, from `experiment` to `heldout_eval`.

Each view is saved to test-artifacts/ui/<view>.png; with DILOCO_UPDATE_SCREENSHOTS=1 they are
also copied to docs/img/ui_<view>.png, the README's screenshots.

The browser is Debian's chromium and chromium-driver (never downloaded). Without them the test
skips, except under CI (env `CI` set), where it fails: `.ci/run` installs them.
"""

import contextlib
import os
import shutil
import time
from pathlib import Path

import pytest
from ui_driver import Browser, Page, browser_missing, copy_screenshots

from pipelines.commands.dagster_dev import REPO_ROOT, DagsterDev
from resources.store.artifact_store import ArtifactStore
from resources.store.backends import open_blob_store

ARTIFACTS = REPO_ROOT / "test-artifacts" / "ui"
README_IMAGES = REPO_ROOT / "docs" / "img"
EXPERIMENT = "ui-e2e"

# What a person types into the launchpad: the orchestrated defaults, made small and fast,
# mostly in the typed form (`experiment`: the browser validates each field's type as it is
# typed) and a few as overrides (applied last).
LAUNCH_YAML = f"""\
ops:
  start_experiment:
    config:
      experiment:
        model:
          preset: tiny
        data:
          seq_len: 32
          batch_size: 4
        learners:
          num_learners: 2
          speeds: [1.0, 1.0]
        sync:
          sync_period: 120
          num_fragments: 2
          min_quorum: 2
          grace_min_seconds: 1
        token_budget: 80000
      overrides:
        - name={EXPERIMENT}
        - orchestration.step_seconds_floor=0.1
        - orchestration.eval_batches=1
        - orchestration.checkpoint_every_steps=60
        - orchestration.heartbeat_seconds=1
        - orchestration.round_timeout_seconds=30
"""

# Assets the lineage view must show (the training path and its evals).
LINEAGE = ["experiment", "initial_params", "learner_update", "global_params", "heldout_eval"]


@pytest.fixture
def browser_ready():
    why = browser_missing()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"CI needs headless Chromium: {why}")
        pytest.skip(why)


@pytest.fixture
def dagster(tmp_path):
    """`dagster dev` serving the code location on a private home and store; stopped (with
    every run it launched) when the test ends, however it ends."""
    store_uri = str(tmp_path / "store")
    env = {"DILOCO_STORE_URI": store_uri, "DILOCO_ENV": "local", "DILOCO_TICK_SECONDS": "2",
           "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.2"}
    with DagsterDev(tmp_path / "dagster_home", env=env, max_concurrent_runs=8) as dev:
        dev.store_uri = store_uri
        with contextlib.suppress(Exception):  # the instance disables it; belt and braces
            dev.graphql("mutation { setNuxSeen }")
        yield dev


@pytest.fixture
def page(tmp_path, browser_ready):
    with Browser(tmp_path / "chromium-profile") as page:
        yield page


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_run_launched_and_inspected_from_the_dagster_ui(dagster, page: Page):
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    ARTIFACTS.mkdir(parents=True)
    page.base_url = dagster.url
    shots: dict[str, Path] = {}

    def shot(name: str) -> None:
        shots[name] = page.screenshot(ARTIFACTS / f"{name}.png")

    try:
        run_id = _launch_from_the_launchpad(page, dagster, shot)
        summary = _wait_for_the_run(dagster, run_id)
        keys = _merged_partitions(dagster)
        merged = summary.outcome.rounds_merged
        assert len(keys) == merged >= 3, (keys, merged)
        _runs_list(page, shot)
        _partitions(page, keys, shot)
        _decision_table(page, shot)
        _plots(page, shot)
        _lineage(page, shot)
    except BaseException as err:
        with contextlib.suppress(Exception):
            page.screenshot(ARTIFACTS / "failure.png")
            (ARTIFACTS / "failure.html").write_text(page.driver.page_source)
        with contextlib.suppress(Exception):
            err.add_note(f"page: {page.url}; screenshot in {ARTIFACTS / 'failure.png'}; "
                         f"Dagster log tail:\n{dagster.log_path.read_text()[-3000:]}")
        raise
    if os.environ.get("DILOCO_UPDATE_SCREENSHOTS") == "1":
        copy_screenshots(shots, README_IMAGES)


def _launch_from_the_launchpad(page: Page, dagster, shot) -> str:
    page.open("/locations/diloco/jobs/train/playground")
    page.wait(lambda: "start_experiment" in (page.editor_text() or ""),
              "the launchpad's config editor with the job's default config", timeout=180)
    # The form is typed: a wrong type in an experiment field is an error the launchpad names,
    # with the field's path, before anything is launched.
    page.set_editor_text(LAUNCH_YAML.replace("token_budget: 80000", 'token_budget: "lots"'))
    page.wait(lambda: [e for e in page.visible_containing("Invalid scalar")
                       if "token_budget" in e.text], "the launchpad naming the mistyped field",
              timeout=60)
    shot("launchpad_type_error")
    # Well typed but inconsistent (a quorum of 3 among 2 learners): the schema passes ("No
    # errors"), and Launch Run is refused with the field and the reason; no run is created.
    page.set_editor_text(LAUNCH_YAML.replace("min_quorum: 2", "min_quorum: 3"))
    page.wait_text("No errors")
    page.click("Launch Run")
    page.wait(lambda: [e for e in page.visible_containing("sync.min_quorum")
                       if "num_learners" in e.text], "the launch refused, naming the field",
              timeout=120)
    shot("launchpad_config_error")
    runs = dagster.graphql('{ runsOrError(filter: {pipelineName: "train"}) { ... on Runs { '
                           "results { runId } } } }")["runsOrError"]["results"]
    assert runs == [], runs
    page.open("/locations/diloco/jobs/train/playground")    # the error dialog dismissed
    page.wait(lambda: "start_experiment" in (page.editor_text() or ""),
              "the launchpad's config editor again", timeout=120)
    page.set_editor_text(LAUNCH_YAML)
    page.wait(lambda: "name=ui-e2e" in (page.editor_text() or ""), "the YAML in the editor")
    # The launchpad validates the YAML against the job's config schema as it changes.
    page.wait_text("No errors")
    shot("launchpad")
    page.click("Launch Run")  # a real click: the browser sends the launch mutation
    page.wait(lambda: "/runs/" in page.url, "the new run's page after Launch Run", timeout=120)
    run_id = page.url.split("/runs/")[1].split("?")[0].strip("/")
    run = dagster.graphql("query($id: ID!) { runOrError(runId: $id) { __typename ... on Run { "
                          "jobName runConfigYaml } } }", {"id": run_id})["runOrError"]
    assert run["__typename"] == "Run" and run["jobName"] == "train", run
    assert f"name={EXPERIMENT}" in run["runConfigYaml"], run["runConfigYaml"]
    return run_id


def _wait_for_the_run(dagster, run_id: str, timeout: float = 720.0) -> dict:
    """Poll the store until the run's summary is recorded by the `summarize` run (its rounds all
    merged and mirrored into Dagster; the syncer's own summary comes a sensor tick earlier),
    failing fast if the train run fails or Dagster goes down."""
    store = ArtifactStore(open_blob_store(dagster.store_uri), EXPERIMENT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert all(s.alive() for s in dagster.services.values()), "dagster dev exited"
        status = dagster.graphql("query($id: ID!) { runOrError(runId: $id) { ... on Run { "
                                 "status } } }", {"id": run_id})["runOrError"]["status"]
        assert status not in ("FAILURE", "CANCELED"), f"the train run ended {status}"
        with contextlib.suppress(OSError, ValueError):  # a read racing a write
            summary = store.get_summary()
            if (summary is not None
                    and summary.summarized_by == ArtifactStore.SUMMARY_RECORDED_BY):
                config = store.get_config()
                # The YAML typed into the launchpad is what the experiment runs.
                assert config["model"]["preset"] == "tiny", config["model"]
                assert config["learners"]["num_learners"] == 2, config["learners"]
                return summary
        time.sleep(2.0)
    versions = [store.current_version(p) for p in range(2)]
    raise TimeoutError(f"no run summary after {timeout:.0f}s (fragment versions {versions})")


def _merged_partitions(dagster) -> list[str]:
    data = dagster.graphql('{ assetOrError(assetKey: {path: ["global_params"]}) { ... on Asset '
                           "{ assetMaterializations(limit: 1000) { partition } } } }")
    return sorted({m["partition"] for m in data["assetOrError"]["assetMaterializations"]})


def _runs_list(page: Page, shot) -> None:
    page.open("/runs")
    for job in ("train", "learner", "syncer"):
        page.wait_text(job)
    shot("runs")


def _partitions(page: Page, keys: list[str], shot) -> None:
    page.open("/assets/global_params")
    page.click_tab("Partitions")
    page.wait_text(f"Materialized ({len(keys)})")
    for key in keys:
        page.wait_text(key)
    page.visible_text(keys[-1])[0].click()  # the latest round's materialization and metadata
    page.wait(lambda: page.visible("//table//th[normalize-space(.)='learner']"),
              f"round {keys[-1]}'s decision table")
    shot("partitions")


def _decision_row(page: Page):
    rows = page.visible("//tr[td[1][normalize-space(.)='decisions']]")
    return rows[0] if rows and rows[0].find_elements("xpath", ".//table//tbody/tr") else None


def _decision_table(page: Page, shot) -> None:
    page.click_tab("Overview")
    page.click("Table")
    row = page.wait(lambda: _decision_row(page), "the 'decisions' table in the metadata")
    headers = [th.text.strip() for th in row.find_elements("xpath", ".//table//th")]
    assert headers[:2] == ["learner", "status"] and "weight" in headers, headers
    cells = [[td.text.strip() for td in tr.find_elements("xpath", "./td")]
             for tr in row.find_elements("xpath", ".//table//tbody/tr")]
    # Every learner has a row: merged, or late / missing / rejected with a reason (the final
    # round may close without a learner that stopped first).
    status = {c[0].replace("\n", ""): c[1] for c in cells}
    assert set(status) == {"learner-0", "learner-1"}, cells
    assert "merged" in status.values(), cells
    assert set(status.values()) <= {"merged", "late", "missing", "rejected", "declined",
                                    "not live"}, cells
    page.scroll_to(page.visible_text("decision_reason")[0])
    shot("decisions")


def _plots(page: Page, shot) -> None:
    page.click("Plots")
    for key in ("merged_norm", "update_norm", "bytes_in"):
        page.wait_text(key)
    # Each chart draws its series (a line through one point per round) on a canvas.
    drawn = page.wait(lambda: [n for n in page.series_pixels() if n > 30],
                      "plots with a drawn series")
    page.wait(lambda: len([n for n in page.series_pixels() if n > 30]) >= 3,
              f"at least three plots with a drawn series (so far {len(drawn)})")
    page.scroll_to(page.visible_text("Metadata")[0])
    shot("plots")


def _lineage(page: Page, shot) -> None:
    page.click_tab("Lineage")
    page.wait_text("Graph depth")
    with contextlib.suppress(TimeoutError):  # disabled when every depth is already shown
        page.click("All", timeout=10)
    page.wait(lambda: page.graph_nodes_in_view(["global_params"]), "the asset graph")
    # Zoomed out as a person would (the graph keeps its zoom when the depth grows).
    page.zoom_graph_to_show(LINEAGE)
    shot("lineage")
