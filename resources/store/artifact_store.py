"""The artifact store: one experiment's config, global fragments, contributions, decisions, evals.

Same code over a local directory or a GCS prefix (any `BlobStore`). The rules that make it safe:
- payload objects are written once, create-only, under names that carry their checksum;
- a small JSON manifest is written last, create-only, and is the commit point: readers look only
  at manifests, verify every object's size and SHA-256, and parse arrays without unpickling;
- a fragment's current version is a pointer moved by compare-and-swap on its generation, only
  after the new version is fully committed, so nothing partial is ever visible;
- writing the same thing twice is a no-op; writing something different where something is
  committed is refused (`Conflict`).
See `layout.py` for the keys.

JAX is imported only where arrays are handled: sensors and run workers that load the Dagster
code location only read and write small records and should not pay for it.
"""

import contextlib
import json
import logging
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from diloco_core.capacity import Capacity
from diloco_core.config import ENCODINGS, MAX_LEARNERS, LearnersConfig
from diloco_core.contribution import Contribution
from diloco_core.round_records import MAX_INT, Heartbeat, RecordError, RoundDecision, RoundOpen
from diloco_core.syncer_events import OfferDigest
from resources.store import layout
from resources.store.array_bundle import BadBundle, decode_bundle, encode_bundle, sha256
from resources.store.blobs import BlobNotFound, BlobStore, ListingTooLong, PreconditionFailed
from resources.store.contention import retries
from resources.store.fan_out import fan_out
from resources.store.names import check_name

FORMAT = 1
DEFAULT_MAX_OBJECT_BYTES = 4 * 2**30
# JSON records (manifests, decisions, heartbeats, summaries) are small; a larger one is refused
# before it is parsed.
MAX_RECORD_BYTES = 16 * 2**20
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
# Listings of prefixes that learners write are bounded (`BlobStore.list(limit=)`), generously
# for honest runs: a round's contributions hold 2 objects per learner (manifest, payload); a
# learner's attempt records, one per process; the fired faults, one per fault of the tape.
LISTED_PER_LEARNER = 4           # objects per learner of the config under a round's contributions
MAX_ATTEMPTS_LISTED = 2048       # objects under a learner's attempts/ (processes it ran)
MAX_FIRED_LISTED = 10_000        # objects under faults/fired/

_log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")


class Conflict(RuntimeError):
    """Something different is already committed where this write would go."""


class RejectedArtifact(ValueError):
    """A stored artifact that must not be used; `reason` says why (logged, never merged)."""

    def __init__(self, key: str, reason: str):
        self.key, self.reason = key, reason
        super().__init__(f"{key}: {reason}")


class Pruned(KeyError):
    """The arrays asked for were deleted by retention (their manifest and records remain)."""

    def __str__(self) -> str:      # KeyError would print its message quoted
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class GlobalFragment:
    fragment: int
    version: int
    params: dict[str, np.ndarray]
    outer_state: Any                 # optax state in the template's structure, or a leaf list
    meta: dict


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, indent=1, allow_nan=False).encode()


class ArtifactStore:
    """One experiment's artifacts in a blob store."""

    def __init__(self, blobs: BlobStore, experiment: str,
                 max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES):
        self.blobs = blobs
        self.experiment = check_name("experiment", experiment)
        self.max_object_bytes = max_object_bytes
        self._sealed: set[tuple[str, int, int]] = set()   # claim segments this process wrote
        self._roster: tuple[str, ...] | None = None        # the config's learners, once read
        # Prefixes whose listing went past its bound -> why (logged once per prefix).
        self.listing_refusals: dict[str, str] = {}

    # ---- write-once primitives ----------------------------------------------------------------
    def _write_once(self, key: str, data: bytes) -> None:
        """Create `key`; if it exists with the same bytes, fine; if different, `Conflict`."""
        try:
            self.blobs.write(key, data, if_generation=0)
        except PreconditionFailed:
            try:
                same = self.blobs.read(key) == data
            except BlobNotFound:
                same = False  # existed a moment ago and is gone: someone else is at work here
            if not same:
                raise Conflict(f"{key} is already committed with different content") from None

    def _read_json(self, key: str) -> dict | None:
        found = self._read_json_with_digest(key)
        return None if found is None else found[0]

    def _read_json_with_digest(self, key: str) -> tuple[dict, str] | None:
        """The record and the SHA-256 of the bytes it was parsed from."""
        try:
            data = self.blobs.read(key)
        except BlobNotFound:
            return None
        if len(data) > MAX_RECORD_BYTES:
            raise RejectedArtifact(key, f"{len(data)} bytes: larger than a record may be "
                                        f"({MAX_RECORD_BYTES})")
        try:
            value = json.loads(data)
        except (ValueError, RecursionError) as err:
            # Also integers past Python's 4300-digit limit and absurd nesting.
            raise RejectedArtifact(key, f"not valid JSON: {str(err)[:200]}") from None
        if not isinstance(value, dict):
            raise RejectedArtifact(key, "not a JSON object")
        return value, sha256(data)

    def _read_record(self, key: str, kind: type[RoundOpen | RoundDecision | Heartbeat]
                     ) -> dict | None:
        typed = self._read_typed(key, kind)
        return None if typed is None else typed.to_json()

    def _read_typed(self, key: str, kind: type[RoundOpen | RoundDecision | Heartbeat]):
        """The record at `key` validated into `kind`, None if absent; `RejectedArtifact`
        names the field that is wrong."""
        raw = self._read_json(key)
        if raw is None:
            return None
        try:
            return kind.from_json(raw)
        except RecordError as err:
            raise RejectedArtifact(key, str(err)) from None

    def _read_object(self, key: str, entry: Mapping[str, Any]) -> dict[str, np.ndarray]:
        info = self.blobs.info(key)
        if info is None:
            raise RejectedArtifact(key, "manifest names an object that does not exist")
        if info.size > self.max_object_bytes:
            raise RejectedArtifact(key, f"oversized: {info.size} bytes > limit "
                                        f"{self.max_object_bytes}")
        try:
            return decode_bundle(self.blobs.read(key), expected_sha256=entry["sha256"],
                                 expected_size=entry["size"], dtypes=entry["dtypes"],
                                 shapes=entry["shapes"])
        except BadBundle as err:
            raise RejectedArtifact(key, str(err)) from None

    def _put_arrays(self, directory: str, stem: str, arrays: Mapping[str, np.ndarray]) -> dict:
        bundle = encode_bundle(arrays)
        if len(bundle.data) > self.max_object_bytes:
            raise ValueError(f"{stem} bundle of {len(bundle.data)} bytes exceeds the limit")
        name = f"{stem}-{bundle.sha256[:16]}.npz"
        self._write_once(f"{directory}/{name}", bundle.data)
        return {"name": name, "size": len(bundle.data), "sha256": bundle.sha256,
                "dtypes": bundle.dtypes, "shapes": bundle.shapes}

    # ---- experiment config and summary --------------------------------------------------------
    def put_config(self, config: Mapping[str, Any]) -> None:
        self._write_once(layout.config(self.experiment), _json_bytes(dict(config)))

    def get_config(self) -> dict | None:
        config = self._read_json(layout.config(self.experiment))
        if config is not None and self._roster is None:
            self._roster = _roster_of(config)   # write-once: what bounds listings per learner
        return config

    # The summary's `summarized_by` once the `summarize` run has recorded it as Dagster's
    # `run_summary` asset (the syncer service writes it first, under its own name).
    SUMMARY_RECORDED_BY = "summarize"

    def put_summary(self, summary: Mapping[str, Any]) -> None:
        # The one object that is rewritten: the latest summary of a (possibly resumed) run.
        self.blobs.write(layout.summary(self.experiment), _json_bytes(dict(summary)))

    def get_summary(self) -> dict | None:
        return self._read_json(layout.summary(self.experiment))

    # ---- global fragments ---------------------------------------------------------------------
    def current_version(self, fragment: int) -> int | None:
        pointer = self._read_json(layout.pointer(self.experiment, fragment))
        return None if pointer is None else int(pointer["version"])

    def versions(self, fragment: int) -> list[int]:
        prefix = layout.fragment_dir(self.experiment, fragment) + "/v"
        return sorted(int(key[len(prefix):].split("/")[0]) for key in self.blobs.list(prefix)
                      if key.endswith("/" + layout.MANIFEST))

    def commit_global(self, fragment: int, version: int, params: Mapping[str, Any],
                      outer_state: Any, meta: Mapping[str, Any] | None = None,
                      move_pointer: bool = True) -> None:
        """Commit version `version` of a fragment and move its pointer there.

        Version 0 creates the pointer; version v > 0 requires the pointer at v - 1 (compare and
        swap), so two syncers cannot both advance the same fragment. Re-committing an identical
        version that is already current is a no-op (a retried merge run). With
        `move_pointer=False` the version is written but not current until `adopt_version`.
        """
        import jax

        directory = layout.version_dir(self.experiment, fragment, version)
        leaves = {f"leaf{i:05d}": np.asarray(v)
                  for i, v in enumerate(jax.tree_util.tree_leaves(outer_state))}
        objects = {
            "params": self._put_arrays(directory, "params",
                                       {k: np.asarray(v) for k, v in params.items()}),
            "outer": self._put_arrays(directory, "outer", leaves),
        }
        manifest = {"format": FORMAT, "kind": "global_fragment", "experiment": self.experiment,
                    "fragment": fragment, "version": version, "objects": objects,
                    "meta": dict(meta or {})}
        self._write_once(f"{directory}/{layout.MANIFEST}", _json_bytes(manifest))
        if move_pointer:
            self._move_pointer(fragment, version)

    def _move_pointer(self, fragment: int, version: int) -> None:
        key = layout.pointer(self.experiment, fragment)
        info = self.blobs.info(key)
        current = None if info is None else self.current_version(fragment)
        if current == version:
            return
        expected = -1 if current is None else current
        if version != expected + 1:
            raise Conflict(f"fragment {fragment}: cannot move the pointer from version "
                           f"{current} to {version}")
        manifest = f"{layout.version_dir(self.experiment, fragment, version)}/{layout.MANIFEST}"
        if self.blobs.info(manifest) is None:
            # Never point at a version that is not (or no longer) committed: every poll,
            # restart and merge would fail from then on.
            raise Conflict(f"fragment {fragment}: version {version} is not committed")
        try:
            self.blobs.write(key, _json_bytes({"version": version}),
                             if_generation=0 if info is None else info.generation)
        except PreconditionFailed:
            # A retried request whose first attempt landed also ends here: check before failing.
            if self.current_version(fragment) != version:
                raise Conflict(f"fragment {fragment}: the pointer moved concurrently") from None

    def version_meta(self, fragment: int, version: int | None = None) -> dict | None:
        """The `meta` of a committed version (default: the current one) without reading its
        arrays, or None if there is no such manifest."""
        if version is None:
            version = self.current_version(fragment)
            if version is None:
                return None
        manifest = self._read_json(
            f"{layout.version_dir(self.experiment, fragment, version)}/{layout.MANIFEST}")
        return None if manifest is None else dict(manifest.get("meta") or {})

    def find_round_commit(self, fragment: int, round_index: int, version: int, meta: dict
                          ) -> tuple[int, dict] | None:
        """The committed version of this round, searching back from `version` (whose meta is
        `meta`) while the versions belong to this round or later ones (merges of a fragment
        commit in round order). None when the fragment moved past the round without it."""
        while version > 0:
            committed = meta.get("round")
            if committed == round_index:
                return version, meta
            if not isinstance(committed, int) or committed < round_index:
                return None
            version -= 1
            meta = self.version_meta(fragment, version) or {}
        return None

    def adopt_version(self, fragment: int, version: int) -> None:
        """Move the pointer to an already written version (a commit whose pointer move was
        lost: the manifest is there, the pointer still at version - 1)."""
        self._move_pointer(fragment, version)

    def discard_unreferenced(self, fragment: int, version: int) -> None:
        """Delete a version the pointer never reached (a failed commit of another attempt), so
        that version number can be committed. Refuses if the pointer is at or past it."""
        current = self.current_version(fragment)
        if current is not None and current >= version:
            raise Conflict(f"fragment {fragment} version {version} is referenced (current "
                           f"{current})")
        directory = layout.version_dir(self.experiment, fragment, version)
        self.blobs.delete(f"{directory}/{layout.MANIFEST}")
        for key in self.blobs.list(directory + "/"):
            self.blobs.delete(key)

    def load_global(self, fragment: int, version: int | None = None,
                    outer_template: Any = None) -> GlobalFragment:
        """A committed version (default: the current one), verified. With `outer_template`
        (e.g. `tx.init(fragment)`) the outer state comes back in its optax structure."""
        if version is None:
            version = self.current_version(fragment)
            if version is None:
                raise KeyError(f"fragment {fragment} has no committed version")
        directory = layout.version_dir(self.experiment, fragment, version)
        manifest = self._read_json(f"{directory}/{layout.MANIFEST}")
        if manifest is None:
            raise KeyError(f"fragment {fragment} version {version} is not committed")
        objects = manifest["objects"]
        try:
            params = self._read_object(f"{directory}/{objects['params']['name']}",
                                       objects["params"])
            outer = self._read_object(f"{directory}/{objects['outer']['name']}",
                                      objects["outer"])
        except RejectedArtifact:
            self._raise_if_pruned(directory, f"fragment {fragment} version {version}")
            raise
        leaves = [outer[name] for name in sorted(outer)]
        if outer_template is not None:
            import jax

            treedef = jax.tree_util.tree_structure(outer_template)
            outer_state = jax.tree_util.tree_unflatten(treedef, leaves)
        else:
            outer_state = leaves
        return GlobalFragment(fragment, version, params, outer_state, manifest["meta"])

    # ---- contributions ------------------------------------------------------------------------
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
            tensors.append({"name": name, "shape": list(enc.shape), "encoding": enc.encoding,
                            "block_size": enc.block_size, "scales": enc.scales is not None})
        delta = self._put_arrays(directory, "delta", arrays)
        manifest = {"format": FORMAT, "kind": "contribution", "experiment": self.experiment,
                    "learner": c.learner, "round": c.round, "fragment": c.fragment,
                    "base_version": c.base_version, "tokens": c.tokens, "steps": c.steps,
                    "learner_step": c.learner_step, "clock": c.clock,
                    "encoding": sorted({t["encoding"] for t in tensors}),
                    "nbytes": c.nbytes, "tensors": tensors, "objects": {"delta": delta},
                    "extra": dict(extra or {})}
        self._write_once(f"{directory}/{layout.MANIFEST}", _json_bytes(manifest))
        return delta["size"]

    def contribution_manifest(self, round_index: int, learner: str) -> dict | None:
        """The committed manifest (metadata only, no payload), or None if not committed."""
        return self._read_json(
            f"{layout.contribution_dir(self.experiment, round_index, learner)}/{layout.MANIFEST}")

    def list_contributions(self, round_index: int) -> list[str]:
        """Learners with a committed contribution to the round (a prefix listing). Learners
        write under that prefix, so the listing is bounded (`LISTED_PER_LEARNER` objects per
        learner of the config): past it, each learner of the experiment is looked up on its
        own instead, and the reason is logged (`listing_refusals`)."""
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

    def roster(self) -> tuple[str, ...] | None:
        """The experiment's learners, from its config (read once), or None without one."""
        if self._roster is None:
            with contextlib.suppress(RejectedArtifact):
                self.get_config()
        return self._roster

    def _refuse_listing(self, prefix: str, reason: str) -> None:
        if prefix not in self.listing_refusals:
            self.listing_refusals[prefix] = reason
            _log.warning("listing of %s stopped: %s", prefix, reason)

    def contribution_digest(self, round_index: int, learner: str) -> OfferDigest | None:
        """What the store vouches for of a committed offer (the SHA-256 of its manifest and of
        its payload as the manifest states it, its base version, its counters), or None if
        nothing is committed; `RejectedArtifact` for a manifest that is no offer of this
        learner to this round. A decision commits to the first; the second tells a replayed
        or copied payload, the third a replayed base."""
        directory = layout.contribution_dir(self.experiment, round_index, learner)
        key = f"{directory}/{layout.MANIFEST}"
        found = self._read_json_with_digest(key)
        if found is None:
            return None
        manifest, digest = found
        _check_contribution_manifest(key, manifest, round_index, learner)
        return OfferDigest(digest, manifest["objects"]["delta"]["sha256"],
                           manifest["base_version"], manifest["tokens"], manifest["steps"])

    def contribution_created(self, round_index: int, learner: str) -> float | None:
        """When the store created the payload of the learner's committed offer (its own clock,
        never the learner's), or None if unknown. Of two byte-identical payloads the copy was
        created after the original, since a copier must read the original first."""
        manifest = self.contribution_manifest(round_index, learner)
        objects = (manifest or {}).get("objects")
        entry = objects.get("delta") if isinstance(objects, Mapping) else None
        name = entry.get("name") if isinstance(entry, Mapping) else None
        if not isinstance(name, str) or "/" in name:
            return None
        key = f"{layout.contribution_dir(self.experiment, round_index, learner)}/{name}"
        # The bytes first, then the time: a file made early and filled with the original's
        # bytes later must not pass for the original. Only the bytes the manifest claims
        # count, and an overwrite after they were read has a later creation time.
        try:
            data = self.blobs.read(key)
        except BlobNotFound:
            return None
        if sha256(data) != entry.get("sha256"):
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
        found = self._read_json_with_digest(key)
        if found is None:
            raise KeyError(f"no committed contribution from {learner} to round {round_index}")
        manifest, actual = found
        if digest is not None and actual != digest:
            raise RejectedArtifact(key, f"changed after the decision: manifest digest "
                                        f"{actual[:12]}, the decision admitted {digest[:12]}")
        _check_contribution_manifest(key, manifest, round_index, learner)
        entry = manifest["objects"]["delta"]
        try:
            arrays = self._read_object(f"{directory}/{entry['name']}", entry)
        except RejectedArtifact:
            self._raise_if_pruned(layout.round_dir(self.experiment, round_index),
                                  f"the contribution of {learner} to round {round_index}")
            raise
        delta = {}
        for i, t in enumerate(manifest["tensors"]):
            payload = arrays.get(f"t{i:04d}.payload")
            scales = arrays.get(f"t{i:04d}.scales") if t["scales"] else None
            if payload is None or (t["scales"] and scales is None):
                raise RejectedArtifact(key, f"tensor {t['name']} is missing from the payload")
            # Dtype and element count, not only bytes: float64 in place of float32 values, or
            # float codes in place of int8 ones, has the right size and the wrong meaning.
            problem = wire_problem(t["encoding"], tuple(t["shape"]), t["block_size"],
                                   payload.dtype.name, payload.shape,
                                   None if scales is None else scales.dtype.name,
                                   None if scales is None else scales.shape)
            if problem is not None:
                raise RejectedArtifact(key, f"tensor {t['name']}: {problem}")
            delta[t["name"]] = Encoded(t["encoding"], tuple(t["shape"]), t["block_size"],
                                       payload, scales)
        return Contribution(manifest["learner"], manifest["fragment"], manifest["round"],
                            manifest["base_version"], manifest["tokens"], manifest["steps"],
                            manifest["learner_step"], manifest["clock"], delta)

    # ---- decisions and evals ------------------------------------------------------------------
    def put_decision(self, round_index: int, record: RoundDecision | Mapping[str, Any]) -> None:
        if not isinstance(record, RoundDecision):
            record = RoundDecision.from_json(record)
        self._write_once(layout.decision(self.experiment, round_index),
                         _json_bytes(record.to_json()))

    def get_decision(self, round_index: int) -> dict | None:
        """The decision record (validated: `RejectedArtifact` names the field otherwise)."""
        return self._read_record(layout.decision(self.experiment, round_index), RoundDecision)

    def decision_record(self, round_index: int) -> RoundDecision | None:
        """`get_decision` as the typed record."""
        return self._read_typed(layout.decision(self.experiment, round_index), RoundDecision)

    def put_round_not_merged(self, round_index: int, record: Mapping[str, Any]) -> None:
        """The merge record of a round that committed nothing (write-once: a retry finds it;
        the reasons of its rejections must outlive the merge run for the token ledger)."""
        # Conflict: an earlier try of the same merge recorded it.
        with contextlib.suppress(Conflict):
            self._write_once(layout.round_outcome(self.experiment, round_index),
                             _json_bytes(dict(record)))

    def get_round_not_merged(self, round_index: int) -> dict | None:
        return self._read_json(layout.round_outcome(self.experiment, round_index))

    def put_eval(self, round_index: int, result: Mapping[str, Any]) -> None:
        self._write_once(layout.evaluation(self.experiment, round_index), _json_bytes(dict(result)))

    def get_eval(self, round_index: int) -> dict | None:
        return self._read_json(layout.evaluation(self.experiment, round_index))

    # ---- rounds, heartbeats and the run's lifecycle (the data plane's control records) --------
    def open_round(self, round_index: int, record: RoundOpen | Mapping[str, Any]) -> None:
        """Open a round: its record is write-once; then the OPEN pointer moves to it (learners
        read only the pointer, one small object per poll)."""
        if isinstance(record, RoundOpen):
            record = record.to_json()
        body = RoundOpen.from_json({**dict(record), "round": round_index}).to_json()
        self._write_once(layout.round_open(self.experiment, round_index), _json_bytes(body))
        latest = self.latest_open_round()
        if latest is None or latest["round"] < round_index:
            self.blobs.write(layout.open_pointer(self.experiment), _json_bytes(body))

    def latest_open_round(self) -> dict | None:
        return self._read_record(layout.open_pointer(self.experiment), RoundOpen)

    def get_round_open(self, round_index: int) -> dict | None:
        return self._read_record(layout.round_open(self.experiment, round_index), RoundOpen)

    def latest_open_record(self) -> RoundOpen | None:
        """`latest_open_round` as the typed record."""
        return self._read_typed(layout.open_pointer(self.experiment), RoundOpen)

    def round_open_record(self, round_index: int) -> RoundOpen | None:
        """`get_round_open` as the typed record."""
        return self._read_typed(layout.round_open(self.experiment, round_index), RoundOpen)

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

    def heartbeat_generation(self, learner: str) -> tuple[dict | None, int]:
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

    def read_heartbeat(self, learner: str) -> tuple[dict | None, str | None]:
        """(the learner's validated heartbeat or None, why it was refused or None). A learner
        writes it: a malformed one reads as no heartbeat (the learner is not live) plus the
        reason, never as an error that would stop the reader."""
        beat, why = self.heartbeat_record(learner)
        return (None if beat is None else beat.to_json()), why

    def heartbeat_record(self, learner: str) -> tuple[Heartbeat | None, str | None]:
        """`read_heartbeat` as the typed record."""
        try:
            return self._read_typed(layout.heartbeat(self.experiment, learner), Heartbeat), None
        except RejectedArtifact as err:
            return None, err.reason
        except (OSError, ValueError) as err:
            # A file the learner made unreadable, or a link out of the store's root: its
            # own record, so its own refusal, never the reader's failure.
            return None, f"unreadable: {type(err).__name__}: {str(err)[:200]}"

    def heartbeat_records(self, learners: Sequence[str]
                          ) -> list[tuple[Heartbeat | None, str | None]]:
        """`heartbeat_record` of each learner, in the order given, read concurrently."""
        return self.each(self.heartbeat_record, learners)

    def each(self, read: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """`[read(item) for item in items]` with as many reads in flight as the backend serves
        (`fan_out`): the control plane's per-learner reads, not one round trip after another."""
        return fan_out(read, items, self.blobs.read_concurrency)

    def get_heartbeat(self, learner: str) -> dict | None:
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

    def _read_bounded_json(self, key: str, max_bytes: int) -> dict | None:
        """`_read_json` of an object a learner writes, refused unread when it is larger than
        `max_bytes` (its size is looked up first)."""
        info = self.blobs.info(key)
        if info is None:
            return None
        if info.size > max_bytes:
            raise RejectedArtifact(key, f"{info.size} bytes: larger than it may be "
                                        f"({max_bytes}); not read")
        return self._read_json(key)

    def _claim_segments_justified(self) -> tuple[int, int]:
        """(rounds opened so far, the most sealed claim segments one attempt can have): a
        learner offers at most once per opened round, and the control plane writes the OPEN
        pointer. One segment more than the rounds fill covers rounds opened while the ledger
        is read."""
        latest = self.latest_open_round()
        rounds = 0 if latest is None else latest["round"] + 1
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

    # ---- fault injection (chaos runs) ---------------------------------------------------------
    def put_fault_tape(self, tape: Mapping[str, Any]) -> None:
        self._write_once(layout.fault_tape(self.experiment), _json_bytes(dict(tape)))

    def get_fault_tape(self) -> dict | None:
        return self._read_json(layout.fault_tape(self.experiment))

    def mark_fault_fired(self, fault_id: str, record: Mapping[str, Any]) -> bool:
        """Record that a fault fires; False if it already fired (so it never fires twice,
        e.g. when a learner relaunched from an earlier checkpoint reaches the step again)."""
        try:
            self.blobs.write(layout.fired_fault(self.experiment, fault_id) + ".json",
                             _json_bytes(dict(record)), if_generation=0)
        except PreconditionFailed:
            return False
        return True

    def fired_faults(self) -> list[dict]:
        """The fired-fault records, in time order. In a chaos run learners write them too: an
        unreadable or oversized one is left out, and past `MAX_FIRED_LISTED` objects none is
        read (`listing_refusals` says why; `mark_fault_fired` still fires each fault once)."""
        prefix = layout.fired_prefix(self.experiment)
        try:
            keys = self.blobs.list(prefix, limit=MAX_FIRED_LISTED)
        except ListingTooLong:
            self._refuse_listing(prefix, f"more than {MAX_FIRED_LISTED} objects; none read")
            return []
        out = []
        for key in keys:
            with contextlib.suppress(RejectedArtifact):
                record = self._read_bounded_json(key, 64 * 2**10)
                if record is not None:
                    out.append(record)

        def when(record: dict) -> float:
            t = record.get("time")
            ok = isinstance(t, int | float) and not isinstance(t, bool) and math.isfinite(t)
            return float(t) if ok else 0.0

        return sorted(out, key=when)

    def request_stop(self, record: Mapping[str, Any]) -> None:
        self._write_once(layout.stop(self.experiment), _json_bytes(dict(record)))

    def stop_requested(self) -> dict | None:
        return self._read_json(layout.stop(self.experiment))

    def capacity(self, standby: Sequence[str] = ()) -> tuple[Capacity, int]:
        """Which learners are absent now, and the generation the record was read at for a
        conditional `put_capacity` (0: none written yet; then it is the launch state, the
        `standby` learners absent). `RejectedArtifact` if the stored record is malformed."""
        key = layout.capacity(self.experiment)
        for _ in range(10):
            info = self.blobs.info(key)
            if info is None:
                return Capacity.at_launch(standby), 0
            raw = self._read_json(key)
            again = self.blobs.info(key)
            if raw is None or again is None or again.generation != info.generation:
                continue   # moved while read: read again
            try:
                return Capacity.from_json(raw), info.generation
            except RecordError as err:
                raise RejectedArtifact(key, str(err)) from None
        raise Conflict("the capacity record keeps changing")

    def put_capacity(self, record: Capacity, if_generation: int) -> None:
        """Write the capacity record only if it is still at `if_generation` (`Conflict`
        otherwise): two operators (or an operator and a fault tape) changing capacity at once
        never lose one another's change."""
        try:
            self.blobs.write(layout.capacity(self.experiment), _json_bytes(record.to_json()),
                             if_generation=if_generation)
        except PreconditionFailed:
            raise Conflict("the capacity record was changed concurrently") from None

    def token_budget(self, configured: int) -> int:
        """The run's token budget: the config's, or a larger one set on resume
        (`raise_token_budget`). A malformed record is refused (`RejectedArtifact`)."""
        raw = self._read_json(layout.budget(self.experiment))
        if raw is None:
            return configured
        budget = raw.get("token_budget") if isinstance(raw, dict) else None
        if not isinstance(budget, int) or isinstance(budget, bool) or not 0 < budget <= MAX_INT:
            raise RejectedArtifact(layout.budget(self.experiment),
                                   f"token_budget must be a positive integer, got {budget!r}")
        return max(configured, budget)

    def raise_token_budget(self, budget: int, configured: int, record: Mapping[str, Any]
                           ) -> int:
        """Raise the run's token budget to `budget` if that is larger than the one in force
        (the control plane, when `train` resumes a run with a larger one); returns the budget
        in force after. Conditional on the record read: two raises at once both count."""
        key = layout.budget(self.experiment)
        for _ in retries():
            info = self.blobs.info(key)
            current = self.token_budget(configured)
            if budget <= current:
                return current
            try:
                self.blobs.write(key, _json_bytes({**record, "token_budget": budget}),
                                 if_generation=0 if info is None else info.generation)
                return budget
            except PreconditionFailed:
                continue
        raise Conflict("the token budget keeps changing")

    def put_stop_request(self, record: Mapping[str, Any]) -> bool:
        """An operator asks to end the run before its budget (`diloco stop`, the `stop` job).
        The round controller turns it into STOP at its next tick, so the run ends as at the
        budget: final rounds, then the summary. Write-once: False if one was already made."""
        try:
            self._write_once(layout.stop_request(self.experiment), _json_bytes(dict(record)))
        except Conflict:
            return False
        return True

    def stop_request(self) -> dict | None:
        return self._read_json(layout.stop_request(self.experiment))

    def mark_finished(self, record: Mapping[str, Any]) -> None:
        """The run's final rounds are decided and published (write-once; the first writer's
        record stands when the syncer and the sensor fallback both get there)."""
        with contextlib.suppress(Conflict):
            self._write_once(layout.finished(self.experiment), _json_bytes(dict(record)))

    def finished(self) -> dict | None:
        return self._read_json(layout.finished(self.experiment))

    def get_syncer_lease(self) -> dict | None:
        """The syncer's lease record as observers see it (`resources.store.lease`)."""
        try:
            return self._read_json(layout.syncer_lease(self.experiment))
        except RejectedArtifact:
            return {}

    def checkpoint_uri(self, learner: str) -> str:
        """Where a learner's Orbax CheckpointManager lives (a path or gs:// URI)."""
        return f"{self.blobs.uri.rstrip('/')}/{layout.checkpoints(self.experiment, learner)}"

    # ---- retention ----------------------------------------------------------------------------
    # Retention deletes arrays only. Every manifest and record stays: the token ledger and the
    # run summary read the meta of every version and the manifest of every offer, and they are
    # kilobytes where the arrays are the model's size (a 12B model's fragment: gigabytes per
    # version, and again per contribution).
    def prune_version(self, fragment: int, version: int, reason: str) -> int:
        """Delete the arrays of a committed version older than the current one, after writing
        its PRUNED marker; returns how many objects went (0: nothing left to delete). Version
        0 (the initial parameters) and the current version or newer ones are refused."""
        if version < 1:
            raise ValueError(f"version {version}: the initial parameters (version 0) are kept")
        current = self.current_version(fragment)
        if current is None or version >= current:
            raise Conflict(f"fragment {fragment} version {version} is not older than the "
                           f"current version ({current})")
        return self._prune(layout.version_dir(self.experiment, fragment, version), reason)

    def prune_round(self, round_index: int, reason: str) -> int:
        """Delete the arrays of every contribution to a decided round, after writing the
        round's PRUNED marker; returns how many objects went. An undecided round is refused
        (its contributions may still be merged)."""
        if self.get_decision(round_index) is None:
            raise Conflict(f"round {round_index} is not decided: its contributions may still "
                           "be merged")
        return self._prune(layout.round_dir(self.experiment, round_index), reason)

    def _prune(self, directory: str, reason: str) -> int:
        payloads = [key for key in self.blobs.list(directory + "/")
                    if key.endswith(layout.PAYLOAD_SUFFIX)]
        if not payloads:
            return 0
        marker = f"{directory}/{layout.PRUNED}"
        if self.blobs.info(marker) is None:
            with contextlib.suppress(PreconditionFailed):   # a concurrent pruner wrote it
                self.blobs.write(marker, _json_bytes({"reason": reason[:500]}), if_generation=0)
        for key in payloads:
            self.blobs.delete(key)      # absent is fine: a concurrent pruner got there first
        return len(payloads)

    def _raise_if_pruned(self, directory: str, what: str) -> None:
        marker = f"{directory}/{layout.PRUNED}"
        if self.blobs.info(marker) is not None:
            record = self._read_json(marker) or {}
            raise Pruned(f"{what} was deleted by retention ({record.get('reason', 'no reason')})")

    def get_retention(self) -> dict | None:
        """How far retention got (written by the syncer), or None before its first pass."""
        try:
            return self._read_json(layout.retention(self.experiment))
        except RejectedArtifact:
            return None   # unreadable: retention starts over, which only re-checks

    def put_retention(self, record: Mapping[str, Any]) -> None:
        self.blobs.write(layout.retention(self.experiment), _json_bytes(record))


def _roster_of(config: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The learner names of a stored experiment config, as `LearnersConfig.learner_names`
    gives them (read from the plain data: a sensor tick cannot afford to parse the whole
    config again); None if they are not there to read."""
    learners = config.get("learners", {})
    if not isinstance(learners, Mapping):
        return None
    names = learners.get("names") or ()
    if isinstance(names, list | tuple) and names and all(isinstance(n, str) for n in names):
        return tuple(names)
    count = learners.get("num_learners", LearnersConfig.num_learners)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_LEARNERS:
        return None
    return tuple(f"learner-{i}" for i in range(count))


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


MAX_TENSORS = 100_000
MAX_TENSOR_RANK = 16     # dimensions of one tensor (models here have at most 4)
_OBJECT_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")


def _check_contribution_manifest(key: str, m: Mapping[str, Any], round_index: int,
                                 learner: str) -> None:
    """Refuse manifests that lie about who and what they are, before reading any payload."""
    def bad(reason: str) -> RejectedArtifact:
        return RejectedArtifact(key, reason)

    if m.get("format") != FORMAT or m.get("kind") != "contribution":
        raise bad(f"unknown format/kind {m.get('format')!r}/{m.get('kind')!r}")
    if m.get("learner") != learner or m.get("round") != round_index:
        raise bad(f"manifest says learner {m.get('learner')!r} round {m.get('round')!r}")
    for field in ("fragment", "base_version", "tokens", "steps", "learner_step"):
        value = m.get(field)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_INT:
            shown = value if not isinstance(value, int) or value.bit_length() < 64 else (
                f"an integer of {value.bit_length()} bits")
            raise bad(f"{field} must be an integer in [0, {MAX_INT}], got {shown!r}")
    clock = m.get("clock")
    if (not isinstance(clock, int | float) or isinstance(clock, bool)
            or not math.isfinite(clock)):
        # json.loads reads NaN, Infinity and 1e400 (inf) as floats.
        raise bad(f"clock must be a finite number, got {str(clock)[:40]}")
    tensors = m.get("tensors")
    if not isinstance(tensors, list) or not tensors:
        raise bad("no tensors")
    if len(tensors) > MAX_TENSORS:
        raise bad(f"{len(tensors)} tensors (at most {MAX_TENSORS})")
    objects = m.get("objects")
    entry = objects.get("delta") if isinstance(objects, Mapping) else None
    if not isinstance(entry, Mapping):
        raise bad("objects.delta must describe the payload object")
    name = entry.get("name")
    if (not isinstance(name, str) or not _OBJECT_NAME.fullmatch(name)):
        raise bad(f"objects.delta.name must be a plain file name, got {str(name)[:80]!r}")
    if not isinstance(entry.get("size"), int) or not isinstance(entry.get("sha256"), str):
        raise bad("objects.delta needs an integer size and a sha256")
    for t in tensors:
        if not isinstance(t, Mapping) or not isinstance(t.get("name"), str):
            raise bad("every tensor must be an object with a name")
        if t.get("encoding") not in ENCODINGS:
            raise bad(f"tensor {t.get('name')!r} has unknown encoding {t.get('encoding')!r}")
        shape = t.get("shape")
        if (not isinstance(shape, list) or len(shape) > MAX_TENSOR_RANK
                or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_INT
                           for d in shape)):
            raise bad(f"tensor {str(t.get('name'))[:80]!r} has a bad shape {str(shape)[:80]}")
        block_size = t.get("block_size")
        if (not isinstance(block_size, int) or isinstance(block_size, bool)
                or not 1 <= block_size <= MAX_INT):
            raise bad(f"tensor {str(t.get('name'))[:80]!r} has a bad block size")
        if not isinstance(t.get("scales"), bool):
            raise bad(f"tensor {str(t.get('name'))[:80]!r}: scales must be true or false")


def set_active_experiment(blobs: BlobStore, experiment: str | None) -> None:
    """Point the sensors at `experiment` (None: no experiment is running)."""
    if experiment is not None:
        check_name("experiment", experiment)
    blobs.write(layout.ACTIVE, _json_bytes({"experiment": experiment}))


def active_experiment(blobs: BlobStore) -> str | None:
    try:
        value = json.loads(blobs.read(layout.ACTIVE))
    except BlobNotFound:
        return None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RejectedArtifact(layout.ACTIVE, f"not valid JSON: {err}") from None
    name = value.get("experiment") if isinstance(value, dict) else None
    return None if name is None else check_name("experiment", name)
