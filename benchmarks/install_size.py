"""Install size and time: the plain install (what a laptop needs) next to every extra, each in a
fresh virtual environment built from a wheel of this checkout (a regular install, not an
editable one), at the versions in requirements/ci.lock. Then, in the plain one, the commands a
new user runs first: `diloco --version`, `diloco config`, the Dagster definitions, and a short
`diloco demo` (tiny model, a small budget) to show the demo works from an installed package.

    python benchmarks/install_size.py              # about 6 minutes with a warm pip cache

Times include resolving and downloading, so they depend on the pip cache and the network; the
sizes do not.
"""

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "install_size.json"
VARIANTS = {"plain": "", "all extras": "[all]"}
DEMO = ["--set", "model.preset=tiny", "--set", "token_budget=60000",
        "--set", "data.seq_len=64", "--timeout", "900"]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def _size_mib(path: Path) -> float:
    total = sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
    return total / 2**20


def _run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, capture_output=True, text=True, **kw)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:4])}... failed:\n{out.stdout[-2000:]}"
                         f"\n{out.stderr[-3000:]}")
    return out


def _largest(site: Path, n: int = 8) -> list[dict]:
    sizes = [(p.name, _size_mib(p)) for p in site.iterdir() if p.is_dir()
             and not p.name.endswith((".dist-info", "__pycache__"))]
    return [{"package": name, "mib": round(mib, 1)}
            for name, mib in sorted(sizes, key=lambda x: -x[1])[:n]]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--no-demo", action="store_true", help="skip the short demo")
    args = p.parse_args(argv)
    commit = _git("rev-parse", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    result = {"benchmark": "install_size",
              "when": datetime.now(UTC).isoformat(timespec="seconds"),
              "commit": commit, "dirty": dirty,
              "command": "python benchmarks/install_size.py" + (" --no-demo" if args.no_demo
                                                                 else ""),
              "machine": {"platform": platform.platform(), "python": sys.version.split()[0],
                          "cpu_count": os.cpu_count()},
              "installs": {}}
    with tempfile.TemporaryDirectory(prefix="install-size-") as tmp:
        work = Path(tmp)
        _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(work / "dist"),
              str(ROOT)])
        (wheel,) = (work / "dist").glob("*.whl")
        for name, extra in VARIANTS.items():
            venv = work / name.replace(" ", "-")
            start = time.perf_counter()
            _run([sys.executable, "-m", "venv", str(venv)])
            pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                   "-c", str(ROOT / "requirements" / "ci.lock")]
            _run([*pip, f"{wheel}{extra}"])
            seconds = time.perf_counter() - start
            site = next((venv / "lib").glob("python3*/site-packages"))
            result["installs"][name] = {
                "spec": f"decoupled-diloco{extra}", "seconds": round(seconds, 1),
                "venv_mib": round(_size_mib(venv), 1), "largest": _largest(site)}
            print(f"{name}: {result['installs'][name]['venv_mib']:.0f} MiB in {seconds:.0f} s",
                  flush=True)
        plain = work / "plain"
        bin_ = plain / "bin"
        checks = {}
        elsewhere = work / "elsewhere"            # not the checkout: nothing to lean on
        elsewhere.mkdir()
        checks["version"] = _run([str(bin_ / "diloco"), "--version"], cwd=elsewhere
                                 ).stdout.strip()
        config = _run([str(bin_ / "diloco"), "config"], cwd=elsewhere).stdout
        checks["config_lines"] = len(config.splitlines())
        jobs = _run([str(bin_ / "python"), "-c", "from pipelines.definitions import defs; "
                     "print(sorted(j.name for j in defs().jobs))"], cwd=elsewhere).stdout
        checks["jobs"] = jobs.strip()
        if not args.no_demo:
            start = time.perf_counter()
            _run([str(bin_ / "diloco"), "demo", *DEMO, "--workdir", str(work / "demo"),
                  "--json", str(work / "demo.json")], cwd=elsewhere, timeout=1200)
            summary = json.loads((work / "demo.json").read_text())
            checks["demo"] = {
                "args": " ".join(DEMO), "seconds": round(time.perf_counter() - start, 1),
                "rounds_merged": summary.get("rounds_merged"),
                "initial_eval_loss": summary.get("initial_eval_loss"),
                "final_eval_loss": summary.get("final_eval_loss")}
            print(f"demo from the installed package: {checks['demo']}", flush=True)
        result["plain_install_checks"] = checks
        shutil.rmtree(work / "demo", ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
