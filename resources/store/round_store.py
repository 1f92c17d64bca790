"""A round's records: the open record and pointer, the learners' contributions (verified before a
byte is decoded), the decision, the not-merged record and the eval.

Part of `ArtifactStore` (`artifact_store.py`), which composes the record families; keys in
`layout.py`.
"""

import contextlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from diloco_core.config import MAX_LEARNERS
from diloco_core.contribution import Contribution
from diloco_core.offer_manifest import (
    OfferManifest,
    PayloadObject,
    PayloadObjects,
    TensorEntry,
    field_reason,
)
from diloco_core.round_records import RecordError, RoundDecision, RoundOpen
from diloco_core.stored_merge import StoredMerge, as_stored_merge
from diloco_core.syncer_events import OfferDigest
from resources.store import layout
from resources.store.array_bundle import sha256
from resources.store.blobs import BlobNotFound, ListingTooLong
from resources.store.record_archive import BadBlock, block_of
from resources.store.store_base import (
    Conflict,
    RejectedArtifact,
    StoreBase,
    _json_bytes,
)
from resources.store.summary_records import RoundEval

# Listings of prefixes that learners write are bounded (`BlobStore.list(limit=)`), generously
# for honest runs: a round's contributions hold 2 objects per learner (manifest, payload); a
# learner's attempt records, one per process; the fired faults, one per fault of the tape.
LISTED_PER_LEARNER = 4           # objects per learner of the config under a round's contributions


class RoundStore(StoreBase):
    """The records of each round, from its opening to its eval."""

    def put_contribution(self, c: Contribution, extra: Mapping[str, Any] | None = None) -> int:
        """Commit a learner's contribution to a round; returns the payload bytes written.
        `extra` is free-form JSON for observers (e.g. the learner's recent train loss)."""
        directory = layout.contribution_dir(self.experiment, c.round, c.learner)
        names = sorted(c.delta)
        arrays: dict[str, np.ndarray] = {}
        tensors = []
        for i, name in enumerate(names):
            enc = c.delta[name]
            arrays[f"t{i:04d}.payload"] = np.asarray(enc.payload)
            if enc.scales is not None:
                arrays[f"t{i:04d}.scales"] = np.asarray(enc.scales)
            tensors.append(TensorEntry(name, tuple(enc.shape), enc.encoding, enc.block_size,
                                       enc.scales is not None))
        delta = PayloadObject.from_json(self._put_arrays(directory, "delta", arrays))
        manifest = OfferManifest(
            c.learner, c.round, c.fragment, c.base_version, c.tokens, c.steps, c.learner_step,
            c.clock, tuple(tensors), PayloadObjects(delta), experiment=self.experiment,
            encoding=tuple(sorted({t.encoding for t in tensors})), nbytes=c.nbytes,
            extra=dict(extra or {}))
        self._write_once(f"{directory}/{layout.MANIFEST}", _json_bytes(manifest.to_json()))
        return delta.size

    def contribution_manifest(self, round_index: int, learner: str) -> OfferManifest | None:
        """The committed manifest (metadata only, no payload), validated, or None if not
        committed; `RejectedArtifact` names the field that is wrong, or says whose offer to
        which round it claims to be when that is not the key's."""
        found = self._offer_manifest(round_index, learner)
        return None if found is None else found[0]

    def _offer_manifest(self, round_index: int, learner: str, admitted: str | None = None
                        ) -> tuple[OfferManifest, str] | None:
        """The validated manifest and the SHA-256 of its bytes. With `admitted` (the digest a
        decision admitted), anything else in its place is refused as changed, whatever else
        is wrong with it."""
        key = f"{layout.contribution_dir(self.experiment, round_index, learner)}/{layout.MANIFEST}"
        found = self._read_json_with_digest(key)
        if found is None:
            return None
        raw, digest = found
        if admitted is not None and digest != admitted:
            raise RejectedArtifact(key, f"changed after the decision: manifest digest "
                                        f"{digest[:12]}, the decision admitted {admitted[:12]}")
        try:
            manifest = OfferManifest.from_json(raw)
        except RecordError as err:
            raise RejectedArtifact(key, field_reason(err)) from None
        if manifest.learner != learner or manifest.round != round_index:
            raise RejectedArtifact(key, f"manifest says learner {manifest.learner!r} round "
                                        f"{manifest.round!r}")
        return manifest, digest

    def list_contributions(self, round_index: int) -> list[str]:
        """Learners with a committed contribution to the round (a prefix listing). Learners
        write under that prefix, so the listing is bounded (`LISTED_PER_LEARNER` objects per
        learner of the config): past it, each learner of the experiment is looked up on its
        own instead, and the reason is logged (`listing_refusals`)."""
        if self.archive.holds(round_index):
            return self._archived_contributions(round_index)
        listed = self._listed_contributions(round_index)
        # Archived while we listed (its records deleted under the listing)? The block has them.
        if self.archive.holds(round_index, ask=True):
            return self._archived_contributions(round_index)
        return listed

    def _archived_contributions(self, round_index: int) -> list[str]:
        try:
            objects = self.archive.objects(round_index)
        except BadBlock as err:
            raise RejectedArtifact(self.archive.family.block(block_of(round_index)),
                                   str(err)) from None
        return sorted(key.split("/")[1] for key in objects
                      if key.startswith("contributions/") and key.count("/") == 2
                      and key.endswith("/" + layout.MANIFEST))

    def _listed_contributions(self, round_index: int) -> list[str]:
        prefix = layout.contributions_prefix(self.experiment, round_index)
        if prefix not in self.listing_refusals:
            count = len(self.roster() or ()) or MAX_LEARNERS   # no config: the most
            limit = LISTED_PER_LEARNER * count + 64
            try:
                keys = self.blobs.list(prefix, limit=limit)
            except ListingTooLong:
                self._refuse_listing(prefix, (
                    f"more than {limit} objects ({LISTED_PER_LEARNER} per learner of "
                    f"{count}): a learner wrote junk there; each learner's manifest is "
                    "looked up on its own instead"))
            else:
                learners = []
                for key in keys:
                    parts = key[len(prefix):].split("/")
                    if len(parts) == 2 and parts[1] == layout.MANIFEST:
                        learners.append(parts[0])
                return sorted(learners)
        return sorted(name for name in self.roster() or () if self.blobs.info(
            f"{layout.contribution_dir(self.experiment, round_index, name)}/{layout.MANIFEST}"
        ) is not None)

    def contribution_digest(self, round_index: int, learner: str) -> OfferDigest | None:
        """What the store vouches for of a committed offer (the SHA-256 of its manifest and of
        its payload as the manifest states it, its base version, its counters), or None if
        nothing is committed; `RejectedArtifact` for a manifest that is no offer of this
        learner to this round. A decision commits to the first; the second tells a replayed
        or copied payload, the third a replayed base."""
        found = self._offer_manifest(round_index, learner)
        if found is None:
            return None
        manifest, digest = found
        return OfferDigest(digest, manifest.payload.sha256, manifest.base_version,
                           manifest.tokens, manifest.steps)

    def contribution_created(self, round_index: int, learner: str) -> float | None:
        """When the store created the payload of the learner's committed offer (its own clock,
        never the learner's), or None if unknown. Of two byte-identical payloads the copy was
        created after the original, since a copier must read the original first."""
        try:
            manifest = self.contribution_manifest(round_index, learner)
        except RejectedArtifact:
            return None
        if manifest is None:
            return None
        key = (f"{layout.contribution_dir(self.experiment, round_index, learner)}/"
               f"{manifest.payload.name}")
        # The bytes first, then the time: a file made early and filled with the original's
        # bytes later must not pass for the original. Only the bytes the manifest claims
        # count, and an overwrite after they were read has a later creation time.
        try:
            data = self.blobs.read(key)
        except BlobNotFound:
            return None
        if sha256(data) != manifest.payload.sha256:
            return None
        info = self.blobs.info(key)
        return None if info is None else info.created

    def load_contribution(self, round_index: int, learner: str,
                          digest: str | None = None) -> Contribution:
        """A committed contribution, verified; `RejectedArtifact` with the reason otherwise.
        `digest` (the decision's record of the manifest it admitted): anything else in its
        place now is refused, so the merge uses exactly what was decided."""
        from diloco_core.compression import Encoded, wire_problem

        directory = layout.contribution_dir(self.experiment, round_index, learner)
        key = f"{directory}/{layout.MANIFEST}"
        found = self._offer_manifest(round_index, learner, admitted=digest)
        if found is None:
            raise KeyError(f"no committed contribution from {learner} to round {round_index}")
        manifest = found[0]
        entry = manifest.payload
        try:
            arrays = self._read_object(f"{directory}/{entry.name}", entry.to_json())
        except RejectedArtifact:
            self._raise_if_pruned(layout.round_dir(self.experiment, round_index),
                                  f"the contribution of {learner} to round {round_index}")
            raise
        delta = {}
        for i, t in enumerate(manifest.tensors):
            payload = arrays.get(f"t{i:04d}.payload")
            scales = arrays.get(f"t{i:04d}.scales") if t.scales else None
            if payload is None or (t.scales and scales is None):
                raise RejectedArtifact(key, f"tensor {t.name} is missing from the payload")
            # Dtype and element count, not only bytes: float64 in place of float32 values, or
            # float codes in place of int8 ones, has the right size and the wrong meaning.
            problem = wire_problem(t.encoding, t.shape, t.block_size, payload.dtype.name,
                                   payload.shape,
                                   None if scales is None else scales.dtype.name,
                                   None if scales is None else scales.shape)
            if problem is not None:
                raise RejectedArtifact(key, f"tensor {t.name}: {problem}")
            delta[t.name] = Encoded(t.encoding, t.shape, t.block_size, payload, scales)
        return Contribution(manifest.learner, manifest.fragment, manifest.round,
                            manifest.base_version, manifest.tokens, manifest.steps,
                            manifest.learner_step, manifest.clock, delta)

    def put_decision(self, round_index: int, record: RoundDecision | Mapping[str, Any]) -> None:
        if not isinstance(record, RoundDecision):
            record = RoundDecision.from_json(record)
        self._write_once(layout.decision(self.experiment, round_index),
                         _json_bytes(record.to_json()))

    def get_decision(self, round_index: int) -> RoundDecision | None:
        """The decision record (validated: `RejectedArtifact` names the field otherwise)."""
        return self._read_typed(layout.decision(self.experiment, round_index), RoundDecision)

    def put_round_not_merged(self, round_index: int,
                             record: StoredMerge | Mapping[str, Any]) -> None:
        """The merge record of a round that committed nothing (write-once: a retry finds it;
        the reasons of its rejections must outlive the merge run for the token ledger)."""
        # Conflict: an earlier try of the same merge recorded it.
        with contextlib.suppress(Conflict):
            self._write_once(layout.round_outcome(self.experiment, round_index),
                             _json_bytes(as_stored_merge(record).to_json()))

    def get_round_not_merged(self, round_index: int) -> StoredMerge | None:
        """The merge record of a decided round that committed nothing, None if absent."""
        return self._read_typed(layout.round_outcome(self.experiment, round_index), StoredMerge)

    def put_eval(self, round_index: int, result: RoundEval) -> None:
        self._write_once(layout.evaluation(self.experiment, round_index),
                         _json_bytes(result.to_json()))

    def get_eval(self, round_index: int) -> RoundEval | None:
        return self._read_model(layout.evaluation(self.experiment, round_index), RoundEval)

    def open_round(self, round_index: int, record: RoundOpen | Mapping[str, Any]) -> None:
        """Open a round: its record is write-once; then the OPEN pointer moves to it (learners
        read only the pointer, one small object per poll)."""
        if isinstance(record, RoundOpen):
            record = record.to_json()
        body = RoundOpen.from_json({**dict(record), "round": round_index}).to_json()
        self._write_once(layout.round_open(self.experiment, round_index), _json_bytes(body))
        latest = self.latest_open_round()
        if latest is None or latest.round < round_index:
            self.blobs.write(layout.open_pointer(self.experiment), _json_bytes(body))

    def latest_open_round(self) -> RoundOpen | None:
        """The round the OPEN pointer names (validated), None before the first."""
        return self._read_typed(layout.open_pointer(self.experiment), RoundOpen)

    def get_round_open(self, round_index: int) -> RoundOpen | None:
        return self._read_typed(layout.round_open(self.experiment, round_index), RoundOpen)

    def prune_round(self, round_index: int, reason: str) -> int:
        """Delete the arrays of every contribution to a decided round, after writing the
        round's PRUNED marker; returns how many objects went. An undecided round is refused
        (its contributions may still be merged)."""
        if self.get_decision(round_index) is None:
            raise Conflict(f"round {round_index} is not decided: its contributions may still "
                           "be merged")
        return self._prune(layout.round_dir(self.experiment, round_index), reason)
