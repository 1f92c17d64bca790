"""Which learners are live, judged by the syncer's clock, never by the learners' own.

A learner's heartbeat carries its own clock, which may be skewed (another machine, another
region). So the syncer never compares that clock with its own: it remembers, in its state (the
sensor's cursor), when it last saw each heartbeat *change*, and a learner is live while that
was less than `learner_timeout_seconds` ago (and its status says it is working). A lost state
only makes every heartbeat look fresh once, for one timeout. Pure: the syncer's state machine
(`syncer_machine`) and the sensors use it alike.
"""

from collections.abc import Mapping

LIVE_STATUSES = ("starting", "training", "stopping")
# A learner's last process has ended: its final heartbeat carries its final ledger record. (A
# "leaving" learner is neither live nor ended: it still offers what it has.)
ENDED_STATUSES = ("done", "left", "failed", "superseded")


def _marker(beat: Mapping | None) -> str | None:
    if not beat:
        return None
    return (f"{beat.get('attempt')}|{beat.get('time')}|{beat.get('step')}|"
            f"{beat.get('status')}")


def observe(seen: Mapping[str, list] | None, beats: Mapping[str, Mapping | None], now: float
            ) -> dict[str, list]:
    """{learner: [heartbeat marker, when this syncer first saw it]}, updated with `beats`."""
    out = {k: list(v) for k, v in (seen or {}).items()}
    for name, beat in beats.items():
        marker = _marker(beat)
        if marker is not None and (name not in out or out[name][0] != marker):
            out[name] = [marker, now]
    return out


def silent_for(seen: Mapping[str, list], learner: str, now: float) -> float | None:
    """Seconds since this learner's heartbeat last changed (None: never seen one)."""
    entry = seen.get(learner)
    return None if entry is None else now - float(entry[1])


def live_learners(beats: Mapping[str, Mapping | None], seen: Mapping[str, list], now: float,
                  timeout: float) -> list[str]:
    live = []
    for name, beat in beats.items():
        silent = silent_for(seen, name, now)
        if (beat is not None and beat.get("status") in LIVE_STATUSES and silent is not None
                and silent < timeout):
            live.append(name)
    return sorted(live)
