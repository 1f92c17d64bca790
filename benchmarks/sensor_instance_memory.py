"""What each sensor tick leaves in the code server: the Dagster instance it opens (issue 37).

Dagster builds a sensor's resources with an instance opened from the instance reference, every
evaluation, in the code server; opening one checks the SQLite schema with alembic, which
registered an `ExitStack` with `atexit` per check until `pipelines/alembic_paths.py` resolved
alembic's package resources once per process. This opens instances from a reference as a
tick does (and reads the runs, as the supervisor does), in a fresh process per arm: "as
shipped" loads the code location first (which applies the mend), "without the mend" does not.
Each arm warms up with 200 opens, then counts resident memory and `atexit` registrations over
1,600 more.

    python benchmarks/sensor_instance_memory.py       # about a minute on 2 cores
"""

import argparse
import json
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipelines.reporting import code_revision, machine_info  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "sensor_instance_memory.json"

ARM = """
import atexit, gc, json, os, sys, time
import dagster as dg
if sys.argv[1] == "as shipped":
    import pipelines.definitions  # noqa: F401  (the code location's load applies the mend)

def rss_mb():
    return next(int(l.split()[1]) for l in open("/proc/self/status")
                if l.startswith("VmRSS")) / 1024

with dg.DagsterInstance.get() as home:
    ref = home.get_ref()
def tick():
    with dg.DagsterInstance.from_ref(ref) as instance:
        instance.get_run_records(limit=1)
for _ in range(200):
    tick()
gc.collect()
rss0, exits0, t0 = rss_mb(), atexit._ncallbacks(), time.perf_counter()
points = []
for k in range(1, 5):
    for _ in range(400):
        tick()
    gc.collect()
    points.append({"opens": 400 * k, "rss_mb": round(rss_mb() - rss0, 2),
                   "atexit_registrations": atexit._ncallbacks() - exits0})
print(json.dumps({"points": points,
                  "ms_per_open": round((time.perf_counter() - t0) / 1600 * 1e3, 1)}))
"""


def run_arm(arm: str) -> dict:
    with tempfile.TemporaryDirectory() as home:
        env = {"DAGSTER_HOME": home, "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
        (Path(home) / "dagster.yaml").write_text("")
        out = subprocess.run([sys.executable, "-c", ARM, arm], env=env, cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    first, last = result["points"][0], result["points"][-1]
    # After the first 400 (the allocator settling): what each further open adds.
    result["kb_per_open"] = round((last["rss_mb"] - first["rss_mb"]) * 1024
                                  / (last["opens"] - first["opens"]), 2)
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    arms = {}
    for arm in ("without the mend", "as shipped"):
        arms[arm] = r = run_arm(arm)
        last = r["points"][-1]
        print(f"{arm:>17}: over {last['opens']} instance opens resident memory "
              f"{last['rss_mb']:+.1f} MB ({r['kb_per_open']:+.2f} KB an open after the first 400), "
              f"{last['atexit_registrations']} atexit registrations, {r['ms_per_open']} ms an "
              "open", flush=True)
    result = {"benchmark": "sensor_instance_memory", "timestamp": datetime.now(UTC).isoformat(),
              **code_revision(), "command": "python benchmarks/sensor_instance_memory.py "
              + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": machine_info(), "arms": arms}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
