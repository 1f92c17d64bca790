"""Which committed result files still measure today's code, and which are stale.

    python benchmarks/freshness.py [--out benchmarks/results/freshness.md]

A result file names the commit(s) that produced it. It is stale once the code it measures has
changed since its newest one: the benchmark's own script, and the product code it exercises
(`MEASURES` below; the whole product by default: `diloco_core`, `resources`, `pipelines`).
Separately, it ran under other defaults once the embedded defaults changed since
(`diloco_core/config.py`, with `pipelines/launch_defaults.py` laid over it for the benchmarks
that run `diloco demo`'s config: `DEFAULTS_MATTER`), read field by field from both versions
of those files, so that a reworded comment or a new field that is off by default does not
count: a stale figure may still hold, one under other defaults means something else. The
quality experiments keep their own, finer record (a hash of the code each run executed,
`benchmarks/quality/code_identity.py`) and are not listed here; the other results kept beside
them (experiment 1 through the real Dagster path) are.

A commit counts against a result only where it changed what the interpreter sees: a Python
file is compared as its syntax tree without comments or docstrings (the quality code hash's
`semantic_source`), so a reworded comment or docstring does not make a result stale; any other
file (a lock file, pyproject) counts when its bytes change. Still coarse (a refactor that
computes the same thing counts), so "stale" says "re-run before quoting", not "wrong". A
benchmark module a script takes names from (`from benchmarks.quality.experiments import Arm`)
counts only where those names' definitions changed (`measured_names`). The functions that
write a result's provenance (`PROVENANCE`: the machine and the commit it names) do not count:
no figure passes through them, so naming the CPU model from today on leaves yesterday's soak
current. For a benchmark whose defaults are read field by field, a default's new value counts
there and not again as a code change. The table is a snapshot at the commit it names; re-run
this script for today's.
"""

import argparse
import ast
import functools
import json
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.quality import code_identity  # noqa: E402
from benchmarks.quality.code_identity import semantic_source  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
PRODUCT = ("diloco_core", "resources", "pipelines")
CORE = ("diloco_core",)
# The benchmarks that run their arms through the quality runner depend on what its code hash
# covers (the simulator's closure, the runner, the scoring, the data loaders), not on the rest
# of benchmarks/quality: a new experiment's arms or a report column does not change them.
QUALITY_RUNNER = CORE + tuple(str(p.relative_to(code_identity.REPO))
                              for p in code_identity.code_files())
# The product code each benchmark exercises, where it is less than the whole product. The
# benchmark's script (and anything under benchmarks/ it is named after), and the benchmark
# modules it imports, are always included. A benchmark takes the longest key it starts with.
MEASURES = {
    "scavenging_orchestrated": PRODUCT,   # the real path, not the simulator's scavenging
    "merge_cost": CORE, "merge_profile": CORE, "merge_under_load": CORE,
    "final_rounds": QUALITY_RUNNER, "scavenging": QUALITY_RUNNER,
    "goodput_calibration": CORE, "goodput_crosscheck": CORE,
    "simulator_schedule_spread": CORE, "syncer_sizing": (),
    "inner_step_throughput": CORE + ("resources",),
    "store_throughput": ("resources",), "checkpoint_save": CORE + ("resources",),
    "install_size": ("pyproject.toml", "requirements"),
}
# The functions that record who made a result, where and from which commit, file -> names:
# they describe a run and no measured figure passes through them, so a change to them (and
# to a helper only they call) leaves every result's figures as they were.
PROVENANCE = {"pipelines/reporting.py": frozenset({"machine_info", "code_revision"})}
CONFIG, LAUNCH = "diloco_core/config.py", "pipelines/launch_defaults.py"
# Benchmarks whose figures depend on the training defaults (losses, times to a budget, goodput),
# by the path they train on. The others measure machinery (merges, stores, the control plane,
# memory, install size) that the learning rates and the sync period do not change.
# "launch": `diloco demo`'s defaults (`pipelines/launch_defaults.py`) laid over the embedded
# ones, for the benchmarks that run the demo's config. "embedded": the config's defaults alone,
# for the simulator's and for the soaks and the real-path quality benchmark, which build their
# config without the launch defaults (`load_config` with no base, or experiment 1's arm) even
# though they train on the orchestrated path; goodput_crosscheck reads the chaos soak's runs.
DEFAULTS_MATTER = {
    "launch": ("orchestration_demo", "demo_side_by_side", "scavenging_orchestrated", "pacing"),
    "embedded": ("scavenging", "final_rounds", "simulator_schedule_spread", "chaos_soak",
                 "hostile_soak", "quality_real_path", "goodput_crosscheck"),
}
SHA = re.compile(r"\b[0-9a-f]{7,40}\b")


def _git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                          check=False).stdout.strip()


def recorded_commits(result: object, depth: int = 0) -> list[str]:
    """Every commit-like token under a "commit" key, at any depth up to four: a result names
    its commit at the top, per run, or per arm of a side-by-side comparison."""
    found: list[str] = []
    if depth > 4:
        return found
    if isinstance(result, dict):
        for key, value in result.items():
            if key == "commit" and isinstance(value, str):
                found += SHA.findall(value)
            elif key == "commit" and isinstance(value, dict):
                found += SHA.findall(str(value.get("commit") or ""))
            else:
                found += recorded_commits(value, depth + 1)
    elif isinstance(result, list):
        for item in result:
            found += recorded_commits(item, depth + 1)
    return found


def recorded_command(result: object) -> str | None:
    if isinstance(result, dict):
        if isinstance(result.get("command"), str):
            return result["command"]
        runs = result.get("runs")
        if isinstance(runs, list) and runs and isinstance(runs[0], dict):
            return recorded_command(runs[0])
    return None


def benchmark_of(path: Path, result: object) -> str:
    """The benchmark script a result came from: named in its command, else its file name."""
    command = recorded_command(result) or ""
    script = re.search(r"benchmarks/([A-Za-z0-9_]+)\.(?:py|sh)", command)
    return script.group(1) if script else path.stem


def result_files(results: Path = RESULTS) -> list[Path]:
    """The result files to assess: every one in `results`, and those in its quality folder
    that the quality experiments' own record does not cover (the real-path runs: their code
    is the product's, not the simulator's the code hash names)."""
    quality = [p for p in sorted((results / "quality").glob("*.json"))
               if benchmark_of(p, json.loads(p.read_text())) != "quality_benchmarks"]
    return sorted(results.glob("*.json")) + quality


def measured_paths(benchmark: str, repo: Path = REPO) -> tuple[str, ...]:
    found = sorted((repo / "benchmarks").glob(f"{benchmark}*"))
    scripts = tuple(dict.fromkeys(str(p.relative_to(repo)) for p in [
        *found, *(m for f in found if f.suffix == ".py" for m in benchmark_imports(f, repo))]))
    return _measures(benchmark) + scripts


def _measures(benchmark: str) -> tuple[str, ...]:
    """The product code a benchmark exercises: its longest `MEASURES` key, else the product."""
    key = max((k for k in MEASURES if benchmark.startswith(k)), key=len, default=None)
    return MEASURES[key] if key else PRODUCT


def measured_names(benchmark: str, repo: Path = REPO) -> dict[str, frozenset[str]]:
    """The imported benchmark modules that measure a benchmark only through some of their
    names, path -> those names: the simulated scavenging takes `Arm` and two constants from
    the experiments' module, so an experiment's new arms there do not make it stale. A module
    any of its scripts imports whole, or one its `MEASURES` entry covers, is not listed (the
    whole file counts)."""
    covered = _measures(benchmark)
    names: dict[str, frozenset[str] | None] = {}
    for script in sorted((repo / "benchmarks").glob(f"{benchmark}*.py")):
        for module in benchmark_imports(script, repo):
            rel = str(module.relative_to(repo))
            taken = imported_names(script, module, repo)
            names[rel] = (None if taken is None or (rel in names and names[rel] is None)
                          else taken | names.get(rel, frozenset()))
    return {rel: taken for rel, taken in names.items() if taken is not None
            and not any(rel == c or rel.startswith(c.rstrip("/") + "/") for c in covered)}


def imported_names(script: Path, module: Path, repo: Path = REPO) -> frozenset[str] | None:
    """The names `script` takes from `module` (`from a.b import X, Y`), or None where it
    imports the module whole (`import a.b`, `from a import b`)."""
    dotted = str(module.relative_to(repo).with_suffix("")).replace("/", ".")
    taken: set[str] = set()
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Import) and any(a.name == dotted for a in node.names):
            return None
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if any(f"{node.module}.{a.name}" == dotted for a in node.names):
                return None
            if node.module == dotted:
                if any(a.name == "*" for a in node.names):
                    return None
                taken |= {a.name for a in node.names}
    return frozenset(taken)


def definitions(text: str, names: frozenset[str]) -> str | None:
    """What a module's `names` are, as the interpreter sees them: the top-level statements
    that bind them and, in turn, those binding the top-level names they use (a class's default
    that is a module constant, the decorator it imports), compared like `semantic_source`.
    None where a name is bound nowhere at the top (then the whole module counts)."""
    body = ast.parse(text).body
    binds: dict[str, list[int]] = {}
    for i, statement in enumerate(body):
        for name in _bound_names(statement):
            binds.setdefault(name, []).append(i)
    if not names <= binds.keys():
        return None
    kept, todo = set(), list(names)
    while todo:
        for i in binds.get(todo.pop(), ()):
            if i not in kept:
                kept.add(i)
                todo += [n.id for n in ast.walk(body[i]) if isinstance(n, ast.Name)]
    module = ast.Module(body=[body[i] for i in sorted(kept)], type_ignores=[])
    return semantic_source(ast.unparse(module))


def _bound_names(statement: ast.stmt) -> list[str]:
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [statement.name]
    if isinstance(statement, (ast.Import, ast.ImportFrom)):
        return [(a.asname or a.name).split(".")[0] for a in statement.names]
    targets = (statement.targets if isinstance(statement, ast.Assign) else
               [statement.target] if isinstance(statement, (ast.AnnAssign, ast.AugAssign))
               else [])
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]


def benchmark_imports(script: Path, repo: Path = REPO) -> list[Path]:
    """The modules under benchmarks/ that a script imports, at any depth in the file (a soak's
    scoring lives in benchmarks/quality/store_scoring.py); one level, not their imports."""
    try:
        found = code_identity.imported_modules(script, ("benchmarks",), repo)
    except (OSError, SyntaxError):
        return []
    return sorted(found - {script})


def uses_defaults(benchmark: str) -> str | None:
    """Which defaults a benchmark's figures stand on: "launch", "embedded", or None where they
    do not depend on them."""
    for which in ("launch", "embedded"):     # scavenging_orchestrated before scavenging
        if any(benchmark.startswith(k) for k in DEFAULTS_MATTER[which]):
            return which
    return None


def pinned(command: str | None) -> set[str]:
    """The fields a command set itself (`--set section.field=value`): a change of their
    default does not reach its runs."""
    return {key for key in re.findall(r"--set[= ]([a-z_][a-z0-9_.]*)=", command or "")}


def default_values(config_py: str, launch_py: str = "") -> dict[str, str]:
    """The embedded defaults as written in the two files, "section.field" -> the default's
    source text (comments dropped). The config's dataclasses give "SyncConfig.sync_period";
    the launch defaults' "sync.sync_period=16" strings are laid over them under the same name
    (a section is the class whose name starts with it). Read from the syntax tree, so a field
    wrapped over several lines is read as one that is not."""
    try:
        config = ast.parse(config_py)
        launch = ast.parse(launch_py)
    except SyntaxError:
        return {}     # no defaults to compare; the code comparison counts the file as changed
    values = {f"{cls}.{field.target.id}": _as_written(config_py, field.value)
              for cls, field in _config_fields(config)}
    sections = {k.split(".")[0] for k in values}
    for statement in _launch_defaults(launch):
        for element in statement.value.elts:
            key, _, value = element.value.partition("=")
            values[field_name(key, sections)] = value.strip()
    return {k: v.strip("\"'") for k, v in values.items()}


def _config_fields(module: ast.Module) -> Iterator[tuple[str, ast.AnnAssign]]:
    """Each config class's fields that have a default: (class name, the field)."""
    for statement in module.body:
        if isinstance(statement, ast.ClassDef):
            for field in statement.body:
                if (isinstance(field, ast.AnnAssign) and field.value is not None
                        and isinstance(field.target, ast.Name)):
                    yield statement.name, field


def _launch_defaults(module: ast.Module) -> Iterator[ast.Assign | ast.AnnAssign]:
    """A module's lists of "section.field=value" strings (the launch defaults)."""
    for statement in module.body:
        if (isinstance(statement, (ast.Assign, ast.AnnAssign))
                and isinstance(statement.value, (ast.List, ast.Tuple))
                and statement.value.elts and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str)
                    and re.match(r"[a-z_][a-z0-9_.]*=", e.value) for e in statement.value.elts)):
            yield statement


def _as_written(source: str, node: ast.expr) -> str:
    """A value's source text as written; one written over several lines as the interpreter
    reads it (`ast.unparse`: one line, no comments), so that it fits a table cell."""
    if node.lineno == node.end_lineno:
        return ast.get_source_segment(source, node)
    return ast.unparse(node)


def field_name(dotted: str, sections: Iterable[str]) -> str:
    """"sync.sync_period" (as the launch defaults and --set spell a field) -> "SyncConfig.
    sync_period": the section is the config class whose name starts with it."""
    head, _, field = dotted.rpartition(".")
    cls = next((c for c in sorted(sections, key=len)
                if head and c.lower().startswith(head.lower())), "ExperimentConfig")
    return f"{cls}.{field}"


def changed_defaults(commit: str, which: str | None, command: str | None = None,
                     repo: Path = REPO) -> list[str]:
    """The defaults that differ between `commit` and HEAD, as "field: old -> new" (a field on
    one side only is new or gone, not changed; one the command set itself does not count)."""
    if which is None:
        return []
    def at(rev: str) -> dict[str, str]:
        launch = _git("show", f"{rev}:{LAUNCH}", cwd=repo) if which == "launch" else ""
        return default_values(_git("show", f"{rev}:{CONFIG}", cwd=repo), launch)

    before, now = at(commit), at("HEAD")
    sections = {k.split(".")[0] for k in now}
    own = {field_name(key, sections) for key in pinned(command)}
    return [f"{k}: {before[k]} -> {now[k]}" for k in sorted(before.keys() & now.keys())
            if not same_value(before[k], now[k]) and k not in own]


def same_value(a: str, b: str) -> bool:
    """Two defaults' source texts mean the same value: "6e-3" in the config and "0.006" in a
    launch default that pins it (the demo kept the inner lr when the embedded one moved) are
    one value; text that is no Python literal (a bare word, as the launch defaults spell a
    string) is compared as text."""
    try:
        return ast.literal_eval(a) == ast.literal_eval(b)
    except (ValueError, SyntaxError):
        return a == b


def commits_since(commit: str, paths: Sequence[str], repo: Path = REPO,
                  names: dict[str, frozenset[str]] | None = None,
                  defaults_apart: bool = False) -> list[str] | None:
    """Commits after `commit` (on the way to HEAD) that touched any of `paths`; None when the
    commit is not in this clone's history. A file in `names` counts only where the
    definitions of those names changed (`measured_names`). With `defaults_apart` (a
    benchmark whose defaults are judged field by field, `changed_defaults`), a commit to the
    defaults' two files counts only where it changed more than a default's value."""
    full = _git("rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}", cwd=repo)
    if not full:
        return None
    if not paths:
        return []
    log = _git("log", "--format=%h", f"{full}..HEAD", "--", *paths, cwd=repo)
    return [c for c in log.splitlines()
            if c and changes_meaning(c, paths, repo, names, defaults_apart)]


def changes_meaning(commit: str, paths: Sequence[str], repo: Path = REPO,
                    names: dict[str, frozenset[str]] | None = None,
                    defaults_apart: bool = False) -> bool:
    """Whether `commit` changed any file under `paths` in a way the interpreter sees: Python
    compared without comments and docstrings, anything else by its bytes. A file added or
    removed counts; one that no longer parses is compared by its bytes."""
    touched = _git("diff-tree", "--no-commit-id", "--name-only", "-r", "--root", commit, "--",
                   *paths, cwd=repo).splitlines()
    return any(_file_changes_meaning(commit, name, repo, (names or {}).get(name),
                                     defaults_apart and name in (CONFIG, LAUNCH))
               for name in touched)


@functools.cache
def _file_changes_meaning(commit: str, name: str, repo: Path,
                          names: frozenset[str] | None = None,
                          defaults_apart: bool = False) -> bool:
    """One file's part of `changes_meaning`, cached: every result file asks about the same
    commits."""
    before = _git_blob(f"{commit}^:{name}", repo)
    after = _git_blob(f"{commit}:{name}", repo)
    if before == after:
        return False
    if before is None or after is None or not name.endswith(".py"):
        return True
    try:
        if names is not None:
            seen = definitions(before, names), definitions(after, names)
            if None not in seen:
                return seen[0] != seen[1]
        if defaults_apart:
            return without_default_values(before) != without_default_values(after)
        if name in PROVENANCE:
            return (without(before, PROVENANCE[name])
                    != without(after, PROVENANCE[name]))
        return semantic_source(before) != semantic_source(after)
    except SyntaxError:
        return True


def without_default_values(text: str) -> str:
    """The defaults' files as the interpreter sees them (`semantic_source`) with the defaults'
    values left out, which `changed_defaults` reads field by field: a config class's field
    defaults (`lr: PositiveNumber = 8e-3`) and a module's list of "section.field=value"
    strings (the launch defaults). What is left (a validator, a new field's type, a constant
    the code reads) still counts: e5fee76 moved the embedded inner lr and pinned the demo's
    at its old value, and the demo's runs are the same runs."""
    module = ast.parse(text)
    for _, field in _config_fields(module):
        field.value = ast.Constant(value=None)
    for statement in _launch_defaults(module):
        statement.value = ast.List(elts=[], ctx=ast.Load())
    return semantic_source(ast.unparse(module))


def without(text: str, names: frozenset[str]) -> str:
    """A module as the interpreter sees it (`semantic_source`) less the top-level functions
    `names` and the helpers (functions, constants) only they use: what is left is what a
    change to the provenance record does not touch."""
    body = ast.parse(text).body
    dropped = [s for s in body if _bound_names(s) and set(_bound_names(s)) <= names]
    kept = [s for s in body if not any(s is d for d in dropped)]
    while True:
        wanted = {n.id for s in dropped for n in ast.walk(s) if isinstance(n, ast.Name)}
        # Names read, not bound: a constant's own target does not keep it.
        used = {n.id for s in kept for n in ast.walk(s)
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        # A helper is a function or a module constant (code_revision's paths that are not
        # code) that only the dropped statements read.
        helpers = [s for s in kept if _bound_names(s)
                   and isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Assign,
                                      ast.AnnAssign))
                   and set(_bound_names(s)) <= wanted - used]
        if not helpers:
            break
        dropped += helpers
        kept = [s for s in kept if not any(s is h for h in helpers)]
    return semantic_source(ast.unparse(ast.Module(body=kept, type_ignores=[])))


def _git_blob(spec: str, repo: Path) -> str | None:
    """A file's text at `rev:path`, None where it does not exist there."""
    done = subprocess.run(["git", "show", spec], cwd=repo, capture_output=True, text=True,
                          check=False)
    return done.stdout if done.returncode == 0 else None


@dataclass(frozen=True)
class Freshness:
    file: str
    benchmark: str
    commit: str | None          # the newest recorded commit this clone knows
    command: str | None
    code_changes: list[str] | None     # commits since that touched the measured code
    defaults_changes: list[str] | None  # defaults changed since, "field: old -> new"

    @property
    def verdict(self) -> str:
        if self.commit is None:
            return "unknown commit"
        if self.defaults_changes:
            return "stale, other defaults"
        return "stale" if self.code_changes else "current"


def assess(path: Path, repo: Path = REPO) -> Freshness:
    result = json.loads(path.read_text())
    benchmark = benchmark_of(path, result)
    best: tuple[str, list[str], list[str]] | None = None
    paths, names = measured_paths(benchmark, repo), measured_names(benchmark, repo)
    for commit in dict.fromkeys(recorded_commits(result)):
        code = commits_since(commit, paths, repo, names, uses_defaults(benchmark) is not None)
        if code is None:
            continue
        defaults = changed_defaults(commit, uses_defaults(benchmark), recorded_command(result),
                                    repo)
        if best is None or (len(code), len(defaults)) < (len(best[1]), len(best[2])):
            best = (commit, code, defaults)
    return Freshness(str(path.relative_to(repo)) if path.is_relative_to(repo) else str(path),
                     benchmark, best[0] if best else None, recorded_command(result),
                     best[1] if best else None, best[2] if best else None)


def table(rows: Iterable[Freshness], head: str) -> str:
    lines = [
        f"# Result files against the code at {head}",
        "",
        "Written by `python benchmarks/freshness.py` (see its docstring for what each column "
        "means); a snapshot at the commit above. The quality experiments mark their own stale "
        "runs (docs/results.md).",
        "",
        "| result | benchmark | measured at | commits since to the code it measures | "
        "defaults changed since | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        code = "-" if r.code_changes is None else str(len(r.code_changes))
        defaults = ("-" if r.defaults_changes is None
                    else "; ".join(r.defaults_changes) or "none")
        # Named from the results folder (a file in quality/ says so), else by its name.
        name = r.file.removeprefix("benchmarks/results/")
        lines.append(f"| `{name}` | {r.benchmark} | {r.commit or '-'} | {code} | "
                     f"{defaults} | {r.verdict} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "freshness.md")
    args = parser.parse_args(argv)
    rows = [assess(p) for p in result_files()]
    text = table(rows, _git("rev-parse", "--short", "HEAD"))
    args.out.write_text(text)
    print(text)
    missing = [r.file for r in rows if r.commit is None or r.command is None]
    if missing:
        print(f"{len(missing)} result file(s) name no known commit or no command: {missing}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
