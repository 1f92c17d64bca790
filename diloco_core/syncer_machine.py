"""The syncer's side of the round protocol as one pure state machine:
`step(state, observed, cfg) -> (state, actions)`.

Its drivers read the store, step, and write the actions in order
(`pipelines/syncer/round_control.py`: the syncer service and the quorum sensor's fallback, on
the syncer's wall clock). The machine reads and writes nothing itself: everything it knows
arrives as one `Observed` per tick, and everything it decides leaves as actions (`StopRun`,
`Decide`, `OpenRound`, `FinishRun`). The rules are the round protocol's (`round_protocol`);
what this module adds is the state they run
on and how one tick's observations become decisions:

- An offer's arrival time is when a tick first saw it (the syncer's clock, never a learner's).
- A learner is live while its heartbeat changed less than `learner_timeout_seconds` ago by the
  syncer's clock (`liveness`), unless the capacity record marks it absent.
- Offers to a decided round are late: recorded, never merged into it. Offers written before
  their round opened are planted and refused; a payload offered before is a replay or a copy.
- **The syncer's own account of each learner** (`accounts`): the tokens of its offers that were
  merged, per fragment, each credited only as far as the protocol's pace allows
  (`corroboration.credit_offer`), and only once the published version names it a member
  (an admitted offer the merge refuses, or a late one, vouches for nothing). Where fewer
  than two other learners are live to compare a heartbeat with (M = 2), its total counts
  toward the budget and the opening of rounds only as far as that account allows
  (`syncer_account.credited`): a learner that claims 2^62 tokens counts as one learner at the
  pace of the rounds unless it offers for more.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from diloco_core.config import ExperimentConfig
from diloco_core.corroboration import credit_offer, offer_step_bound, peer_step_bound
from diloco_core.liveness import live_learners, observe
from diloco_core.quorum import Estimates
from diloco_core.round_protocol import (
    budget_reached,
    decide_round,
    final_rounds,
    ready_to_open,
    tokens_needed,
)
from diloco_core.round_records import MAX_TEXT, Heartbeat, RoundDecision, RoundOpen
from diloco_core.syncer_account import credited
from diloco_core.syncer_events import (
    Action,
    Decide,
    FinishRun,
    Observed,
    OfferDigest,
    OfferSeen,
    OpenRound,
    StopRun,
)

LATE_WINDOW = 2          # decided rounds still watched for late offers
# A payload offered again within this many versions of every fragment (P rounds each) is a
# replay or a copy; it is remembered by the first PAYLOAD_KEY_CHARS hex digits of its SHA-256
# (64 bits: the window holds M x 16 P keys in the cursor, and a learner that wants to evade
# the check changes one byte instead, which makes it a fresh offer under every other rule).
REPLAY_WINDOW_VERSIONS = 16
PAYLOAD_KEY_CHARS = 16


# ---- the state --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pending:
    """A decided round whose merge is not yet published; `bases`: each member's base version
    (once published, an offer of the fragment on a base no newer is a replay)."""

    round: int
    fragment: int
    decided_at: float
    bases: Mapping[str, int] = field(default_factory=dict)
    # Each member's credited tokens, booked to its account once the merge is published with it
    # among the members: an offer the merge refuses (a screen, a bad payload) vouches for
    # nothing. Empty for a pending merge rebuilt from the store (credited to no one).
    credits: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Accounts:
    """The syncer's account of each learner: the credited tokens of the offers it saw since
    the account began, per fragment (`offered`), and each learner's credited total when it
    began (`base`: 0 at the start of the run; the last round's record when the state was
    rebuilt from the store), and when (`began`)."""

    offered: Mapping[str, Mapping[int, int]] = field(default_factory=dict)
    base: Mapping[str, int] = field(default_factory=dict)
    # When each learner's account began, by the syncer's clock: the first tick that read its
    # heartbeat, or, for a state rebuilt from the store, when the latest open round opened
    # (no earlier than one round timeout before the rebuild).
    began: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class SyncerState:
    """Everything the syncer remembers between ticks; the sensor keeps it as its cursor
    (`syncer_state_codec.state_to_json`), and a lost one is rebuilt from the store's records."""

    experiment: str
    round: int = -1
    fragment: int = 0
    decided: bool = True
    final: bool = False
    opened_at: float = 0.0
    tokens_at_open: Mapping[str, int] = field(default_factory=dict)
    arrivals: Mapping[str, float] = field(default_factory=dict)
    watch: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    pending: tuple[Pending, ...] = ()
    estimates: Estimates | None = None
    stop: bool = False
    final_left: int | None = None
    finished: bool = False
    digests: Mapping[str, OfferDigest] = field(default_factory=dict)   # admitted, open round
    payloads: Mapping[str, tuple[str, int]] = field(default_factory=dict)  # key -> (who, round)
    refused: Mapping[str, str] = field(default_factory=dict)           # open round
    bases: Mapping[str, Mapping[int, tuple[int, int]]] = field(default_factory=dict)
    seen: Mapping[str, list] = field(default_factory=dict)             # liveness markers
    accounts: Accounts = field(default_factory=Accounts)


@dataclass(frozen=True)
class Stepped:
    state: SyncerState
    actions: tuple[Action, ...]
    reason: str
    clipped: Mapping[str, str] = field(default_factory=dict)
    # The next time this state decides something with no new observation (a grace window or
    # a round's timeout ends, a final merge is given up on): an event-driven driver (the
    # simulator) ticks then; drivers on a poll loop need not look. None: nothing pending.
    wake_at: float | None = None


# ---- one tick ---------------------------------------------------------------------------------
class _Tick:
    """One step's working copy: the state's containers copied once, changed in place, frozen
    again at the end (the caller's state is never touched)."""

    def __init__(self, state: SyncerState, obs: Observed, cfg: ExperimentConfig):
        self.s = state
        self.obs, self.cfg = obs, cfg
        self.arrivals = dict(state.arrivals)
        self.watch = {k: set(v) for k, v in state.watch.items()}
        self.pending = list(state.pending)
        self.digests = dict(state.digests)
        self.payloads = dict(state.payloads)
        self.refused = dict(state.refused)
        self.bases = dict(state.bases)
        self.accounts = dict(state.accounts.offered)
        self.began = {**{n: obs.now for n, b in obs.beats.items() if b is not None},
                      **state.accounts.began}
        self.estimates = state.estimates
        self.decided_by = "sensor"
        self.actions: list[Action] = []
        self.reason = ""
        self.wake_at: float | None = None
        self.fields: dict[str, Any] = {}

    def freeze(self) -> SyncerState:
        keep = sorted(self.watch)[-(LATE_WINDOW + 1):]
        return replace(self.s, arrivals=self.arrivals,
                       watch={k: tuple(sorted(self.watch[k])) for k in keep},
                       pending=tuple(self.pending[-4 * self.cfg.sync.num_fragments:]),
                       digests=self.digests, payloads=self.payloads, refused=self.refused,
                       bases=self.bases,
                       accounts=replace(self.s.accounts, offered=self.accounts,
                                        began=self.began),
                       estimates=self.estimates,
                       **self.fields)

    def get(self, name: str):
        return self.fields.get(name, getattr(self.s, name))


def step(state: SyncerState, obs: Observed, cfg: ExperimentConfig, decided_by: str = "sensor"
         ) -> Stepped:
    """One tick of the syncer: observations in, the new state and the actions out.
    `decided_by` names the decider in the decisions it writes ("sensor" or the syncer's)."""
    if state.finished:
        return Stepped(state, (), "the run is finished")
    t = _Tick(state, obs, cfg)
    t.decided_by = decided_by
    now = obs.now
    views = {n: _marker_view(b) for n, b in obs.beats.items()}    # once per tick
    t.fields["seen"] = seen = observe(state.seen, views, now)
    live = [n for n in live_learners(views, seen, now,
                                     cfg.orchestration.learner_timeout_seconds)
            if n not in obs.absent]
    estimates = _estimates(t, obs.beats)
    _watch_published(t, now)
    _collect_offers(t, now)
    budget_tokens, tokens, clipped = credited(t.accounts, state.accounts.base,
                                              t.get("tokens_at_open"), obs.beats, live, cfg,
                                              {n: now - at for n, at in t.began.items()})
    _maybe_stop(t, budget_tokens, now)
    if not t.get("decided"):
        _decide(t, live, estimates, now)
    if t.get("decided"):
        _maybe_open(t, tokens, live, now)
    if not t.reason:
        t.reason = _status(t, live)
    if obs.refused_beats:
        t.reason += "; heartbeats refused: " + "; ".join(
            f"{n} ({why})" for n, why in sorted(obs.refused_beats.items()))
    if clipped:
        t.reason += "; claims not corroborated: " + "; ".join(
            f"{n} ({why})" for n, why in sorted(clipped.items()))
    return Stepped(t.freeze(), tuple(t.actions), t.reason, clipped, t.wake_at)


def planted(state: SyncerState, round_index: int, names: Sequence[str]) -> SyncerState:
    """The offers found under a round before its open record was written: refused (planted,
    to reach quorum the moment it opens), and watched so they are never arrivals."""
    if not names:
        return state
    refused = {**state.refused, **{n: f"offered before round {round_index} opened (planted)"
                                   for n in names}}
    return replace(state, refused=refused,
                   watch={**state.watch, round_index: tuple(sorted(names))})


def _marker_view(beat: Heartbeat | None) -> Mapping | None:
    """The fields liveness reads of a heartbeat."""
    if beat is None:
        return None
    return {"attempt": beat.attempt, "time": beat.time, "step": beat.step,
            "status": beat.status}


def _estimates(t: _Tick, beats: Mapping[str, Heartbeat | None]) -> Estimates:
    # The step time sets grace windows, and each learner reports its own: the lower median
    # (one learner claiming 1e300 seconds a step moves it no more than one claiming 0), held
    # within the round timeout (no window longer than a round may wait anyway).
    step_times = sorted(b.compute_seconds / b.step for b in beats.values()
                        if b and b.step and b.compute_seconds)
    seconds = step_times[(len(step_times) - 1) // 2] if step_times else 1.0
    seconds = min(seconds, float(t.cfg.orchestration.round_timeout_seconds))
    t.estimates = replace(t.estimates or Estimates(seconds), step_seconds=seconds)
    return t.estimates


def _observe(t: _Tick, **observed: float) -> None:
    t.estimates = t.estimates.observe(t.cfg.sync.ema_decay, **observed)


def _watch_published(t: _Tick, now: float) -> None:
    """Merges requested earlier whose version is now current: measure the sync latency, and
    remember the bases their members offered on."""
    still = []
    for p in t.pending:
        seen = t.obs.versions.get(p.fragment)
        if seen is None or seen.round < p.round:
            still.append(p)
            continue
        _observe(t, sync=now - p.decided_at)
        # A later round's version is current already: the driver looked up the version that
        # merged this one, if any (its members are unknown otherwise: nothing is booked).
        members = seen.members if seen.round == p.round else t.obs.merged.get(p.round, ())
        for member in members:
            if member in p.credits:
                account = dict(t.accounts.get(member, {}))
                account[p.fragment] = account.get(p.fragment, 0) + p.credits[member]
                t.accounts[member] = account
            base = p.bases.get(member)
            if base is not None:
                bases = dict(t.bases.get(member, {}))
                bases[p.fragment] = (max(base, bases.get(p.fragment, (-1, 0))[0]), p.round)
                t.bases[member] = bases
    t.pending = still


def _collect_offers(t: _Tick, now: float) -> None:
    r = t.get("round")
    if r < 0:
        return
    fresh: set[str] = set()      # payloads first seen this tick
    admitted: list[OfferSeen] = []
    names = set(t.cfg.learners.learner_names)
    for offer in t.obs.offers:
        seen = t.watch.setdefault(offer.round, set())
        if offer.learner in seen:
            continue
        seen.add(offer.learner)
        if offer.round == r and not t.get("decided") and offer.learner in names:
            if _admit_offer(t, r, offer, now, fresh):
                admitted.append(offer)
        elif offer.learner in names and offer.digest is not None:
            # Late: never merged, so it vouches for no tokens (a learner could write such
            # offers to every decided round).
            # Its payload is remembered as an admitted one's is: an honest learner's next offer
            # carries new bytes, so the same bytes again are a replay (or a copy). The hostile
            # soak replayed an offer that had come late, and it merged.
            t.payloads.setdefault(offer.digest.payload[:PAYLOAD_KEY_CHARS],
                                  (offer.learner, offer.round))
    horizon = r - REPLAY_WINDOW_VERSIONS * t.cfg.sync.num_fragments
    t.payloads = {k: v for k, v in t.payloads.items() if v[1] >= horizon}


def _credits(t: _Tick, admitted: Mapping[str, OfferDigest], fragment: int) -> dict[str, int]:
    """The tokens each member's offer adds to its account once merged (`_credit`), each
    bounded by the others' offers as well as by the versions' pace."""
    steps = {m: d.steps for m, d in admitted.items()}
    return {m: _credit(t, m, d, fragment, [s for n, s in steps.items() if n != m])
            for m, d in admitted.items()}


def _credit(t: _Tick, learner: str, d: OfferDigest, fragment: int,
            other_steps: Sequence[int]) -> int:
    """The tokens an admitted offer adds to its learner's account once merged. An offer
    claiming more than the protocol's pace allows (more steps than `max_speed_ratio` x H at its
    staleness, or than `max_speed_ratio` times the fewest another member of its round offered,
    whichever is more; or more tokens than its steps process) is a claim no honest learner
    makes: it adds nothing, not the capped amount (the hostile soak's over-claiming offers,
    capped, made a learner that trained like its peers count as 1.1 of them toward STOP)."""
    current = t.obs.current_versions.get(fragment)
    staleness = 0 if current is None else max(0, current - d.base)
    ratio = t.cfg.sync.max_speed_ratio
    bound = peer_step_bound(offer_step_bound(t.cfg.sync.sync_period, staleness, ratio),
                            other_steps, ratio)
    step_tokens = dict(zip(t.cfg.learners.learner_names, t.cfg.learner_step_tokens,
                           strict=True)).get(learner)
    tokens, _, overclaimed = credit_offer(d.tokens, d.steps, step_tokens, bound)
    return 0 if overclaimed is not None else tokens


def _admit_offer(t: _Tick, r: int, offer: OfferSeen, now: float, fresh: set[str]) -> bool:
    """An offer to the open round arrives: record the digests a decision will commit to, or
    refuse it when its payload was offered before (a replay of its own old offer, or a copy of
    another learner's seen in an earlier tick). Two offers of one payload first seen in the
    same tick are told apart by when the store created each payload: the later is the copy.
    Where the store cannot say, both arrive (refusing both would let a copier deny an honest
    learner its round; the copy adds one honest delta twice, nothing of its own). A manifest
    the store refuses still arrives (the merge refuses it with the store's reason). True:
    admitted with its digests."""
    learner, d = offer.learner, offer.digest
    if d is None:
        t.arrivals[learner] = now
        return False
    merged = t.bases.get(learner, {}).get(t.get("fragment"))
    if merged is not None and d.base <= merged[0]:
        t.refused[learner] = (
            f"base version {d.base}: its offer on base {merged[0]} was merged in round "
            f"{merged[1]}, and it has not received a version since (a replay)")
        t.arrivals.pop(learner, None)
        return False
    key = d.payload[:PAYLOAD_KEY_CHARS]
    prior = t.payloads.get(key)
    if prior is not None and key in fresh and prior[1] == r and prior[0] != learner:
        # Both first seen in this tick: the store's creation times tell original from copy.
        first = _created_first(t, prior[0], offer)
        if first == prior[0]:
            _refuse_copy(t, learner, prior[0], r, "the store created it later")
            return False
        if first == learner:
            _refuse_copy(t, prior[0], learner, r, "the store created it later")
            t.digests.pop(prior[0], None)
            prior = None
    if prior is not None and prior != (learner, r) and not (key in fresh and prior[1] == r):
        who, when = prior
        t.refused[learner] = (f"its payload is {who}'s offer to round {when}: "
                              + ("a replay" if who == learner else "a copy"))
        t.arrivals.pop(learner, None)
        return False
    t.payloads[key] = (learner, r)
    fresh.add(key)
    t.digests[learner] = d
    t.arrivals[learner] = now
    return True


def _created_first(t: _Tick, earlier: str, offer: OfferSeen) -> str | None:
    """Which of two offers of one payload the store created first; None when it cannot say."""
    other = next((o for o in t.obs.offers
                  if o.learner == earlier and o.round == offer.round), None)
    times = [None if other is None else other.created, offer.created]
    if None in times or times[0] == times[1]:
        return None
    return earlier if times[0] < times[1] else offer.learner


def _refuse_copy(t: _Tick, copier: str, original: str, r: int, why: str) -> None:
    t.refused[copier] = f"its payload is {original}'s offer to round {r}: a copy ({why})"
    t.arrivals.pop(copier, None)


def _maybe_stop(t: _Tick, tokens: Mapping[str, int], now: float) -> None:
    if t.get("stop"):
        return
    total, P = sum(tokens.values()), final_rounds(t.cfg.sync.num_fragments)
    request = t.obs.stop_request
    if t.obs.budget is not None and budget_reached(tokens, t.obs.budget):
        reason = f"token budget reached ({total} >= {t.obs.budget})"
    elif request is not None:
        # An operator's request ends the run the same way the budget does, so the final
        # rounds still publish every learner's last progress.
        reason = (f"stop requested by {request.requested_by[:80] or 'an operator'} "
                  f"({request.reason[:200] or 'no reason given'}) at {total} tokens")
    else:
        return
    t.actions.append(StopRun(reason, now, total, P))
    t.fields.update(stop=True, final_left=P)


def _decide(t: _Tick, live: list[str], estimates: Estimates, now: float) -> None:
    r, arrivals = t.get("round"), t.arrivals
    # After STOP the learners stop training: an open round waits for every live learner (up
    # to the round timeout) instead of a quorum that may never come. A learner that trained
    # nothing on this fragment since it last received it says so in its heartbeat.
    declined = [n for n in live if (b := t.obs.beats.get(n)) and r in b.declined_rounds]
    final = t.get("final")
    decision = decide_round(now, arrivals, live, estimates, t.cfg,
                            stopping=bool(final or t.get("stop")),
                            opened_at=t.get("opened_at"), declined=declined,
                            refused=t.refused)
    if not decision.merge:
        t.reason = f"round {r}: {decision.reason}"
        if decision.deadline is not None:
            t.wake_at = decision.deadline               # the grace window closes
        elif final or t.get("stop"):
            t.wake_at = t.get("opened_at") + t.cfg.orchestration.round_timeout_seconds
        return
    k = t.cfg.sync.min_quorum
    order = sorted(arrivals.values())
    quorum_at = order[min(k, len(order)) - 1] if order else now
    admitted = {m: t.digests[m] for m in decision.members if m in t.digests}
    record = RoundDecision(
        round=r, fragment=t.get("fragment"), final=final, decided_by=t.decided_by,
        members=decision.members, late=decision.late, missing=decision.missing,
        reason=decision.reason, grace_seconds=decision.grace_seconds,
        deadline=decision.deadline, opened_at=t.get("opened_at"), quorum_at=quorum_at,
        decided_at=now, arrivals=dict(arrivals), live=tuple(live),
        declined=tuple(sorted(set(declined) - set(arrivals))),
        digests={m: d.manifest for m, d in admitted.items()},
        payloads={m: d.payload for m, d in admitted.items()},
        refused={n: why[:MAX_TEXT] for n, why in t.refused.items()},
        bases={m: d.base for m, d in admitted.items()})
    t.actions.append(Decide(record))
    if not final:
        _observe(t, quorum=quorum_at - t.get("opened_at"))
    t.fields["decided"] = True
    if decision.members:
        t.pending.append(Pending(
            r, t.get("fragment"), now, {m: d.base for m, d in admitted.items()},
            _credits(t, admitted, t.get("fragment"))))
    if final:
        t.fields["final_left"] = max(0, (t.get("final_left") or 1) - 1)
    t.reason = f"round {r} decided: {decision.reason}"


def _maybe_open(t: _Tick, tokens: Mapping[str, int], live: list[str], now: float) -> None:
    cfg = t.cfg
    if t.get("stop"):
        if t.get("final_left") == 0:
            # Finished once the final merges are published (or evidently failed).
            timeout = cfg.orchestration.round_timeout_seconds
            if any(now - p.decided_at < timeout for p in t.pending):
                t.reason = "waiting for the final merges to be published"
                t.wake_at = min(p.decided_at + timeout for p in t.pending
                            if now - p.decided_at < timeout)
                return
            t.actions.append(FinishRun(now, t.get("round")))
            t.fields["finished"] = True
            return
        final = True
    else:
        at_open = t.get("tokens_at_open")
        since = {n: tokens.get(n, 0) - at_open.get(n, 0) for n in tokens}
        if not ready_to_open(since, tokens_needed(cfg), live, cfg.sync.min_quorum,
                             previous_decided=t.get("decided")):
            return
        final = False
    r = t.get("round") + 1
    fragment = r % cfg.sync.num_fragments
    t.actions.append(OpenRound(RoundOpen(round=r, fragment=fragment, opened_at=now,
                                         final=final, learner_tokens=dict(tokens))))
    t.fields.update(round=r, fragment=fragment, decided=False, final=final, opened_at=now,
                    tokens_at_open=dict(tokens))
    t.arrivals, t.digests, t.refused = {}, {}, {}


def _status(t: _Tick, live: list[str]) -> str:
    r = t.get("round")
    if r < 0:
        return f"waiting for learners to progress before round 0 ({len(live)} live)"
    return (f"round {r} {'decided' if t.get('decided') else 'open'}; waiting for "
            f"{t.cfg.sync.min_quorum} of {len(live)} live learners to progress")
