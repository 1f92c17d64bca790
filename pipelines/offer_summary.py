"""What an observer records of one committed offer (a `learner_update` event in Dagster, the
mirror's and the sensor's reports): a summary of its manifest, bounded field by field, or why
it is not one of this experiment's learners' offers. Never on the control path: the syncer's
state machine decides from the store's own digests, not from this."""

from collections.abc import Mapping
from typing import Any

from diloco_core.config import ExperimentConfig
from diloco_core.round_records import MAX_INT, MAX_TEXT, finite_float
from resources.store.artifact_store import ArtifactStore, RejectedArtifact


def describe_offer(store: ArtifactStore, cfg: ExperimentConfig, round_index: int,
                   learner: str, late: bool) -> dict:
    """What an observer records of one committed offer (a `learner_update` event): its
    manifest's summary, or why it is not one of this experiment's learners' offers."""
    if learner not in cfg.learners.learner_names:
        # Not one of this experiment's learners (a stray or hostile writer, or a name that
        # is not even a valid key): never an arrival, never merged.
        return {**_offer_summary({}), "round": round_index, "learner": learner, "late": True,
                "foreign": True, "problem": "not a learner of this experiment"}
    try:
        manifest = store.contribution_manifest(round_index, learner) or {}
    except RejectedArtifact as err:
        manifest = {"rejected": err.reason}
    except (OSError, ValueError) as err:    # made unreadable by its learner, or a link out
        manifest = {"rejected": f"unreadable: {type(err).__name__}: {str(err)[:200]}"}
    offer = _offer_summary(manifest)
    fragment = offer["fragment"]
    if fragment is not None and not fragment < cfg.sync.num_fragments:
        # Never a key built from a learner's number that the plan does not have (-1 or
        # 10**300 made every tick raise here, in both of the sensor's modes).
        offer["problem"] = offer["problem"] or (
            f"fragment {fragment} does not exist (P={cfg.sync.num_fragments})")
        fragment = offer["fragment"] = None
    current = store.current_version(fragment) if fragment is not None else None
    if current is not None and isinstance(offer["base_version"], int):
        # Global versions of this fragment the learner had not seen when it offered.
        offer["staleness"] = max(0, current - offer["base_version"])
    return {**offer, "round": round_index, "learner": learner, "late": late}


def _offer_summary(manifest: Mapping[str, Any]) -> dict:
    """Observer metadata of an offer; a malformed manifest yields what it can (the merge
    validates for real and rejects it with a reason)."""
    def number(key: str) -> int | None:
        """An integer in [0, MAX_INT] (what every counter of a record is), else None."""
        value = manifest.get(key)
        return (value if isinstance(value, int) and not isinstance(value, bool)
                and 0 <= value <= MAX_INT else None)

    extra = manifest.get("extra") if isinstance(manifest.get("extra"), Mapping) else {}
    encoding = manifest.get("encoding")
    loss = finite_float(extra.get("train_loss"))
    problem = manifest.get("rejected")
    return {"fragment": number("fragment"), "base_version": number("base_version"),
            "tokens": number("tokens"), "steps": number("steps"), "nbytes": number("nbytes"),
            "encoding": (",".join(str(e)[:16] for e in encoding[:8])
                         if isinstance(encoding, list) else ""),
            "learner_step": number("learner_step"), "train_loss": loss,
            "problem": None if problem is None else str(problem)[:MAX_TEXT]}
