"""Small conventions a user meets first: the licence the package declares is in the checkout,
and the demo's progress lines spell learner statuses out."""

import tomllib
from pathlib import Path

from diloco_core.config import ExperimentConfig
from pipelines.demo_command import Watch, _progress_line

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
        return {"round": 3}

    def current_version(self, fragment):
        return 1

    def get_eval(self, round_index):
        return None


def test_progress_lines_spell_statuses_out():
    cfg = ExperimentConfig()
    names = cfg.learners.learner_names
    beats = {names[0]: {"status": "stopping", "step": 9}, names[1]: {"status": "failed"}}
    line = _progress_line(_Store(beats), cfg, Watch())
    assert "0:stopping@9" in line and "1:failed@0" in line and "2:down@0" in line
