"""Where an experiment is in its life, read from its store records alone:

- `active`: the store's ACTIVE names it (the sensors and the syncer drive it) and it has not
  finished;
- `stopping`: STOP is written (the token budget is reached, or an operator asked to stop and
  the syncer acted on it); its final rounds are under way;
- `finished`: its final rounds are merged (FINISHED), at its token budget;
- `stopped`: finished early, at an operator's request;
- `inactive`: neither active nor finished: its processes were interrupted (a demo stopped with
  Ctrl-C, an instance torn down), or another experiment took the store over. Launching it
  again resumes it.
"""

from resources.store.artifact_store import ArtifactStore

STATES = ("active", "stopping", "finished", "stopped", "inactive")


def experiment_state(store: ArtifactStore, active: str | None) -> str:
    """`active`: the name the store's ACTIVE holds (None: no experiment is active)."""
    if store.finished() is not None:
        return "stopped" if store.stop_request() is not None else "finished"
    if store.stop_requested() is not None or store.stop_request() is not None:
        return "stopping"
    return "active" if store.experiment == active else "inactive"
