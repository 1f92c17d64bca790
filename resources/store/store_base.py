"""The artifact store's primitives: write-once objects, bounded and validated JSON records,
checksummed array bundles, the limits on what a reader accepts, and the errors every record
family raises.

Part of `ArtifactStore` (`artifact_store.py`), which composes the record families; keys in
`layout.py`.
"""

import contextlib
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import numpy as np

from diloco_core.config import MAX_LEARNERS, LearnersConfig
from diloco_core.round_records import RecordError, _Record
from resources.store import layout
from resources.store.array_bundle import BadBundle, decode_bundle, encode_bundle, sha256
from resources.store.blobs import BlobNotFound, BlobStore, PreconditionFailed
from resources.store.fan_out import fan_out
from resources.store.names import check_name
from resources.store.record_archive import BadBlock, Family, RecordArchive
from resources.store.summary_records import M, SummaryRecordError, parse_record

FORMAT = 1
DEFAULT_MAX_OBJECT_BYTES = 4 * 2**30
# JSON records (manifests, decisions, heartbeats, summaries) are small; a larger one is refused
# before it is parsed.
MAX_RECORD_BYTES = 16 * 2**20

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


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, indent=1, allow_nan=False).encode()


class StoreBase:
    """One experiment in a blob store: the primitives every record family builds on."""

    def __init__(self, blobs: BlobStore, experiment: str,
                 max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES):
        self.blobs = blobs
        self.experiment = check_name("experiment", experiment)
        self.max_object_bytes = max_object_bytes
        self._sealed: set[tuple[str, int, int]] = set()   # claim segments this process wrote
        self._roster: tuple[str, ...] | None = None        # the config's learners, once read
        # Prefixes whose listing went past its bound -> why (logged once per prefix).
        self.listing_refusals: dict[str, str] = {}
        # Records beyond retention, packed into blocks (`record_archive.py`): the rounds', and
        # each fragment's versions' (made when first asked for).
        self.archive = RecordArchive(blobs, self.experiment, Family.rounds(self.experiment))
        self._version_archives: dict[int, RecordArchive] = {}
        self._global_prefix = layout.experiment(self.experiment) + "/global/f"

    def version_archive(self, fragment: int) -> RecordArchive:
        if fragment not in self._version_archives:
            self._version_archives[fragment] = RecordArchive(
                self.blobs, self.experiment, Family.versions(self.experiment, fragment))
        return self._version_archives[fragment]

    def _archive_of(self, key: str) -> tuple[RecordArchive, int] | None:
        """The archive that may hold `key` and its round (version), None for other keys."""
        archive = self.archive
        if key.startswith(self._global_prefix):
            fragment = key[len(self._global_prefix):].split("/", 1)[0]
            if not (len(fragment) == 3 and fragment.isdigit()):
                return None
            archive = self.version_archive(int(fragment))
        where = archive.index_of(key)
        return None if where is None else (archive, where[0])

    def _read_bytes(self, key: str) -> bytes:
        """The object's bytes, from its archive block once its round (version) is archived;
        `BlobNotFound` if absent."""
        where = self._archive_of(key)
        if where is not None and where[0].holds(where[1]):
            return self._archived(where[0], key)
        try:
            return self.blobs.read(key)
        except BlobNotFound:
            # Archived (and deleted) since the pointer was last read?
            if where is not None and where[0].holds(where[1], ask=True):
                return self._archived(where[0], key)
            raise

    def _exists(self, key: str) -> bool:
        where = self._archive_of(key)
        if where is None or not where[0].holds(where[1]):
            if self.blobs.info(key) is not None:
                return True
            if where is None or not where[0].holds(where[1], ask=True):
                return False
        try:
            self._archived(where[0], key)
        except BlobNotFound:
            return False
        return True

    @staticmethod
    def _archived(archive: RecordArchive, key: str) -> bytes:
        try:
            return archive.read(key)
        except BadBlock as err:
            raise RejectedArtifact(key, f"its archive block is unusable: {err}") from None

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
            data = self._read_bytes(key)
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

    def _read_typed(self, key: str, kind: type[_Record]):
        """The record at `key` validated into `kind`, None if absent; `RejectedArtifact`
        names the field that is wrong."""
        raw = self._read_json(key)
        if raw is None:
            return None
        try:
            return kind.from_json(raw)
        except RecordError as err:
            raise RejectedArtifact(key, str(err)) from None

    def _read_model(self, key: str, kind: type[M]) -> M | None:
        """`_read_typed` for the pydantic records of a run's results (`summary_records`)."""
        raw = self._read_json(key)
        if raw is None:
            return None
        try:
            return parse_record(kind, raw)
        except SummaryRecordError as err:
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

    def each(self, read: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """`[read(item) for item in items]` with as many reads in flight as the backend serves
        (`fan_out`): the control plane's per-learner reads, not one round trip after another."""
        return fan_out(read, items, self.blobs.read_concurrency)

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
            # Absent is fine: a concurrent pruner got there first. A payload is named by its
            # content's hash, so nothing writes the key again with other bytes: forgotten.
            self.blobs.delete(key, forget=True)
        return len(payloads)

    def _raise_if_pruned(self, directory: str, what: str) -> None:
        marker = f"{directory}/{layout.PRUNED}"
        if self._exists(marker):
            record = self._read_json(marker) or {}
            raise Pruned(f"{what} was deleted by retention ({record.get('reason', 'no reason')})")


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
