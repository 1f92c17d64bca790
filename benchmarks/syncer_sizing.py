"""A sizing table for the syncer and the store, derived from the measured cost curves.

    python benchmarks/syncer_sizing.py

Nothing is run here: the table is arithmetic on two committed results, `merge_cost.json` (merge
time and peak memory against fragment size and M) and `control_plane_cost.json` (the syncer's
store requests per round against M), plus the store layout's byte counts (a global version is
written as fp32 parameters and fp32 momentum; a learner downloads the parameters; an offer is
the wire encoding). Its result names the commits of both inputs; re-run it when they are
re-run. What it cannot say is marked: the merge's scaling with cores was not measured (the
figures are from 2 shared cores and extrapolated linearly), nor a real bucket's limits.
"""

import json
import sys
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from pipelines.reporting import code_revision

RESULTS = Path(__file__).parent / "results"
OUT = RESULTS / "syncer_sizing.json"
MEASURED_CORES = 2
WIRE_BYTES = {"int4": 0.5625, "bf16": 2.0}     # per parameter; int4 carries a scale a block
HEARTBEAT_SECONDS, POLL_SECONDS = 2.0, 0.5      # the orchestration defaults
# (label, model parameters, P, M, seconds between rounds, wire encoding). The paper's main
# configuration: 12B parameters, P = H = 24, one round a step at about a second a step.
SCENARIOS = [
    ("1.2B, P = 8, M = 8, a round every 10 s", 1.2e9, 8, 8, 10.0, "int4"),
    ("12B, P = 24, M = 8, a round every 10 s", 12e9, 24, 8, 10.0, "int4"),
    ("12B, P = 24, M = 8, a round every 1 s (the paper's cadence)", 12e9, 24, 8, 1.0, "int4"),
    ("12B, P = 24, M = 16, a round every 1 s", 12e9, 24, 16, 1.0, "int4"),
    ("12B, P = 24, M = 8, bf16, a round every 10 s", 12e9, 24, 8, 10.0, "bf16"),
]


def merge_fit(points: list[dict], encoding: str, min_params: float = 64e6) -> dict:
    """Least squares of merge seconds = N * (a + b * M) over the streaming merge's points of
    at least `min_params` parameters (smaller fragments cost dispatches, not arithmetic). The
    points were measured on a shared machine (load average in the file), so the fit is an
    order of magnitude, with its worst point's error reported beside it."""
    rows = [p for p in points if p["impl"] == "new" and p["encoding"] == encoding
            and p["params"] >= min_params]
    n = np.array([p["params"] for p in rows], dtype=float)
    m = np.array([p["members"] for p in rows], dtype=float)
    t = np.array([p["merge_s_median"] for p in rows])
    # Relative errors (each row divided by its time): the large points must not drown the
    # small. A negative per-parameter term (noise) is dropped, not extrapolated.
    X = np.stack([n, n * m], axis=1) / t[:, None]
    (a, b), *_ = np.linalg.lstsq(X, np.ones_like(t), rcond=None)
    if a < 0:
        a, b = 0.0, float(np.sum(n * m * t / t**2) / np.sum((n * m / t) ** 2))
    predicted = n * (a + b * m)
    return {"seconds_per_param": a, "seconds_per_param_member": b, "points": len(rows),
            "worst_relative_error": float(np.max(np.abs(predicted - t) / t)),
            "peak_x_fp32_fragment_max": max(p["peak_over_setup_x_fp32_fragment"] for p in rows
                                            if p["members"] <= 8)}


def requests_fit(control: dict) -> dict:
    """The syncer's store requests per round = c + d * M (the local store, after the change)."""
    after = control["results"]["local"]["after"]
    m = np.array([float(k) for k in after])
    ops = np.array([after[k]["per_round"]["store_ops"] for k in after])
    d, c = np.polyfit(m, ops, 1)
    return {"fixed": float(c), "per_learner": float(d)}


def size(label, params, P, M, interval, encoding, merge, requests) -> dict:
    frag = params / P
    merge_s = frag * (merge["seconds_per_param"] + merge["seconds_per_param_member"] * M)
    return {
        "scenario": label, "fragment_params": frag, "members": M,
        "seconds_between_rounds": interval, "encoding": encoding,
        # Every fragment's fp32 values and momentum, one round's offers, and the merge's own
        # working set (its measured peak over set-up, in fp32 fragments).
        "syncer_memory_gb": (params * 8 + M * frag * WIRE_BYTES[encoding]
                             + merge["peak_x_fp32_fragment_max"] * frag * 4) / 1e9,
        "merge_seconds_on_2_cores": merge_s,
        # Cores to merge one round within the interval, if the merge scaled with cores.
        "cores_to_keep_up": MEASURED_CORES * merge_s / interval,
        "syncer_in_gbps": M * frag * WIRE_BYTES[encoding] * 8 / interval / 1e9,
        "syncer_out_gbps": frag * 8 * 8 / interval / 1e9,
        "each_learner_down_gbps": frag * 4 * 8 / interval / 1e9,
        "each_learner_up_gbps": frag * WIRE_BYTES[encoding] * 8 / interval / 1e9,
        "syncer_requests_per_s": (requests["fixed"] + requests["per_learner"] * M) / interval,
        # A learner's poll reads the open round, STOP, the capacity record and each fragment's
        # pointer; it writes a heartbeat and, once a round, its offer.
        "learner_requests_per_s": M * ((3 + P) / POLL_SECONDS + 1 / HEARTBEAT_SECONDS),
    }


def table(rows: list[dict]) -> str:
    head = ("| scenario | fragment | syncer memory | merge on 2 cores | cores to keep up | "
            "syncer in / out | a learner down / up | store requests/s (syncer + learners) |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|\n")
    return head + "".join(
        f"| {r['scenario']} | {r['fragment_params'] / 1e6:.0f}M | {r['syncer_memory_gb']:.0f} GB"
        f" | {r['merge_seconds_on_2_cores']:.0f} s | {r['cores_to_keep_up']:.0f} | "
        f"{r['syncer_in_gbps']:.1f} / {r['syncer_out_gbps']:.1f} Gbit/s | "
        f"{r['each_learner_down_gbps']:.1f} / {r['each_learner_up_gbps']:.1f} Gbit/s | "
        f"{r['syncer_requests_per_s']:.0f} + {r['learner_requests_per_s']:.0f} |\n"
        for r in rows)


def main() -> dict:
    revision = code_revision()
    merge_cost = json.loads((RESULTS / "merge_cost.json").read_text())
    control = json.loads((RESULTS / "control_plane_cost.json").read_text())
    fits = {e: merge_fit(merge_cost["points"], e) for e in WIRE_BYTES}
    requests = requests_fit(control)
    rows = [size(*s, fits[s[5]], requests) for s in SCENARIOS]
    print(table(rows))
    for e, f in fits.items():
        print(f"merge fit ({e}, {f['points']} points of >= 64M): "
              f"{f['seconds_per_param'] * 1e9:.1f} ns a parameter + "
              f"{f['seconds_per_param_member'] * 1e9:.1f} ns a parameter a member on 2 cores; "
              f"worst point off by {f['worst_relative_error']:.0%}")
    print(f"syncer store requests a round: {requests['fixed']:.0f} + "
          f"{requests['per_learner']:.2f} x M")
    result = {"benchmark": "syncer_sizing", "commit": revision,
              "command": "python " + " ".join(["benchmarks/syncer_sizing.py", *sys.argv[1:]]),
              "when": datetime.now(UTC).isoformat(timespec="seconds"),
              "inputs": {"merge_cost": {"commit": merge_cost["commit"],
                                        "command": merge_cost["command"]},
                         "control_plane_cost": {"commit": control["commit"],
                                                "command": control["command"]}},
              "merge_fit": fits, "requests_fit": requests, "rows": rows}
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
