"""The syncer's driver: read the store, step the syncer's state machine, write its actions.

The rules and the state live in `diloco_core.syncer_machine` (pure, typed). This module does
what the machine cannot: it reads what the store shows (heartbeats, offers and their digests,
capacity, budget, stop requests, published versions) into one `Observed` per tick, and writes
what the machine decides (STOP, decision records, round-open records, FINISHED) and, near the
end of the budget, the learners' pause targets (`forecast_publisher.py`), each behind
the caller's `guard` (the syncer's lease check: a fenced syncer raises there and writes
nothing). Every decision is written to the store before anything acts on it, so a lost state is
rebuilt from the store (`_recover`) and a repeated tick changes nothing. What the caller must
do in Dagster or the merge loop (run a merge, record a learner update, add a partition) comes
back in `TickResult`.

Two deciders may run at once during a hand-over (the syncer and the sensor's fallback): the
first write of a record stands, and the loser takes its state from the store.
"""

import contextlib
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from diloco_core.config import ExperimentConfig
from diloco_core.config_loading import config_from_mapping
from diloco_core.round_records import RoundDecision
from diloco_core.syncer_events import (
    Decide,
    FinishRun,
    Observed,
    OfferSeen,
    OpenRound,
    StopRequest,
    StopRun,
    VersionSeen,
)
from diloco_core.syncer_machine import (
    PAYLOAD_KEY_CHARS,
    REPLAY_WINDOW_VERSIONS,
    Accounts,
    Pending,
    Stepped,
    SyncerState,
    planted,
    step,
)
from diloco_core.syncer_state_codec import state_from_json, state_to_json
from pipelines.offer_summary import OfferSummary, describe_offer
from pipelines.syncer.forecast_publisher import ForecastPublisher
from pipelines.syncer.trace import SyncerTrace
from resources.store.artifact_store import ArtifactStore, Conflict, RejectedArtifact

# An operator's stop request (`diloco stop`) and the capacity and budget records are read at
# most this often: the syncer ticks every fraction of a second, and a change may take a tick
# or two longer, not a read of the store each.
STOP_REQUEST_POLL_SECONDS = 2.0


@dataclass
class TickResult:
    state: dict
    merges: list[RoundDecision] = field(default_factory=list)   # decisions to merge
    opened: list[int] = field(default_factory=list)         # rounds opened this tick
    offers: list[OfferSummary] = field(default_factory=list)    # new offers, described
    finished: bool = False
    reason: str = ""


class RoundController:
    """`decided_by` names who runs it in the records it writes ("syncer" or "sensor");
    `guard` runs before every commit-point write."""

    def __init__(self, store: ArtifactStore, cfg: ExperimentConfig | None = None,
                 decided_by: str = "sensor", guard: Callable[[], None] | None = None,
                 describe_offers: bool = True, trace: SyncerTrace | None = None,
                 forecast_state: dict | None = None):
        self.store = store
        self.cfg = cfg or config_from_mapping(store.get_config())
        self.decided_by = decided_by
        self.guard = guard or (lambda: None)
        # The sensor reports each offer to Dagster; the syncer service only needs arrivals
        # (and skips the two reads per offer that describing it costs).
        self.describe_offers = describe_offers
        self.trace = trace                       # records each tick for replay, if given
        self._stop_request_read_at = -math.inf
        self._absent: frozenset[str] = frozenset(self.cfg.learners.standby_names)
        self._budget = self.cfg.token_budget     # raised on resume (`BUDGET` in the store)
        self._control_read_at = -math.inf        # when CAPACITY and BUDGET were last read
        # Offers a recovery found in the store (reported before): not described again, also
        # when the recovery happened at the end of the last tick (a Conflict).
        self._reported: set[tuple[int, str]] = set()
        # A decider that builds a controller per tick (the quorum sensor) passes the last
        # one's forecast memory (`forecast_state()`), kept in its cursor.
        self._forecasts = ForecastPublisher(store, self.cfg, self.guard, forecast_state)

    def forecast_state(self) -> dict:
        """The budget forecast writer's memory, for the next controller of this run."""
        return self._forecasts.state()

    def tick(self, state: dict | None, now: float | None = None) -> TickResult:
        # A float: the state's times are, and a replayed trace must read back what was decided.
        now = float(time.time() if now is None else now)
        typed = self._load(state)
        remerge: list[RoundDecision] = []
        reported, self._reported = self._reported, set()
        if typed is None:
            typed, remerge, found = self._recover(SyncerState(self.store.experiment), now)
            reported |= found
        elif self._behind(typed):
            typed, remerge, found = self._recover(
                SyncerState(self.store.experiment, estimates=typed.estimates), now)
            reported |= found
        result = TickResult(state_to_json(typed), merges=list(remerge))
        if typed.finished:
            result.reason = "the run is finished"
            return result
        observed = self._observe(typed, now, result, reported)
        before = typed
        stepped = step(typed, observed, self.cfg, self.decided_by)
        typed = stepped.state
        found: list[tuple[int, list[str]]] = []     # planted offers, by round opened
        try:
            for action in stepped.actions:
                typed = self._write(action, typed, result, found)
        except Conflict as err:
            self._record(before, observed, stepped, found, typed)
            # Another decider (the syncer and the sensor fallback during a hand-over) wrote
            # this record first: its record stands; take the state from the store.
            carried = SyncerState(self.store.experiment, estimates=typed.estimates,
                                  seen=typed.seen)
            typed, remerge, self._reported = self._recover(carried, now)
            return TickResult(state_to_json(typed), merges=remerge, offers=result.offers,
                              reason=f"another decider wrote first ({err}); state rebuilt "
                                     "from the store")
        self._record(before, observed, stepped, found, typed)
        self._forecasts.tick(before, observed, typed)
        result.state = state_to_json(typed)
        result.reason = stepped.reason
        return result

    def _record(self, before: SyncerState, observed: Observed, stepped: Stepped,
                found: list[tuple[int, list[str]]], carried: SyncerState) -> None:
        if self.trace is not None:
            self.trace.tick(before, self.decided_by, observed, stepped.actions, stepped.state,
                            found, carried)

    # ---- reading --------------------------------------------------------------------------
    def _load(self, state: dict | None) -> SyncerState | None:
        """The state a cursor holds, or None (none, another experiment's, or unreadable: an
        older or damaged cursor is rebuilt from the store like a lost one)."""
        if state is None:
            return None
        try:
            typed = state_from_json(state)
        except (ValueError, TypeError, KeyError, IndexError):
            return None
        return typed if typed.experiment == self.store.experiment else None

    def _behind(self, state: SyncerState) -> bool:
        """Whether the store moved past the state (a tick wrote records, then failed)."""
        latest = self.store.latest_open_round()
        if latest is not None and latest.round != state.round:
            return True
        return (state.round >= 0 and not state.decided
                and self.store.get_decision(state.round) is not None)

    def _observe(self, state: SyncerState, now: float, result: TickResult,
                 reported: set[tuple[int, str]]) -> Observed:
        store, cfg = self.store, self.cfg
        beats, refused = {}, {}
        names = cfg.learners.learner_names
        # Read concurrently, kept in the config's order (the machine sees the same `Observed`
        # whatever order the reads end in).
        for name, (beat, why) in zip(names, store.read_heartbeats(names), strict=True):
            beats[name] = beat
            if why is not None:
                refused[name] = why     # reads as no heartbeat: the learner is not live
        self._read_control_records(now)
        offers = self._new_offers(state, result, reported)
        fragments = {o.round % cfg.sync.num_fragments for o in offers if o.digest is not None}
        current = {f: v for f in sorted(fragments)
                   if (v := store.current_version(f)) is not None}
        versions = self._versions(state.pending)
        return Observed(now=now, beats=beats, refused_beats=refused, absent=self._absent,
                        budget=self._budget, stop_request=self._stop_request(state, now),
                        versions=versions, offers=tuple(offers), current_versions=current,
                        merged=self._passed(state.pending, versions))

    def _new_offers(self, state: SyncerState, result: TickResult,
                    reported: set[tuple[int, str]]) -> list[OfferSeen]:
        """Offers listed for the first time, with the digests of those a decision may commit
        to (or that count in a learner's account), and the store's creation times where two
        of this tick's offers to the open round carry one payload."""
        r = state.round
        if r < 0:
            return []
        names = set(self.cfg.learners.learner_names)
        new: list[tuple[int, str]] = []          # (round, learner), in listing order
        for index in [r] + [w for w in state.watch if w != r]:
            seen = set(state.watch.get(index, ()))
            for learner in self.store.list_contributions(index):
                if learner not in seen:
                    seen.add(learner)
                    new.append((index, learner))
        # One manifest read per new offer (two more each to describe it): concurrently, the
        # results in listing order.
        offers = self.store.each(lambda o: self._offer(o[0], o[1], names), new)
        if self.describe_offers:
            described = [o for o in new if o not in reported]
            result.offers.extend(self.store.each(
                lambda o: describe_offer(self.store, self.cfg, o[0], o[1],
                                         o[0] != r or state.decided), described))
        by_payload: dict[str, list[int]] = {}
        for i, offer in enumerate(offers):
            if offer.round == r and offer.digest is not None:
                by_payload.setdefault(offer.digest.payload[:PAYLOAD_KEY_CHARS], []).append(i)
        for same in by_payload.values():
            for i in same if len(same) > 1 else ():
                offers[i] = OfferSeen(offers[i].round, offers[i].learner, offers[i].digest,
                                      created=self._created(r, offers[i].learner))
        return offers

    def _offer(self, index: int, learner: str, names: set[str]) -> OfferSeen:
        if learner not in names:
            return OfferSeen(index, learner)    # a stray writer: never an arrival
        try:
            return OfferSeen(index, learner, self.store.contribution_digest(index, learner))
        except RejectedArtifact as err:
            return OfferSeen(index, learner, rejected=err.reason)
        except (OSError, ValueError) as err:
            # A manifest its learner made unreadable (or a link out of the store's root): its
            # own offer refused, never the tick failed.
            return OfferSeen(index, learner,
                             rejected=f"unreadable: {type(err).__name__}: {str(err)[:200]}")

    def _created(self, r: int, learner: str) -> float | None:
        try:
            return self.store.contribution_created(r, learner)
        except (RejectedArtifact, OSError):
            return None

    def _versions(self, pending: tuple[Pending, ...]) -> dict[int, VersionSeen]:
        """Current versions of the fragments with merges pending (their publication)."""
        return self._versions_of(sorted({p.fragment for p in pending}))

    def _passed(self, pending: tuple[Pending, ...], versions: Mapping[int, VersionSeen]
                ) -> dict[int, tuple[str, ...]]:
        """For each pending merge whose fragment a later round's version has passed (two
        merges of it published between ticks, or one that was not merged): the members of the
        version that merged it, found by walking back from the current one; () if none did."""
        out: dict[int, tuple[str, ...]] = {}
        for p in pending:
            seen = versions.get(p.fragment)
            if seen is None or seen.round <= p.round:
                continue
            version = self.store.current_version(p.fragment)
            meta = self.store.version_meta(p.fragment, version) if version is not None else None
            found = (None if meta is None else
                     self.store.find_round_commit(p.fragment, p.round, version, meta))
            out[p.round] = () if found is None else found[1].members
        return out

    def _versions_of(self, fragments) -> dict[int, VersionSeen]:
        out = {}
        for fragment in fragments:
            meta = self.store.version_meta(fragment)
            if meta is not None and meta.round is not None:
                out[fragment] = VersionSeen(meta.round, meta.members)
        return out

    def _stop_request(self, state: SyncerState, now: float) -> StopRequest | None:
        """An operator's request to stop, read at most every STOP_REQUEST_POLL_SECONDS."""
        if state.stop or now - self._stop_request_read_at < STOP_REQUEST_POLL_SECONDS:
            return None
        self._stop_request_read_at = now
        request = self.store.stop_request()
        if not isinstance(request, Mapping):
            return None
        return StopRequest(str(request.get("requested_by") or ""),
                           str(request.get("reason") or ""))

    def _read_control_records(self, now: float) -> None:
        """The learners without capacity now and the token budget in force (the config's, or
        a larger one set when `train` resumed the run), read at most every
        STOP_REQUEST_POLL_SECONDS. A malformed record keeps the last good value: only the
        control plane writes them."""
        if now - self._control_read_at < STOP_REQUEST_POLL_SECONDS:
            return
        self._control_read_at = now
        with contextlib.suppress(RejectedArtifact, Conflict):
            self._absent = frozenset(self.store.capacity(self.cfg.learners.standby_names)[0]
                                     .absent)
        with contextlib.suppress(RejectedArtifact):
            self._budget = self.store.token_budget(self.cfg.token_budget)

    # ---- writing --------------------------------------------------------------------------
    def _write(self, action, state: SyncerState, result: TickResult,
               found: list[tuple[int, list[str]]]) -> SyncerState:
        store = self.store
        if isinstance(action, StopRun):
            self.guard()
            store.request_stop(action.record())
        elif isinstance(action, Decide):
            record = action.decision
            self.guard()
            store.put_decision(record.round, record)
            if record.members:
                result.merges.append(record)
        elif isinstance(action, OpenRound):
            r = action.record.round
            # Offers already there were written before anyone could know the round: planted.
            # Listed before the open record is written, so no honest offer is among them.
            early = store.list_contributions(r)
            self.guard()
            store.open_round(r, action.record)
            state = planted(state, r, early)
            if early:
                found.append((r, list(early)))
            if early and self.describe_offers:
                result.offers.extend(describe_offer(store, self.cfg, r, n, True)
                                     for n in early)
            result.opened.append(r)
        elif isinstance(action, FinishRun):
            self.guard()
            store.mark_finished({"at": action.at, "by": self.decided_by,
                                 "last_round": action.last_round})
            result.finished = True
        return state

    # ---- recovery -------------------------------------------------------------------------
    def _recover(self, state: SyncerState, now: float
                 ) -> tuple[SyncerState, list[RoundDecision], set[tuple[int, str]]]:
        """Rebuild the state from the store (first tick, a lost state, or a state behind the
        store after a tick that wrote but did not return). Offers already in the store were
        reported before: they are not described again, and offers to an undecided round
        arrive now (which only restarts its grace window). Decided rounds of the last 2P
        whose merge is not published are returned to be requested again (the run key makes
        that idempotent). (state, decisions to merge again, offers already reported)"""
        store, P = self.store, self.cfg.sync.num_fragments
        latest = store.latest_open_round()
        if latest is None:
            return state, [], set()
        r = latest.round
        decided = store.get_decision(r) is not None
        offered = store.list_contributions(r)
        remerge, pending = [], []
        payloads: dict[str, tuple[str, int]] = {}
        current = {f: self._current_meta(f) for f in range(P)}
        bases: dict[str, dict[int, tuple[int, int]]] = {}
        # Payloads over the whole replay window (a replay from further back than 2P rounds
        # passed after a rebuild); merges to request again and bases from the last 2P.
        for k in range(max(0, r - REPLAY_WINDOW_VERSIONS * P), r + 1):
            decision = store.get_decision(k)
            if decision is None:
                continue
            for learner, payload in decision.payloads.items():
                payloads[payload[:PAYLOAD_KEY_CHARS]] = (learner, k)
            if k < r - 2 * P:
                continue
            published = current[decision.fragment]
            if decision.members and published.round < k:
                remerge.append(decision)
                pending.append(Pending(k, decision.fragment, now, dict(decision.bases)))
            elif published.round == k:
                # The merge a fragment's current version holds: its members' bases, as the
                # state noted them when it saw the merge published (a replay of one is refused
                # across a restart too).
                for member in published.members:
                    if member in decision.bases:
                        bases.setdefault(member, {})[decision.fragment] = (
                            decision.bases[member], k)
        final_left = None
        stop = store.stop_requested()
        if stop is not None:
            # Final rounds are the last ones opened: those already decided are done.
            decided_finals, k = 0, r
            while k >= 0:
                record = store.get_round_open(k)
                if record is None or not record.final:
                    break
                decided_finals += store.get_decision(k) is not None
                k -= 1
            asked = stop.get("final_left", 0)
            final_left = max(0, (asked if isinstance(asked, int) else 0) - decided_finals)
        state = SyncerState(
            experiment=state.experiment, estimates=state.estimates, seen=state.seen,
            round=r, fragment=latest.fragment, decided=decided, final=latest.final,
            opened_at=latest.opened_at, tokens_at_open=dict(latest.learner_tokens),
            # The account of each learner starts again from what the record credited it, when
            # that round opened (a declared rate bound counts the seconds from then), but no
            # earlier than one round timeout ago: a run resumed after a long pause must not
            # grant a liar the rate times the pause.
            accounts=Accounts(base=dict(latest.learner_tokens), began=dict.fromkeys(
                latest.learner_tokens,
                max(latest.opened_at, now - self.cfg.orchestration.round_timeout_seconds))),
            # An undecided round's offers are listed again by this tick: they arrive now.
            watch={r: tuple(offered)} if decided else {}, pending=tuple(pending),
            payloads=payloads, bases=bases, stop=stop is not None, final_left=final_left,
            finished=store.finished() is not None)
        return state, remerge, {(r, n) for n in offered}

    def _current_meta(self, fragment: int) -> VersionSeen:
        """The fragment's current version: the round that merged it (-1: none, the initial
        version) and its members. Merges of a fragment commit in round order, so a round at
        or before it is published (or superseded)."""
        return self._versions_of([fragment]).get(fragment, VersionSeen(-1))
