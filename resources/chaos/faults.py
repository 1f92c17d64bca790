"""Fault injection: the tape's faults, executed where they happen.

- `LearnerFaults` runs inside a learner process: SIGKILL itself, hang, run slower, skew its
  clock, see store errors for a while, or offer a bad contribution (NaN, absurd, wrong shape,
  truncated payload, a pickle instead of arrays).
- `MergeFaults` runs inside a merge run: crash before, during (version written, pointer not
  moved) or after its commit, or see store errors; each fires on the round's first try only.
- `FaultyBlobStore` wraps a blob store with seeded transient errors, timeouts and slow calls.
Dagster restarts are executed by the driver that owns the instance
(`pipelines.commands.demo`, `diloco demo --fault-tape`).

Every fault is recorded in the store (`faults/fired/{id}.json`, write-once) *before* it acts:
that is the audit trail, and what keeps a fault from firing twice (a learner relaunched from a
checkpoint taken before `at_step` reaches that step again).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from diloco_core.contribution import Contribution
from diloco_core.fault_tape import FaultTape, TapeError, tape_from_mapping
from resources.chaos.hostile_records import HostileWriter
from resources.learner.hooks import AfterPut, LearnerHooks
from resources.store import layout
from resources.store.artifact_store import ArtifactStore, RejectedArtifact
from resources.store.blobs import BlobInfo, BlobStore

Log = Callable[[str], None]     # where `load_tape` says why a tape is refused
_logger = logging.getLogger(__name__)


# The bytes pickle.dumps({}, protocol=4) writes (this project never imports pickle): what a
# hostile or confused writer might put where arrays belong.
PICKLED_EMPTY_DICT = b"\x80\x04}\x94."


class InjectedFault(RuntimeError):
    """Raised by an injected crash (a merge run failing at a chosen phase)."""


class InjectedStoreError(ConnectionError):
    """An injected transient store error (what a dropped connection or a 503 looks like)."""


def read_tape_file(path: str, learners: list[str] | None = None) -> FaultTape:
    """A tape from a JSON file, validated; `TapeError` (naming the file or the field) if it
    cannot be read or is invalid."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise TapeError(f"cannot read {path}: {err}") from None
    return tape_from_mapping(data, learners)


def load_tape(store: ArtifactStore, learners: list[str] | None = None, *,
              chaos: bool | None = None, log: Log | None = None) -> FaultTape | None:
    """The experiment's fault tape, validated, if it is a chaos run and has one; else None.

    Honoured only in an experiment launched as a chaos run (`orchestration.chaos` in its
    config; `chaos` when the caller already has the config): a tape found in any other
    experiment is ignored. A tape that cannot be read or is invalid is refused. Either way
    the reason goes to `log` (default: this module's logger) and nothing is raised: the
    sensors, the syncer, merges and learners load it on every tick or start."""
    say = log or _logger.warning
    try:
        data = store.get_fault_tape()
    except RejectedArtifact as err:
        say(f"fault tape refused, no fault is injected: {err}")
        return None
    if data is None:
        return None
    if chaos is None:
        chaos = chaos_run(store)
    if not chaos:
        say(f"fault tape ignored: experiment {store.experiment!r} was not launched as a chaos "
            "run (orchestration.chaos is false in its config)")
        return None
    try:
        return tape_from_mapping(data, learners)
    except TapeError as err:
        say(f"fault tape refused, no fault is injected: "
            f"{layout.fault_tape(store.experiment)}: {err}")
        return None


def chaos_run(store: ArtifactStore) -> bool:
    """Whether the experiment's committed config marks it a chaos run."""
    try:
        config = store.get_config()
    except RejectedArtifact:
        return False
    orchestration = config.get("orchestration") if isinstance(config, dict) else None
    return isinstance(orchestration, dict) and orchestration.get("chaos") is True


class FaultyBlobStore(BlobStore):
    """Seeded store errors around another blob store, while `active()` says so."""

    def __init__(self, inner: BlobStore, seed: Any, rate: float, kinds: list[str],
                 slow_seconds: float, active: Callable[[], bool] = lambda: True):
        self.inner, self.rate, self.kinds, self.slow_seconds = inner, rate, kinds, slow_seconds
        self._rng = random.Random(str(seed))
        self._active = active
        self.injected: dict[str, int] = {}

    def _maybe_fail(self, op: str, key: str) -> None:
        if not self._active() or self._rng.random() >= self.rate:
            return
        kind = self._rng.choice(self.kinds)
        self.injected[kind] = self.injected.get(kind, 0) + 1
        if kind == "transient":
            raise InjectedStoreError(f"injected transient error on {op} {key}")
        time.sleep(self.slow_seconds)
        if kind == "timeout":
            raise TimeoutError(f"injected timeout on {op} {key}")

    def write(self, key: str, data: bytes, *, if_generation: int | None = None) -> BlobInfo:
        self._maybe_fail("write", key)
        return self.inner.write(key, data, if_generation=if_generation)

    def read(self, key: str) -> bytes:
        self._maybe_fail("read", key)
        return self.inner.read(key)

    def info(self, key: str) -> BlobInfo | None:
        self._maybe_fail("info", key)
        return self.inner.info(key)

    def list(self, prefix: str, *, limit: int | None = None) -> list[str]:
        self._maybe_fail("list", prefix)
        return self.inner.list(prefix, limit=limit)

    def delete(self, key: str, *, forget: bool = False) -> None:
        self._maybe_fail("delete", key)
        self.inner.delete(key, forget=forget)

    @property
    def uri(self) -> str:
        return self.inner.uri


class LearnerFaults(LearnerHooks):
    """The tape's faults for one learner process: the hooks its runtime calls."""

    def __init__(self, store: ArtifactStore, tape: FaultTape, learner: str, attempt: int,
                 log: logging.Logger = _logger):
        self.store, self.learner, self.attempt, self.log = store, learner, attempt, log
        self.tape = tape
        self.faults = tape.for_learner(learner)
        self.step = 0
        self._skew = 0.0
        self._fired = {f.get("id") for f in store.fired_faults()}
        self.faulty_blobs: list[FaultyBlobStore] = []
        self.hostile: HostileWriter | None = None

    # ---- what the runtime asks ----------------------------------------------------------------
    def wrap_store(self, store: ArtifactStore) -> ArtifactStore:
        """The store as this learner sees it: with the tape's store-error windows."""
        blobs = store.blobs
        for f in self.faults:
            if f.kind == "store_errors":
                start, end = f.at_step, f.at_step + f.param("steps")  # steps may be inf
                blobs = FaultyBlobStore(blobs, (self.tape.seed, f.id, self.attempt),
                                        float(f.param("rate")), list(f.param("kinds")),
                                        float(f.param("slow_seconds")),
                                        active=lambda s=start, e=end: s <= self.step < e)
                self.faulty_blobs.append(blobs)
        return store if blobs is store.blobs else ArtifactStore(blobs, store.experiment,
                                                                store.max_object_bytes)

    def clock(self) -> float:
        """This learner's idea of the time (skewed by a clock_skew fault)."""
        return time.time() + self._skew

    def slowdown(self, step: int) -> float:
        factor = 1.0
        for f in self.faults:
            if f.kind == "learner_slow" and f.at_step <= step < f.at_step + f.param("steps"):
                factor *= float(f.param("factor"))
        return factor

    def before_step(self, step: int, flush_record: Callable[[str], None]) -> None:
        """Fire what is due at `step` (at most once per fault over all attempts)."""
        self.step = step
        self._hostile_records(step)
        for f in self.faults:
            if f.at_step > step or f.id in self._fired:
                continue
            if f.kind == "learner_slow" and step >= f.at_step + f.param("steps"):
                continue  # a window already over (e.g. rejoined past it): nothing to record
            if not self._fire(f.id, f.kind, step):
                continue
            if f.kind == "learner_kill":
                self.log.warning(f"fault {f.id}: SIGKILL at step {step}")
                flush_record("killed")   # the ledger must know exactly what this process did
                os.kill(os.getpid(), signal.SIGKILL)
            elif f.kind == "learner_hang":
                seconds = float(f.param("seconds"))
                self.log.warning(f"fault {f.id}: hanging at step {step} for {seconds} s")
                _sleep(seconds)
            elif f.kind == "clock_skew":
                self._skew = float(f.param("seconds"))
                self.log.warning(f"fault {f.id}: clock skewed by {self._skew:+.0f} s")
            else:
                self.log.warning(f"fault {f.id}: {f.kind} from step {step}")

    def _hostile_records(self, step: int) -> None:
        """A `hostile_records` fault: one hostile record every `every_steps` steps of its
        window, in every attempt (what a compromised learner keeps doing)."""
        for f in self.faults:
            if f.kind != "hostile_records" or not (
                    f.at_step <= step < f.at_step + f.param("steps")):
                continue
            if (step - f.at_step) % int(f.param("every_steps")):
                continue
            if f.id not in self._fired:
                self._fire(f.id, f.kind, step)
                self.log.warning(f"fault {f.id}: writing hostile records from step {step}")
            if self.hostile is None:
                sync = (self.store.get_config() or {}).get("sync") or {}
                self.hostile = HostileWriter(self.store, self.learner,
                                             int(sync.get("num_fragments", 1)))
            try:
                self.hostile.write_next()
            except Exception as err:  # noqa: BLE001 - the attack failing is not the learner's
                self.log.warning(f"fault {f.id}: a hostile write failed: {err!r}")

    def offer(self, contribution: Contribution, round_index: int
              ) -> tuple[Contribution, AfterPut | None, dict]:
        """A bad contribution, if one is due at this offer: its delta corrupted before it is
        written, or its payload tampered with after; marked `fault` in the offer's record."""
        bad = self.bad_contribution(round_index)
        if bad is None:
            return contribution, None, {}
        if bad in ("nan", "absurd", "wrong_shape"):
            return corrupt_delta(contribution, bad), None, {"fault": bad}

        def after_put(store: ArtifactStore) -> None:
            tamper_payload(store, round_index, self.learner, bad)
        return contribution, after_put, {"fault": bad}

    def bad_contribution(self, round_index: int) -> str | None:
        """The mode of a bad contribution due at this offer, if any: the learner's first offer
        to a round >= `at_round` (it may skip rounds while down or slow). Fires once."""
        for f in self.faults_of("bad_contribution"):
            if (f.at_round <= round_index and f.id not in self._fired
                    and self._fire(f.id, f.kind, self.step, round=round_index)):
                return str(f.param("mode"))
        return None

    def faults_of(self, kind: str):
        return sorted((f for f in self.tape.faults
                       if f.kind == kind and f.learner == self.learner),
                      key=lambda f: f.at_round)

    def _fire(self, fault_id: str, kind: str, step: int, **extra: Any) -> bool:
        self._fired.add(fault_id)
        return self.store.mark_fault_fired(fault_id, {
            "id": fault_id, "kind": kind, "learner": self.learner, "attempt": self.attempt,
            "step": step, "time": time.time(), "pid": os.getpid(), **extra})


def corrupt_delta(contribution: Contribution, mode: str) -> Contribution:
    """A contribution whose values are bad in the way `mode` names (the payload still encodes
    cleanly: the syncer must catch it by looking at the values)."""
    import numpy as np

    from diloco_core.compression import decode, encode

    delta = {}
    for name, enc in contribution.delta.items():
        values = np.asarray(decode(enc), np.float32)
        if mode == "nan":
            values = np.full_like(values, np.nan)
        elif mode == "absurd":
            values = values * 1e6 + 1e3
        elif mode == "wrong_shape":
            values = values.reshape(-1)[: max(values.size - 1, 1)]
        delta[name] = encode(values, enc.encoding, enc.block_size)
    return replace(contribution, delta=delta)


def tamper_payload(store: ArtifactStore, round_index: int, learner: str, mode: str) -> None:
    """After a contribution is committed, damage its payload object in place: truncate it, or
    replace it with a pickle. Its manifest still names the original size and checksum."""
    manifest = store.contribution_manifest(round_index, learner)
    from resources.store import layout

    key = (f"{layout.contribution_dir(store.experiment, round_index, learner)}/"
           f"{manifest.payload.name}")
    if mode == "truncated":
        data = store.blobs.read(key)
        store.blobs.write(key, data[: len(data) // 2])
    elif mode == "pickle":
        # A hostile writer: the manifest is rewritten to vouch for the pickle (size and
        # checksum match), so only the reader's refusal to unpickle stands in the way.
        import json

        from diloco_core.offer_manifest import PayloadObjects
        from resources.store.array_bundle import sha256

        # Padded to the original size (pickle.loads ignores what follows its STOP opcode), so
        # it also passes the reader's size bound and reaches the refusal to parse a non-archive.
        payload = PICKLED_EMPTY_DICT.ljust(manifest.payload.size, b"\0")
        store.blobs.write(key, payload)
        vouched = replace(manifest.payload, size=len(payload), sha256=sha256(payload))
        manifest = replace(manifest, objects=PayloadObjects(vouched))
        directory = layout.contribution_dir(store.experiment, round_index, learner)
        store.blobs.write(f"{directory}/{layout.MANIFEST}",
                          json.dumps(manifest.to_json()).encode())
    else:
        raise ValueError(f"cannot tamper a payload as {mode!r}")


class MergeFaults:
    """The tape's faults for the merge run of one round."""

    def __init__(self, store: ArtifactStore, tape: FaultTape | None, round_index: int,
                 log: logging.Logger = _logger):
        self.store, self.round, self.log = store, round_index, log
        self.crashes = {} if tape is None else {
            f.param("phase"): f for f in tape.at_round("merge_crash", round_index)}
        self.store_errors = [] if tape is None else list(
            tape.at_round("merge_store_errors", round_index))
        self.tape = tape

    def wrap_store(self, store: ArtifactStore) -> ArtifactStore:
        blobs = store.blobs
        for f in self.store_errors:
            if self._fire(f.id, f.kind, {}):
                blobs = FaultyBlobStore(blobs, (self.tape.seed, f.id), float(f.param("rate")),
                                        list(f.param("kinds")), float(f.param("slow_seconds")))
        return store if blobs is store.blobs else ArtifactStore(blobs, store.experiment,
                                                                store.max_object_bytes)

    def at(self, phase: str) -> None:
        f = self.crashes.get(phase)
        if f is not None and self._fire(f.id, f.kind, {"phase": phase}):
            self.log.warning(f"fault {f.id}: merge of round {self.round} crashes {phase}")
            raise InjectedFault(f"injected crash of the round {self.round} merge at {phase} "
                                f"({f.id})")

    def _fire(self, fault_id: str, kind: str, extra: dict) -> bool:
        return self.store.mark_fault_fired(fault_id, {
            "id": fault_id, "kind": kind, "round": self.round, "time": time.time(),
            "pid": os.getpid(), **extra})


class SyncerFaults:
    """The tape's faults for the syncer service: as it is about to merge a round, SIGKILL
    itself (`syncer_kill`) or stop deciding, merging and renewing its lease for a while
    (`syncer_hang`: the sensor fallback takes over, the supervisor ends the hung run). A crash
    mid-commit is the merge's own `merge_crash`, which the syncer's merges honour too."""

    def __init__(self, store: ArtifactStore, tape: FaultTape, log: logging.Logger = _logger):
        self.store, self.tape, self.log = store, tape, log

    def merge(self, round_index: int) -> MergeFaults:
        return MergeFaults(self.store, self.tape, round_index, self.log)

    def before_merge(self, round_index: int) -> None:
        for f in self.tape.at_round("syncer_kill", round_index):
            if self._fire(f, round_index):
                self.log.warning(f"fault {f.id}: the syncer kills itself before merging round "
                                 f"{round_index}")
                os.kill(os.getpid(), signal.SIGKILL)
        for f in self.tape.at_round("syncer_hang", round_index):
            if self._fire(f, round_index):
                seconds = float(f.param("seconds"))
                self.log.warning(f"fault {f.id}: the syncer hangs for {seconds}s before "
                                 f"merging round {round_index}")
                _sleep(seconds)

    def _fire(self, f, round_index: int) -> bool:
        return self.store.mark_fault_fired(f.id, {"id": f.id, "kind": f.kind,
                                                  "round": round_index, "time": time.time(),
                                                  "pid": os.getpid()})


def syncer_faults(store: ArtifactStore, log: logging.Logger = _logger) -> SyncerFaults | None:
    """A chaos run's faults for its syncer (the hooks `SyncerService` takes); None when the
    experiment has no fault tape."""
    tape = load_tape(store, log=log.warning)
    return None if tape is None else SyncerFaults(store, tape, log)


def learner_faults(store: ArtifactStore, learner: str, attempt: int,
                   log: logging.Logger = _logger) -> LearnerFaults | None:
    """A chaos run's faults for one learner process (the hooks `LearnerRuntime` takes); None
    when the experiment has no fault tape."""
    tape = load_tape(store, log=log.warning)
    return None if tape is None else LearnerFaults(store, tape, learner, attempt, log)


def _sleep(seconds: float) -> None:
    # In slices, so a forwarded SIGINT (Dagster terminating the run) ends an infinite hang.
    deadline = time.monotonic() + seconds if math.isfinite(seconds) else math.inf
    while time.monotonic() < deadline:
        time.sleep(min(1.0, max(deadline - time.monotonic(), 0.0)))
