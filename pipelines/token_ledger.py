"""The token ledger of a run, assembled from the store (see `diloco_core.ledger`).

Learner processes write their own ledgers (`learners/{l}/attempts/`); offers carry their claim
and the process that made them; decisions and committed merges give each offer its fate.
"""

from collections.abc import Sequence
from typing import Any

from diloco_core.config import ExperimentConfig
from diloco_core.ledger import MAX_ATTEMPT, Ledger, build_ledger, ledger_count
from diloco_core.round_records import MAX_INT, RoundDecision
from diloco_core.stored_merge import StoredMerge
from resources.store import layout, record_archive
from resources.store.artifact_store import ArtifactStore, RejectedArtifact
from resources.store.record_archive import BadBlock, PackedRecords


def offer_claim(extra: Any) -> tuple[dict | None, str | None]:
    """The {attempt, claim} an offer's manifest carries in its `extra` (free-form JSON that the
    learner writes), checked field by field: (the offer, None) or (None, why it is refused).
    An offer from before the ledger existed has neither field: attempt 0, no claim."""
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        return None, f"extra must be an object, got {type(extra).__name__}"
    attempt, claim = extra.get("attempt", 0), extra.get("claim")
    if not ledger_count(attempt, MAX_ATTEMPT):
        return None, f"extra.attempt must be an integer in [0, {MAX_ATTEMPT}], got " \
                     f"{str(attempt)[:40]}"
    if claim is not None and not ledger_count(claim, MAX_INT):
        return None, f"extra.claim must be an integer in [0, {MAX_INT}], got {str(claim)[:40]}"
    return {"attempt": attempt, "claim": claim}, None


def offer_fates(store: ArtifactStore, num_fragments: int, learners: Sequence[str],
                refusals: list[dict] | None = None, *, digests: bool = True
                ) -> tuple[dict, dict, list[dict]]:
    """(round, learner) -> stored offer {attempt, claim}; (round, learner) -> fate; and the
    rejections with their reasons. Only the experiment's learners count: anything else under
    a round's contributions (a foreign or hostile writer) was never merged, and is not read.
    An offer whose manifest cannot be read, or whose attempt or claim is malformed, is left
    out (its claim counts as `offer_not_stored`), and appended to `refusals` ({"key",
    "reason"}) when given.

    Rounds beyond retention come from their archive block's digest (`ledger_digest`: the
    same answers, computed once by the syncer as it archived them), so a run's ledger does
    not parse every record of every round it ever ran; a block without a usable digest, and
    every round after the archived ones, is read record by record. `digests=False` reads
    every round that way (the benchmark's comparison)."""
    offers: dict = {}
    fates: dict = {}
    rejections: list[dict] = []
    wanted = frozenset(learners)
    latest = store.latest_open_round()
    last_round = -1 if latest is None else latest.round
    archived = min(store.archive.through(ask=True), last_round + 1) if digests else 0
    merged: dict | None = None      # round -> its commit, read once records are needed

    def from_records(rounds: range) -> None:
        nonlocal merged
        if merged is None:
            merged = _commits_from(store, num_fragments, rounds.start)
        for r in rounds:
            decision, merge = store.get_decision(r), merged.get(r)
            _round_fates(store, r, store.list_contributions(r), wanted, decision, merge,
                         _not_merged(store, r, decision, merge), offers, fates, rejections,
                         refusals)

    first, size = 0, record_archive.BLOCK_ROUNDS
    while first + size <= archived:
        block = range(first, first + size)
        entries = _digested_block(store, first, wanted)
        if entries is None:
            from_records(block)
        else:
            for r, (round_offers, round_refused) in zip(block, entries, strict=True):
                for learner, entry in round_offers.items():
                    offers[(r, learner)] = {"attempt": entry["attempt"],
                                            "claim": entry["claim"]}
                    fates[(r, learner)] = entry["fate"]
                    if entry["fate"] == "rejected":
                        rejections.append({"round": r, "learner": learner,
                                           "reason": entry["reason"]})
                if refusals is not None:
                    refusals.extend(round_refused)
        first += size
    from_records(range(first, last_round + 1))
    return offers, fates, rejections


def _commits_from(store: ArtifactStore, num_fragments: int, first_round: int) -> dict:
    """Round -> the version record that committed it, for the rounds from `first_round`: each
    fragment's versions read newest first down to the first that committed an earlier round
    (a fragment's merges commit its rounds in order)."""
    merged = {}
    for p in range(num_fragments):
        for version in reversed(store.versions(p)):
            meta = store.version_meta(p, version) if version > 0 else None
            if meta is None or meta.round is None:
                continue
            if meta.round < first_round:
                break
            merged[meta.round] = meta
    return merged


def _not_merged(store: ArtifactStore, r: int, decision: RoundDecision | None,
                merge: StoredMerge | None) -> StoredMerge | None:
    """The record of a decided round that committed nothing (None when it committed, or was
    not decided, or has no such record)."""
    return store.get_round_not_merged(r) if merge is None and decision is not None else None


def _round_fates(store: ArtifactStore, r: int, listed: Sequence[str], learners: frozenset,
                 decision: RoundDecision | None, merge: StoredMerge | None,
                 not_merged: StoredMerge | None, offers: dict, fates: dict,
                 rejections: list[dict], refusals: list[dict] | None) -> None:
    """One round's offers and their fates, added to `offers`, `fates` and `rejections`."""
    refused = {} if not_merged is None else not_merged.rejected
    for learner in listed:
        if learner not in learners:
            continue
        key = f"{layout.contribution_dir(store.experiment, r, learner)}/{layout.MANIFEST}"
        try:
            manifest = store.contribution_manifest(r, learner)
        except RejectedArtifact as err:  # the learner's claim counts as offer_not_stored
            if refusals is not None:
                refusals.append({"key": key, "reason": err.reason})
            continue
        offer, why = offer_claim(None if manifest is None else manifest.extra)
        if offer is None:
            if refusals is not None:
                refusals.append({"key": key, "reason": why})
            continue
        offers[(r, learner)] = offer
        if decision is None:
            fate = "undecided"
        elif learner not in decision.members:
            fate = "late"
        elif learner in refused:
            fate = "rejected"   # refused, and so was everyone else: nothing committed
            rejections.append({"round": r, "learner": learner, "reason": refused[learner]})
        elif merge is None:
            fate = "round_not_merged"
        elif learner in merge.members:
            fate = "merged"
        else:
            fate = "rejected"
            rejections.append({"round": r, "learner": learner,
                               "reason": merge.rejected.get(
                                   learner, "admitted but not in the merge")})
        fates[(r, learner)] = fate


# ---- the digest of a round, packed with its records when the syncer archives them -----------

# The fates a stored offer can have (the rest of `FATES` are the learners' own losses).
OFFER_FATES = frozenset({"merged", "late", "rejected", "round_not_merged", "undecided"})
MAX_DIGEST_TEXT = 2000      # a reason or a key in a digest entry, in characters


class CommittedRounds:
    """The version record that committed each round, asked in increasing round order (the
    archiver packs rounds in order). A fragment's merges commit its rounds in order, so a
    cursor per fragment only moves forward, each version's record read once, from where a
    bisection over the versions put it at the first question (a few reads however far back
    that round is: an archiver catching up on a run from before archiving)."""

    def __init__(self, store: ArtifactStore):
        self.store = store
        self._ahead: dict[int, dict[int, StoredMerge]] = {}   # fragment -> round -> record
        self._read_to: dict[int, int] = {}     # fragment -> the newest version read
        self._newest: dict[int, int] = {}      # fragment -> the latest round read (-1: none)

    def merge_of(self, fragment: int, round_index: int) -> StoredMerge | None:
        store = self.store
        if fragment not in self._read_to:
            self._read_to[fragment] = self._before(fragment, round_index)
            self._newest[fragment], self._ahead[fragment] = -1, {}
        ahead = self._ahead[fragment]
        while self._newest[fragment] < round_index:
            version = self._read_to[fragment] + 1
            if version > (store.current_version(fragment) or 0):
                break
            meta = store.version_meta(fragment, version)
            self._read_to[fragment] = version
            if meta is not None and meta.round is not None:
                ahead[meta.round] = meta
                self._newest[fragment] = max(self._newest[fragment], meta.round)
        for r in [r for r in ahead if r < round_index]:
            del ahead[r]
        return ahead.get(round_index)

    def _before(self, fragment: int, round_index: int) -> int:
        """A version at or below which every version committed an earlier round or none, and
        above which the first version that committed a round committed `round_index` or a
        later one."""
        lo, hi = 0, self.store.current_version(fragment) or 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            version, committed = mid, None
            while version > lo:     # the newest version at or below mid that committed a round
                meta = self.store.version_meta(fragment, version)
                committed = None if meta is None else meta.round
                if committed is not None:
                    break
                version -= 1
            if committed is None or committed < round_index:
                lo = mid
            else:
                hi = version - 1
        return lo


def ledger_digest(store: ArtifactStore, learners: Sequence[str]):
    """The archiver's digest of a round (`RecordArchiver(digest=...)`): each packed offer's
    {attempt, claim, fate, reason} and the refused manifests, as `offer_fates` would read them
    from the records; None for a round not settled yet (decided and admitted, but neither
    committed nor recorded as not merged), whose block then goes without a digest."""
    wanted = frozenset(learners)
    commits = CommittedRounds(store)

    def digest(r: int, records: dict[str, bytes]) -> dict | None:
        # The round's records read from the bytes being packed, through the store's own
        # readers (the same checks), not from the store a second time.
        packed = ArtifactStore(PackedRecords(layout.round_dir(store.experiment, r), records),
                               store.experiment, store.max_object_bytes)
        decision = packed.get_decision(r)
        if decision is None:
            return None
        merge = commits.merge_of(decision.fragment, r)
        not_merged = _not_merged(packed, r, decision, merge)
        if merge is None and decision.members and not_merged is None:
            return None
        # The offers packed (the experiment's learners' manifests), not a second listing: an
        # offer written between the two would be in one and not the other.
        listed = sorted(learner for learner in wanted
                        if f"contributions/{learner}/{layout.MANIFEST}" in records)
        offers, fates, rejections, refused = {}, {}, [], []
        _round_fates(packed, r, listed, wanted, decision, merge, not_merged, offers, fates,
                     rejections, refused)
        reasons = {x["learner"]: x["reason"] for x in rejections}
        return {"offers": {learner: {**offers[(r, learner)], "fate": fates[(r, learner)],
                                     **({"reason": reasons[learner]}
                                        if learner in reasons else {})}
                           for (_, learner) in offers},
                "refused": refused}

    return digest


def _digested_block(store: ArtifactStore, first: int, learners: frozenset
                    ) -> list[tuple[dict, list[dict]]] | None:
    """Each round's (offers, refused manifests) from the digest of the archive block at
    `first`, checked entry by entry; None when the block has none, or one that does not
    check (its rounds are then read from its records)."""
    try:
        digest = store.archive.digest(first)
    except BadBlock:
        return None     # reading its records names what is wrong with it
    if digest is None:
        return None
    rounds = []
    for r in sorted(digest):
        entry = digest[r]
        if not isinstance(entry, dict) or not isinstance(entry.get("offers"), dict) \
                or not isinstance(entry.get("refused"), list):
            return None
        for learner, offer in entry["offers"].items():
            if learner not in learners or not isinstance(offer, dict) \
                    or offer_claim(offer)[0] is None or offer.get("fate") not in OFFER_FATES:
                return None
            reason = offer.get("reason")
            if (offer["fate"] == "rejected") != isinstance(reason, str) \
                    or reason is not None and len(reason) > MAX_DIGEST_TEXT:
                return None
        if not all(isinstance(x, dict) and set(x) == {"key", "reason"}
                   and all(isinstance(v, str) and len(v) <= MAX_DIGEST_TEXT
                           for v in x.values()) for x in entry["refused"]):
            return None
        rounds.append((entry["offers"], entry["refused"]))
    return rounds


def run_ledger(store: ArtifactStore, cfg: ExperimentConfig, *, digests: bool = True
               ) -> tuple[Ledger, list[dict]]:
    P = cfg.sync.num_fragments
    refused: list[dict] = []
    attempts = [record for name in cfg.learners.learner_names
                for record in store.attempt_records(name, refused)]
    offers, fates, rejections = offer_fates(store, P, cfg.learners.learner_names, refused,
                                            digests=digests)
    ledger = build_ledger(P, attempts, offers, fates)
    ledger.refused_records = [f"{r['key']}: {r['reason']}" for r in refused]
    return ledger, rejections
