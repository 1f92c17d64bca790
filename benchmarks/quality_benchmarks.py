"""Quality benchmarks: the paper's findings reproduced at CPU scale on the reference simulator.

    python benchmarks/quality_benchmarks.py all        # every experiment (about an hour, 2 cores)
    python benchmarks/quality_benchmarks.py 1 4        # experiments 1 and 4 only
    python benchmarks/quality_benchmarks.py 1 --workers 2   # arms in 2 processes at once
    python benchmarks/quality_benchmarks.py --report   # tables, plots and docs/results.md
                                                       # from the stored results
    python benchmarks/quality_benchmarks.py 1 --report # experiment 1's only (the page's other
                                                       # sections stay as last reported)
    python benchmarks/quality_benchmarks.py 1 --seeds confirmation --tokens 1000000 \
        --labels data-parallel "Decoupled DiLoCo"     # those arms on seeds 3-5 instead

Every run is scored on a validation and a test slice of the held-out stream (100 batches each
unless --validation-batches / --test-batches say otherwise; `diloco_core/eval_slices.py`).
Seeds 0-2 are for selection, 3-5 for confirmation (`benchmarks/quality/selection.py`).

Each arm's figures are stored in `benchmarks/results/quality/runs/` as soon as it finishes (an
interrupted sweep resumes); each experiment's table, verdict and plot go to
`benchmarks/results/quality/expN_<slug>.{json,md}` and `docs/img/quality_expN_<slug>.png`.
The experiments are defined in `benchmarks/quality/experiments.py`.
"""

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.quality.experiments import EXPERIMENTS, RUN_ORDER  # noqa: E402
from benchmarks.quality.scoring import TEST_BATCHES, VALIDATION_BATCHES  # noqa: E402


def _selected(names: list[str]) -> list[int]:
    if not names or names == ["all"]:
        return list(RUN_ORDER)
    chosen = []
    for name in names:
        if not name.isdigit() or int(name) not in EXPERIMENTS:
            raise SystemExit(f"unknown experiment {name!r}; choose from 1-12 or 'all'")
        chosen.append(int(name))
    return chosen


def unknown_labels(numbers: list[int], labels: list[str] | None) -> list[str]:
    """Each --labels entry that names no arm of the chosen experiments, with the labels it is
    near (a label quoted from an older record may have been renamed since: an arm pinned to
    the default it ran at carries it in its label). Empty when every label names an arm."""
    import difflib

    known = sorted({a.label for n in numbers for a in EXPERIMENTS[n].arms})
    problems = []
    for label in labels or ():
        if label not in known:
            near = difflib.get_close_matches(label, known, n=3, cutoff=0.6)
            hint = f"; near: {', '.join(repr(k) for k in near)}" if near else ""
            problems.append(f"{label!r} names no arm of experiment(s) "
                            f"{', '.join(map(str, numbers))}{hint}")
    return problems


def _arms(exp, args) -> list:
    """The experiment's arms that this command runs: its own, or (--seeds) each configuration
    at the seeds asked for; --labels and --tokens narrow them, --max-tokens caps the budget."""
    from benchmarks.quality.selection import parse_seeds, reseed

    arms = list(exp.arms)
    if args.seeds or args.labels or args.tokens is not None:
        seeds = parse_seeds(args.seeds) if args.seeds else None
        arms = [a for a in arms if (not args.labels or a.label in args.labels)
                and (args.tokens is None or a.tokens == args.tokens)]
        if seeds is not None:
            arms = reseed(arms, seeds)
    return [a for a in arms if args.max_tokens is None or a.tokens <= args.max_tokens]


def _sizes(args):
    from benchmarks.quality.scoring import SliceSizes

    return SliceSizes(args.validation_batches, args.test_batches)


def run(numbers: list[int], args) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from benchmarks.quality.code_identity import code_hash
    from benchmarks.quality.report import write_experiment
    from benchmarks.quality.runner import arm_key, is_usable, load_arm, run_arm

    console = Console(stderr=True)
    sizes = _sizes(args)
    code_hash()  # the code this process runs, hashed now (see run_parallel)
    for number in numbers:
        exp = EXPERIMENTS[number]
        arms = _arms(exp, args)
        todo = [a for a in arms if not is_usable(load_arm(a), sizes)]
        console.print(f"experiment {number} ({exp.slug}): {len(exp.arms)} arms, "
                      f"{len(todo)} to run now")
        for arm in arms:
            label = f"{arm.label} (seed {arm.seed})"
            with Progress(TextColumn("{task.description:<40}"), BarColumn(),
                          MofNCompleteColumn(), TimeElapsedColumn(), console=console) as bar:
                task = bar.add_task(label, total=arm.tokens)
                last = [-1]

                def progress(done: int, total: int, task=task, label=label, last=last) -> None:
                    bar.update(task, completed=min(done, total))
                    if not console.is_terminal and 10 * done // total > last[0]:
                        last[0] = 10 * done // total  # logs: one line every 10%
                        console.print(f"  {label}: {min(done, total):,}/{total:,} tokens")

                record = run_arm(arm, progress=progress, sizes=sizes)
            console.print(f"  {label}: {_figures(record)} ({record['compute_seconds']} s, "
                          f"run {arm_key(arm)})")
        try:  # a report bug must not cost the runs: `--report` rebuilds it from stored results
            paths = write_experiment(exp)
            console.print(f"  wrote {', '.join(str(p.relative_to(REPO)) for p in paths)}")
        except Exception as err:  # noqa: BLE001
            console.print(f"  [red]report of experiment {number} failed: {err!r}[/red]")


def _figures(record: dict) -> str:
    slices = record.get("heldout_slices")
    first = f"first 8 KB {record['summary']['final_heldout_loss']:.4f}"
    if not slices:
        return f"held-out loss ({first})"
    return (f"validation {slices['validation']['loss']:.4f}, test {slices['test']['loss']:.4f}"
            f" ± {slices['test']['standard_error']:.4f} ({first})")


def run_parallel(numbers: list[int], args) -> None:
    """Run the selected experiments' arms in `workers` processes (`parallel.run_arms`), each arm
    once however many experiments share it."""
    from benchmarks.quality.parallel import arms_to_run, run_arms
    from benchmarks.quality.report import write_experiment
    from benchmarks.quality.runner import arm_key

    sizes = _sizes(args)
    arms = [arm for number in numbers for arm in _arms(EXPERIMENTS[number], args)]
    print(f"{len(arms_to_run(arms, sizes=sizes))} arms to run in {args.workers} processes",
          flush=True)

    def done(arm, record) -> None:
        print(f"  {arm.label} (seed {arm.seed}, {arm.tokens:,} tokens): {_figures(record)}"
              f" ({record['compute_seconds']} s, run {arm_key(arm)})", flush=True)

    run_arms(arms, workers=args.workers, sizes=sizes, on_done=done)
    for number in numbers:
        try:
            write_experiment(EXPERIMENTS[number])
        except Exception as err:  # noqa: BLE001
            print(f"  report of experiment {number} failed: {err!r}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiments", nargs="*", help="experiment numbers (1-12) or 'all'")
    parser.add_argument("--report", action="store_true",
                        help="only rebuild tables and plots from stored results")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="run only the arms with at most this budget (the rest later)")
    parser.add_argument("--workers", type=int, default=1,
                        help="run arms in this many processes at once (default 1)")
    parser.add_argument("--seeds", nargs="+", default=None,
                        help="run each configuration at these seeds instead: 'selection' "
                             "(0-2), 'confirmation' (3-5) or numbers")
    parser.add_argument("--labels", nargs="+", default=None,
                        help="run only the arms with these labels")
    parser.add_argument("--tokens", type=int, default=None,
                        help="run only the arms at this token budget")
    parser.add_argument("--validation-batches", type=int, default=VALIDATION_BATCHES,
                        help=f"validation slice size in batches (default {VALIDATION_BATCHES})")
    parser.add_argument("--test-batches", type=int, default=TEST_BATCHES,
                        help=f"test slice size in batches (default {TEST_BATCHES})")
    args = parser.parse_args()
    numbers = _selected(args.experiments)
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    # A label that selects nothing would run nothing and say so only as "0 to run now".
    if (problems := unknown_labels(numbers, args.labels)):
        parser.error("--labels: " + "\n  ".join(problems))
    from benchmarks.quality.runner import RUNS_DIR, rekey_runs
    from benchmarks.quality.stale_runs import refile_stale_runs
    from benchmarks.quality.unread_fields import settle_unread_fields

    # A default changed since the runs were stored: the baselines' runs take today's value of
    # the fields they do not read, then each current run moves to its key under today's
    # defaults, so that the runs made at the new value are the plain arm's now, and each stale
    # run onto its key where that is free (its arm shows it, marked stale).
    settled = settle_unread_fields(RUNS_DIR)
    if settled:
        print(f"{len(settled)} baseline runs: fields they do not read set to their arms' "
              "values today")
    for old, new in rekey_runs():
        print(f"run {old} -> {new} (a default changed)")
    for old, new in refile_stale_runs():
        print(f"stale run {old} -> {new} (a default changed; shown marked stale)")
    if not args.report and args.workers > 1:
        run_parallel(numbers, args)
    elif not args.report:
        run(numbers, args)
    from benchmarks.quality.report import Missing, write_experiment, write_results_page

    for number in numbers:
        try:
            for path in write_experiment(EXPERIMENTS[number]):
                print(path.relative_to(REPO))
        except Missing as why:
            print(f"experiment {number}: not written, {why}")
    print(write_results_page(numbers=numbers).relative_to(REPO))


if __name__ == "__main__":
    main()
