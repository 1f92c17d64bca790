"""What an observer records of one committed offer (a `learner_update` event in Dagster, the
mirror's and the sensor's reports): a summary of its manifest, bounded field by field, or why
it is not one of this experiment's learners' offers. Never on the control path: the syncer's
state machine decides from the store's own digests, not from this."""

from dataclasses import dataclass

from diloco_core.config import ExperimentConfig
from diloco_core.round_records import MAX_TEXT, finite_float
from resources.store.artifact_store import ArtifactStore, RejectedArtifact


@dataclass(frozen=True)
class OfferSummary:
    """An offer as an observer records it: its validated manifest's figures (None where the
    manifest was refused), whether it came after its round was decided, and why it is not
    one of this experiment's learners' offers or was refused (`problem`)."""

    round: int
    learner: str
    late: bool
    fragment: int | None = None
    base_version: int | None = None
    tokens: int | None = None
    steps: int | None = None
    nbytes: int | None = None
    learner_step: int | None = None
    staleness: int | None = None        # versions of its fragment it had not seen
    encoding: str = ""
    train_loss: float | None = None
    problem: str | None = None
    foreign: bool = False               # not a learner of this experiment: never an arrival

    def figures(self) -> dict[str, int]:
        """The counters present, for an observer's metadata."""
        return {k: v for k, v in (
            ("fragment", self.fragment), ("base_version", self.base_version),
            ("tokens", self.tokens), ("steps", self.steps), ("nbytes", self.nbytes),
            ("learner_step", self.learner_step), ("staleness", self.staleness))
            if v is not None}


def describe_offer(store: ArtifactStore, cfg: ExperimentConfig, round_index: int,
                   learner: str, late: bool) -> OfferSummary:
    """What an observer records of one committed offer (a `learner_update` event): its
    manifest's summary, or why it is not one of this experiment's learners' offers."""
    if learner not in cfg.learners.learner_names:
        # Not one of this experiment's learners (a stray or hostile writer, or a name that
        # is not even a valid key): never an arrival, never merged.
        return OfferSummary(round_index, learner, True, foreign=True,
                            problem="not a learner of this experiment")
    manifest, problem = None, None
    try:
        manifest = store.contribution_manifest(round_index, learner)
    except RejectedArtifact as err:
        problem = err.reason
    except (OSError, ValueError) as err:    # made unreadable by its learner, or a link out
        problem = f"unreadable: {type(err).__name__}: {str(err)[:200]}"
    if manifest is None:
        return OfferSummary(round_index, learner, late,
                            problem=None if problem is None else problem[:MAX_TEXT])
    fragment, staleness = manifest.fragment, None
    if not fragment < cfg.sync.num_fragments:
        # Never a key built from a learner's number that the plan does not have (10**18
        # made every tick raise here, in both of the sensor's modes).
        problem = f"fragment {fragment} does not exist (P={cfg.sync.num_fragments})"
        fragment = None
    current = store.current_version(fragment) if fragment is not None else None
    if current is not None:
        staleness = max(0, current - manifest.base_version)
    return OfferSummary(
        round_index, learner, late, fragment=fragment, base_version=manifest.base_version,
        tokens=manifest.tokens, steps=manifest.steps, nbytes=manifest.nbytes,
        learner_step=manifest.learner_step, staleness=staleness,
        encoding=",".join(e[:16] for e in manifest.encoding[:8]),
        train_loss=finite_float(manifest.extra.get("train_loss")), problem=problem)
