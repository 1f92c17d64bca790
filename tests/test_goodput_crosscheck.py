"""benchmarks/goodput_crosscheck.py: every tape the chaos soak ran is cross-checked on its own
failures, and the figures to quote are the medians over tapes."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import goodput_crosscheck  # noqa: E402


def _run(goodput: float, kills: int, wall: float) -> dict:
    return {"faults_fired": {"learner_kill": kills}, "relaunch_seconds": [10.0, 14.0],
            "rejoin_seconds_median": 20.0, "learners": 4, "quorum": 2, "goodput": goodput,
            "wall_seconds": wall}


def _soak(tmp_path: Path, tapes: dict[str, tuple[float, int]]) -> Path:
    runs = {}
    for method in ("decoupled", "synchronous"):
        runs[f"{method}/fault_free"] = _run(0.9, 0, 300.0)
        for name, (goodput, kills) in tapes.items():
            runs[f"{method}/{name}"] = _run(goodput, kills, 400.0)
    path = tmp_path / "soak.json"
    path.write_text(json.dumps({"when": "then", "commit": {"commit": "a" * 40}, "runs": runs}))
    return path


def test_every_tape_is_checked_and_the_medians_are_over_tapes(tmp_path, monkeypatch):
    soak = _soak(tmp_path, {"tape": (0.45, 8), "tape-s8": (0.72, 4), "tape-s9": (0.63, 6)})
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", ["goodput_crosscheck.py", "--soak", str(soak),
                                      "--out", str(out), "--seeds", "4"])
    goodput_crosscheck.main()
    result = json.loads(out.read_text())
    for method in ("decoupled", "synchronous"):
        checked = result["methods"][method]
        assert set(checked["tapes"]) == {"tape", "tape-s8", "tape-s9"}
        # Each tape with its own kills (MTBI = learners x wall / kills).
        assert [checked["tapes"][t]["mtbi_learner_seconds"]
                for t in ("tape", "tape-s8", "tape-s9")] == [200.0, 400.0, 400.0 * 4 / 6]
        assert checked["median"]["measured_ratio"] == pytest.approx(0.63 / 0.9)


def test_a_tape_without_kills_is_refused_by_name(tmp_path, monkeypatch):
    soak = _soak(tmp_path, {"tape": (0.45, 8), "tape-s8": (0.9, 0)})
    monkeypatch.setattr(sys, "argv", ["goodput_crosscheck.py", "--soak", str(soak),
                                      "--out", str(tmp_path / "out.json"), "--seeds", "4"])
    with pytest.raises(SystemExit, match="decoupled/tape-s8 fired no kills"):
        goodput_crosscheck.main()
