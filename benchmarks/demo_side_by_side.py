"""`diloco demo` at this checkout and at an older commit, interleaved on one machine.

The demo's decision -> published latency moves with the machine's load by half (issue 35's
notes), so a figure from another day is no baseline. This runs the demo at HEAD ("after") and
at `--baseline REF` ("before", a temporary git worktree whose own packages are imported through
PYTHONPATH, with this environment's installed dependencies), alternating which goes first, and
splits each round's decision -> published from the store the run left:

- `before_merge`: the decision's `decided_at` (taken at the start of the syncer's tick, before it
  reads the store) to the start of the merge: the tick's reads, its writes, the lease;
- `merge_seconds`: the merge's own clock, from its start to `published_at` (loading the
  fragment and the contributions, merging, checking).

Only versions retention kept have their merge record; every run's summary has the full
decision -> published distribution.

    python benchmarks/demo_side_by_side.py --baseline da36eb6 --runs 2
"""

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "demo_side_by_side.json"


def _git(*argv: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *argv], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()


def _cli_module(code: Path) -> str:
    """The `diloco` command's module at that commit (it moved to pipelines/commands/)."""
    return ("pipelines.commands.cli" if (code / "pipelines" / "commands" / "cli.py").exists()
            else "pipelines.cli")


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def split_latency(store: Path) -> dict:
    """Per committed round still in the store: decision -> published, the merge's own
    seconds, and what came before the merge."""
    decided = {}
    for path in glob.glob(str(store / "experiments" / "*" / "rounds" / "*" / "decision.json")):
        record = json.loads(Path(path).read_text())
        decided[record["round"]] = record["decided_at"]
    rows = []
    for path in glob.glob(str(store / "experiments" / "*" / "global" / "*" / "v*" /
                              "manifest.json")):
        meta = json.loads(Path(path).read_text()).get("meta") or {}
        r, published, merge = meta.get("round"), meta.get("published_at"), meta.get(
            "merge_seconds")
        if r in decided and published and merge is not None:
            total = published - decided[r]
            rows.append({"round": r, "decision_to_published": total, "merge_seconds": merge,
                         "before_merge": total - merge})
    return {"rounds": len(rows),
            **{f"{k}_median": _median([row[k] for row in rows])
               for k in ("decision_to_published", "merge_seconds", "before_merge")}}


def run_demo(code: Path, workdir: Path) -> dict:
    workdir.mkdir(parents=True)
    out = workdir / "summary.json"
    env = {**os.environ, "PYTHONPATH": str(code)}
    command = [sys.executable, "-m", _cli_module(code), "demo", "--workdir",
               str(workdir / "demo"), "--json", str(out), "--set",
               f"orchestration.compilation_cache_dir={workdir / 'jax-cache'}"]
    load = os.getloadavg()[0]
    with open(workdir / "log", "w") as log:
        subprocess.run(command, cwd=code, env=env, check=True, stdout=log,
                       stderr=subprocess.STDOUT)
    s = json.loads(out.read_text())
    return {"load_average_1m_at_start": load,
            "decision_to_published": s["decision_to_publish_seconds"],
            "quorum_to_published": s["merge_latency_seconds"],
            "final_eval_loss": s["final_eval_loss"], "rounds_merged": s["rounds_merged"],
            "wall_seconds": s["wall_seconds"],
            "split": split_latency(workdir / "demo" / "store")}


def _side_medians(runs: list[dict]) -> dict:
    def each(get):
        values = [get(r) for r in runs]
        return {"runs": values, "median": _median([v for v in values if v is not None])}
    return {
        "decision_to_published_median_s": each(lambda r: r["decision_to_published"]["median"]),
        "decision_to_published_p90_s": each(lambda r: r["decision_to_published"]["p90"]),
        "quorum_to_published_median_s": each(lambda r: r["quorum_to_published"]["median"]),
        "merge_seconds_median_s": each(lambda r: r["split"]["merge_seconds_median"]),
        "before_merge_median_s": each(lambda r: r["split"]["before_merge_median"]),
        "final_eval_loss": each(lambda r: r["final_eval_loss"]),
        "wall_seconds": each(lambda r: r["wall_seconds"]),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="the older commit ('before')")
    parser.add_argument("--runs", type=int, default=2, help="demos per side")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    from pipelines.reporting import machine_info

    head = _git("rev-parse", "HEAD")
    base = _git("rev-parse", args.baseline)
    sides: dict[str, list[dict]] = {"after": [], "before": []}
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "baseline"
        _git("worktree", "add", "--detach", str(tree), base)
        try:
            for i in range(args.runs):
                order = ("after", "before") if i % 2 == 0 else ("before", "after")
                for side in order:
                    code = ROOT if side == "after" else tree
                    started = time.time()
                    result = run_demo(code, Path(tmp) / f"{side}-{i}")
                    sides[side].append(result)
                    print(f"{side} {i}: decision -> published median "
                          f"{result['decision_to_published']['median']:.3f} s (merge "
                          f"{result['split']['merge_seconds_median']:.3f} s), loss "
                          f"{result['final_eval_loss']:.3f}, {time.time() - started:.0f} s",
                          flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                           check=False)
    after, before = _side_medians(sides["after"]), _side_medians(sides["before"])
    ratio = {k: (after[k]["median"] / before[k]["median"]
                 if after[k]["median"] and before[k]["median"] else None) for k in after}
    result = {
        "benchmark": "demo_side_by_side", "commit": head, "baseline": base,
        "uncommitted_changes": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "command": "python benchmarks/demo_side_by_side.py " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "after": after, "before": before, "after_over_before": ratio,
        "runs": sides,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"after": {k: v["median"] for k, v in after.items()},
                      "before": {k: v["median"] for k, v in before.items()},
                      "after_over_before": ratio}, indent=2))
    return result


if __name__ == "__main__":
    main()
