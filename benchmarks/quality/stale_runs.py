"""Stale runs under the arms they ran as, when a default moves.

A stale run (computed by code whose hash is not today's) is still shown, marked stale, by the
arm whose config it recorded: `runner.load_arm` finds it by the key that config has. When a
default changes, `runner.rekey_runs` moves only current runs, so a stale run stayed under the
key its config had under the old default, which no arm has any more, and its arm's row left
the report instead of showing the old figure marked stale (moving the outer momentum's warm-up
to 16 hid experiment 1's H = 8 rows). `refile_stale_runs` moves each such run to its key under
today's defaults, onto a free key only: a run already there (current, or stale) stays, since a
current run is the better record and two stale ones cannot be told apart by age here.
(This lives outside `runner.py`, whose code is in the quality code hash.)
"""

import json
from pathlib import Path

from benchmarks.quality.code_identity import is_current
from benchmarks.quality.runner import RUNS_DIR, config_key


def refile_stale_runs(runs_dir: Path = RUNS_DIR) -> list[tuple[str, str]]:
    """Move every stale run that is off its key under today's defaults onto it where that key
    is free; return the moves (old key, new key). Pass after pass until one moves nothing: a
    run's key may be freed only by a run the pass meets after it (one stale run sitting on
    another's key), which left the first one off its key until the next report moved it. Each
    move puts a run on its own key, where it stays, so the passes end."""
    moves = []
    while moved := _refile_once(runs_dir):
        moves += moved
    return moves


def _refile_once(runs_dir: Path) -> list[tuple[str, str]]:
    moves = []
    for path in sorted(runs_dir.glob("*.json")):
        record = json.loads(path.read_text())
        # An undated run (from before runs recorded their commit and code hash) cannot say
        # which code it is stale against: it stays where it is rather than be shown again.
        if is_current(record) or "commit" not in record:
            continue
        key = config_key(record["arm"]["method"], record["config"])
        target = runs_dir / f"{key}.json"
        if key == path.stem or target.exists():
            continue
        target.write_text(json.dumps({**record, "key": key}, indent=1))
        path.unlink()
        moves.append((path.stem, key))
    return moves
