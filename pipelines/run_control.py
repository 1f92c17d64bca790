"""Ending a run before its budget: the operator's request, shared by `diloco stop` and the
`stop` job in the Dagster UI.

The request is a record in the store, never a signal to processes: the round controller (the
syncer service, or the quorum sensor falling back) reads it at its next tick and writes STOP
exactly as at the token budget, so the learners stop, the P final rounds publish everyone's
last progress, and the run summary is written. Learners are not killed, so nothing they
trained since their last offer is lost, and a stopped run is never relaunched: it is finished.
"""

import time

from resources.store.artifact_store import ArtifactStore


def request_stop(store: ArtifactStore, requested_by: str, reason: str = "") -> str:
    """Ask the run to stop; returns one line saying what happens next."""
    if store.get_config() is None:
        raise ValueError(f"experiment {store.experiment!r} has no config in the store")
    if store.finished() is not None:
        return f"experiment {store.experiment} has already finished; nothing to stop"
    if store.stop_requested() is not None:
        return (f"experiment {store.experiment} is already stopping "
                f"({store.stop_requested().get('reason')}); its final rounds are under way")
    made = store.put_stop_request({"requested_by": requested_by[:80], "reason": reason[:200],
                                   "time": time.time()})
    if not made:
        return f"a stop of experiment {store.experiment} was already requested"
    return (f"stop requested for experiment {store.experiment}: at its next tick the syncer "
            "writes STOP, the learners stop, the final rounds merge and the summary is "
            "written (watch it with `diloco status`)")
