"""Which code computed a quality result: the hash a stored arm is keyed to.

An arm's figures depend on the modules the simulator, the baselines and the data loaders import,
found by following their imports (module- and function-level) through the project's own
packages, plus the runner that turns a simulation into figures and the scoring that turns its
final model into validation and test figures. Code they cannot reach (the
learner mesh, the goodput model) does not make stored results stale.

The hash is of each module's syntax tree with docstrings dropped, not of its bytes: a comment,
a docstring (a field's documentation included) or a line reflowed for the linter cannot change
a figure, and used to mark every stored result stale (a run of hours to clear). Any change the
interpreter sees still does, with one exception: the default value of a config field
(`@config_section` classes in `diloco_core/config.py`). A stored run records its whole resolved
config and is reused only while that config is what its arm resolves to today (`runner.load_arm`),
so a changed default already refuses every run it changes and leaves the others valid; hashing
the value too would mark every stored result stale for the one decision the results exist to
make (issue 38: a default changes only when the confirmation says so, and the confirmation's
runs are then the new default's).
"""

import ast
import functools
import hashlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# scoring.py is named, not followed: imports are followed only through PACKAGES, so that adding
# an experiment (experiments.py) or a report column does not make every stored result stale.
ROOTS = ("diloco_core/simulator.py", "diloco_core/baselines.py", "resources/task_data.py",
         "benchmarks/quality/runner.py", "benchmarks/quality/scoring.py")
PACKAGES = ("diloco_core", "resources")
# The module whose config fields' defaults a stored run's recorded config covers (see above).
CONFIG_MODULE = "diloco_core/config.py"


def imported_modules(path: Path, packages: tuple[str, ...] = PACKAGES,
                     repo: Path = REPO) -> set[Path]:
    """The modules of `packages` (under `repo`) one source file imports, at any depth in the
    file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                 if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
        for name in names:
            if name.split(".")[0] in packages:
                candidate = repo / (name.replace(".", "/") + ".py")
                if candidate.exists():
                    found.add(candidate)
    return found


def code_files() -> list[Path]:
    """Every source file an arm's figures depend on (the import closure of ROOTS)."""
    seen: set[Path] = set()
    todo = [REPO / root for root in ROOTS]
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo.extend(imported_modules(path) - seen)
    return sorted(seen)


def _is_config_section(node: ast.AST) -> bool:
    return isinstance(node, ast.ClassDef) and any(
        isinstance(d, ast.Name) and d.id == "config_section" for d in node.decorator_list)


def semantic_source(text: str, drop_field_defaults: bool = False) -> str:
    """The module as the interpreter sees it: its syntax tree, without comments (the parser
    drops them), layout or docstrings (dropped here: a module's, class's or function's, and
    the string under a field, `config.py`'s field documentation; a bare string statement does
    nothing; an f-string or a constant used anywhere is kept). With `drop_field_defaults`, the
    default values of `@config_section` fields go too (their names and types stay)."""
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if drop_field_defaults and _is_config_section(node):
            for statement in node.body:
                if isinstance(statement, ast.AnnAssign):
                    statement.value = None
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            kept = [s for s in node.body if not (isinstance(s, ast.Expr)
                                                 and isinstance(s.value, ast.Constant)
                                                 and isinstance(s.value.value, str))]
            # An empty body is not valid syntax: a docstring-only function keeps a `pass`.
            node.body = kept or [ast.Pass()]
    return ast.dump(tree, annotate_fields=False)


def _hashed_source(rel: str, text: str) -> str:
    return semantic_source(text, drop_field_defaults=rel == CONFIG_MODULE)


@functools.cache
def code_hash() -> str:
    """A hash of the sources that compute an arm's figures, taken once per process: the code a
    process runs is what it imported, so a file edited during a sweep must not relabel the
    sweep's later results (and a report checks every stored run against the same hash)."""
    digest = hashlib.sha256()
    for path in code_files():
        rel = str(path.relative_to(REPO))
        digest.update(rel.encode() + b"\0" + _hashed_source(rel, path.read_text()).encode()
                      + b"\0")
    return digest.hexdigest()[:16]


def is_current(record: dict) -> bool:
    """Whether a stored result was computed by the code in this tree."""
    return record.get("code") == code_hash()


def changed_since(commit: str) -> list[str] | None:
    """The files among today's `code_files()` whose syntax differs from their version at
    `commit` (added files included): what a reader needs to judge a stale result. None when git
    cannot say (no repository, an unknown commit)."""
    import subprocess

    def at_commit(rel: str) -> str | None:
        done = subprocess.run(["git", "show", f"{commit}:{rel}"], cwd=REPO,
                              capture_output=True, text=True, timeout=30)
        return done.stdout if done.returncode == 0 else None

    try:
        known = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=REPO,
                               capture_output=True, timeout=30).returncode == 0
        if not known:
            return None
        changed = []
        for path in code_files():
            rel = str(path.relative_to(REPO))
            old = at_commit(rel)
            if old is None or _hashed_source(rel, old) != _hashed_source(rel, path.read_text()):
                changed.append(rel)
        return changed
    except (OSError, subprocess.SubprocessError, SyntaxError):
        return None
