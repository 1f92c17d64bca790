"""Every figure the README's results table quotes equals its committed results file.

The README is the entry point a new user reads first; its headline figures must not drift from
the measurements they cite (`benchmarks/results/`). Each check formats the figure from the
results file as the README writes it and looks for it in the README's results section.
"""

import json
import statistics
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"


def _results_section() -> str:
    text = (REPO / "README.md").read_text()
    start = text.index("\n## Results\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _exp1_figures() -> list[str]:
    exp1 = _load("quality/exp1_baselines.json")
    # The headline is the confirmation seeds' figure where they were run (the selection seeds
    # chose the configuration), as the experiment's verdict reports it, with synchronous
    # DiLoCo's beside it.
    def confirmation(tokens: int, method: str) -> dict:
        return next(r for r in exp1["rows"] if r["tokens"] == tokens
                    and r["seed_role"] == "confirmation" and r["method"] == method)

    mine = confirmation(1_000_000, "Decoupled DiLoCo")
    # Synchronous DiLoCo at the inner lr before 8e-3 on the confirmation seeds, and at 8e-3 on
    # the selection seeds (not yet confirmed).
    sync = confirmation(1_000_000, "synchronous DiLoCo, inner lr 6e-3")
    sync_now = next(r for r in exp1["rows"] if r["tokens"] == 1_000_000
                    and r["seed_role"] == "selection" and r["method"] == "synchronous DiLoCo")
    assert f"= {mine['test_vs_data_parallel']:.4f} ± {mine['test_ratio_se_seeds']:.4f}" in \
        exp1["verdict"]["measured"]
    long = confirmation(4_000_000, "Decoupled DiLoCo")
    # The default before the outer momentum's warm-up became 16 (issue 38), quoted beside it.
    before = "Decoupled DiLoCo, outer momentum warm-up 8 (the default until 16)"
    old, old_4m = confirmation(1_000_000, before), confirmation(4_000_000, before)
    # And the one before the inner clip and warm-up became 0.5 and 40 steps.
    inner = "Decoupled DiLoCo, inner clip at 1.0, warm-up 20"
    old_inner, old_inner_4m = (confirmation(tokens, inner) for tokens in (1_000_000, 4_000_000))
    # And the one before the learners' inner lr became 8e-3.
    lr = "Decoupled DiLoCo, inner lr 6e-3"
    old_lr, old_lr_4m = (confirmation(tokens, lr) for tokens in (1_000_000, 4_000_000))
    return [f"**{mine['test_vs_data_parallel']:.4f}×**",
            f"at 6e-3 {old_lr['test_vs_data_parallel']:.4f}×, missed",
            f"at the learners' 6e-3 {old_lr_4m['test_vs_data_parallel']:.4f}×",
            f"at 8e-3 {sync_now['test_vs_data_parallel']:.4f}× (selection seeds)",
            f"clip 1.0 and warm-up 20, the defaults until 965a8e0, "
            f"{old_inner['test_vs_data_parallel']:.4f}×",
            f"clip 1.0 and warm-up 20: {old_inner_4m['test_vs_data_parallel']:.4f}×",
            f"± {mine['test_ratio_se_seeds']:.4f} s.e. over 3 paired confirmation seeds",
            f"warm-up 8, the default until 5ef89cc, {old['test_vs_data_parallel']:.4f}×",
            f"warm-up 8: {old_4m['test_vs_data_parallel']:.4f}×",
            f"at 6e-3 **{sync['test_vs_data_parallel']:.4f}×** ± "
            f"{sync['test_ratio_se_seeds']:.4f}",
            # The 4M row: today's defaults on the confirmation seeds.
            f"**{long['test_vs_data_parallel']:.4f}×**",
            f"± {long['test_ratio_se_seeds']:.4f} s.e. over 3 paired confirmation seeds"]


def _goodput_figures() -> list[str]:
    cell = _load("goodput_calibration.json")["cells"]["1200128"]
    dec, dp = cell["decoupled"], cell["data_parallel"]
    return [f"**{dec['simulated']:.1f}%**", f"**{dp['simulated']:.1f}%**",
            f"± {dec['ci95']:.1f} / ± {dp['ci95']:.1f} points",
            f"paper: {dec['published']}% vs {dp['published']}%"]


def _demo_figures() -> list[str]:
    """The demo's medians over its repeats (`--runs 3`): one run's loss moves by about 3% with
    its schedule, and its latency with the machine's load."""
    result = _load("orchestration_demo.json")
    rep = result["repeats"]

    def median(name: str) -> float:
        return rep[name]["median"]

    def span(name: str, fmt: str) -> str:
        return f"{format(rep[name]['min'], fmt)}-{format(rep[name]['max'], fmt)}"

    return [f"at {result['commit'][:7]}", f"{median('rounds_merged'):.0f} rounds",
            f"{median('wall_seconds'):.0f} s",
            # The test slice, the figure of record; the syncer's 4-batch eval beside it.
            f"**{median('test_loss'):.3f}**", f"runs {span('test_loss', '.3f')}",
            f"**{median('test_loss_ratio_demo_to_calibrated_reference'):.3f}×**",
            f"ratio {span('test_loss_ratio_demo_to_calibrated_reference', '.3f')}",
            f"{result['demo']['initial_eval_loss']:.3f} → {median('final_eval_loss'):.3f}",
            f"ratio {median('final_loss_ratio_demo_to_calibrated_reference'):.3f}",
            f"**{median('decision_to_publish_median_seconds'):.3f} s**",
            f"published {median('merge_latency_median_seconds'):.2f} s",
            f"p90 {median('decision_to_publish_p90_seconds'):.3f} s",
            f"runs {span('decision_to_publish_median_seconds', '.3f')} s"]


def _chaos_figures() -> list[str]:
    """The test slice's ratio is the figure of record; the syncer's 4-batch eval beside it.
    Each a median over the tapes (one run each per method), as issue 38 asks of the README."""
    soak = _load("chaos_soak_rebase.json")
    per_tape = soak["comparison"]["per_tape"].values()

    def median(figure: str) -> float:
        return statistics.median(t[figure] for t in per_tape)

    dec = " / ".join(f"{t['loss_decoupled']:.3f}" for t in per_tape)
    sync = " / ".join(f"{t['loss_synchronous']:.3f}" for t in per_tape)
    test = " / ".join(f"{t['test_loss_ratio']:.3f}" for t in per_tape)
    lower = (1 - median("test_loss_ratio")) * 100
    small = (1 - median("loss_ratio")) * 100
    return [f"at {soak['commit']['commit'][:7]}", f"**{lower:.1f}% lower** on the 100-batch",
            f"per tape {test}", f"{small:.1f}% lower on the syncer's 4-batch eval",
            f"in {median('wall_ratio'):.2f} of the time", f"{dec} vs {sync}"]


def _real_path_figures() -> list[str]:
    """Experiment 1 through the real Dagster path: each arm's medians over its runs
    (`--runs 3`), paired with its simulator run on the test slice."""
    result = _load("quality/real_path.json")
    dec, sync = (result["summary"][arm] for arm in ("Decoupled DiLoCo", "synchronous DiLoCo"))

    def span(figure: dict, fmt: str) -> str:
        return f"{format(figure['min'], fmt)}-{format(figure['max'], fmt)}"

    vs_sim, vs_dp = dec["real_vs_simulator"], dec["real_vs_data_parallel"]
    return [f"at {result['commit']['commit'][:7]}", f"**{vs_sim['median']:.3f}×**",
            f"**{sync['real_vs_simulator']['median']:.4f}×**",
            f"runs {span(vs_sim, '.3f')} and {span(sync['real_vs_simulator'], '.4f')}",
            f"{vs_dp['median']:.3f}× ({span(vs_dp, '.3f')})",
            f"{sync['real_vs_data_parallel']['median']:.3f}×"]


@pytest.mark.parametrize("figures", [_exp1_figures, _goodput_figures, _demo_figures,
                                     _chaos_figures, _real_path_figures],
                         ids=lambda f: f.__name__.strip("_"))
def test_the_readme_quotes_its_results_files(figures):
    section = _results_section()
    missing = [figure for figure in figures() if figure not in section]
    assert not missing, f"the README's results table does not say {missing}"


def test_the_readme_test_command_is_the_one_ci_runs():
    ci = (REPO / ".ci" / "run").read_text()
    readme = (REPO / "README.md").read_text()
    command = "pip install -c requirements/ci.lock -e '.[dev]' && python -m pytest"
    assert f"\n{command}\n" in ci
    assert f"\n{command}\n" in readme
