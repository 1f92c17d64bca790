"""benchmarks/scavenging.py tunes the baseline as hard as the method (issue 38): a candidate
list that repeats today's value would give one method fewer configurations without a word."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.quality.experiments import DATA_PARALLEL, DECOUPLED  # noqa: E402
from benchmarks.scavenging import OUT, PLOT, candidates, plot_path, uneven_tuning  # noqa: E402
from diloco_core.config import ExperimentConfig  # noqa: E402


def _args(outer: list[float], inner: list[float]) -> argparse.Namespace:
    return argparse.Namespace(tokens=500_000, set=[], outer_lrs=outer, inner_lrs=inner)


def test_a_candidate_that_repeats_todays_value_is_refused_with_the_counts():
    today = ExperimentConfig()
    repeated = candidates(_args([0.3, 0.8], [today.inner.lr, 0.011]))
    assert repeated[DATA_PARALLEL] == sorted({today.inner.lr, 0.011})
    why = uneven_tuning(repeated)
    assert why is not None and "3 candidates" in why and "2 candidates" in why, why

    level = candidates(_args([0.3, 0.8], [0.006, 0.011]))
    assert len(level[DECOUPLED]) == len(level[DATA_PARALLEL]) == 3
    assert uneven_tuning(level) is None
    # Tuning one method alone is uneven too; tuning neither is not tuning.
    assert "1 candidates" in uneven_tuning(candidates(_args([0.3, 0.8], [])))
    assert uneven_tuning(candidates(_args([], []))) is None


def test_a_probe_written_elsewhere_does_not_overwrite_the_docs_figure(tmp_path):
    """Only the headline result draws docs/img/scavenging.png; a probe with its own `--out`
    plots beside it (stop 85: two probes each overwrote the headline's figure), and `--plot`
    still wins."""
    assert plot_path(str(OUT), None) == PLOT
    probe = tmp_path / "scavenging_grace_one_step.json"
    assert plot_path(str(probe), None) == tmp_path / "scavenging_grace_one_step.png"
    assert plot_path(str(probe), str(tmp_path / "mine.png")) == tmp_path / "mine.png"
