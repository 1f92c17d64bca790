"""Imports point one way: pipelines -> resources -> diloco_core. diloco_core does no I/O."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
FORBIDDEN = {
    "diloco_core": {"dagster", "dagster_pipes", "resources", "pipelines", "google", "orbax",
                    "pickle", "os", "pathlib", "subprocess", "socket", "requests", "sklearn"},
    "resources": {"pipelines", "pickle"},
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layering(package):
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = _imports(path) & FORBIDDEN[package]
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


# The driver boundary: the process entries and the Dagster definitions that launch a chaos run
# select its fault injectors. The learner runtime, the syncer service and the merge take them
# only as hooks (`resources/learner/hooks.py`, `pipelines/syncer/hooks.py`).
CHAOS_DRIVERS = {"pipelines/learner_entry.py", "pipelines/syncer/entry.py",
                 "pipelines/defs/rounds.py", "pipelines/defs/supervise_tick.py",
                 "pipelines/defs/experiment.py", "pipelines/commands/demo.py"}


def _modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_only_the_drivers_import_fault_injection():
    importers = set()
    for package in ("pipelines", "resources", "diloco_core"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel.startswith("resources/chaos/"):
                continue
            if any(m == "resources.chaos" or m.startswith("resources.chaos.")
                   for m in _modules(path)):
                importers.add(rel)
    assert importers <= CHAOS_DRIVERS, sorted(importers - CHAOS_DRIVERS)
    assert importers, "the drivers select the chaos hooks somewhere"


def _store_attributes(path: Path) -> set[str]:
    """The attributes the module uses on a store: `store.x`, `self.store.x`,
    `self.plain_store.x`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if (isinstance(owner, ast.Name) and owner.id == "store") or (
                isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name)
                and owner.value.id == "self" and owner.attr in ("store", "plain_store")):
            found.add(node.attr)
    return found


def test_the_learner_uses_only_its_view_of_the_store(tmp_path):
    """"What may a learner read and write?" has one answer in code, `LearnerView`: the learner
    process calls nothing else on the store, and the artifact store provides all of it."""
    from resources.store.artifact_store import ArtifactStore
    from resources.store.backends import open_blob_store
    from resources.store.learner_view import LearnerView

    allowed = {name for name in dir(LearnerView) if not name.startswith("_")} | {"experiment"}
    used = {}
    for path in sorted((ROOT / "resources" / "learner").rglob("*.py")):
        for attr in _store_attributes(path) - allowed:
            used.setdefault(attr, []).append(str(path.relative_to(ROOT)))
    assert not used, used
    assert isinstance(ArtifactStore(open_blob_store(str(tmp_path)), "exp"), LearnerView)
