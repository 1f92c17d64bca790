"""The global fragments: committed versions, the pointer to the current one (moved by
compare-and-swap, only after the version is fully committed), and their retention.

Part of `ArtifactStore` (`artifact_store.py`), which composes the record families; keys in
`layout.py`.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from diloco_core.round_records import RecordError
from diloco_core.stored_merge import StoredMerge, as_stored_merge
from resources.store import layout
from resources.store.blobs import PreconditionFailed
from resources.store.store_base import (
    FORMAT,
    Conflict,
    RejectedArtifact,
    StoreBase,
    _json_bytes,
)


@dataclass(frozen=True)
class GlobalFragment:
    fragment: int
    version: int
    params: dict[str, np.ndarray]
    outer_state: Any                 # optax state in the template's structure, or a leaf list
    meta: StoredMerge


class GlobalVersions(StoreBase):
    """Each fragment's committed versions and its current-version pointer."""

    def current_version(self, fragment: int) -> int | None:
        pointer = self._read_json(layout.pointer(self.experiment, fragment))
        return None if pointer is None else int(pointer["version"])

    def versions(self, fragment: int) -> list[int]:
        """The committed versions: those in place (a listing) and the archived ones (every
        version from 1 up to the archive's pointer: only pruned versions are archived, and
        versions below the current one are contiguous). The pointer is asked again after the
        listing: a version deleted under it had been archived before."""
        prefix = layout.fragment_dir(self.experiment, fragment) + "/v"
        live = {int(key[len(prefix):].split("/")[0]) for key in self.blobs.list(prefix)
                if key.endswith("/" + layout.MANIFEST)}
        archive = self.version_archive(fragment)
        return sorted(live | set(range(archive.family.first, archive.through(ask=True))))

    def commit_global(self, fragment: int, version: int, params: Mapping[str, Any],
                      outer_state: Any, meta: StoredMerge | Mapping[str, Any] | None = None,
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
                    "meta": as_stored_merge(meta or {}).to_json()}
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

    def version_meta(self, fragment: int, version: int | None = None) -> StoredMerge | None:
        """The `meta` of a committed version (default: the current one) without reading its
        arrays, or None if there is no such manifest."""
        if version is None:
            version = self.current_version(fragment)
            if version is None:
                return None
        key = f"{layout.version_dir(self.experiment, fragment, version)}/{layout.MANIFEST}"
        manifest = self._read_json(key)
        return None if manifest is None else _stored_meta(key, manifest)

    def find_round_commit(self, fragment: int, round_index: int, version: int,
                          meta: StoredMerge) -> tuple[int, StoredMerge] | None:
        """The committed version of this round, searching back from `version` (whose meta is
        `meta`) while the versions belong to this round or later ones (merges of a fragment
        commit in round order). None when the fragment moved past the round without it."""
        while version > 0:
            committed = meta.round
            if committed == round_index:
                return version, meta
            if not isinstance(committed, int) or committed < round_index:
                return None
            version -= 1
            meta = self.version_meta(fragment, version) or StoredMerge()
        return None

    def next_round_commit(self, fragment: int, round_index: int, current: int,
                          after: int | None = None
                          ) -> tuple[int, int | None, StoredMerge | None]:
        """(below, version, meta): the first committed version of the fragment up to `current`
        that holds this round or a later one (merges of a fragment commit in round order) and
        its meta, or None, None when none does; `below` the version before it, up to which
        every version holds an earlier round (a version whose meta has no round, version 0
        or an unreadable one, counts as earlier).

        `after`, a `below` from the search for an earlier round: the search goes forward from
        it, so a reader going through the rounds in order (the mirror) reads each version
        about once. Without it the search walks back from `current`, as many reads as
        versions since the round (what `find_round_commit` does): fine for a recent round,
        quadratic for a reader catching up on an hour's rounds one walk at a time."""
        def holds_it_or_later(meta: StoredMerge) -> bool:
            return isinstance(meta.round, int) and meta.round >= round_index

        if after is None or after > current:
            version, first = current, None
            while version > 0:
                meta = self.version_meta(fragment, version) or StoredMerge()
                if not holds_it_or_later(meta):
                    break
                first, version = (version, meta), version - 1
            return (version, None, None) if first is None else (version, *first)
        for version in range(after + 1, current + 1):
            meta = self.version_meta(fragment, version) or StoredMerge()
            if holds_it_or_later(meta):
                return version - 1, version, meta
        return current, None, None

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
        key = f"{directory}/{layout.MANIFEST}"
        manifest = self._read_json(key)
        if manifest is None:
            raise KeyError(f"fragment {fragment} version {version} is not committed")
        meta = _stored_meta(key, manifest)
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
        return GlobalFragment(fragment, version, params, outer_state, meta)

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



def _stored_meta(key: str, manifest: Mapping[str, Any]) -> StoredMerge:
    """A version manifest's merge record, validated. One that does not validate (a foreign or
    broken write: only the merge writes them, and it validates first) reads as the merge of
    no round, its reason the refusal, so that every reader skips it and goes on (the merge
    discards such a version at the next commit), instead of failing every tick."""
    try:
        return StoredMerge.from_json(manifest.get("meta") or {})
    except RecordError as err:
        return StoredMerge(reason=f"refused: {key}: {err}"[:4096])
