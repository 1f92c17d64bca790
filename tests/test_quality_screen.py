"""The configuration screen (benchmarks/quality_screen.py) stays runnable and apart from the
results: every grid arm is a valid config, its ratios pair seeds, and it refuses to write its runs
among the committed ones."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import quality_screen  # noqa: E402
from benchmarks.quality.runner import RUNS_DIR, arm_config, arm_key  # noqa: E402


def test_every_grid_arm_is_a_valid_config_and_a_distinct_run():
    arms = quality_screen.screen_arms(1_000_000, [0, 1])
    for arm in arms:
        cfg = arm_config(arm)  # H = 2 without P = 2 raised here: H must be a multiple of P
        assert cfg.token_budget == 1_000_000
    # Two grid rows that resolve to one config would be one run under two names.
    assert len({arm_key(a) for a in arms}) == len(arms)
    # Every configuration's first seed comes before any second seed: a screen cut off at its
    # deadline has seen the whole grid once.
    assert [a.seed for a in arms[:len(quality_screen.GRID)]] == [0] * len(quality_screen.GRID)


def _record(label: str, seed: int, loss: float) -> dict:
    return {"arm": {"label": label, "seed": seed},
            "heldout_slices": {"validation": {"loss": loss}}}


def test_the_summary_pairs_each_configuration_with_the_baseline_seed_by_seed():
    base, default = quality_screen.BASELINE, quality_screen.DEFAULTS
    rows = quality_screen.summarise([
        _record(base, 0, 2.0), _record(base, 1, 4.0),
        _record(default, 0, 2.2), _record(default, 1, 4.0), _record(default, 2, 9.0),
        _record("H = 2, P = 2", 2, 3.0)])
    by_label = {r["label"]: r for r in rows}
    # Seed 2 has no baseline: it counts in the mean loss but not in the ratio.
    assert by_label[default]["paired_seeds"] == [0, 1]
    assert by_label[default]["ratio_to_baseline"] == pytest.approx((1.1 + 1.0) / 2)
    assert by_label["H = 2, P = 2"]["ratio_to_baseline"] is None


def test_it_refuses_to_write_its_runs_among_the_committed_results(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["quality_screen.py", "--out", str(tmp_path),
                                      "--runs-dir", str(RUNS_DIR)])
    # No arms: without the refusal the screen would end at once, writing an empty screen.json.
    monkeypatch.setattr(quality_screen, "screen_arms", lambda tokens, seeds: [])
    with pytest.raises(SystemExit):
        quality_screen.main()
    assert not (tmp_path / "screen.json").exists()
