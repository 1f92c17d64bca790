"""What each learner writes about itself: heartbeats, attempt records with their sealed ledger
segments, and where its checkpoints go.

Part of `ArtifactStore` (`artifact_store.py`), which composes the record families; keys in
`layout.py`.
"""

from collections.abc import Mapping, Sequence
from typing import Any

from diloco_core.round_records import MAX_INT, Heartbeat
from resources.store import layout
from resources.store.blobs import ListingTooLong, PreconditionFailed
from resources.store.store_base import (
    Conflict,
    RejectedArtifact,
    StoreBase,
    _json_bytes,
)

# A learner's ledger claims (one per offer) are kept as sealed segments of this many claims plus
# a live tail, so the attempt record it rewrites every heartbeat stays under ~40 KiB however
# long the run (the whole list was 370 KiB after 10,000 offers, rewritten every beat).
CLAIMS_PER_SEGMENT = 1024
MAX_CLAIM_SEGMENTS = 100_000    # 100M offers by one process: beyond that a record is refused
# A learner makes at most one offer per opened round, so its segments can be no more than the
# rounds opened so far justify (`_claim_segments_justified`); a sealed segment of 1024 claims is
# at most ~64 KiB, an attempt record ~80 KiB (tail, P counters): beyond these a ledger build
# refuses the record unread, so a learner's forged segments cannot make it read gigabytes.
MAX_CLAIM_SEGMENT_BYTES = 128 * 2**10
MAX_ATTEMPT_RECORD_BYTES = 512 * 2**10
# Listings of a learner's attempts/ are bounded: it writes there.
MAX_ATTEMPTS_LISTED = 2048       # objects under a learner's attempts/ (processes it ran)


class LearnerRecords(StoreBase):
    """Each learner's heartbeat, attempt records and checkpoint location."""

    def put_heartbeat(self, learner: str, beat: Heartbeat | Mapping[str, Any],
                      if_generation: int | None = None) -> None:
        """Write a learner's heartbeat; with `if_generation` (from `heartbeat_generation`) only
        if nobody wrote it since (`Conflict` otherwise): a learner fences itself off a newer
        attempt's heartbeat without a read-then-write race."""
        if not isinstance(beat, Heartbeat):
            beat = Heartbeat.from_json(beat)
        key = layout.heartbeat(self.experiment, learner)
        try:
            self.blobs.write(key, _json_bytes(beat.to_json()), if_generation=if_generation)
        except PreconditionFailed:
            raise Conflict(f"{learner}'s heartbeat was written concurrently") from None

    def heartbeat_generation(self, learner: str) -> tuple[Heartbeat | None, int]:
        """The heartbeat (None if absent or refused) and the generation it was read at (0: no
        heartbeat yet), for a conditional `put_heartbeat`."""
        key = layout.heartbeat(self.experiment, learner)
        for _ in range(10):
            info = self.blobs.info(key)
            if info is None:
                return None, 0
            beat, _ = self.read_heartbeat(learner)
            again = self.blobs.info(key)
            if again is not None and again.generation == info.generation:
                return beat, info.generation
        raise Conflict(f"{learner}'s heartbeat keeps changing")

    def read_heartbeat(self, learner: str) -> tuple[Heartbeat | None, str | None]:
        """(the learner's validated heartbeat or None, why it was refused or None). A learner
        writes it: a malformed one reads as no heartbeat (the learner is not live) plus the
        reason, never as an error that would stop the reader."""
        try:
            return self._read_typed(layout.heartbeat(self.experiment, learner), Heartbeat), None
        except RejectedArtifact as err:
            return None, err.reason
        except (OSError, ValueError) as err:
            # A file the learner made unreadable, or a link out of the store's root: its
            # own record, so its own refusal, never the reader's failure.
            return None, f"unreadable: {type(err).__name__}: {str(err)[:200]}"

    def read_heartbeats(self, learners: Sequence[str]
                        ) -> list[tuple[Heartbeat | None, str | None]]:
        """`read_heartbeat` of each learner, in the order given, read concurrently."""
        return self.each(self.read_heartbeat, learners)

    def get_heartbeat(self, learner: str) -> Heartbeat | None:
        """The learner's validated heartbeat, None if absent or refused."""
        return self.read_heartbeat(learner)[0]

    def put_attempt_record(self, learner: str, attempt: int, record: Mapping[str, Any]) -> None:
        """A learner process's own record (its token ledger); rewritten as it progresses.

        The ledger's claims are append-only: every full run of `CLAIMS_PER_SEGMENT` of them is
        sealed once into its own write-once object (before the record that drops them from
        its tail), and the record keeps only the tail and the number of sealed segments."""
        record = dict(record)
        ledger = record.get("ledger")
        if isinstance(ledger, Mapping) and isinstance(ledger.get("claims"), list):
            claims, size = ledger["claims"], CLAIMS_PER_SEGMENT
            sealed = len(claims) // size
            for k in range(sealed):
                if (learner, attempt, k) not in self._sealed:
                    self._write_once(layout.claim_segment(self.experiment, learner, attempt, k),
                                     _json_bytes({"claims": claims[k * size:(k + 1) * size]}))
                    self._sealed.add((learner, attempt, k))
            record["ledger"] = {**ledger, "claims": claims[sealed * size:],
                                "claim_segments": sealed}
        self.blobs.write(layout.attempt(self.experiment, learner, attempt),
                         _json_bytes(record))

    def _claim_segments_justified(self) -> tuple[int, int]:
        """(rounds opened so far, the most sealed claim segments one attempt can have): a
        learner offers at most once per opened round, and the control plane writes the OPEN
        pointer. One segment more than the rounds fill covers rounds opened while the ledger
        is read."""
        latest = self.latest_open_round()
        rounds = 0 if latest is None else latest.round + 1
        return rounds, -(-rounds // CLAIMS_PER_SEGMENT) + 1

    def _with_sealed_claims(self, key: str, learner: str, record: dict,
                            justified: tuple[int, int] | None = None) -> dict:
        """The record with its ledger's claims whole again (sealed segments, then the tail).
        A learner writes both: a bad segment count (more than `justified`, from
        `_claim_segments_justified`, allows) or a missing, oversized or malformed segment
        refuses the record, naming why, and no segment past the bound is read."""
        ledger = record.get("ledger")
        if not isinstance(ledger, dict) or "claim_segments" not in ledger:
            return record
        count, tail = ledger["claim_segments"], ledger.get("claims")
        if (isinstance(count, bool) or not isinstance(count, int)
                or not 0 <= count <= MAX_CLAIM_SEGMENTS or not isinstance(tail, list)):
            raise RejectedArtifact(key, f"claim_segments must be an integer in [0, "
                                        f"{MAX_CLAIM_SEGMENTS}] with a claims list, got "
                                        f"{str(count)[:40]}")
        rounds, most = justified or self._claim_segments_justified()
        if count > most:
            raise RejectedArtifact(key, f"claim_segments {count}: more than the {most} that "
                                        f"{rounds} opened rounds justify (one offer per round, "
                                        f"{CLAIMS_PER_SEGMENT} claims per segment); none read")
        attempt = record.get("attempt")
        if isinstance(attempt, bool) or not isinstance(attempt, int) or not 0 <= attempt < 10**5:
            raise RejectedArtifact(key, f"attempt must be an integer in [0, 99999], got "
                                        f"{str(attempt)[:40]}")
        claims: list = []
        for k in range(count):
            segment_key = layout.claim_segment(self.experiment, learner, attempt, k)
            try:
                segment = self._read_bounded_json(segment_key, MAX_CLAIM_SEGMENT_BYTES)
            except RejectedArtifact as err:
                raise RejectedArtifact(key, f"claim segment {k}: {err.reason}") from None
            part = None if segment is None else segment.get("claims")
            if not isinstance(part, list) or len(part) != CLAIMS_PER_SEGMENT:
                raise RejectedArtifact(key, f"claim segment {k} is missing or malformed")
            claims.extend(part)
        ledger = {k: v for k, v in ledger.items() if k != "claim_segments"}
        return {**record, "ledger": {**ledger, "claims": claims + tail}}

    def attempt_records(self, learner: str, refused: list[dict] | None = None) -> list[dict]:
        """Every process's record of this learner, oldest attempt first. A record that is
        unreadable or malformed is left out, and appended to `refused` ({"key", "reason"})
        when given: a learner writes these, and one bad record must not stop the ledger."""
        records = []
        prefix = layout.attempts_prefix(self.experiment, learner)
        try:
            keys = self.blobs.list(prefix, limit=MAX_ATTEMPTS_LISTED)
        except ListingTooLong:
            reason = (f"more than {MAX_ATTEMPTS_LISTED} objects: junk under the learner's "
                      "attempt records; none of them is read")
            self._refuse_listing(prefix, reason)
            if refused is not None:
                refused.append({"key": prefix, "reason": reason})
            return []
        justified = self._claim_segments_justified()
        for key in keys:
            name = key[len(prefix):]
            if "/" in name or not name.endswith(".json"):
                continue   # not an attempt record
            try:
                record = self._read_bounded_json(key, MAX_ATTEMPT_RECORD_BYTES)
                if record is None:
                    continue
                record = self._with_sealed_claims(key, learner, record, justified)
                _check_attempt_record(key, record, learner)
            except RejectedArtifact as err:
                if refused is not None:
                    refused.append({"key": key, "reason": err.reason})
                continue
            records.append(record)
        return sorted(records, key=lambda r: int(r.get("attempt", 0)))

    def checkpoint_uri(self, learner: str) -> str:
        """Where a learner's Orbax CheckpointManager lives (a path or gs:// URI)."""
        return f"{self.blobs.uri.rstrip('/')}/{layout.checkpoints(self.experiment, learner)}"


def _check_attempt_record(key: str, r: Mapping[str, Any], learner: str) -> None:
    """Refuse an attempt record the ledger could not account with, naming the field."""
    def bad(reason: str) -> RejectedArtifact:
        return RejectedArtifact(key, reason)

    def count(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_INT

    if r.get("learner") != learner:
        raise bad(f"record of learner {str(r.get('learner'))[:80]!r} under {learner}'s prefix")
    if not count(r.get("attempt")) or not key.endswith(f"a{r['attempt']:05d}.json"):
        raise bad(f"attempt {str(r.get('attempt'))[:40]!r} does not match the record's name")
    book = r.get("ledger")
    if not isinstance(book, dict) or not count(book.get("processed")):
        raise bad("ledger.processed must be an integer >= 0")
    for field in ("superseded", "unclaimed"):
        values = book.get(field)
        if not isinstance(values, list) or not all(count(v) for v in values):
            raise bad(f"ledger.{field} must be a list of integers >= 0")
    claims = book.get("claims")
    if not isinstance(claims, list) or not all(
            isinstance(c, list) and len(c) == 3 and all(count(v) for v in c) for c in claims):
        raise bad("ledger.claims must be a list of [round, fragment, tokens]")
    returned = book.get("returned", [])
    if not isinstance(returned, list) or len(returned) > len(claims) or not all(
            isinstance(c, list) and len(c) == 3 and all(count(v) for v in c) for c in returned):
        raise bad("ledger.returned must be a list of [round, fragment, tokens], one at most "
                  "per claim")
