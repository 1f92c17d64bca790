"""The quality benchmarks' definitions stay runnable: every arm is a valid config, arms that
mean the same run share one stored result, and each experiment compares what it says."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quality.experiments import (  # noqa: E402
    DATA_PARALLEL,
    EXPERIMENTS,
    GRACE_ONE_STEP,
    OLD_INNER_LABEL,
    OLD_LR_LABEL,
    RUN_ORDER,
    STILL_AT_OLD_INNER,
    STILL_AT_OLD_LR,
    STILL_AT_WARMUP8,
    WARMUP8_DEFAULT,
    WARMUP8_LABEL,
)
from benchmarks.quality.runner import arm_config, arm_key  # noqa: E402
from benchmarks.quality.selection import reseed  # noqa: E402


def test_every_arm_is_a_valid_config_and_every_experiment_runs_in_all():
    assert sorted(RUN_ORDER) == sorted(EXPERIMENTS) == list(range(1, 13))
    for exp in EXPERIMENTS.values():
        labels = [(a.label, a.seed, a.tokens) for a in exp.arms]
        assert len(set(labels)) == len(labels), exp.slug
        for arm in exp.arms:
            cfg = arm_config(arm)   # raises ConfigError naming the field if a definition rots
            assert cfg.token_budget == arm.tokens and cfg.seed == arm.seed


def test_equal_runs_share_one_result_and_different_runs_do_not():
    exp1, exp2, exp9 = EXPERIMENTS[1], EXPERIMENTS[2], EXPERIMENTS[9]
    headline = {(a.label, a.seed, a.tokens): arm_key(a) for a in exp1.arms}
    free = {a.label: arm_key(a) for a in exp9.arms}
    # Experiment 9's fault-free references are experiment 1's seed-0 runs, at the settings
    # each ran with: the outer warm-up of 8 while it is in STILL_AT_WARMUP8, the old inner clip
    # and warm-up while it is in STILL_AT_OLD_INNER, the old inner lr while it is in
    # STILL_AT_OLD_LR, today's since.
    def plain(number: int, label: str) -> str:
        if number in STILL_AT_WARMUP8:
            return WARMUP8_DEFAULT
        if number in STILL_AT_OLD_INNER:
            return f"{label}, {OLD_INNER_LABEL}"
        return f"{label}, {OLD_LR_LABEL}" if number in STILL_AT_OLD_LR else label
    ref = plain(9, "Decoupled DiLoCo")
    assert free["Decoupled DiLoCo, no failures"] == headline[(ref, 0, 1_000_000)]
    assert all(free["Decoupled DiLoCo, no failures"] != headline[(other, 0, 1_000_000)]
               for other in ("Decoupled DiLoCo", WARMUP8_DEFAULT,
                             f"Decoupled DiLoCo, {OLD_INNER_LABEL}",
                             f"Decoupled DiLoCo, {OLD_LR_LABEL}") if other != ref)
    assert free["data-parallel, no failures"] == headline[(plain(9, "data-parallel"), 0,
                                                           1_000_000)]
    # The default Decoupled run at 500k tokens is experiment 2's P=4 tau=1.
    base = next(a for a in exp2.arms if a.label == "P=4 tau=1")
    assert arm_key(base) == headline[(plain(2, "Decoupled DiLoCo"), 0, 500_000)]
    assert len({arm_key(a) for a in exp2.arms}) == len(exp2.arms)


def test_arms_that_ran_at_the_old_warm_up_keep_it_and_todays_run_the_new_one():
    """The outer momentum's warm-up moved from 8 to 16 (issue 38): the arms that ran at 8 pin
    it, so that their stored runs keep their meaning; today's defaults run at 16; an arm that
    sets its own warm-up keeps it."""
    from diloco_core.config import ExperimentConfig

    assert ExperimentConfig().outer.momentum_warmup_steps == 16
    exp1 = EXPERIMENTS[1]

    def warmup(arm):
        return arm_config(arm).outer.momentum_warmup_steps

    for label in ("Decoupled DiLoCo", "synchronous DiLoCo", "Decoupled DiLoCo, M = 2"):
        assert {warmup(a) for a in exp1.arms if a.label == label} == {16}, label
    old = [a for a in exp1.arms if WARMUP8_LABEL in a.label or "(the " in a.label
           or "cosine" in a.label or "as synchronous DiLoCo" in a.label]
    assert {a.label for a in old} >= {WARMUP8_DEFAULT, "synchronous DiLoCo, warm-up 8"}
    assert all(warmup(a) == 8 for a in old if a.method != DATA_PARALLEL)
    # Experiment 12 and those not yet re-run pin 8 before their own overrides; the re-run
    # ones run today's default unless an arm sets its own.
    for number in range(2, 13):
        pinned = number == 12 or number in STILL_AT_WARMUP8
        for arm in EXPERIMENTS[number].arms:
            own = next((o for o in arm.overrides[1 if pinned else 0:]
                        if "momentum_warmup_steps" in o), None)
            expected = int(own.split("=")[1]) if own else (8 if pinned else 16)
            assert arm.method == DATA_PARALLEL or warmup(arm) == expected, (number, arm.label)
        # Their reports say which warm-up they ran at.
        assert ("warm-up of 8" in EXPERIMENTS[number].question) == (number in STILL_AT_WARMUP8)
    assert any(warmup(a) == 0 for a in EXPERIMENTS[12].arms)   # its own setting survives


def test_every_arm_but_the_plain_defaults_names_the_inner_clip_and_warm_up_it_ran_at():
    """Data-parallel's 1M winner clips at 0.5 and warms up over 40 steps, and the learners with
    both are the defaults since issue 38's confirmation. Every arm that ran at the old ones
    (clip 1.0, 20 steps) names them in its overrides, so that the change moved only experiment
    1's plain arms (the experiments in STILL_AT_OLD_INNER keep theirs until re-run, and say
    so); the plain arms as they ran are there under OLD_INNER_LABEL; an arm that sets one of
    them itself keeps its own value."""
    from benchmarks.quality.experiments import OLD_INNER
    from diloco_core.config import InnerOptConfig

    assert (InnerOptConfig().clip_norm, InnerOptConfig().warmup_steps) == (0.5, 40)

    fields = {pin.split("=")[0] for pin in OLD_INNER}
    plain = {"data-parallel", "synchronous DiLoCo", "Decoupled DiLoCo",
             "Decoupled DiLoCo, M = 2", "Decoupled DiLoCo, M = 8"}

    def named(arm):
        return fields <= {o.split("=")[0] for o in arm.overrides}
    def inner(arm):
        cfg = arm_config(arm).inner
        return cfg.clip_norm, cfg.warmup_steps
    for arm in EXPERIMENTS[1].arms:
        assert named(arm) != (arm.label in plain), arm.label
        if arm.label in plain:
            assert inner(arm) == (0.5, 40), arm.label
    # Each plain arm as it ran before, at every budget and seed, at the old settings.
    before = {(a.label, a.seed, a.tokens) for a in EXPERIMENTS[1].arms
              if a.label.endswith(f", {OLD_INNER_LABEL}") and inner(a) == (1.0, 20)}
    assert before == {(f"{a.label}, {OLD_INNER_LABEL}", a.seed, a.tokens)
                      for a in EXPERIMENTS[1].arms if a.label in plain}
    for number in (12, *STILL_AT_OLD_INNER):
        assert all(named(arm) for arm in EXPERIMENTS[number].arms), number
    for number in range(2, 12):
        assert ("20-step warm-up" in EXPERIMENTS[number].question) == (
            number in STILL_AT_OLD_INNER), number
    clip_only = next(a for a in EXPERIMENTS[12].arms if a.label.endswith("4.5e-3, clip at 0.5"))
    assert (arm_config(clip_only).inner.clip_norm, arm_config(clip_only).inner.warmup_steps) == (
        0.5, 20)


def test_every_arm_but_the_plain_defaults_names_the_inner_lr_it_ran_at():
    """The learners' inner lr moved from 6e-3 to 8e-3 (issue 38's confirmation, stop 81). Every
    arm that ran at 6e-3 names it in its overrides, so that the change moved only experiment
    1's plain arms (the experiments in STILL_AT_OLD_LR keep theirs until re-run, and say so);
    the plain arms as they ran are there under OLD_LR_LABEL, with today's clip and warm-up
    named too; an arm that sets its own lr keeps it; the orchestrated runs keep 6e-3 until
    measured there."""
    from diloco_core.config import ExperimentConfig, InnerOptConfig
    from pipelines.launch_defaults import ORCHESTRATED_DEFAULTS

    assert InnerOptConfig().lr == 8e-3
    plain = {"data-parallel", "synchronous DiLoCo", "Decoupled DiLoCo",
             "Decoupled DiLoCo, M = 2", "Decoupled DiLoCo, M = 8"}

    def named(arm):
        return any(o.startswith("inner.lr=") for o in arm.overrides)
    def lr(arm):
        return arm_config(arm).inner.lr
    for arm in EXPERIMENTS[1].arms:
        assert named(arm) != (arm.label in plain), arm.label
        if arm.label in plain:
            assert lr(arm) == 8e-3, arm.label
    before = {(a.label, a.seed, a.tokens) for a in EXPERIMENTS[1].arms
              if a.label.endswith(f", {OLD_LR_LABEL}") and lr(a) == 6e-3
              and (arm_config(a).inner.clip_norm, arm_config(a).inner.warmup_steps) == (0.5, 40)
              and {"inner.clip_norm", "inner.warmup_steps"} <= {
                  o.split("=")[0] for o in a.overrides}}
    assert before == {(f"{a.label}, {OLD_LR_LABEL}", a.seed, a.tokens)
                      for a in EXPERIMENTS[1].arms if a.label in plain}
    for number in (12, *STILL_AT_OLD_LR):
        assert all(named(arm) for arm in EXPERIMENTS[number].arms), number
    for number in range(2, 12):
        assert ("inner lr of 6e-3" in EXPERIMENTS[number].question) == (
            number in STILL_AT_OLD_LR), number
    # An arm's own lr wins over the pin: data-parallel's 1M reference still runs at 4.5e-3.
    assert {lr(a) for a in EXPERIMENTS[12].arms if a.label.endswith("4.5e-3, clip at 0.5")} == \
        {0.0045}
    from diloco_core.config_loading import config_from_mapping
    assert config_from_mapping({}, ORCHESTRATED_DEFAULTS).inner.lr == 6e-3 != \
        ExperimentConfig().inner.lr


def test_each_experiment_varies_what_it_studies():
    weighting = [arm_config(a) for a in EXPERIMENTS[6].arms]
    assert {c.sync.weighting for c in weighting} == {"tokens", "uniform"}
    assert all(len(set(c.learner_batch_sizes)) > 1 for c in weighting)
    encodings = {arm_config(a).sync.encoding for a in EXPERIMENTS[7].arms}
    assert encodings == {"fp32", "bf16", "int8", "int4", "int2"}
    merge = {(arm_config(a).learners.num_learners, arm_config(a).sync.merge_rule)
             for a in EXPERIMENTS[5].arms}
    assert merge == {(m, r) for m in (4, 8, 16) for r in ("mean", "rda")}
    # Experiment 12's arms spell out their optimizer settings: they keep their meaning (and
    # stored results) whatever the defaults become; its new-defaults arms are experiment 1's.
    tuning = {a.label: arm_key(a) for a in EXPERIMENTS[12].arms}
    headline = {(a.label, a.seed): arm_key(a) for a in EXPERIMENTS[1].arms
                if a.tokens == 1_000_000}
    # The defaults until issue 38 (H = 16, outer lr 0.7, overwrite) are experiment 1's arm of
    # that name, not today's defaults.
    old_defaults = "outer 0.7/0.5 warm-up 8, inner 6e-3 (defaults until issue 38)"
    assert tuning[f"Decoupled DiLoCo, {old_defaults}"] == headline[
        ("Decoupled DiLoCo, H = 16, outer lr 0.7, overwrite (the old defaults)", 0)]
    assert tuning[f"Decoupled DiLoCo, {old_defaults}"] != headline[("Decoupled DiLoCo", 0)]
    assert tuning[f"synchronous DiLoCo, {old_defaults}"] != headline[("synchronous DiLoCo", 0)]
    # The arms on the old cosine inner schedule pin it; every other arm runs today's default.
    for arm in (*EXPERIMENTS[1].arms, *EXPERIMENTS[12].arms):
        schedule = arm_config(arm).inner.schedule
        assert schedule == ("cosine" if "cosine" in arm.label else
                            "constant" if "constant" in arm.label else "wsd"), arm.label
    for old in ("outer 0.7/0.9, inner 3e-3 (old defaults)",
                "outer 0.7/0.9 warm-up 8, inner 6e-3 (first tuned defaults)"):
        assert tuning[f"Decoupled DiLoCo, {old}"] != headline[("Decoupled DiLoCo", 0)]
    outages = [arm_config(a) for a in EXPERIMENTS[9].arms if "no failures" not in a.label]
    assert all(c.simulation.outages for c in outages)


def test_a_stored_result_is_reused_only_while_the_code_that_computed_it_is_unchanged(tmp_path):
    import json

    from benchmarks.quality.code_identity import code_hash, is_current
    from benchmarks.quality.experiments import DECOUPLED, Arm
    from benchmarks.quality.runner import arm_path, run_arm

    arm = Arm("tiny", DECOUPLED, ("model.preset=tiny", "data.seq_len=32", "data.batch_size=4",
                                  "simulation.eval_points=1", "simulation.eval_batches=1"),
              tokens=4 * 8 * 128)
    first = run_arm(arm, tmp_path)
    assert first["code"] == code_hash() and is_current(first)
    assert first["commit"]["commit"]                      # the commit that produced it
    assert run_arm(arm, tmp_path) == first                # reused, not run again
    path = arm_path(arm, tmp_path)
    path.write_text(json.dumps({**first, "code": "older", "compute_seconds": -1}))
    again = run_arm(arm, tmp_path)                        # stale: run again and replaced
    assert again["code"] == code_hash() and again["compute_seconds"] >= 0
    assert json.loads(path.read_text())["code"] == code_hash()


def test_the_code_hash_covers_what_the_simulator_imports_and_only_that():
    from benchmarks.quality.code_identity import REPO, code_files

    files = {str(p.relative_to(REPO)) for p in code_files()}
    # Reached through imports, including function-level ones (the vision model, the digits
    # loader) and modules imported only by other imported modules (the round protocol).
    for needed in ("diloco_core/simulator.py", "diloco_core/syncer.py", "diloco_core/outer.py",
                   "diloco_core/round_protocol.py", "diloco_core/vit.py", "resources/corpus.py",
                   "resources/digits.py", "benchmarks/quality/runner.py",
                   # What scores the final model on the validation and test slices.
                   "benchmarks/quality/scoring.py", "diloco_core/eval_slices.py",
                   "diloco_core/evaluation.py"):
        assert needed in files, needed
    # What no arm runs does not stale the stored results.
    for unrelated in ("diloco_core/spmd.py", "diloco_core/goodput.py", "diloco_core/bandwidth.py",
                      "resources/learner/runtime.py"):
        assert unrelated not in files, unrelated


def test_the_code_hash_ignores_comments_docstrings_and_layout_but_not_code():
    from benchmarks.quality.code_identity import semantic_source

    base = semantic_source('"""Module."""\nX = 1  # one\n\ndef f(a):\n'
                           '    """Doc."""\n    return a + X\n')
    same = semantic_source('X = 1\n\n\ndef f(a):  # reflowed\n    return (a +\n            X)\n')
    assert base == same
    # A docstring-only function stays valid; a changed constant, operator or name does not pass.
    assert semantic_source('def g():\n    """Only a docstring."""\n') == semantic_source(
        'def g():\n    pass\n')
    # A field's documentation (the string under it) is a docstring too; its default is not.
    field = 'class C:\n    x: int = 1\n    """The x."""\n    y: int = 2\n'
    assert semantic_source(field) == semantic_source(
        'class C:\n    x: int = 1\n    """Another text."""\n    y: int = 2\n')
    assert semantic_source(field) != semantic_source(field.replace("= 1", "= 3"))
    for changed in ('X = 2\n\ndef f(a):\n    return a + X\n',
                    'X = 1\n\ndef f(a):\n    return a - X\n',
                    'X = 1\n\ndef f(b):\n    return b + X\n',
                    'X = 1\n\ndef f(a):\n    return f"{a}" + X\n'):
        assert semantic_source(changed) != base, changed


def test_a_stale_result_names_the_files_that_changed_since_its_commit():
    import subprocess

    from benchmarks.quality.code_identity import REPO, changed_since, code_files

    files = {str(p.relative_to(REPO)) for p in code_files()}
    head = changed_since("HEAD")
    assert head is not None and set(head) <= files   # only uncommitted edits, if any
    first = subprocess.run(["git", "rev-list", "--max-parents=0", "HEAD"], cwd=REPO,
                           capture_output=True, text=True).stdout.split()
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=REPO,
                             capture_output=True, text=True).stdout.strip() == "true"
    if first and not shallow:  # at the project's first commit nearly every file is new
        assert len(changed_since(first[0]) or []) >= len(files) // 2
    assert changed_since("0" * 40) is None


def _fake_record(loss: float, commit: str | None, code: str) -> dict:
    """A stored arm result with only what the report reads, at a chosen held-out loss."""
    return {"key": "k", "code": code, "commit": {"commit": commit} if commit else None,
            "summary": {"final_heldout_loss": loss, "final_bits_per_byte": None, "goodput": 1.0,
                        "uptime": 1.0, "rounds_merged": 1, "bytes_up_per_token": 1.0,
                        "wall_seconds": 1.0},
            "idle_fraction": 0.0, "mean_members_per_merge": 4.0}


def test_the_report_states_the_gap_at_the_largest_multi_seed_budget_and_counts_undated_runs(
        monkeypatch):
    from benchmarks.quality import report
    from benchmarks.quality.code_identity import code_hash

    exp = EXPERIMENTS[1]
    largest = max(a.tokens for a in exp.arms)
    # Decoupled DiLoCo 8% behind at the headline budget, 3% at the largest, on every seed; the
    # seed-1 runs predate commit records.
    def loss(arm):
        base = 2.0 if arm.tokens == 1_000_000 else 1.0
        return base * ({"Decoupled DiLoCo": 1.08 if arm.tokens == 1_000_000 else 1.03,
                        "data-parallel": 1.0}.get(arm.label, 1.05))
    # Arms of one configuration share a run (the first label's here: the plain arms lead).
    records = {}
    for a in exp.arms:
        records.setdefault(arm_key(a), _fake_record(
            loss(a), None if a.seed == 1 else "abcdef1234", code_hash()))
    # Only the experiment's own seeds were run (the report also looks for seeds 3-5).
    monkeypatch.setattr(report, "load_arm", lambda arm: records.get(arm_key(arm)))

    rows, verdict = report._exp1(exp)
    assert not verdict["met"]
    assert "1.0800" in verdict["measured"] and "within 2%: no" in verdict["measured"]
    assert f"1.0300 ± 0.0000 (s.e. over seeds) at {largest:,} tokens (mean of 3 seeds" in \
        verdict["measured"]
    assert {r["tokens"] for r in rows} >= {1_000_000, largest}

    line = report.provenance(exp)
    # Counted over the runs the report shows: an arm declared on fewer seeds shows a run on
    # another seed where one of its configuration exists (the candidate default at 4M is the
    # plain arm's configuration now, which ran on seeds 1 and 2 too).
    shown = report.observed_arms(exp, report.load_arm)
    undated = sum(a.seed == 1 for a in shown)
    assert len(shown) > len(exp.arms)
    assert f"Runs computed at commit abcdef1; {undated} of {len(shown)} predate" in line
    assert "stale" not in line


def test_experiment_4_judges_each_budget_on_the_test_slice_where_its_runs_were_scored(
        monkeypatch):
    from benchmarks.quality import report
    from benchmarks.quality.code_identity import code_hash
    from benchmarks.quality.experiments import EXP4_TINY

    exp = EXPERIMENTS[4]
    tiny = [a for a in exp.arms if a.label.endswith(EXP4_TINY)]
    assert {(a.tokens, arm_config(a).model.d_model) for a in tiny} == {(4_000_000, 32)}
    # Tiny 4M: three settings (0.4x, 0.82x, 0.4x with outages) x three policies, data-parallel
    # at 0.4x with and without the outages, and the longer grace window's probe in each
    # setting; small: three settings (0.4x, 0.82x, 0.4x paced), one baseline, and the probe in
    # each setting.
    assert len(tiny) == 3 * (3 * 3 + 2 + 3) and len(exp.arms) - len(tiny) == 3 * (3 * 3 + 1 + 3)
    paced = [a for a in exp.arms if arm_config(a).sync.block_on_overlap]
    assert {a.label for a in paced} == {f"{p}, 0.4x, paced" for p in (
        "K=M", "K=1", "K=1 + grace", GRACE_ONE_STEP)}
    probes = [a for a in exp.arms if a.label.startswith(GRACE_ONE_STEP)]
    assert len(probes) == 18 and all(arm_config(a).sync.grace_min_seconds == 1.0
                                     for a in probes)
    assert len({a.seed for a in tiny}) == 3
    outages = [a for a in tiny if ", outages" in a.label]
    assert len(outages) == 15 and all(arm_config(a).simulation.outages for a in outages)
    # On the first 8 KB the grace window looks worse than K = 1 alone in every block; on the
    # test slice (scored only in the tiny 4M block) it is better.
    def record(arm):
        policy = arm.label.split(",")[0]
        first_8kb = {"K=M": 2.0, "K=1": 2.00, "K=1 + grace": 2.01}.get(policy, 1.9)
        r = _fake_record(first_8kb, "abcdef1234", code_hash())
        r["summary"]["goodput"] = 0.7 if policy == "K=M" else 0.99
        if arm in tiny:
            test = {"K=M": 1.5, "K=1": 1.52, "K=1 + grace": 1.49}.get(policy, 1.4)
            r["heldout_slices"] = {"test": {"loss": test + arm.seed * 1e-3,
                                            "standard_error": 0.01, "batches": 100}}
        return r
    records = {arm_key(a): record(a) for a in exp.arms}
    monkeypatch.setattr(report, "load_arm", lambda arm: records.get(arm_key(arm)))

    rows, verdict = report._exp4(exp)
    by_arm = {r["arm"]: r for r in rows}
    assert by_arm[f"K=1 + grace{EXP4_TINY}"]["test_loss"] == 1.491   # the mean over seeds 0-2
    assert by_arm["K=1 + grace"]["test_loss"] is None
    # Each seed's column is its test-slice loss, "-" where a run predates the slices.
    assert [by_arm[f"K=1 + grace{EXP4_TINY}"][f"test_loss_seed{s}"] for s in (0, 1, 2)] == [
        1.49, 1.491, 1.492]
    assert by_arm["K=1 + grace"]["test_loss_seed0"] is None
    tiny_04, tiny_082, tiny_outages, small_04, small_082, small_paced = \
        verdict["measured"].split(" / ")
    assert tiny_outages.startswith("tiny, 4M tokens, 0.4x with outages (test slice)")
    assert tiny_04.startswith("tiny, 4M tokens, 0.4x (test slice)")
    assert "K=1 alone loses quality (higher mean loss than K=1 + grace): yes" in tiny_04
    assert "K=1 alone loses quality (higher mean loss than K=1 + grace): yes" in tiny_082
    # The probe is reported beside each verdict, on the same slice, and does not enter it.
    assert tiny_04.endswith(f"probe, {GRACE_ONE_STEP}: loss 1.4010 (-6.7% vs K=M), "
                            "goodput 0.990")
    assert f"probe, {GRACE_ONE_STEP}: loss 1.9000 (-5.0% vs K=M)" in small_paced
    assert small_04.startswith("small, 500k tokens, 0.4x (first 8 KB)")
    assert "K=1 alone loses quality (higher mean loss than K=1 + grace): no" in small_04
    # Goodput is judged only where the learners are paced: unpaced none waits, so K = M's
    # lower goodput in these fake records counts only in the paced rows.
    goodput = "K=M loses goodput (vs K=1 + grace, by > 0.02): "
    for unpaced in (tiny_04, tiny_082, tiny_outages, small_04, small_082):
        assert goodput + "n/a, no learner waits unpaced" in unpaced
    assert small_paced.startswith("small, 500k tokens, 0.4x, learners paced (first 8 KB)")
    assert goodput + "yes" in small_paced
    assert not verdict["met"]
    # A block with a run missing (the breadth block, not yet run at today's defaults) is named
    # in the verdict; the other block's table and verdicts stand.
    records.pop(arm_key(next(a for a in exp.arms if a.label == "K=1 + grace")))
    rows, verdict = report._exp4(exp)
    assert {r["arm"] for r in rows} == {a.label for a in tiny}
    assert verdict["measured"].endswith("small, 500k tokens: 1 of 39 runs not run at today's "
                                        "config (`--tokens 500000`)")
    assert verdict["measured"].startswith(tiny_04)


def test_experiments_2_to_10_report_the_test_slice_and_keep_the_first_8_kb_beside_it(
        monkeypatch):
    """Experiment 7's verdict and ratios read the test slice where its runs were scored on it
    (int4 0.5% behind fp32: met), the first 8 KB only where they predate the slices (2%
    behind: not met), saying which; the other experiments' tables show both figures."""
    from benchmarks.quality import report
    from benchmarks.quality.code_identity import code_hash

    exp = EXPERIMENTS[7]

    def record(arm, scored):
        int4 = arm.label == "int4"
        r = _fake_record(2.04 if int4 else 2.0, "abcdef1234", code_hash())
        if scored:
            r["heldout_slices"] = {"test": {"loss": 1.809 if int4 else 1.8,
                                            "standard_error": 0.01, "batches": 100}}
        return r
    for scored, ratio, where, met in ((True, 1.005, "test slice", True),
                                      (False, 1.02, "first 8 KB", False)):
        stored = {arm_key(a): record(a, scored) for a in exp.arms}
        monkeypatch.setattr(report, "load_arm", lambda arm, stored=stored: stored.get(
            arm_key(arm)))
        rows, verdict = report._exp7(exp)
        assert f"int4 / fp32 = {ratio:.4f}" in verdict["measured"], verdict
        assert where in verdict["measured"] and verdict["met"] is met
        int4 = next(r for r in rows if r["encoding"] == "int4")
        assert int4["first_8kb_vs_fp32"] == 1.02
        assert int4["vs_fp32"] == (1.005 if scored else None)
        assert int4["test_loss"] == (1.809 if scored else None)

    exp = EXPERIMENTS[8]
    records = {arm_key(a): record(a, True) for a in exp.arms}
    monkeypatch.setattr(report, "load_arm", lambda arm: records.get(arm_key(arm)))
    rows, _ = report._exp8(exp)
    assert all(r["test_loss"] == 1.8 and r["first_8kb_loss"] == 2.0 and r["vs_overwrite"] == 1.0
               for r in rows)


def test_scavenged_capacity_is_priced_from_the_bandwidth_planner_and_the_window():
    """The scavenging benchmark's prices on the simulator's clock: a 12B model's bf16
    all-reduce between two sites (24 GB each way per step) over 100 Gbps is 1.92 s of a 1 s
    step; start-up and restarts are their share of a two-hour window mapped onto the run's."""
    import argparse

    from benchmarks.scavenging import DATA_PARALLEL, arm, prices

    args = argparse.Namespace(params=12e9, inter_site_gbps=100.0, step_seconds=1.0,
                              window_seconds=7200.0, start_seconds=12.5, restart_seconds=600.0)
    priced = prices(args, window_sim_seconds=36.0, sim_step_seconds=1.0)
    assert priced["allreduce_bytes_per_step"] == pytest.approx(24e9)
    assert priced["capacity_allreduce_seconds"] == pytest.approx(1.92)
    assert priced["capacity_start_seconds"] == pytest.approx(12.5 * 36 / 7200)
    assert priced["capacity_restart_seconds"] == pytest.approx(600 * 36 / 7200)
    # The prices ride on the capacity arms only: the base run is the plain default.
    assert not any("capacity" in o for o in arm(DATA_PARALLEL, 0, 500_000, 1, priced).overrides)
    extra = arm(DATA_PARALLEL, 2, 500_000, 1, priced, ("outer.lr=0.9",)).overrides
    assert "simulation.capacity_allreduce_seconds=1.92" in extra and "outer.lr=0.9" in extra


def test_scavenging_chooses_each_levels_setting_on_the_selection_seeds_validation_slice():
    """With candidates, each method's setting is chosen per capacity level by the mean
    validation-slice loss over the selection seeds (never the test slice, never another
    level's runs), today's value is always a candidate, and a method without candidates keeps
    today's settings. The fake runs put each level's best outer lr elsewhere and make the test
    slice disagree, so a choice made on the wrong slice, seeds or level would show."""
    import argparse

    from benchmarks.scavenging import DATA_PARALLEL, DECOUPLED, choose_settings

    best = {0: 0.5, 1: 0.3, 4: 0.8}
    seen_seeds = set()

    def lr_of(arm):
        return next(float(o.split("=")[1]) for o in arm.overrides if o.startswith("outer.lr="))

    def run(arms):
        out = {}
        for a in arms:
            extra = int(a.label.split("%")[0].lstrip("+")) * 4 // 100
            seen_seeds.add(a.seed)
            # Seed 1 alone prefers 0.8 everywhere: the mean over seeds must outvote it.
            val = (0.6 * abs(lr_of(a) - 0.8) if a.seed == 1 else abs(lr_of(a) - best[extra]))
            out[a] = {"heldout_slices": {"validation": {"loss": 2 + val},
                                         "test": {"loss": 2 - val}}}
        return out

    args = argparse.Namespace(tokens=500_000, extras=[0, 1, 4], selection_seeds=[0, 1, 2],
                              outer_lrs=[0.3, 0.8], inner_lrs=[], set=[])
    chosen, table = choose_settings(args, {"capacity_start_seconds": 0.05,
                                           "capacity_allreduce_seconds": 1.9,
                                           "capacity_restart_seconds": 2.5}, run)
    assert chosen == {(DECOUPLED, 0): "outer.lr=0.5", (DECOUPLED, 1): "outer.lr=0.3",
                      (DECOUPLED, 4): "outer.lr=0.8"}
    assert seen_seeds == {0, 1, 2}
    assert not any(row["method"] == DATA_PARALLEL for row in table)
    # Today's outer lr (0.5) was run beside the candidates at every level.
    assert all(set(row["validation_loss_by_value"]) == {"0.3", "0.5", "0.8"} for row in table)


def test_a_run_stored_under_an_old_default_is_not_taken_for_the_new_one(tmp_path):
    """An arm's key names only the fields it changes from the defaults, so when a default
    changes, the arms that do not override it land on the key of runs made under the old one:
    those runs answer another question and must not load (the report would show them under
    the new meaning). A field added since a run is no conflict."""
    import json

    from benchmarks.quality.experiments import DECOUPLED, Arm
    from benchmarks.quality.runner import arm_path, load_arm
    from diloco_core.config_loading import config_to_mapping

    arm = Arm("defaults", DECOUPLED, (), 0, 500_000)
    config = json.loads(json.dumps(config_to_mapping(arm_config(arm))))
    path = arm_path(arm, tmp_path)

    def store(cfg):
        path.write_text(json.dumps({"key": arm_key(arm), "config": cfg}))

    store(config)
    assert load_arm(arm, tmp_path) is not None
    older = json.loads(json.dumps(config))
    del older["simulation"]["capacity_restart_seconds"]     # a field added since
    store(older)
    assert load_arm(arm, tmp_path) is not None
    other = json.loads(json.dumps(config))
    other["inner"]["schedule"] = "cosine" if config["inner"]["schedule"] != "cosine" else "constant"
    store(other)
    assert load_arm(arm, tmp_path) is None


def test_a_current_run_moves_to_the_key_its_config_has_under_todays_defaults(tmp_path):
    """When a default changes to a value the runs chose (under an override then), those runs
    are the plain arm's now: `rekey_runs` moves them to its key, where `load_arm` finds them,
    instead of the sweep running them again. A stale run stays where it is."""
    import json

    from benchmarks.quality.code_identity import code_hash
    from benchmarks.quality.experiments import DECOUPLED, Arm
    from benchmarks.quality.runner import arm_path, load_arm, rekey_runs
    from diloco_core.config_loading import config_to_mapping

    plain = Arm("defaults", DECOUPLED, (), 0, 500_000)
    other = Arm("defaults, outer lr 0.3", DECOUPLED, ("outer.lr=0.3",), 0, 500_000)
    # Each stored under the key it had when another default held (a name no arm has today).
    for arm, name, code in ((plain, "0000000000000000", code_hash()),
                            (other, "1111111111111111", "older")):
        record = {"arm": {"label": arm.label, "method": arm.method}, "key": name, "code": code,
                  "config": json.loads(json.dumps(config_to_mapping(arm_config(arm))))}
        (tmp_path / f"{name}.json").write_text(json.dumps(record))
    assert load_arm(plain, tmp_path) is None
    assert rekey_runs(tmp_path) == [("0000000000000000", arm_key(plain))]
    moved = load_arm(plain, tmp_path)
    assert moved is not None and moved["key"] == arm_key(plain)
    assert not (tmp_path / "0000000000000000.json").exists()
    assert (tmp_path / "1111111111111111.json").exists() and not arm_path(other, tmp_path).exists()
    assert rekey_runs(tmp_path) == []                      # settled: nothing more moves


def test_a_stale_run_follows_its_config_to_its_key_under_todays_defaults_where_it_is_free(
        tmp_path):
    """A stale run is shown, marked stale, by the arm its config matches; when a default
    moves, `refile_stale_runs` moves it to the key its config has now (where `rekey_runs`, which
    moves current runs only, left it under a key no arm has), but never over a run already
    there."""
    import json

    from benchmarks.quality.code_identity import code_hash, is_current
    from benchmarks.quality.experiments import DECOUPLED, Arm
    from benchmarks.quality.runner import load_arm, rekey_runs
    from benchmarks.quality.stale_runs import refile_stale_runs
    from diloco_core.config_loading import config_to_mapping

    lone = Arm("outer lr 0.3", DECOUPLED, ("outer.lr=0.3",), 0, 500_000)
    taken = Arm("outer lr 0.7", DECOUPLED, ("outer.lr=0.7",), 0, 500_000)

    def store(arm, name, code, loss, dated=True):
        record = {"arm": {"label": arm.label, "method": arm.method}, "key": name, "code": code,
                  "config": json.loads(json.dumps(config_to_mapping(arm_config(arm)))),
                  "summary": {"final_heldout_loss": loss}}
        if dated:
            record["commit"] = {"commit": "abc1234"}
        else:                                   # from before runs recorded commit and code
            del record["code"]
        (tmp_path / f"{name}.json").write_text(json.dumps(record))

    # Both stale, each under the key it had when another default held; a current run of the
    # second arm already at its key.
    store(lone, "2222222222222222", "older", 2.5)
    store(taken, "3333333333333333", "older", 2.6)
    store(taken, arm_key(taken), code_hash(), 2.4)
    undated = Arm("outer lr 0.9", DECOUPLED, ("outer.lr=0.9",), 0, 500_000)
    store(undated, "4444444444444444", None, 2.7, dated=False)
    assert rekey_runs(tmp_path) == []                      # current runs only: nothing moves
    assert load_arm(lone, tmp_path) is None
    assert refile_stale_runs(tmp_path) == [("2222222222222222", arm_key(lone))]
    shown = load_arm(lone, tmp_path)
    assert shown["summary"]["final_heldout_loss"] == 2.5 and not is_current(shown)
    assert shown["key"] == arm_key(lone)
    assert load_arm(taken, tmp_path)["summary"]["final_heldout_loss"] == 2.4
    assert (tmp_path / "3333333333333333.json").exists()   # left where it was
    assert load_arm(undated, tmp_path) is None              # undated: left where it was too
    assert (tmp_path / "4444444444444444.json").exists()
    assert refile_stale_runs(tmp_path) == []               # settled: nothing more moves

    # A stale run whose key another stale run sits on, met first in the pass: it moves once
    # that one has moved off, in the same call (a single pass left it off its key until the
    # next report, where the flip to inner lr 8e-3 found one).
    first = Arm("outer lr 0.4", DECOUPLED, ("outer.lr=0.4",), 0, 500_000)
    squatter = Arm("outer lr 0.6", DECOUPLED, ("outer.lr=0.6",), 0, 500_000)
    store(first, "0000000000000000", "older", 2.8)
    store(squatter, arm_key(first), "older", 2.9)
    assert refile_stale_runs(tmp_path) == [(arm_key(first), arm_key(squatter)),
                                           ("0000000000000000", arm_key(first))]
    assert load_arm(first, tmp_path)["summary"]["final_heldout_loss"] == 2.8
    assert load_arm(squatter, tmp_path)["summary"]["final_heldout_loss"] == 2.9
    assert refile_stale_runs(tmp_path) == []


def test_a_config_fields_default_is_not_code_the_hash_covers():
    """A stored run records its whole config, so a changed default is caught by `load_arm`;
    hashing it too would stale every result for the change the results exist to decide. Only
    `@config_section` fields' defaults are dropped: everything else in the class still counts."""
    from benchmarks.quality.code_identity import semantic_source

    section = ('@config_section\nclass C:\n    x: int = 1\n    """The x."""\n\n'
               '    def __post_init__(self):\n        require(self.x > 0)\n')
    same = semantic_source(section, drop_field_defaults=True)
    assert same == semantic_source(section.replace("= 1", "= 3"), drop_field_defaults=True)
    for changed in (section.replace("x > 0", "x > 1"), section.replace("x: int", "y: int")):
        assert semantic_source(changed, drop_field_defaults=True) != same, changed
    plain = section.replace("@config_section\n", "")        # not a config section: counts
    assert semantic_source(plain, drop_field_defaults=True) != semantic_source(
        plain.replace("= 1", "= 3"), drop_field_defaults=True)
    assert semantic_source(section) != semantic_source(section.replace("= 1", "= 3"))


def test_a_baseline_run_stays_its_arms_when_a_default_it_does_not_read_changes(tmp_path):
    """Data-parallel reads no sync or outer field; a run recorded under another merge rule is
    still its arm's once `settle_unread_fields` has set those fields to what the arm resolves
    to today (what it recorded is kept), including an arm that overrides one of them.
    Decoupled DiLoCo reads the merge rule: its run is left alone."""
    import json

    from benchmarks.quality.code_identity import code_hash
    from benchmarks.quality.experiments import DATA_PARALLEL, DECOUPLED, Arm
    from benchmarks.quality.runner import load_arm, rekey_runs
    from benchmarks.quality.unread_fields import settle_unread_fields
    from diloco_core.config_loading import config_to_mapping

    other = "rda" if arm_config(Arm("x", DECOUPLED)).sync.merge_rule != "rda" else "mean"
    arms = (Arm("plain", DATA_PARALLEL, (), 0, 500_000),
            Arm("H = 16", DATA_PARALLEL, ("sync.sync_period=16",), 0, 500_000),
            Arm("plain", DECOUPLED, (), 0, 500_000))
    for i, arm in enumerate(arms):
        config = json.loads(json.dumps(config_to_mapping(arm_config(arm))))
        config["sync"]["merge_rule"] = other          # as recorded under the old default
        (tmp_path / f"{i:016d}.json").write_text(json.dumps(
            {"arm": {"label": arm.label, "method": arm.method, "seed": arm.seed,
                     "tokens": arm.tokens, "overrides": list(arm.overrides)},
             "key": f"{i:016d}", "code": code_hash(), "commit": {"commit": "abc1234"},
             "config": config}))
    assert settle_unread_fields(tmp_path) == [f"{0:016d}", f"{1:016d}"]
    rekey_runs(tmp_path)
    for arm in arms[:2]:
        run = load_arm(arm, tmp_path)
        assert run is not None and run["config_as_run"]["sync"]["merge_rule"] == other, arm
    assert load_arm(arms[1], tmp_path)["config"]["sync"]["sync_period"] == 16
    assert load_arm(arms[2], tmp_path) is None
    assert settle_unread_fields(tmp_path) == []             # settled: nothing more changes


def test_the_sync_fields_synchronous_diloco_sets_are_the_ones_it_does_not_read():
    from benchmarks.quality.unread_fields import SYNCHRONOUS_SETS
    from diloco_core.baselines import synchronous_config
    from diloco_core.config_loading import config_from_mapping

    base = synchronous_config(config_from_mapping({}, ())).sync
    another = {"num_fragments": 2, "overlap_steps": 2, "min_quorum": 2,
               "block_on_overlap": "true", "grace_gamma": 0.5, "grace_min_seconds": 1.0,
               "merge_rule": "rda", "weighting": "uniform", "receive_rule": "blend"}
    assert set(another) == set(SYNCHRONOUS_SETS)
    for name, value in another.items():
        cfg = config_from_mapping({}, (f"sync.{name}={value}",))
        assert synchronous_config(cfg).sync == base, name
    # A field it does not set reaches it.
    assert synchronous_config(config_from_mapping({}, ("sync.sync_period=16",))).sync != base


def test_run_arms_runs_each_missing_arm_once_longest_first_and_returns_every_record(
        monkeypatch):
    """The sweep runner (`quality/parallel.py`): an arm with a usable stored result does not
    run, two arms with one key run once, the arms to run go longest first, and every arm's
    record comes back by key, stored or new."""
    from benchmarks.quality import parallel
    from benchmarks.quality.experiments import DECOUPLED, Arm

    stored = {"short-stored": {"stored": True}}
    ran = []

    def key(arm):
        return arm.label

    monkeypatch.setattr(parallel, "arm_key", key)
    monkeypatch.setattr(parallel, "load_arm", lambda arm, runs_dir: stored.get(key(arm)))
    monkeypatch.setattr(parallel, "is_usable", lambda record, sizes: record is not None)

    def fake_run(arm, runs_dir, sizes):
        ran.append(arm.label)
        stored[arm.label] = {"ran": arm.label}
        return stored[arm.label]

    monkeypatch.setattr(parallel, "run_arm", fake_run)
    arms = [Arm("short", DECOUPLED, tokens=100), Arm("short-stored", DECOUPLED, tokens=100),
            Arm("long", DECOUPLED, tokens=1000), Arm("short", DECOUPLED, tokens=100)]
    done = []
    records = parallel.run_arms(arms, on_done=lambda arm, record: done.append(arm.label))
    assert ran == ["long", "short"] and done == ran
    assert records == {"short": {"ran": "short"}, "short-stored": {"stored": True},
                       "long": {"ran": "long"}}


def test_experiment_1s_trend_plots_the_test_slice_and_leaves_no_stale_image(monkeypatch,
                                                                             tmp_path):
    """The budget trend draws each method's test-slice ratio on the confirmation seeds where
    they ran, else the selection seeds; where no method has two budgets on the slices it draws
    nothing, removes the image an older report left, and the report does not show it."""
    from benchmarks.quality import report
    from benchmarks.quality.code_identity import code_hash

    def row(tokens, method, seed_role, ratio):
        return {"tokens": tokens, "method": method, "seed_role": seed_role,
                "test_vs_data_parallel": ratio, "test_ratio_se_seeds": 0.01}
    rows = [row(500_000, "Decoupled DiLoCo", "selection", 1.05),
            row(500_000, "Decoupled DiLoCo", "confirmation", 1.02),
            row(1_000_000, "Decoupled DiLoCo", "confirmation", 1.03),
            row(4_000_000, "Decoupled DiLoCo", "selection", 1.01),
            row(4_000_000, "Decoupled DiLoCo, M = 2", "selection", 0.9),
            row(1_000_000, "synchronous DiLoCo", "selection", 1.04),
            row(2_000_000, "synchronous DiLoCo", "selection", None),   # not on the slices
            row(1_000_000, "data-parallel", "selection", 1.0)]
    points = report.trend_points(rows)
    assert [(t, r["test_vs_data_parallel"]) for t, r in points["Decoupled DiLoCo"]] == [
        (500_000, 1.02), (1_000_000, 1.03), (4_000_000, 1.01)]
    assert [t for t, _ in points["synchronous DiLoCo"]] == [1_000_000]
    assert set(points) == {"Decoupled DiLoCo", "synchronous DiLoCo"}
    assert report._trend_plot(rows, tmp_path / "trend.png").stat().st_size > 0

    # Through the whole report: runs that predate the slices draw no trend.
    monkeypatch.setattr(report, "OUT_DIR", tmp_path / "out")
    monkeypatch.setattr(report, "IMG_DIR", tmp_path)
    exp = EXPERIMENTS[1]
    stale = tmp_path / f"quality_{report._name(exp)}_trend.png"
    stale.write_bytes(b"an old plot")
    machine = {"platform": "Linux-x", "cpu_count": 2, "jax": "0.10.2"}
    records = {arm_key(a): {**_fake_record(2.0, "abcdef1234", code_hash()), "machine": machine}
               for a in exp.arms}
    monkeypatch.setattr(report, "load_arm", lambda arm: records.get(arm_key(arm)))
    monkeypatch.setattr(report, "_plot", lambda exp, path: path)   # the other plot
    report.write_experiment(exp)
    assert not stale.exists()
    assert "_trend.png" not in (tmp_path / "out" / f"{report._name(exp)}.md").read_text()


def test_a_report_reads_each_arm_once_and_the_next_report_reads_again(monkeypatch, tmp_path):
    """Experiment 1's report asked for the same stored runs thousands of times (~2 min); within
    one report each arm's run is read once. The reads are not kept: a sweep reports before and
    after its runs, and the second report must see what ran in between."""
    from collections import Counter

    from benchmarks.quality import report
    from benchmarks.quality.code_identity import code_hash

    monkeypatch.setattr(report, "OUT_DIR", tmp_path / "out")
    monkeypatch.setattr(report, "IMG_DIR", tmp_path)
    monkeypatch.setattr(report, "_plot", lambda exp, path: path)
    exp = EXPERIMENTS[1]
    machine = {"platform": "Linux-x", "cpu_count": 2, "jax": "0.10.2"}

    def record():
        return {**_fake_record(2.0, "abcdef1234", code_hash()), "machine": machine}
    records = {arm_key(a): record() for a in exp.arms}
    reads = Counter()

    def load(arm):
        reads[arm] += 1
        return records.get(arm_key(arm))
    monkeypatch.setattr(report, "load_arm", load)
    report.write_experiment(exp)
    assert reads and max(reads.values()) == 1, reads.most_common(3)
    out = tmp_path / "out" / f"{report._name(exp)}.json"
    seed_4 = reseed([exp.arms[0]], [4])[0]
    shown = f"{seed_4.label} (seed 4, {seed_4.tokens:,} tokens)"
    assert shown not in json.loads(out.read_text())["runs"]
    records[arm_key(seed_4)] = record()                 # ran between the two reports
    reads.clear()
    report.write_experiment(exp)
    assert reads[seed_4] == 1 and max(reads.values()) == 1
    assert shown in json.loads(out.read_text())["runs"]
    assert report._READ is None            # nothing kept outside a report


def test_experiment_1_measures_the_dilocos_against_data_parallel_at_its_best_lr(monkeypatch):
    """Where another data-parallel lr beats the default's on the validation slice of the
    selection seeds, every DiLoCo's ratio and the verdict are against it, named; a worse one
    leaves the default as the reference."""
    from benchmarks.quality import report
    from benchmarks.quality.code_identity import code_hash

    exp = EXPERIMENTS[1]
    lower = "data-parallel, inner lr 4.5e-3"
    assert any(a.label == lower and a.tokens == 1_000_000 for a in exp.arms)

    def records_for(lower_loss):
        def loss(arm):
            return {"data-parallel": 2.0, lower: lower_loss}.get(arm.label, 2.04)
        records = {}
        for a in exp.arms:
            r = _fake_record(loss(a), "abcdef1234", code_hash())
            r["heldout_slices"] = {name: {"loss": loss(a) + a.seed * 1e-3,
                                          "standard_error": 0.01, "batches": 100}
                                   for name in ("validation", "test")}
            records.setdefault(arm_key(a), r)   # one configuration's run: the first label's
        return records
    for lower_loss, against, ratio in ((1.96, lower, 2.04 / 1.96),
                                       (2.02, "data-parallel", 1.02)):
        records = records_for(lower_loss)
        monkeypatch.setattr(report, "load_arm", lambda arm, r=records: r.get(arm_key(arm)))
        rows, verdict = report._exp1(exp)
        decoupled = next(r for r in rows if r["tokens"] == 1_000_000
                         and r["method"] == "Decoupled DiLoCo")
        assert decoupled["against"] == against
        assert decoupled["test_vs_data_parallel"] == pytest.approx(ratio, abs=2e-4)
        assert f"= {ratio:.4f}" in verdict["measured"], verdict
        assert ("(inner lr 4.5e-3, its best on the validation slice)" in verdict["measured"]) \
            is (against == lower)
        default = next(r for r in rows if r["tokens"] == 1_000_000
                       and r["method"] == "data-parallel")
        assert default["test_vs_data_parallel"] == pytest.approx(2.0 / lower_loss
                                                                 if against == lower else 1.0,
                                                                 abs=2e-4)
    # A configuration run on seed 0 only is not data-parallel's best yet, however low its
    # loss there: the default stays the reference at that budget.
    largest = max(a.tokens for a in exp.arms)
    records = records_for(1.96)
    for a in exp.arms:
        if a.tokens == largest and a.label == lower and a.seed != 0:
            records.pop(arm_key(a))
    monkeypatch.setattr(report, "load_arm", lambda arm: records.get(arm_key(arm)))
    _, verdict = report._exp1(exp)
    assert verdict["measured"].endswith(f"= 1.0200 ± 0.0000 (s.e. over seeds) at {largest:,} "
                                        "tokens (mean of 3 seeds, paired; test slice, selection "
                                        "seeds 0, 1, 2 (not yet confirmed on fresh seeds)); "
                                        f"within 1.5% (the bar at {largest / 1e6:g}M tokens): "
                                        "no"), verdict
    # Where data-parallel's best has run and Decoupled DiLoCo has not, the gap is said to be
    # unmeasured rather than taken against another baseline.
    records = records_for(1.96)
    for a in exp.arms:
        if a.tokens == largest and a.label == "Decoupled DiLoCo":
            records.pop(arm_key(a))
    monkeypatch.setattr(report, "load_arm", lambda arm: records.get(arm_key(arm)))
    _, verdict = report._exp1(exp)
    assert verdict["measured"].endswith(
        f"(inner lr 4.5e-3, its best on the validation slice) not measured at {largest:,} "
        "tokens: no seed has run for both"), verdict


def test_data_parallels_best_is_chosen_among_the_arms_that_ran_where_the_default_has_not(
        monkeypatch):
    """Right after a default changes, the plain data-parallel arm has no runs at a budget
    until it is re-run: the reference there is still data-parallel's best of the
    configurations that ran on the selection seeds (paired with the one run on the most of
    them), not a budget left out of the table and a gap "not measured"."""
    from benchmarks.quality import report
    from benchmarks.quality.code_identity import code_hash
    from benchmarks.quality.experiments import DATA_PARALLEL_BEST

    exp = EXPERIMENTS[1]
    largest = max(a.tokens for a in exp.arms)
    records = {}
    for a in exp.arms:
        loss = {DATA_PARALLEL_BEST: 1.96}.get(a.label, 2.0 if a.method == DATA_PARALLEL
                                               else 2.04)
        r = _fake_record(loss, "abcdef1234", code_hash())
        r["heldout_slices"] = {name: {"loss": loss + a.seed * 1e-3, "standard_error": 0.01,
                                      "batches": 100} for name in ("validation", "test")}
        if not (a.label == "data-parallel" and a.tokens == largest):
            records[arm_key(a)] = r
    monkeypatch.setattr(report, "load_arm", lambda arm: records.get(arm_key(arm)))
    rows, verdict = report._exp1(exp)
    at_largest = [r for r in rows if r["tokens"] == largest]
    assert at_largest and {r["against"] for r in at_largest} == {DATA_PARALLEL_BEST}
    assert "data-parallel" not in {r["method"] for r in at_largest}
    assert verdict["measured"].endswith(
        f"(inner lr 4.5e-3, clip at 0.5, warm-up 40, its best on the validation slice) = "
        f"{2.04 / 1.96:.4f} ± 0.0000 (s.e. over seeds) at {largest:,} tokens (mean of 3 seeds, "
        "paired; test slice, selection seeds 0, 1, 2 (not yet confirmed on fresh seeds)); "
        f"within 1.5% (the bar at {largest / 1e6:g}M tokens): no"), verdict


def test_a_label_that_names_no_arm_is_refused_with_the_labels_near_it():
    """A command quoted from an older record may name an arm by a label renamed since (an arm
    pinned to the default it ran at carries it in its label): it must say so, not run
    nothing."""
    from benchmarks.quality_benchmarks import unknown_labels

    assert unknown_labels([1, 9], ["data-parallel", "Decoupled DiLoCo, no failures"]) == []
    [problem] = unknown_labels([1], ["data-parallel", "Decoupled DiLoCo, inner lr 8e-3"])
    assert "'Decoupled DiLoCo, inner lr 8e-3' names no arm" in problem
    assert "'Decoupled DiLoCo, inner lr 6e-3'" in problem
    assert unknown_labels([9], ["Decoupled DiLoCo, no failures"]) == []
    assert len(unknown_labels([2], ["Decoupled DiLoCo, no failures"])) == 1


def test_the_results_page_rewrites_only_the_experiments_asked_for(monkeypatch, tmp_path):
    """`quality_benchmarks.py 12` rewrites experiment 12's section of the page; experiment 1's
    stays as its last report wrote it (its JSON agrees), even where experiment 12's runs would
    move its figures; one never reported is written now, and one whose runs went stale is
    marked so whoever asked."""
    from benchmarks.quality import report

    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setattr(report, "OUT_DIR", out)
    for number in (1, 12, 5):
        (out / f"{report._name(EXPERIMENTS[number])}.md").write_text(
            f"### {number}. as last written\n")

    def section(exp):
        if exp.number == 5:
            raise report.Missing("a run went stale")
        return f"### {exp.number}. as it stands now\n"
    monkeypatch.setattr(report, "section", section)
    monkeypatch.setattr(report, "real_path_section", lambda: "### real path\n")
    page = tmp_path / "results.md"
    page.write_text("# Results\n")

    text = report.write_results_page(page, numbers=[12]).read_text()
    assert "### 12. as it stands now" in text and "### 12. as last written" not in text
    assert "### 1. as last written" in text and "### 1. as it stands now" not in text
    assert "### 2. as it stands now" in text            # never reported: written now
    assert "**Not current: a run went stale**" in text   # experiment 5, not asked for
    text = report.write_results_page(page).read_text()   # `--report`: every experiment now
    assert "### 1. as it stands now" in text and "### 1. as last written" not in text


def test_experiment_1_shows_seed_by_seed_the_configurations_level_for_the_reference(
        monkeypatch):
    """Two data-parallel configurations level on the selection seeds and apart on the
    confirmation seeds: the seed-by-seed table lists both, says which one is the reference and
    which was level, and shows the confirmation seeds that broke the tie; the verdict is taken
    against the reference it names."""
    from benchmarks.quality import report
    from benchmarks.quality.code_identity import code_hash
    from benchmarks.quality.experiments import DATA_PARALLEL_BEST

    exp = EXPERIMENTS[1]
    # Level on seeds 0-2 (alternating by 0.004 around the same mean), the default lower by
    # 0.02 on seeds 3-5.
    def loss(a):
        if a.label == "data-parallel":
            return 2.0 + (0.004 if a.seed == 1 else -0.002 if a.seed < 3 else -0.02)
        if a.label == DATA_PARALLEL_BEST:
            return 2.0 + (-0.004 if a.seed == 1 else 0.002 if a.seed < 3 else 0.0)
        return 2.1 if a.method == DATA_PARALLEL else 2.06
    records = {}
    for a in exp.arms + tuple(reseed(exp.arms, range(6), tokens=1_000_000)):
        r = _fake_record(loss(a), "abcdef1234", code_hash())
        r["heldout_slices"] = {name: {"loss": loss(a), "standard_error": 0.01, "batches": 100}
                               for name in ("validation", "test")}
        records.setdefault(arm_key(a), r)
    monkeypatch.setattr(report, "load_arm", lambda arm: records.get(arm_key(arm)))
    rows = {r["arm"]: r for r in report.per_seed(exp) if r["tokens"] == 1_000_000}
    assert rows["data-parallel"]["reference"] == "yes"
    assert rows[DATA_PARALLEL_BEST]["reference"] == "level"
    assert rows["data-parallel"]["seed 3"] == pytest.approx(1.98)
    assert rows[DATA_PARALLEL_BEST]["seed 1"] == pytest.approx(1.996)
    assert rows["Decoupled DiLoCo"]["reference"] == ""
    _, verdict = report._exp1(exp)
    assert verdict["measured"].startswith(
        'Decoupled / data-parallel (its default settings: level with "inner lr 4.5e-3, clip at '
        '0.5, warm-up 40" on the selection seeds'), verdict
    assert f"= {2.06 / 1.98:.4f}" in verdict["measured"], verdict


def test_experiment_1s_plot_draws_the_methods_at_todays_defaults_and_a_long_legend_sits_outside(
        monkeypatch, tmp_path):
    """Experiment 1 has run dozens of configurations at 1M: drawn all at once their legend
    covered the curves. Its plot draws the three methods and M = 2 / 8 at today's defaults
    (the table keeps every configuration), and any plot with more than eight legend entries
    puts the legend beside the axes on a wider figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.quality import report
    from benchmarks.quality.code_identity import code_hash

    exp = EXPERIMENTS[1]
    evals = [{"tokens": 500_000, "loss": 2.5}, {"tokens": 1_000_000, "loss": 2.0}]
    records = {arm_key(a): {**_fake_record(2.0, "abcdef1234", code_hash()),
                            "summary": {"final_heldout_loss": 2.0, "evals": evals}}
               for a in exp.arms}
    monkeypatch.setattr(report, "load_arm", lambda arm: records.get(arm_key(arm)))
    drawn = []

    def save(fig, ax, title, path):
        drawn.extend(ax.get_legend_handles_labels()[1])
        plt.close(fig)
        return path
    monkeypatch.setattr(report, "_save", save)
    report._plot(exp, tmp_path / "exp1.png")
    assert {label.split(" (mean of")[0] for label in drawn} == set(report.EXP1_PLOTTED)
    assert len({a.label for a in exp.arms if a.tokens == 1_000_000}) > len(drawn)

    monkeypatch.undo()
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    for i in range(report.LEGEND_INSIDE_AT_MOST + 1):
        ax.plot([0, 1], [i, i], label=f"arm {i}")
    report._save(fig, ax, "many arms", tmp_path / "many.png")
    assert fig.get_size_inches()[0] > 7.5   # widened for the legend beside the axes
    assert (tmp_path / "many.png").stat().st_size > 0
