"""Small conventions a user meets first: the licence the package declares is in the checkout,
and the demo's progress lines spell learner statuses out."""

import tomllib
from pathlib import Path

from diloco_core.config import ExperimentConfig
from diloco_core.round_records import Heartbeat, RoundOpen
from pipelines.commands.demo import Watch, _progress_line

ROOT = Path(__file__).resolve().parent.parent


def test_the_declared_licence_is_shipped_in_full():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]
    assert declared == {"text": "Apache-2.0"}
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:5] == ["Apache", "License", "Version", "2.0,", "January"]
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 150


class _Store:
    """What `_progress_line` reads from the store."""

    def __init__(self, beats):
        self.beats = beats

    def get_heartbeat(self, name):
        return self.beats.get(name)

    def latest_open_round(self):
        return RoundOpen(3, 1, 0.0)

    def current_version(self, fragment):
        return 1

    def get_eval(self, round_index):
        return None


def test_progress_lines_spell_statuses_out():
    cfg = ExperimentConfig()
    names = cfg.learners.learner_names
    beats = {names[0]: Heartbeat("stopping", 0.0, step=9), names[1]: Heartbeat("failed", 0.0)}
    line = _progress_line(_Store(beats), cfg, Watch())
    assert "0:stopping@9" in line and "1:failed@0" in line and "2:down@0" in line


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalized (PEP 503)."""
    import re

    name = re.match(r"[A-Za-z0-9._-]+", requirement.strip()).group(0)
    return re.sub(r"[-_.]+", "-", name).lower()


def _extras(extra: str, optional: dict, seen: set) -> list[str]:
    """The requirements `.[extra]` brings in, following the project's own extras."""
    out = []
    for req in optional[extra]:
        if _name(req) == "decoupled-diloco":
            for inner in req.split("[", 1)[1].split("]", 1)[0].split(","):
                if inner.strip() not in seen:
                    seen.add(inner.strip())
                    out += _extras(inner.strip(), optional, seen)
        else:
            out.append(req)
    return out


def test_the_tensorboard_the_docs_tell_users_to_run_is_installable():
    """docs/operating.md says `pip install -e '.[tensorboard]'` then `tensorboard --logdir`:
    that extra exists and brings the TensorBoard app (writing event files needs only the base
    install's tensorboardX)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    doc = (ROOT / "docs" / "operating.md").read_text()
    assert "pip install -e '.[tensorboard]'" in doc and "tensorboard --logdir" in doc
    assert "tensorboard" in {_name(r) for r in project["optional-dependencies"]["tensorboard"]}
    assert "tensorboardx" in {_name(r) for r in project["dependencies"]}


def test_everything_the_ci_install_brings_in_directly_is_pinned_in_its_lock():
    """`.ci/run` installs `.[dev]` with requirements/ci.lock as constraints: a dependency added
    to the base or to an extra `dev` reaches must be in the lock too (an extra outside it, such
    as `tensorboard`, need not)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    locked = {_name(line) for line in (ROOT / "requirements" / "ci.lock").read_text().splitlines()
              if line.strip() and not line.startswith("#")}
    reached = project["dependencies"] + _extras("dev", project["optional-dependencies"], {"dev"})
    assert {_name(r) for r in reached} - locked == set()
