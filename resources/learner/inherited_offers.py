"""What a relaunched learner inherits of its earlier attempts' offers: whether it already
offered the round open now, and which offers still await their merge.

A learner that was never killed does not offer a fragment again while its last offer of it is
in flight (`OfferBook.in_flight`): the next offer waits for the merged version. A relaunched
attempt starts with an empty book, so without this it offered that fragment on the version the
earlier offer was made on, as soon as a round of it opened; once the earlier offer's merge was
published the syncer refused the new one as a replay (an offer on a base no newer than one of
this learner's merged offers), and after STOP the round waited for it (the chaos soak's tape 8
saw a final round wait out the round timeout for a learner relaunched 7 s before STOP).
"""

import logging
from collections.abc import Sequence

from diloco_core.learner_protocol import PendingOffer
from resources.store.artifact_store import RejectedArtifact
from resources.store.learner_view import LearnerView

_logger = logging.getLogger(__name__)


def offered_before(store: LearnerView, learner: str, round_index: int) -> bool:
    """Whether the learner's offer to the round is in the store: a manifest the store refuses
    counts too (offers are write-once: another could not land)."""
    try:
        return store.contribution_manifest(round_index, learner) is not None
    except RejectedArtifact:
        return True


def offers_in_flight(store: LearnerView, learner: str, open_round: int | None,
                     versions: Sequence[int], log: logging.Logger = _logger
                     ) -> dict[int, tuple[int, int]]:
    """Fragment -> (round, base version) of the learner's newest offer of each fragment, where
    `versions` (what the new attempt starts from) does not include its merge yet. Read from the
    store's offers to the last 2P rounds up to `open_round` (older offers have been decided and
    their merges published or given up; an offer the store refuses is skipped with a reason)."""
    P = len(versions)
    newest: dict[int, tuple[int, int]] = {}
    if open_round is None:
        return {}
    for r in range(open_round, max(-1, open_round - 2 * P), -1):
        try:
            manifest = store.contribution_manifest(r, learner)
        except RejectedArtifact as err:
            log.warning(f"{learner}: its offer to round {r} is unreadable, not inherited: {err}")
            continue
        if manifest is None or not 0 <= manifest.fragment < P or manifest.fragment in newest:
            continue
        newest[manifest.fragment] = (r, manifest.base_version)
    return {p: (r, base) for p, (r, base) in newest.items() if versions[p] <= base}


def as_ints(found: dict[int, tuple[int, int]], num_fragments: int) -> list[int]:
    """(round, base) per fragment, -1 where none: a multi-process learner's leader broadcasts
    them (`Lockstep.ints`) so that every process starts from the same book."""
    flat = [-1] * (2 * num_fragments)
    for p, (r, base) in found.items():
        flat[2 * p:2 * p + 2] = [r, base]
    return flat


def as_pending(flat: Sequence[int], step: int, since: float) -> dict[int, PendingOffer]:
    """The book's pending offers (round -> offer) from `as_ints`' list, counted from `step`
    and `since` (pacing and patience run from the relaunch)."""
    return {r: PendingOffer(r, p, base, step, since)
            for p, (r, base) in enumerate(zip(flat[::2], flat[1::2], strict=True)) if r >= 0}
