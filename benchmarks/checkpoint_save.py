"""Learner checkpoint saves: how long a save holds the learner's loop, and how long until it is
durable, with Orbax creating the checkpoint's directories on the caller's thread (the project's
setting, safe with several managers in one process) or in its background (Orbax's default).

Per backend (a local path, a loopback GCS API server) and repeat, both settings interleaved:
a background save (`wait=False`: the time until it returns is what the learner's loop waits)
then its wait until durable, and a blocking save (`wait=True`). Medians over repeats.

    python benchmarks/checkpoint_save.py          # 48 MB of float32 state, 5 repeats
"""

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from pipelines.reporting import code_revision, machine_info  # noqa: E402
from resources.store.checkpoints import LearnerCheckpoints  # noqa: E402

DEFAULT_OUT = Path(__file__).parent / "results" / "checkpoint_save.json"
SETTINGS = {"caller": False, "background": True}     # name -> directories_in_background


def learner_state(megabytes: float, leaves: int, seed: int = 0) -> dict[str, np.ndarray]:
    """`leaves` float32 arrays of `megabytes` in all (params and AdamW moments alike)."""
    rng = np.random.default_rng(seed)
    n = int(megabytes * 1e6 / 4 / leaves)
    return {f"leaf_{i:02d}": rng.standard_normal(n, dtype=np.float32) for i in range(leaves)}


def measure(ckpts: LearnerCheckpoints, state: dict, step: int) -> dict[str, float]:
    start = time.perf_counter()
    ckpts.save(step, state, {"step": step}, wait=False)
    returned = time.perf_counter()
    ckpts.wait()
    durable = time.perf_counter()
    ckpts.save(step + 1, state, {"step": step + 1}, wait=True)
    blocking = time.perf_counter()
    return {"background_return_s": returned - start, "background_durable_s": durable - start,
            "blocking_s": blocking - durable}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=48.0)
    parser.add_argument("--leaves", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backends", default="local,gcs")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    state = learner_state(args.megabytes, args.leaves)
    backends = args.backends.split(",")
    with contextlib.ExitStack() as stack:
        roots = {}
        if "local" in backends:
            roots["local"] = stack.enter_context(tempfile.TemporaryDirectory())
        if "gcs" in backends:
            from gcs_emulator import gcs_emulator

            stack.enter_context(gcs_emulator())
            roots["gcs"] = f"gs://diloco-test/ckpt-bench-{uuid.uuid4().hex[:8]}"
        managers = {(b, name): LearnerCheckpoints(f"{root}/{name}", max_to_keep=2,
                                                  directories_in_background=flag)
                    for b, root in roots.items() for name, flag in SETTINGS.items()}
        runs: dict = {key: [] for key in managers}
        for repeat in range(args.repeats):
            for key, ckpts in managers.items():
                runs[key].append(measure(ckpts, state, 2 * repeat))
                r = runs[key][-1]
                print(f"{key[0]:<6}{key[1]:<11} repeat {repeat}: returns "
                      f"{r['background_return_s'] * 1e3:7.1f} ms, durable "
                      f"{r['background_durable_s']:6.2f} s, blocking {r['blocking_s']:6.2f} s",
                      flush=True)
        for ckpts in managers.values():
            ckpts.close()
    results = {b: {name: {k: statistics.median(r[k] for r in runs[(b, name)])
                          for k in runs[(b, name)][0]} for name in SETTINGS} for b in roots}
    report = {
        "benchmark": "checkpoint_save",
        "command": "python benchmarks/checkpoint_save.py " + " ".join(argv or sys.argv[1:]),
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        **code_revision(), "machine": machine_info(),
        "settings": {"megabytes": args.megabytes, "leaves": args.leaves,
                     "repeats": args.repeats},
        "median_seconds": results,
        "runs": {f"{b}/{name}": reps for (b, name), reps in runs.items()},
    }
    print(f"\n{args.megabytes:g} MB in {args.leaves} arrays, medians of {args.repeats} "
          "(directories created on the caller's thread vs in Orbax's background)")
    print(f"{'backend':<8}{'setting':<12}{'save returns':>14}{'durable':>10}{'blocking':>10}")
    for b, per in results.items():
        for name, m in per.items():
            print(f"{b:<8}{name:<12}{m['background_return_s'] * 1e3:>11.1f} ms"
                  f"{m['background_durable_s']:>9.2f}s{m['blocking_s']:>9.2f}s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
