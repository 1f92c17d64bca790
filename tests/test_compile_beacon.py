"""The compile beacon keeps a learner's heartbeat changing while its first step blocks the loop,
and goes silent after its limit, so a truly hung compile is still detected."""

import time

from diloco_core.liveness import observe, silent_for
from resources.learner.beacon import CompileBeacon


def _beats_during(block_seconds: float, limit: float) -> list[dict]:
    published: list[dict] = []
    beat = {"learner": "learner-0", "attempt": 2, "status": "training", "step": 40, "time": 0.0}
    with CompileBeacon(published.append, beat, every=0.05, limit=limit):
        time.sleep(block_seconds)   # the blocked loop (XLA compiling)
    return published


def test_beats_keep_changing_while_the_first_step_blocks():
    published = _beats_during(0.6, limit=60.0)
    assert len(published) >= 5
    assert all(b["status"] == "starting" and b["step"] == 40 and b["attempt"] == 2
               for b in published)
    times = [b["time"] for b in published]
    assert times == sorted(times) and len(set(times)) == len(times)
    # Seen by the syncer's liveness rule, the learner never goes silent for long.
    seen, last = {}, 0.0
    for i, b in enumerate(published):
        seen = observe(seen, {"learner-0": b}, now=i * 0.05)
        last = silent_for(seen, "learner-0", now=i * 0.05)
    assert last == 0.0


def test_beacon_goes_silent_after_its_limit_and_stops_on_exit():
    published = _beats_during(0.8, limit=0.2)
    assert 1 <= len(published) <= 6   # about limit / every beats, then nothing
    assert max(b["compiling_seconds"] for b in published) <= 0.3
    published = _beats_during(0.0, limit=60.0)
    count = len(published)
    time.sleep(0.2)
    assert len(published) == count   # the thread ended with the block
