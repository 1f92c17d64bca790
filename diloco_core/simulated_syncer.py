"""The simulator's syncer: the syncer's state machine (`syncer_machine.step`) on the fake clock.

The simulator drives the same machine the syncer service and the quorum sensor drive, so a
round opens, is decided, stops and finishes by the same rules and the same state on both
paths. What this module adds is the driver's half, the simulated world seen as the syncer would
see it in the store:

- each learner's heartbeat, rewritten at every tick while it is up (its status, attempt, steps,
  tokens, compute seconds, the rounds it declined);
- the offers written since the last tick, with digests that name each offer (an honest learner
  never offers the same bytes twice);
- the version each fragment's published merge holds, and the round that merged it.

Where the two paths differ, on purpose, is in the driver:
- **Failure detection.** A failed learner's heartbeat says "failed" at once here; the real syncer
  notices a silent heartbeat after `learner_timeout_seconds`. The simulator models a perfect
  failure detector, as it always has (its outage experiments measure the protocol, not the
  detector).
- **Time.** The machine is ticked at every simulated event, and at the times it asks for
  (`Stepped.wake_at`: a grace window closing, a round's timeout), never on a poll interval, so
  an offer arrives when it was made.
"""

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

from diloco_core.config import ExperimentConfig
from diloco_core.contribution import Contribution
from diloco_core.quorum import Estimates
from diloco_core.round_records import Heartbeat
from diloco_core.syncer import MergeRecord
from diloco_core.syncer_events import Observed, OfferDigest, OfferSeen, OpenRound, VersionSeen
from diloco_core.syncer_machine import Accounts, Stepped, SyncerState, step

DECIDED_BY = "simulator"


@dataclass
class SimulatedRound:
    """A round the machine opened: the contributions offered to it (the payloads a decision's
    members name) and who answered it (offered or declined)."""

    index: int
    fragment: int
    opened_at: float
    final: bool = False
    contributions: dict[str, Contribution] = field(default_factory=dict)
    answered: set[str] = field(default_factory=set)
    decided: bool = False


@dataclass(frozen=True)
class LearnerView:
    """What a learner's heartbeat tells the syncer."""

    name: str
    status: str              # "training", "stopping", "failed", "left", or "absent" (none yet)
    attempt: int
    steps: int
    tokens: int
    compute_seconds: float
    declined: tuple[int, ...]


def start_state(experiment: str, estimates: Estimates,
                tokens_at_start: dict[str, int] | None = None) -> SyncerState:
    """The machine's state at the start of a simulated run: the simulator's configured step
    and sync times as the first estimates, and (after a warm start) the tokens the learners
    already had, so that round 0 waits for H/P steps of progress past the fork."""
    tokens = dict(tokens_at_start or {})
    # As a syncer rebuilt from the store credits them: its account of each learner begins at
    # the tokens it had (the M = 2 and declared-rate bounds count from there, not from 0).
    return SyncerState(experiment, estimates=estimates, tokens_at_open=tokens,
                       accounts=Accounts(base=tokens))


def offer_seen(contribution: Contribution) -> OfferSeen:
    """The machine's view of an offer: its counters and base, and digests naming it."""
    name = f"{contribution.learner}/round-{contribution.round}"
    digest = hashlib.sha256(name.encode()).hexdigest()
    return OfferSeen(contribution.round, contribution.learner,
                     OfferDigest(manifest=digest, payload=digest,
                                 base=contribution.base_version, tokens=contribution.tokens,
                                 steps=contribution.steps))


def observe(now: float, learners: Iterable[LearnerView], budget: int,
            offers: list[OfferSeen], published: dict[int, VersionSeen],
            versions: dict[int, int]) -> Observed:
    """One tick's observation of the simulated world."""
    beats: dict[str, Heartbeat | None] = {}
    absent = set()
    for view in learners:
        if view.status == "absent":
            beats[view.name] = None
            absent.add(view.name)
            continue
        if view.status == "left":
            absent.add(view.name)
        beats[view.name] = Heartbeat(
            status=view.status, time=now, learner=view.name, attempt=view.attempt,
            step=view.steps, tokens_total=view.tokens, compute_seconds=view.compute_seconds,
            declined_rounds=view.declined[-64:])
    return Observed(now, beats, absent=frozenset(absent), budget=budget,
                    versions=dict(published), offers=tuple(offers),
                    current_versions=dict(versions))


class SimulatedSyncer:
    """The syncer's side of a simulated run: the machine's state, the rounds it opened, the
    offers it has not seen yet and the versions its merges published. The simulator tells it
    what the learners did (`offered`, `declined`, `published_merge`) and ticks it (`tick`);
    the actions it returns are the simulator's to carry out."""

    def __init__(self, cfg: ExperimentConfig, estimates: Estimates):
        self.cfg = cfg
        self.state = start_state(cfg.name, estimates)
        self.rounds: dict[int, SimulatedRound] = {}
        self.unseen: list[OfferSeen] = []
        self.published: dict[int, VersionSeen] = {}     # fragment -> its latest merge's round
        self.versions = dict.fromkeys(range(cfg.sync.num_fragments), 0)
        self.stopping = False
        self.merges: list[MergeRecord] = []
        self.merge_times: dict[int, float] = {}
        # Round -> the learners whose offers its merge took (empty if it merged nothing).
        self.merged_members: dict[int, frozenset[str]] = {}

    def fork(self, tokens: dict[str, int]) -> None:
        """After a warm start: round 0 waits for H/P steps of progress past these totals."""
        self.state = start_state(self.cfg.name, self.state.estimates, tokens)

    def open_round(self) -> SimulatedRound | None:
        return next((r for r in self.rounds.values() if not r.decided), None)

    def offered(self, rnd: SimulatedRound, contribution: Contribution) -> None:
        rnd.answered.add(contribution.learner)
        rnd.contributions[contribution.learner] = contribution
        self.unseen.append(offer_seen(contribution))

    def published_merge(self, round_index: int, version: int, members: tuple[str, ...]) -> None:
        """A decided round's merge reached the learners: the machine sees the round its
        fragment's version holds (one that merged nothing counts all the same: its decision
        was the syncer's last word on it)."""
        fragment = self.rounds[round_index].fragment
        self.published[fragment] = VersionSeen(round_index, members)
        self.versions[fragment] = version

    def tick(self, now: float, learners: Iterable[LearnerView]) -> Stepped:
        obs = observe(now, learners, self.cfg.token_budget, self.unseen, self.published,
                      self.versions)
        self.unseen = []
        stepped = step(self.state, obs, self.cfg, DECIDED_BY)
        self.state = stepped.state
        for action in stepped.actions:
            if isinstance(action, OpenRound):
                r = action.record
                self.rounds[r.round] = SimulatedRound(r.round, r.fragment, now, final=r.final)
        return stepped
