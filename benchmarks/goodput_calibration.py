"""How close the goodput simulator comes to every published cell of the paper's Table 1, and how
sensitive that is to each unpublished timing parameter (±25%).

    python benchmarks/goodput_calibration.py
"""

import dataclasses
import json
import os
import platform
import sys
from datetime import UTC, datetime
from pathlib import Path

from diloco_core.goodput import GoodputParams, goodput_with_ci
from pipelines.reporting import code_revision

OUT = Path(__file__).parent / "results" / "goodput_calibration.json"
# Published cells (MTBI 1 year per chip, Decoupled DiLoCo with M = 8), in percent.
PUBLISHED = {150_016: {"data_parallel": 72, "data_parallel_elastic": 88, "decoupled": 98},
             1_200_128: {"data_parallel": 27, "data_parallel_elastic": 58, "decoupled": 88}}
TUNED = ("restart_seconds", "downscale_seconds", "repair_seconds", "slice_chips")


def cells(params: dict, seeds: int) -> dict:
    out = {}
    slice_chips = params.get("slice_chips", GoodputParams.slice_chips)
    for chips, targets in PUBLISHED.items():
        r = goodput_with_ci(GoodputParams(chips=chips - chips % slice_chips, **params),
                            seeds=seeds)
        out[chips] = {k: {"simulated": 100 * r[k]["mean"], "ci95": 100 * r[k]["ci95"],
                          "published": v, "error": 100 * r[k]["mean"] - v}
                      for k, v in targets.items()}
    return out


def worst(table: dict) -> float:
    return max(abs(c["error"]) for row in table.values() for c in row.values())


def main() -> dict:
    revision = code_revision()     # at the start: the code this process runs
    defaults = {f.name: f.default for f in dataclasses.fields(GoodputParams)
                if f.name != "chips"}
    base = cells({}, seeds=10)
    print(f"{'chips':>10} {'system':<24}{'published':>10}{'simulated':>12}{'error':>8}")
    for chips, row in base.items():
        for key, c in row.items():
            print(f"{chips:>10,} {key:<24}{c['published']:>10}{c['simulated']:>9.1f}"
                  f" ±{c['ci95']:.1f}{c['error']:>+8.1f}")
    print(f"worst |error|: {worst(base):.1f} points")
    sensitivity = {}
    for name in TUNED:
        for factor in (0.75, 1.25):
            value = defaults[name] * factor
            value = int(value) - int(value) % 64 if name == "slice_chips" else value
            table = cells({name: value}, seeds=5)
            sensitivity[f"{name} x{factor}"] = {
                "value": value, "worst_error": worst(table),
                "errors": {str(ch): {k: round(c["error"], 1) for k, c in row.items()}
                           for ch, row in table.items()}}
            print(f"{name} x{factor} ({value}): worst |error| {worst(table):.1f}")
    report = {"benchmark": "goodput_calibration",
              "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
              "commit": revision,
              "command": "python benchmarks/goodput_calibration.py " + " ".join(sys.argv[1:]),
              "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                          "python": platform.python_version()},
              "parameters": defaults, "cells": {str(k): v for k, v in base.items()},
              "worst_error_points": worst(base), "sensitivity": sensitivity}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {OUT}")
    return report


if __name__ == "__main__":
    main()
