"""The syncer's control loop as plain Python: open rounds, watch offers, decide, stop.

The quorum sensor calls `tick` with its cursor state; everything it decides is written to the
store first (round-open records, decision records, the STOP marker), so a lost cursor is rebuilt
from the store and a repeated tick changes nothing. What the sensor must do in Dagster (run a
merge, record a learner update, add a round partition) comes back in `TickResult`.

The rules are the round protocol's (`diloco_core.round_protocol`, which the reference simulator
runs too), on wall-clock time. What this module adds is how the store shows them:
- Arrival time of an offer = when a tick first saw it (the syncer's clock: learner clocks may be
  skewed).
- A learner is live while its heartbeat changed less than `learner_timeout_seconds` ago, by
  the syncer's clock (`pipelines.liveness`); a learner that declined a final round says so in
  its heartbeat.
- Offers to an already-decided round are late: recorded, never merged into it.
- A learner the capacity record marks absent (standby, or asked to leave) is not live from the
  moment the record says so, whatever its heartbeat: no round waits for a departing learner.
  Its offers still count if they arrive in time.
"""

import contextlib
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from diloco_core.config import ExperimentConfig
from diloco_core.config_loading import config_from_mapping
from diloco_core.corroboration import credited_totals
from diloco_core.quorum import Estimates
from diloco_core.round_protocol import (
    budget_reached,
    decide_round,
    final_rounds,
    ready_to_open,
    tokens_needed,
)
from diloco_core.round_records import (
    MAX_INT,
    MAX_TEXT,
    RoundDecision,
    RoundOpen,
    finite_float,
)
from pipelines.liveness import live_learners, observe
from resources.store.artifact_store import ArtifactStore, Conflict, RejectedArtifact

LATE_WINDOW = 2          # decided rounds still watched for late offers
# A payload offered again within this many versions of every fragment (P rounds each) is a
# replay or a copy; it is remembered by the first PAYLOAD_KEY_CHARS hex digits of its SHA-256
# (64 bits: the window holds M x 16 P keys in the sensor's cursor, and a learner that wants
# to evade the check changes one byte instead, which makes it a fresh offer under every
# other rule).
REPLAY_WINDOW_VERSIONS = 16
PAYLOAD_KEY_CHARS = 16
# An operator's stop request (`diloco stop`) is read at most this often: the syncer ticks every
# fraction of a second, and a stop may take a tick or two longer, not a read of the store each.
STOP_REQUEST_POLL_SECONDS = 2.0


def round_key(round_index: int) -> str:
    """The Dagster partition key of a round, zero-padded to 8 digits as in the store's layout,
    so keys sort as numbers (5 digits sorted round 100,000 before 99,999: a week at one round
    a second)."""
    return f"{round_index:08d}"


def partition_key(experiment: str, round_index: int, per_partition: int = 1) -> str:
    """The Dagster partition of a round's assets (`cfg.rounds_per_partition` rounds each):
    the experiment, then the round's own key or the window of rounds holding it, e.g.
    "diloco-demo/00000012" or "diloco-demo/00000064-00000127". The experiment is part of the
    key so that two experiments on one Dagster instance never share a partition (their round
    numbers overlap)."""
    if per_partition == 1:
        return f"{experiment}/{round_key(round_index)}"
    start = round_index - round_index % per_partition
    return f"{experiment}/{round_key(start)}-{round_key(start + per_partition - 1)}"


def partition_rounds(key: str) -> range:
    """The rounds a partition key holds (the inverse of `partition_key`)."""
    first, _, last = key.rpartition("/")[2].partition("-")
    return range(int(first), int(last or first) + 1)


def partition_experiment(key: str) -> str:
    """The experiment a round or learner partition key belongs to ("" for a key from before
    keys carried it)."""
    return key.rpartition("/")[0]


def learner_partition_key(experiment: str, learner: str) -> str:
    """The `learners` partition of one experiment's learner (learner names repeat across
    experiments: learner-0 of two runs is two partitions)."""
    return f"{experiment}/{learner}"


@dataclass
class TickResult:
    state: dict
    merges: list[dict] = field(default_factory=list)        # decision records to merge
    opened: list[int] = field(default_factory=list)         # rounds opened this tick
    offers: list[dict] = field(default_factory=list)        # new contribution manifests
    finished: bool = False
    reason: str = ""


def fresh_state(experiment: str) -> dict:
    return {"experiment": experiment, "round": -1, "decided": True, "arrivals": {},
            "watch": {}, "pending": [], "estimates": None, "stop": False, "final_left": None,
            "finished": False, "digests": {}, "payloads": {}, "refused": {}, "bases": {}}


def _published(store: ArtifactStore, fragment: int, round_index: int) -> dict | None:
    """The current version's metadata if the merge of `round_index` is published (or
    superseded), else None: merges of a fragment commit in round order, so the current
    version's round tells."""
    meta = store.version_meta(fragment) or {}
    committed = meta.get("round")
    return meta if isinstance(committed, int) and committed >= round_index else None


def _recover(store: ArtifactStore, state: dict, now: float, num_fragments: int
             ) -> tuple[dict, list[dict]]:
    """Rebuild the cursor from the store (first tick, a lost cursor, or a cursor behind the
    store after a tick that wrote but did not return). Offers already in the store were
    reported before; they count as seen (and, for an undecided round, as arriving now, which
    only restarts its grace window). Decided rounds of the last 2P whose merge is not
    published are returned to be requested again (the run key makes that idempotent)."""
    latest = store.latest_open_round()
    if latest is None:
        return state, []
    r = latest["round"]
    decided = store.get_decision(r) is not None
    offered = store.list_contributions(r)
    state = {**state, "round": r, "decided": decided, "final": bool(latest.get("final")),
             "opened_at": latest["opened_at"], "fragment": latest["fragment"],
             "tokens_at_open": latest.get("learner_tokens", {}),
             "watch": {str(r): offered},
             "arrivals": {} if decided else {name: now for name in offered}}
    remerge, pending = [], []
    payloads: dict[str, list] = {}
    for k in range(max(0, r - 2 * num_fragments), r + 1):
        decision = store.get_decision(k)
        if decision is None:
            continue
        for learner, payload in decision.get("payloads", {}).items():
            payloads[payload[:PAYLOAD_KEY_CHARS]] = [learner, k]
        if not decision.get("members"):
            continue
        if not _published(store, decision["fragment"], k):
            remerge.append(decision)
            pending.append({"round": k, "fragment": decision["fragment"], "decided_at": now})
    state["pending"] = pending
    state["payloads"], state["digests"], state["refused"] = payloads, {}, {}
    if not decided:
        fresh: set[str] = set()
        for name in list(state["arrivals"]):
            _admit_offer(store, state, r, name, now, fresh)
    if store.finished() is not None:
        state["finished"] = True
    stop = store.stop_requested()
    if stop is not None:
        # Final rounds are the last ones opened: those already decided are done.
        decided_finals, k = 0, r
        while k >= 0:
            record = store.get_round_open(k)
            if record is None or not record.get("final"):
                break
            decided_finals += store.get_decision(k) is not None
            k -= 1
        state["stop"] = True
        state["final_left"] = max(0, int(stop.get("final_left", 0)) - decided_finals)
    return state, remerge


class RoundController:
    """`decided_by` names who runs it in the records it writes ("syncer" or "sensor");
    `guard` runs before every commit-point write (the syncer's lease check: a fenced syncer
    raises there and writes nothing)."""

    def __init__(self, store: ArtifactStore, cfg: ExperimentConfig | None = None,
                 decided_by: str = "sensor", guard: Callable[[], None] | None = None,
                 describe_offers: bool = True):
        self.store = store
        self.cfg = cfg or config_from_mapping(store.get_config())
        self.decided_by = decided_by
        self.guard = guard or (lambda: None)
        # The sensor reports each offer to Dagster; the syncer service only needs arrivals
        # (and skips the two reads per offer that describing it costs).
        self.describe_offers = describe_offers
        self._stop_request_read_at = -math.inf
        self._absent: frozenset[str] = frozenset(self.cfg.learners.standby_names)
        self._budget = self.cfg.token_budget     # raised on resume (`BUDGET` in the store)
        self._control_read_at = -math.inf        # when CAPACITY and BUDGET were last read

    def tick(self, state: dict | None, now: float | None = None) -> TickResult:
        now = time.time() if now is None else now
        store, cfg = self.store, self.cfg
        P = cfg.sync.num_fragments
        remerge: list[dict] = []
        if state is None or state.get("experiment") != store.experiment:
            state, remerge = _recover(store, fresh_state(store.experiment), now, P)
        elif self._behind(state):
            carried = {"estimates": state.get("estimates")}
            state, remerge = _recover(store, {**fresh_state(store.experiment), **carried}, now, P)
        state = dict(state)
        result = TickResult(state, merges=list(remerge))
        if state["finished"]:
            result.reason = "the run is finished"
            return result
        orch = cfg.orchestration
        names = cfg.learners.learner_names
        beats, refused = {}, {}
        for name in names:
            beats[name], why = store.read_heartbeat(name)
            if why is not None:
                refused[name] = why     # reads as no heartbeat: the learner is not live
        state["seen"] = observe(state.get("seen"), beats, now)
        self._read_control_records(now)
        live = [n for n in live_learners(beats, state["seen"], now, orch.learner_timeout_seconds)
                if n not in self._absent]
        estimates = self._estimates(state, beats)
        # Heartbeats' totals as far as the other live learners corroborate them: the budget
        # and the opening of rounds never run on one learner's word (the budget counts none
        # beyond the largest of the others; rounds open at most max_speed_ratio x as fast).
        claimed = {n: b["tokens_total"] for n, b in beats.items() if b}
        slack = max(tokens_needed(cfg).values()) * cfg.sync.num_fragments
        budget_tokens, clipped = credited_totals(claimed, live, 1.0, slack)
        tokens, _ = credited_totals(claimed, live, cfg.sync.max_speed_ratio, slack)

        self._watch_published(state, now)
        self._collect_offers(state, result, now)
        try:
            self._maybe_stop(state, budget_tokens, now)
            if not state["decided"]:
                self._decide(state, result, live, estimates, now, beats)
            if state["decided"]:
                self._maybe_open(state, result, tokens, live, now)
        except Conflict as err:
            # Another decider (the syncer and the sensor fallback during a hand-over) wrote
            # this record first: its record stands; take the state from the store.
            carried = {"estimates": state.get("estimates"), "seen": state.get("seen")}
            state, remerge = _recover(self.store, {**fresh_state(self.store.experiment),
                                                   **carried}, now, P)
            return TickResult(state, merges=remerge, offers=result.offers,
                              reason=f"another decider wrote first ({err}); state rebuilt "
                                     "from the store")
        if not result.reason:
            result.reason = self._status(state, live)
        if refused:
            result.reason += "; heartbeats refused: " + "; ".join(
                f"{n} ({why})" for n, why in sorted(refused.items()))
        if clipped:
            result.reason += "; claims not corroborated: " + "; ".join(
                f"{n} ({why})" for n, why in sorted(clipped.items()))
        return result

    # ---- pieces of a tick ---------------------------------------------------------------------
    def _behind(self, state: dict) -> bool:
        """Whether the store moved past the cursor (a tick wrote records, then failed)."""
        latest = self.store.latest_open_round()
        if latest is not None and latest["round"] != state["round"]:
            return True
        return (state["round"] >= 0 and not state["decided"]
                and self.store.get_decision(state["round"]) is not None)

    def _estimates(self, state: dict, beats: Mapping[str, dict | None]) -> Estimates:
        # The step time sets grace windows, and each learner reports its own: the lower median
        # (one learner claiming 1e300 seconds a step moves it no more than one claiming 0), held
        # within the round timeout (no window longer than a round may wait anyway).
        step_times = sorted(b["compute_seconds"] / b["step"] for b in beats.values()
                            if b and b.get("step") and b.get("compute_seconds"))
        step = step_times[(len(step_times) - 1) // 2] if step_times else 1.0
        step = min(step, float(self.cfg.orchestration.round_timeout_seconds))
        e = state.get("estimates") or {"step_seconds": step, "quorum_seconds": 0.0,
                                       "sync_seconds": 0.0}
        e = {**e, "step_seconds": step}
        state["estimates"] = e
        return Estimates(e["step_seconds"], e["quorum_seconds"], e["sync_seconds"])

    def _observe(self, state: dict, **observed: float) -> None:
        e = state["estimates"]
        est = Estimates(e["step_seconds"], e["quorum_seconds"], e["sync_seconds"]).observe(
            self.cfg.sync.ema_decay, **observed)
        state["estimates"] = {"step_seconds": est.step_seconds,
                              "quorum_seconds": est.quorum_seconds,
                              "sync_seconds": est.sync_seconds}

    def _watch_published(self, state: dict, now: float) -> None:
        """Merges requested earlier whose version is now current: measure the sync latency."""
        still = []
        for pending in state["pending"]:
            meta = _published(self.store, pending["fragment"], pending["round"])
            if meta is not None:
                self._observe(state, sync=now - pending["decided_at"])
                self._note_merged_bases(state, pending, meta)
            else:
                still.append(pending)
        state["pending"] = still[-4 * self.cfg.sync.num_fragments:]

    def _note_merged_bases(self, state: dict, pending: dict, meta: dict) -> None:
        """The base versions of the members whose offers this published merge took: a later
        offer of the fragment on a base no newer is a replay (an honest learner has received
        the merged version, or a newer one, before it offers the fragment again). `meta`: the
        fragment's current version, read once by the caller."""
        if meta.get("round") != pending["round"]:
            return      # a later round's version is current: this one's members are unknown
        fragment = str(pending["fragment"])
        for member in meta.get("members") or ():
            base = pending.get("bases", {}).get(member)
            if isinstance(member, str) and isinstance(base, int):
                bases = state.setdefault("bases", {}).setdefault(member, {})
                bases[fragment] = [max(base, bases.get(fragment, [-1])[0]), pending["round"]]

    def _collect_offers(self, state: dict, result: TickResult, now: float) -> None:
        r = state["round"]
        if r < 0:
            return
        watch = {int(k): set(v) for k, v in state["watch"].items()}
        rounds = [r] + [w for w in watch if w != r]
        fresh: set[str] = set()      # payloads first seen this tick
        for index in rounds:
            seen = watch.get(index, set())
            for learner in self.store.list_contributions(index):
                if learner in seen:
                    continue
                seen.add(learner)
                late = index != r or state["decided"]
                if (index == r and not state["decided"]
                        and learner in self.cfg.learners.learner_names):
                    _admit_offer(self.store, state, r, learner, now, fresh)
                if self.describe_offers:
                    result.offers.append(describe_offer(self.store, self.cfg, index, learner,
                                                        late))
            watch[index] = seen
        keep = sorted(watch)[-(LATE_WINDOW + 1):]
        state["watch"] = {str(k): sorted(watch[k]) for k in keep}
        # Payloads are remembered for REPLAY_WINDOW_VERSIONS versions of every fragment (a
        # recovering decider re-reads the last 2P rounds' decisions only).
        horizon = r - REPLAY_WINDOW_VERSIONS * self.cfg.sync.num_fragments
        state["payloads"] = {k: v for k, v in state["payloads"].items() if v[1] >= horizon}

    def _decide(self, state: dict, result: TickResult, live: list[str], estimates: Estimates,
                now: float, beats: Mapping[str, dict | None]) -> None:
        r, arrivals = state["round"], state["arrivals"]
        # After STOP the learners stop training: an open round waits for every live learner
        # (up to the round timeout) instead of a quorum that may never come. A learner that
        # trained nothing on this fragment since it last received it says so in its heartbeat.
        declined = [n for n in live
                    if r in ((beats.get(n) or {}).get("declined_rounds") or [])]
        decision = decide_round(now, arrivals, live, estimates, self.cfg,
                                stopping=bool(state.get("final") or state["stop"]),
                                opened_at=state["opened_at"], declined=declined)
        if not decision.merge:
            result.reason = f"round {r}: {decision.reason}"
            return
        k = self.cfg.sync.min_quorum
        order = sorted(arrivals.values())
        quorum_at = order[min(k, len(order)) - 1] if order else now
        record = RoundDecision(
            round=r, fragment=state["fragment"], final=bool(state.get("final")),
            decided_by=self.decided_by, members=decision.members, late=decision.late,
            missing=decision.missing, reason=decision.reason,
            grace_seconds=decision.grace_seconds, deadline=decision.deadline,
            opened_at=state["opened_at"], quorum_at=quorum_at, decided_at=now,
            arrivals=dict(arrivals), live=tuple(live),
            declined=tuple(sorted(set(declined) - set(arrivals))),
            digests={m: state["digests"][m][0] for m in decision.members
                     if m in state["digests"]},
            payloads={m: state["digests"][m][1] for m in decision.members
                      if m in state["digests"]},
            refused={n: why[:MAX_TEXT] for n, why in state["refused"].items()}).to_json()
        self.guard()
        self.store.put_decision(r, record)
        if not state.get("final"):
            self._observe(state, quorum=quorum_at - state["opened_at"])
        state["decided"] = True
        if decision.members:
            result.merges.append(record)
            state["pending"].append({"round": r, "fragment": state["fragment"],
                                     "decided_at": now, "bases": {
                                         m: state["digests"][m][2] for m in decision.members
                                         if m in state["digests"]}})
        if state.get("final"):
            state["final_left"] = max(0, (state["final_left"] or 1) - 1)
        result.reason = f"round {r} decided: {decision.reason}"

    def _maybe_stop(self, state: dict, tokens: Mapping[str, int], now: float) -> None:
        if state["stop"]:
            return
        total, P = sum(tokens.values()), final_rounds(self.cfg.sync.num_fragments)
        budget = self._budget
        if budget_reached(tokens, budget):
            reason = f"token budget reached ({total} >= {budget})"
        elif (now - self._stop_request_read_at >= STOP_REQUEST_POLL_SECONDS
              and (request := self._read_stop_request(now)) is not None):
            # An operator's request ends the run the same way the budget does, so the final
            # rounds still publish every learner's last progress.
            who = str(request.get("requested_by") or "an operator")[:80]
            why = str(request.get("reason") or "no reason given")[:200]
            reason = f"stop requested by {who} ({why}) at {total} tokens"
        else:
            return
        self.guard()
        self.store.request_stop({"reason": reason, "at": now, "tokens": total,
                                 "final_left": P})
        state["stop"], state["final_left"] = True, P

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

    def _read_stop_request(self, now: float) -> dict | None:
        self._stop_request_read_at = now
        return self.store.stop_request()

    def _maybe_open(self, state: dict, result: TickResult, tokens: Mapping[str, int],
                    live: list[str], now: float) -> None:
        cfg = self.cfg
        if state["stop"]:
            if state["final_left"] == 0:
                # Finished once the final merges are published (or evidently failed).
                timeout = cfg.orchestration.round_timeout_seconds
                if any(now - p["decided_at"] < timeout for p in state["pending"]):
                    result.reason = "waiting for the final merges to be published"
                    return
                self.guard()
                self.store.mark_finished({"at": now, "by": self.decided_by,
                                          "last_round": state["round"]})
                state["finished"] = True
                result.finished = True
                return
            final = True
        else:
            at_open = state.get("tokens_at_open", {})
            since = {n: tokens.get(n, 0) - at_open.get(n, 0) for n in tokens}
            if not ready_to_open(since, tokens_needed(cfg), live, cfg.sync.min_quorum,
                                 previous_decided=state["decided"]):
                return
            final = False
        r = state["round"] + 1
        fragment = r % cfg.sync.num_fragments
        # Offers already there were written before anyone could know the round: planted
        # (to reach quorum the moment it opens), never arrivals. Listed before the open
        # record is written, so no honest offer can be among them.
        planted = self.store.list_contributions(r)
        self.guard()
        self.store.open_round(r, RoundOpen(round=r, fragment=fragment, opened_at=now,
                                           final=final, learner_tokens=tokens))
        state.update({"round": r, "fragment": fragment, "decided": False, "final": final,
                      "opened_at": now, "arrivals": {}, "tokens_at_open": tokens,
                      "digests": {}, "refused": {
                          n: f"offered before round {r} opened (planted)" for n in planted}})
        if planted:
            state["watch"] = {**state["watch"], str(r): sorted(planted)}
            if self.describe_offers:
                result.offers.extend(describe_offer(self.store, cfg, r, n, True)
                                     for n in planted)
        result.opened.append(r)

    def _status(self, state: dict, live: list[str]) -> str:
        r = state["round"]
        if r < 0:
            return f"waiting for learners to progress before round 0 ({len(live)} live)"
        return (f"round {r} {'decided' if state['decided'] else 'open'}; waiting for "
                f"{self.cfg.sync.min_quorum} of {len(live)} live learners to progress")


def _admit_offer(store: ArtifactStore, state: dict, r: int, learner: str, now: float,
                 fresh: set[str]) -> None:
    """An offer to the open round arrives: record the digests a decision will commit to, or
    refuse it here when its payload was offered before (a replay of its own old offer, or a
    copy of another learner's seen in an earlier tick). Two offers of one payload first seen
    in the same tick are told apart by when the store created each payload: the later is
    the copy. Where the store cannot say, both arrive (refusing both would let a copier deny
    an honest learner its round; the copy adds one honest delta twice, nothing of its own).
    A manifest the store refuses still arrives (the merge refuses it with the store's
    reason)."""
    try:
        found = store.contribution_digest(r, learner)
    except RejectedArtifact:
        found = None
    if found is None:
        state["arrivals"][learner] = now
        return
    manifest, payload, base = found
    merged = state.get("bases", {}).get(learner, {}).get(str(state["fragment"]))
    if merged is not None and base <= merged[0]:
        state["refused"][learner] = (
            f"base version {base}: its offer on base {merged[0]} was merged in round "
            f"{merged[1]}, and it has not received a version since (a replay)")
        state["arrivals"].pop(learner, None)
        return
    key = payload[:PAYLOAD_KEY_CHARS]
    prior = state["payloads"].get(key)
    if prior is not None and key in fresh and prior[1] == r and prior[0] != learner:
        # Both first seen in this tick: the store's creation times tell original from copy.
        first = _created_first(store, r, prior[0], learner)
        if first == prior[0]:
            _refuse_copy(state, learner, prior[0], r, "the store created it later")
            return
        if first == learner:
            _refuse_copy(state, prior[0], learner, r, "the store created it later")
            state["digests"].pop(prior[0], None)
            prior = None
    if (prior is not None and (prior[0], prior[1]) != (learner, r)
            and not (key in fresh and prior[1] == r)):
        who, when = prior
        state["refused"][learner] = (
            f"its payload is {who}'s offer to round {when}: "
            + ("a replay" if who == learner else "a copy"))
        state["arrivals"].pop(learner, None)
        return
    state["payloads"][key] = [learner, r]
    fresh.add(key)
    state["digests"][learner] = [manifest, payload, base]
    state["arrivals"][learner] = now


def _created_first(store: ArtifactStore, r: int, a: str, b: str) -> str | None:
    """Which of two offers of one payload the store created first; None when it cannot say
    (a time unknown, or equal)."""
    try:
        times = [store.contribution_created(r, a), store.contribution_created(r, b)]
    except (RejectedArtifact, OSError):
        return None
    if None in times or times[0] == times[1]:
        return None
    return a if times[0] < times[1] else b


def _refuse_copy(state: dict, copier: str, original: str, r: int, why: str) -> None:
    state["refused"][copier] = f"its payload is {original}'s offer to round {r}: a copy ({why})"
    state["arrivals"].pop(copier, None)


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

