"""Records beyond retention, compacted: one object per block of rounds (or of versions).

Retention deletes a round's arrays and keeps its records (the open record, the decision, the
not-merged record, each offer's manifest, the PRUNED marker): about twenty objects a round
that nothing deletes, 50 million a month at a round a second, and a listing of `rounds/` that
never stops growing; and so for each global version (its manifest and PRUNED marker). Once
every round of a block (`BLOCK_ROUNDS`) has been pruned, the syncer packs the block's records
into one compressed object, `rounds/archive/b{first}.json.gz` (each record's exact bytes, so a
decision's digest of a manifest still matches it), moves the `rounds/ARCHIVED` pointer past
the block, and only then deletes the records it packed. A fragment's versions go the same way
under `global/f{p}/` (`Family`); version 0, the initial parameters, is never pruned and stays.

Readers do not change: `StoreBase` reads a round's (a version's) record from its block once
the pointer covers it. A reader that found a record absent, or listed a round's offers, while the
pointer was behind asks the pointer again: the records are deleted only after the pointer
moved, so if the pointer still does not cover the round, the read saw them all.

The block is the syncer's own record but is read like any other: bounded before and while
it is inflated, its structure checked, nothing evaluated. A learner's late write into an
archived round lands in the live store and is never read (the block answers for the round).
Only the experiment's own learners' manifests are packed (what `list_contributions` shows
of anything else is junk a foreign writer left; it is deleted with the rest).

A block may also carry a digest of its rounds, a value per round that the archiver's owner
computes while the round's records are still in place (`RecordArchiver(digest=...)`; the
token ledger's fates of the round's offers, `pipelines/token_ledger.py`), so that a reader
that wants only that does not parse every record again. It is an accelerator: the records are
in the block whatever the digest says, and a block without one (or with one its reader
refuses) is read record by record.
"""

import gzip
import json
import re
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from resources.store import layout
from resources.store.blobs import (
    BlobInfo,
    BlobNotFound,
    BlobStore,
    ListingTooLong,
    PreconditionFailed,
)
from resources.store.fan_out import fan_out

BLOCK_ROUNDS = 64
FORMAT = 1
MAX_BLOCK_BYTES = 64 * 2**20         # inflated; a block of 64 rounds of 16 learners is ~4 MB
MAX_POINTER_BYTES = 4096
MAX_OBJECTS_LISTED = 4096            # under one round's directory, whoever wrote them
_CACHED_BLOCKS = 2                   # a reader walks rounds in order: the block it is in, and one


class BadBlock(ValueError):
    """An archive block that cannot be used; the message says why."""


def block_of(index: int) -> int:
    return index - index % BLOCK_ROUNDS


@dataclass(frozen=True)
class Family:
    """Numbered directories archived together: `{directory}/{letter}{index:08d}/...`, the
    pointer and the blocks beside them. `first`: the lowest index ever archived."""

    directory: str
    letter: str
    first: int = 0

    @classmethod
    def rounds(cls, experiment: str) -> "Family":
        return cls(layout.rounds_dir(experiment), "r")

    @classmethod
    def versions(cls, experiment: str, fragment: int) -> "Family":
        return cls(layout.fragment_dir(experiment, fragment), "v", first=1)

    @property
    def pointer(self) -> str:
        return f"{self.directory}/ARCHIVED"

    def block(self, first: int) -> str:
        return f"{self.directory}/archive/b{first:08d}.json.gz"

    def entry(self, index: int) -> str:
        """The directory of one round (version), relative to `directory`."""
        return f"{self.letter}{index:08d}"

    @property
    def pattern(self) -> re.Pattern:
        return re.compile(self.letter + r"(\d{8})/(.+)")


class RecordArchive:
    """The reader's side: which rounds (versions) are archived (the pointer, cached and asked
    again when a read needs it) and their records (the last blocks read, decoded)."""

    def __init__(self, blobs: BlobStore, experiment: str, family: Family):
        self.blobs, self.experiment, self.family = blobs, experiment, family
        self._prefix = family.directory + "/"
        self._pattern = family.pattern
        self._through: int | None = None   # rounds below it are archived (the pointer, as
        #                                      last read; None: not read yet)
        self._blocks: OrderedDict[int, Block] = OrderedDict()
        self._blocks_lock = threading.Lock()    # the store reads on several threads (`each`)
        # Set in the process that moves the pointer (the syncer's `RecordArchiver`): its cached
        # pointer is the pointer, so its reads never ask again (none on its hot path).
        self.owned = False

    def index_of(self, key: str) -> tuple[int, str] | None:
        """(round or version, key inside its directory) for a key of this family's records."""
        if not key.startswith(self._prefix):
            return None
        match = self._pattern.fullmatch(key[len(self._prefix):])
        return None if match is None else (int(match.group(1)), match.group(2))

    def holds(self, round_index: int, *, ask: bool = False) -> bool:
        """Whether the round's (version's) records live in its block; `ask`: read the pointer
        first unless the cached one already covers it."""
        if round_index < self.family.first:
            return False
        through = self.through()
        if ask and round_index >= through:
            through = self.through(ask=True)
        return round_index < through

    def through(self, *, ask: bool = False) -> int:
        """Every index below it (from `family.first`) is archived. Read once before the first
        answer: a record found in place is trusted only for an index the pointer did not
        cover then (a write into an archived round is junk); `ask`: read again."""
        if self._through is None or (ask and not self.owned):
            self._through = max(self._through or 0, self.pointer()["through"])
        return self._through

    def pointer(self) -> dict:
        """{"through": rounds below it archived, "cleaned": rounds below it deleted live};
        an absent or malformed pointer reads as nothing archived."""
        try:
            data = self.blobs.read(self.family.pointer)
            raw = json.loads(data) if len(data) <= MAX_POINTER_BYTES else None
        except (BlobNotFound, ValueError, RecursionError):
            return {"through": 0, "cleaned": 0}
        through, cleaned = (raw.get("through"), raw.get("cleaned")) if isinstance(
            raw, dict) else (None, None)
        if not (_count(through) and through % BLOCK_ROUNDS == 0):
            return {"through": 0, "cleaned": 0}
        return {"through": through, "cleaned": cleaned if _count(cleaned) else 0}

    def objects(self, round_index: int) -> dict[str, bytes]:
        """The archived records of one round, by their key inside the round's directory."""
        return _inside(self.family, round_index, self._block(block_of(round_index)).objects)

    def digest(self, first: int) -> dict[int, Any] | None:
        """The digest of the block starting at `first`: round -> the value its archiver
        computed (JSON, unchecked beyond its shape: its reader checks it), or None for a block
        packed without one."""
        return self._block(first).digest

    def _block(self, first: int) -> "Block":
        with self._blocks_lock:
            block = self._blocks.get(first)
        if block is None:
            key = self.family.block(first)
            try:
                data = self.blobs.read(key)
            except BlobNotFound:
                raise BadBlock(f"{key}: missing, and the rounds it holds are archived") from None
            block = read_block(data, self.experiment, self.family, first)
        with self._blocks_lock:
            self._blocks[first] = block
            self._blocks.move_to_end(first)
            while len(self._blocks) > _CACHED_BLOCKS:
                self._blocks.popitem(last=False)
        return block

    def read(self, key: str) -> bytes:
        round_index, inner = self.index_of(key)
        try:
            return self.objects(round_index)[inner]
        except KeyError:
            raise BlobNotFound(key) from None


@dataclass(frozen=True)
class Block:
    objects: dict[str, bytes]          # key inside the family's directory -> record bytes
    digest: dict[int, Any] | None      # round (version) -> its digest; None: packed without


def encode_block(experiment: str, family: Family, first: int,
                 objects: dict[str, bytes], digest: dict[int, Any] | None = None) -> bytes:
    """The block object: every record's bytes kept exactly (latin-1 maps bytes to characters one
    to one), gzip-compressed (mtime 0: the same records make the same bytes, so a retried
    write of a block finds its own), and the digest of its rounds when there is one."""
    body = {"format": FORMAT, "experiment": experiment, "directory": family.directory,
            "first": first, "rounds": BLOCK_ROUNDS,
            "objects": {k: v.decode("latin-1") for k, v in sorted(objects.items())}}
    if digest is not None:
        body["digest"] = {str(index): value for index, value in sorted(digest.items())}
    return gzip.compress(json.dumps(body, sort_keys=True).encode(), mtime=0)


def read_block(data: bytes, experiment: str, family: Family, first: int) -> Block:
    """The records of a block and its digest, checked: `BadBlock` says what is wrong."""
    inflater = zlib.decompressobj(wbits=31)      # gzip framing
    try:
        raw = inflater.decompress(data, MAX_BLOCK_BYTES)
    except zlib.error as err:
        raise BadBlock(f"block b{first:08d}: not gzip data ({err})") from None
    if inflater.unconsumed_tail:
        raise BadBlock(f"block b{first:08d}: inflates past {MAX_BLOCK_BYTES} bytes")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise BadBlock(f"block b{first:08d}: not valid JSON ({str(err)[:100]})") from None
    expected = {"format": FORMAT, "experiment": experiment, "directory": family.directory,
                "first": first, "rounds": BLOCK_ROUNDS}
    if not isinstance(body, dict) or any(body.get(k) != v for k, v in expected.items()):
        raise BadBlock(f"block b{first:08d}: not the block of {family.entry(first)}-"
                       f"{family.entry(first + BLOCK_ROUNDS - 1)} of {family.directory}")
    objects = body.get("objects")
    if not isinstance(objects, dict):
        raise BadBlock(f"block b{first:08d}: objects must be a mapping")
    out, pattern = {}, family.pattern     # compiled once, not per entry
    for key, value in objects.items():
        match = pattern.fullmatch(key)
        if match is None or not first <= int(match.group(1)) < first + BLOCK_ROUNDS \
                or not isinstance(value, str):
            raise BadBlock(f"block b{first:08d}: entry {key[:80]!r} is not a record of its "
                           "rounds")
        try:
            out[key] = value.encode("latin-1")
        except UnicodeEncodeError:
            raise BadBlock(f"block b{first:08d}: entry {key[:80]!r} is not bytes") from None
    return Block(out, _digest(body.get("digest"), first))


def _digest(raw: Any, first: int) -> dict[int, Any] | None:
    """A block's digest: one entry for each of its rounds, or None (absent, or not that shape:
    the records answer instead)."""
    if not isinstance(raw, dict) or len(raw) != BLOCK_ROUNDS:
        return None
    wanted = {str(index): index for index in range(first, first + BLOCK_ROUNDS)}
    if set(raw) != set(wanted):
        return None
    return {wanted[k]: v for k, v in raw.items()}


def _inside(family: Family, index: int, records: dict[str, bytes]) -> dict[str, bytes]:
    """One round's (version's) records among a block's, by their key inside its directory."""
    head = family.entry(index) + "/"
    return {k[len(head):]: v for k, v in records.items() if k.startswith(head)}


class PackedRecords(BlobStore):
    """One round's records as its archiver packs them (key inside the round's directory ->
    bytes), read-only, at their keys in `directory`: a store over it answers a digest's reads
    with the same checks as the records in place, from the bytes in hand, with no read of the
    store (M + 3 a round otherwise)."""

    def __init__(self, directory: str, records: dict[str, bytes]):
        self._objects = {f"{directory}/{k}": v for k, v in records.items()}

    def read(self, key: str) -> bytes:
        try:
            return self._objects[key]
        except KeyError:
            raise BlobNotFound(key) from None

    def info(self, key: str) -> BlobInfo | None:
        data = self._objects.get(key)
        return None if data is None else BlobInfo(key, len(data), 1)

    def list(self, prefix: str, *, limit: int | None = None) -> list[str]:
        keys = sorted(k for k in self._objects if k.startswith(prefix))
        if limit is not None and len(keys) > limit:
            raise ListingTooLong(prefix, limit)
        return keys

    def write(self, key: str, data: bytes, *, if_generation: int | None = None) -> BlobInfo:
        raise PermissionError(f"packed records are read-only: {key}")

    def delete(self, key: str, *, forget: bool = False) -> None:
        raise PermissionError(f"packed records are read-only: {key}")

    @property
    def uri(self) -> str:
        return "packed:"


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class RecordArchiver:
    """The syncer's side: packs each block of pruned rounds, moves the pointer, deletes what it
    packed, a bounded number of rounds per call (`step`), carrying on from the pointer after a
    relaunch. Packing reads every record again: a relaunch midway re-reads the block."""

    def __init__(self, archive: RecordArchive, learners: Iterable[str] = (),
                 digest: Callable[[int, dict[str, bytes]], Any] | None = None):
        """`archive`: the reader of the store this process reads through, which from now on
        takes its pointer from here. `digest(index, records)`: the block's digest entry of a
        round, given the records packed for it (keys inside its directory), computed before
        they are deleted; None from it leaves the block without a digest."""
        self.archive, self.blobs, self.experiment = archive, archive.blobs, archive.experiment
        self.family = archive.family
        self.learners = frozenset(learners)
        pointer = archive.pointer()
        self.through, self.cleaned = pointer["through"], min(pointer["cleaned"],
                                                             pointer["through"])
        self.cleaned = max(self.cleaned, self.family.first)      # version 0 stays
        archive.owned, archive._through = True, self.through
        self._packing = max(self.through, self.family.first)   # next to read into `_packed`
        self._packed: dict[str, bytes] = {}
        self._digest_of = digest
        self._digests: dict[int, Any] | None = {} if digest is not None else None

    def step(self, pruned_below: int, budget: int) -> int:
        """Work on at most `budget` rounds (reading one, or deleting one, each counts) given
        that every round below `pruned_below` has been pruned; returns objects deleted."""
        deleted, cleaned = 0, self.cleaned
        while budget > 0:
            if self.cleaned < self.through:
                deleted += self._clean(self.cleaned)
                self.cleaned += 1
            elif self._packing < self.through + BLOCK_ROUNDS <= pruned_below:
                records = self._collect(self._packing)
                self._packed.update(records)
                if self._digests is not None:
                    self._digest_round(self._packing, records)
                self._packing += 1
            elif self._packing == self.through + BLOCK_ROUNDS:
                self._seal()
            else:
                break
            budget -= 1
        if self.cleaned != cleaned:
            self._write_pointer()
        return deleted

    def _digest_round(self, index: int, records: dict[str, bytes]) -> None:
        entry = self._digest_of(index, _inside(self.family, index, records))
        if entry is None:
            self._digests = None      # this block goes without one
        else:
            self._digests[index] = entry

    def _directory(self, index: int) -> str:
        return f"{self.family.directory}/{self.family.entry(index)}/"

    def _keys(self, round_index: int) -> list[str]:
        directory = self._directory(round_index)
        try:
            return self.blobs.list(directory, limit=MAX_OBJECTS_LISTED)
        except ListingTooLong:
            # Junk past the bound: the records are still found by name; the junk stays.
            names = [directory + layout.MANIFEST, directory + layout.PRUNED]
            if self.family.letter == "r":
                names += [layout.decision(self.experiment, round_index),
                          layout.round_outcome(self.experiment, round_index),
                          layout.round_open(self.experiment, round_index)]
            names += [f"{directory}contributions/{learner}/{layout.MANIFEST}"
                      for learner in sorted(self.learners)]
            return [key for key in names if self.blobs.info(key) is not None]

    def _collect(self, round_index: int) -> dict[str, bytes]:
        directory = self._directory(round_index)
        wanted = []
        for key in self._keys(round_index):
            inner = key[len(directory):]
            parts = inner.split("/")
            if inner.endswith(layout.PAYLOAD_SUFFIX) or parts[0] == "contributions" and not (
                    len(parts) == 3 and parts[1] in self.learners
                    and parts[2] == layout.MANIFEST):
                continue
            wanted.append(key)

        def read(key: str) -> bytes | None:
            try:
                return self.blobs.read(key)
            except BlobNotFound:
                return None

        found = fan_out(read, wanted, self.blobs.read_concurrency)
        return {f"{self.family.entry(round_index)}/{key[len(directory):]}": data
                for key, data in zip(wanted, found, strict=True) if data is not None}

    def _seal(self) -> None:
        """Write the block (create-only: a relaunch that packed it again finds the same
        bytes, or keeps the block an earlier syncer wrote), then move the pointer."""
        first = self.through
        key = self.family.block(first)
        data = encode_block(self.experiment, self.family, first, self._packed, self._digests)
        try:
            self.blobs.write(key, data, if_generation=0)
        except PreconditionFailed:
            # Packed before by a syncer that stopped short of the pointer: keep it if usable;
            # replace one that is not (every record it should hold is still in place).
            info = self.blobs.info(key)
            try:
                read_block(self.blobs.read(key), self.experiment, self.family, first)
            except (BadBlock, BlobNotFound):
                self.blobs.write(key, data, if_generation=0 if info is None else info.generation)
        self.through += BLOCK_ROUNDS
        self._packed = {}
        self._digests = {} if self._digest_of is not None else None
        self._write_pointer()
        self.archive._through = self.through    # before a record of the block is deleted

    def _write_pointer(self) -> None:
        self.blobs.write(self.family.pointer, json.dumps(
            {"through": self.through, "cleaned": self.cleaned}).encode())

    def _clean(self, round_index: int) -> int:
        """Delete a packed round's live objects: records, and anything else left there. Each
        key is forgotten: a round archived is never written again."""
        keys = self._keys(round_index)
        fan_out(lambda key: self.blobs.delete(key, forget=True), keys,
                self.blobs.read_concurrency)
        return len(keys)
