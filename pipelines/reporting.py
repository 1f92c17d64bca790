"""Turning simulation results into a table, a JSON record and a loss-over-tokens plot.

Plots need the `plots` extra (matplotlib); every plot is optional (`optional_plot`): without
the extra a command prints its figures and says how to get the plot.
"""

import json
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from diloco_core.simulation_result import SimulationResult
from resources.extras import MissingExtra, require_extra

# The chip counts of the goodput-at-scale figure (150k to 2.4M, whole 256-chip slices).
GOODPUT_CHIPS = (150_016, 300_032, 600_064, 1_200_128, 2_400_000)


def optional_plot(make: Callable[[], Path],
                  note: Callable[[str], None] = lambda line: print(line, file=sys.stderr)
                  ) -> Path | None:
    """`make()`'s plot, or None when the `plots` extra is missing, with one line saying so."""
    try:
        return make()
    except MissingExtra as err:
        note(f"no plot: {err}")
        return None


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name: two machines of one platform string and core count ran the same
    soak 3-13% apart, so a result names the processor too. `platform.processor()` is empty on
    most Linux systems; /proc/cpuinfo says it there."""
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict:
    import os

    import jax

    return {"platform": platform.platform(), "processor": cpu_model(),
            "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "jax": jax.__version__, "devices": [str(d) for d in jax.devices()]}


# What a benchmark writes and what only describes it: a result re-made over a committed one, or
# an edited page, leaves the code that measured unchanged, so neither makes a result "dirty".
NOT_CODE_PREFIXES = ("benchmarks/results/", "docs/")
NOT_CODE_SUFFIXES = (".md", ".png", ".svg")


def code_revision(root: Path | None = None) -> dict:
    """The commit that produced a result, and whether the code that ran differed from it, for
    every result file: a figure without the code that made it cannot be re-checked."""
    import subprocess

    root = root or Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    # Tracked files that differ from HEAD, staged or not (`git status --porcelain` lines start
    # with a status column that a strip of the output would eat on the first line).
    changed = [line for line in git("diff", "--name-only", "HEAD").splitlines() if line]
    # The paths, not only a flag: an edited README does not change what a benchmark measured,
    # and a benchmark's own outputs (re-made in place before it records this) are not code.
    code = [path for path in changed
            if not path.startswith(NOT_CODE_PREFIXES) and not path.endswith(NOT_CODE_SUFFIXES)]
    return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(code),
            "dirty_files": changed}


def results_table(results: Sequence[SimulationResult]) -> list[dict]:
    base = next((r.final_loss for r in results if r.method == "data_parallel"), None)
    rows = []
    for r in results:
        s = r.summary()
        rows.append({
            "method": r.method,
            "heldout_loss": round(s["final_heldout_loss"], 4),
            "vs_data_parallel": round(s["final_heldout_loss"] / base, 4) if base else None,
            **({"accuracy": round(s["final_accuracy"], 4)} if s.get("final_accuracy") is not None
               else {"bits_per_byte": round(s["final_bits_per_byte"], 4)}),
            "goodput": round(s["goodput"], 3),
            "uptime": round(s["uptime"], 3),
            "rounds": s["rounds_merged"],
            "bytes_up_per_token": round(s["bytes_up_per_token"], 2),
            "sim_seconds": round(s["wall_seconds"], 1),
        })
    return rows


def write_results(results: Sequence[SimulationResult], config: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {"machine": machine_info(), "config": config, "table": results_table(results),
              "runs": [r.summary() for r in results]}
    path = out_dir / "results.json"
    path.write_text(json.dumps(record, indent=2))
    return path


def _axes():
    require_extra("plots", "a plot", ("matplotlib",))
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(7, 4.2))


def _save(fig, ax, path: Path) -> Path:
    import matplotlib.pyplot as plt

    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_loss(results: Sequence[SimulationResult], path: Path) -> Path:
    fig, ax = _axes()
    for r in results:
        if r.evals:
            ax.plot([e["tokens"] / 1e6 for e in r.evals], [e["loss"] for e in r.evals],
                    marker="o", markersize=3, label=r.method)
    ax.set_xlabel("tokens processed (millions)")
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.set_title("Held-out loss over tokens")
    ax.grid(alpha=0.3)
    return _save(fig, ax, path)


def plot_utilisation(plan_at, path: Path) -> Path:
    """Compute utilisation of each method against the available link speed (log scale)."""
    import numpy as np

    speeds = np.logspace(-2, 3, 120)
    curves: dict[str, list[float]] = {}
    for gbps in speeds:
        for method, plan in plan_at(float(gbps)).items():
            curves.setdefault(method, []).append(plan.utilisation)
    fig, ax = _axes()
    for method, values in curves.items():
        ax.plot(speeds, values, label=method)
    ax.set_xscale("log")
    ax.set_xlabel("available cross-site bandwidth per site (Gbps)")
    ax.set_ylabel("compute utilisation")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3, which="both")
    return _save(fig, ax, path)


def plot_goodput(goodput_at, path: Path) -> Path:
    """Goodput of each system against chip count (150k to 2.4M), with 95% intervals."""
    chips = GOODPUT_CHIPS
    fig, ax = _axes()
    results = [goodput_at(n) for n in chips]
    for key in ("data_parallel", "data_parallel_elastic", "synchronous_diloco", "decoupled"):
        ax.errorbar([n / 1e6 for n in chips], [100 * r[key]["mean"] for r in results],
                    yerr=[100 * r[key]["ci95"] for r in results], marker="o", capsize=3,
                    label=key)
    ax.set_xscale("log")
    ax.set_xlabel("chips (millions)")
    ax.set_ylabel("goodput (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3, which="both")
    return _save(fig, ax, path)
