"""What a compromised learner can write within its own write rules, for the hostile-learner soak.

Under the deployment's IAM conditions (`resources.store.access`) a learner writes only its own
records (heartbeat, attempt records, checkpoints) and its own contributions. Inside those it can
write anything: this module writes the malformed and adversarial versions (not JSON, absurd
nesting, integers of thousands of digits, wrong types, manifests that lie, payloads that
explode), raw, around the store's own checks. The fault kind `hostile_records` has a learner
write one every few steps while it trains honestly; everything that reads them (the sensors,
the syncer, the merge, the supervisor, the token ledger, the run summary) must refuse each with
a reason and carry on.

Offer attacks go to the round open for offers, once it opens and before this learner offered
to it (offers planted in rounds not yet open are refused as planted and would reach nothing
else), built from its own last honest offer of that fragment and then damaged, so that they
reach the checks deep in the merge rather than the first "wrong fragment" refusal: manifests
that lie, payloads of the wrong dtype, a trillion claimed steps on a huge delta, replays of its
own offers, a copy of a peer's, fields only an observer reads. Its own honest offer to such a
round is then refused by the write-once store, which costs it only its own tokens. Claim
attacks are well-formed heartbeats of its own that claim absurd progress or step times.
A forged `attempt` in its
own heartbeat would fence only itself out; forging another learner's is what the IAM rules
prevent, so it is not among the attacks. What was written, by kind, is kept in the learner's
own prefix (`hostile.json`) for the soak's figures.
"""

import hashlib
import io
import json
import time
import zipfile
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from diloco_core.offer_manifest import OfferManifest, PayloadObjects
from resources.store import layout
from resources.store.artifact_store import ArtifactStore

HOSTILE_LOG = "hostile.json"   # in the learner's own prefix


def npz(members: dict[str, bytes], deflate: bool = False, pad_to: int = 0) -> bytes:
    """A zip archive of raw members, as `.npz` files are (nothing checks them on the way in);
    `pad_to`: an archive comment makes it at least that many bytes, so that it passes the
    store's first check (the manifest's arrays must fit in the object) and reaches the next."""
    buffer = io.BytesIO()
    method = zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED
    with zipfile.ZipFile(buffer, "w", method) as archive:
        for name, body in members.items():
            archive.writestr(name, body)
        archive.comment = bytes(min(65535, max(0, pad_to - buffer.tell())))
    return buffer.getvalue()


def _declared(m: OfferManifest) -> int:
    """The array bytes a manifest declares (what the object must at least hold)."""
    return sum(np.dtype(np.uint16 if d == "bfloat16" else d).itemsize
               * int(np.prod(m.payload.shapes[k])) for k, d in m.payload.dtypes.items())


def huge_npy_header() -> bytes:
    """A valid `.npy` header declaring 10^13 uint16 values, and no data."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buffer, {"descr": "<u2", "fortran_order": False, "shape": (10 ** 13,)})
    return buffer.getvalue()


# put(manifest, payload): stores a payload and returns the manifest vouching for it (size and
# checksum), so only deeper checks can refuse it.
Put = Callable[[OfferManifest, bytes], OfferManifest]
# The honest manifest, put -> what to write: a manifest, or raw JSON no manifest could hold.
Attack = Callable[[OfferManifest, Put], OfferManifest | dict]


def _members(m: OfferManifest) -> list[str]:
    return list(m.payload.dtypes)


def _with_payload(m: OfferManifest, **changes) -> OfferManifest:
    """The manifest with its payload object's fields changed (built, not validated: the
    reader's checks are what the attack is for)."""
    return replace(m, objects=PayloadObjects(replace(m.payload, **changes)))


def _same_bytes_other_dtype(m: OfferManifest, put: Put) -> OfferManifest:
    """Every array re-declared as another dtype of the same byte count (float64 for float32
    values, float32 for bf16 ones, floats for int8 codes): sizes, checksums and the bundle's
    own dtype checks all agree; only what the bytes mean is wrong."""
    dtypes, shapes, members = {}, {}, {}
    for name, dtype in m.payload.dtypes.items():
        nbytes = np.dtype(np.uint16 if dtype == "bfloat16" else dtype).itemsize * int(
            np.prod(m.payload.shapes[name]))
        other = next(d for d in ("float64", "float32", "float16", "uint8")
                     if d != dtype and nbytes % np.dtype(d).itemsize == 0)
        values = np.zeros(nbytes // np.dtype(other).itemsize, dtype=other)
        buffer = io.BytesIO()
        np.lib.format.write_array(buffer, values, allow_pickle=False)
        members[f"{name}.npy"] = buffer.getvalue()
        dtypes[name], shapes[name] = other, list(values.shape)
    return put(_with_payload(m, dtypes=dtypes, shapes=shapes), npz(members))


CONTRIBUTION_ATTACKS: dict[str, Attack] = {
    "right size, wrong dtype": _same_bytes_other_dtype,
    "tensors is a string": lambda m, put: {**m.to_json(), "tensors": "abc"},
    "objects is a list": lambda m, put: {**m.to_json(), "objects": []},
    "object name climbs": lambda m, put: _with_payload(m, name="../../CURRENT"),
    "tokens of 400 digits": lambda m, put: replace(m, tokens=10 ** 400),
    "more tokens than its steps": lambda m, put: replace(m, tokens=m.tokens * 1000),
    # Each padded to the size the manifest declares, so that the first size check passes and
    # the one each is meant for is reached: the header's shape, the member's inflation, the
    # parse.
    "npy header of 10^13 values": lambda m, put: put(m, npz(
        {f"{k}.npy": huge_npy_header() for k in _members(m)}, pad_to=_declared(m))),
    "manifest declares 10^13 values": lambda m, put: put(
        _with_payload(m, shapes={k: (10 ** 13,) for k in m.payload.shapes}),
        npz({f"{k}.npy": huge_npy_header() for k in _members(m)})),
    # One member that inflates to 16 MiB from ~16 KiB (a learner builds it in memory).
    "zip bomb": lambda m, put: put(m, npz(
        {f"{_members(m)[0]}.npy": huge_npy_header()[:10] + bytes(16 * 2 ** 20)},
        deflate=True, pad_to=_declared(m))),
    "pickle instead of arrays": lambda m, put: put(
        m, b"\x80\x04}\x94." + bytes(_declared(m))),
}

# Raw bytes for the learner's own heartbeat or for an attempt record of its own.
RECORD_ATTACKS: dict[str, tuple[str, Callable[[str], bytes]]] = {
    "heartbeat not JSON": ("heartbeat", lambda name: b"\xff\xfe{not json"),
    "heartbeat nested 100,000 deep": ("heartbeat", lambda name: b"[" * 100_000 + b"]" * 100_000),
    "heartbeat step of 5,000 digits": ("heartbeat", lambda name: (
        b'{"learner": "' + name.encode() + b'", "status": "training", "time": 1, "step": '
        + b"9" * 5000 + b"}")),
    "heartbeat of wrong types": ("heartbeat", lambda name: json.dumps(
        {"learner": name, "attempt": "zero", "status": 5, "time": "now",
         "tokens_total": "lots", "versions": {"a": 1}}).encode()),
    "attempt record not JSON": ("attempt", lambda name: b"\x00\x01 not a record"),
    "attempt record that lies": ("attempt", lambda name: json.dumps(
        {"learner": "someone-else", "attempt": 99999, "status": "done", "final": True,
         "ledger": {"processed": "all", "claims": "many"}}).encode()),
}

def _claim(**fields) -> Callable[[dict], dict]:
    return lambda beat: {**beat, **fields}


# Well-formed heartbeats of its own that claim what it never did (its last heartbeat, with
# fields changed): nothing refuses these on reading, the control plane must not believe them.
CLAIM_ATTACKS: dict[str, Callable[[dict], dict]] = {
    "heartbeat claims 2^62 tokens": _claim(tokens_total=2 ** 62, step=2 ** 62 // 1024),
    "heartbeat claims 1e300 seconds a step": _claim(compute_seconds=1e300),
    "heartbeat claims 1.7e308 seconds a step": _claim(compute_seconds=1.7e308),
}


def _scaled_payload(m: OfferManifest, payload: bytes, factor: float) -> bytes:
    """The template's arrays with every float value (bf16 and fp32 values, intN scales)
    multiplied by `factor`: a fresh payload (no replay) that moves the model `factor` times
    further than the honest one it came from."""
    import ml_dtypes

    members, dtypes = {}, dict(m.payload.dtypes)
    with np.load(io.BytesIO(payload), allow_pickle=False) as arrays:
        for name in arrays.files:
            value = arrays[name]
            if dtypes[name] == "bfloat16":
                value = (value.view(ml_dtypes.bfloat16).astype(np.float32) * factor).astype(
                    ml_dtypes.bfloat16).view(np.uint16)
            elif dtypes[name] in ("float32", "float16", "float64"):
                value = value * value.dtype.type(factor)
            buffer = io.BytesIO()
            np.lib.format.write_array(buffer, np.ascontiguousarray(value), allow_pickle=False)
            members[f"{name}.npy"] = buffer.getvalue()
    return npz(members)


def _trillion_steps(m: OfferManifest, put: Put, payload: bytes,
                    current_version: int) -> OfferManifest:
    """Claims 10^12 steps (tokens to match: weight 1.0 against its peers' 0.0 under
    tokens^2 / steps) on a delta 10^6 times its honest one, on the current version."""
    per_step = max(1, m.tokens // max(1, m.steps))
    return put(replace(m, steps=10 ** 12, tokens=10 ** 12 * per_step,
                       base_version=current_version), _scaled_payload(m, payload, 1e6))


def _replay_on_version_0(m: OfferManifest, put: Put, payload: bytes,
                         current_version: int) -> OfferManifest:
    """A fresh payload (its honest delta, slightly changed) on version 0: under the "global"
    anchor the merge adds Theta_current - Theta_0, pulling the fragment back to its start."""
    return put(replace(m, base_version=0), _scaled_payload(m, payload, 1.01))


# Attacks on the round open for offers (the only ones that reach a decision: offers planted
# before their round opened are refused as such): (manifest, put, payload, current version of
# the fragment) -> the manifest to write.
OPEN_ROUND_ATTACKS = {
    "a trillion steps and a huge delta": _trillion_steps,
    "fresh payload on version 0": _replay_on_version_0,
    "replay of its own old offer": lambda m, put, payload, v: put(
        replace(m, base_version=v), payload),
}

# Manifest fields only an observer reads (the sensor's description of an offer, the Dagster
# mirror, the metadata plots): written into its own offer to the open round.
FIELD_ATTACKS = {
    "train loss of 400 digits": lambda m: replace(m, extra={"train_loss": 10 ** 400}),
    "fragment -1": lambda m: replace(m, fragment=-1),
    "fragment 10^300": lambda m: replace(m, fragment=10 ** 300),
    "extra is a list": lambda m: {**m.to_json(), "extra": [1, 2, 3]},
}

# Offer attacks in the order they are tried: those on what the merge believes (counters,
# bases, replays, copies, dtypes) first, so a short soak reaches them.
KINDS = (tuple(RECORD_ATTACKS) + tuple(CLAIM_ATTACKS) + tuple(OPEN_ROUND_ATTACKS)
         + ("copy of a peer's offer",) + tuple(FIELD_ATTACKS) + tuple(CONTRIBUTION_ATTACKS))
# The attacks written as (or into) an offer, in the order the writer tries them.
OFFER_KINDS = KINDS[len(RECORD_ATTACKS) + len(CLAIM_ATTACKS):]
HEARTBEAT_KINDS = tuple(RECORD_ATTACKS) + tuple(CLAIM_ATTACKS)
FORGED_ATTEMPT = 99999     # the attempt number the forged attempt records use


class HostileWriter:
    """Writes one hostile record per call, cycling through every kind, for one learner."""

    def __init__(self, store: ArtifactStore, learner: str, num_fragments: int):
        self.store, self.learner, self.num_fragments = store, learner, num_fragments
        self.written: dict[str, int] = {}
        self.targets: list[dict] = []       # planted contributions: round, kind
        self.skipped = 0          # contribution attacks with nowhere to go (no offer to copy
                                  # yet, or the next two rounds of its fragment planted)
        self._calls = 0
        self.last_kind: str | None = None
        self._record = 0          # next record attack
        self._contribution = 0    # next contribution attack: moves on only once planted
        # A relaunched attempt carries on from the previous one's log: the same counts, and
        # its planted rounds are never taken for honest offers to copy.
        previous = read_log(store, learner) or {}
        if isinstance(previous.get("written"), dict) and isinstance(previous.get("planted"), list):
            self.written = {k: int(v) for k, v in previous["written"].items() if k in KINDS}
            self.targets = [t for t in previous["planted"] if isinstance(t, dict)
                            and isinstance(t.get("round"), int) and t.get("kind") in KINDS]
            self.skipped = int(previous.get("skipped", 0))
            self._contribution = len(self.targets)
            self._record = sum(n for k, n in self.written.items() if k in HEARTBEAT_KINDS)

    def write_next(self) -> str | None:
        """Write the next record and offer attacks in turn; returns the kind, or None when an
        offer attack had nowhere to go (it is tried again next time)."""
        self._calls += 1
        self.last_kind = None
        if self._calls % 2:
            kind = HEARTBEAT_KINDS[self._record % len(HEARTBEAT_KINDS)]
            self._record += 1
        else:
            kind = OFFER_KINDS[self._contribution % len(OFFER_KINDS)]
        if kind in RECORD_ATTACKS:
            where, body = RECORD_ATTACKS[kind]
            key = (layout.heartbeat(self.store.experiment, self.learner) if where == "heartbeat"
                   else layout.attempt(self.store.experiment, self.learner, FORGED_ATTEMPT))
            self.store.blobs.write(key, body(self.learner))
        elif kind in CLAIM_ATTACKS:
            key = layout.heartbeat(self.store.experiment, self.learner)
            try:
                beat = json.loads(self.store.blobs.read(key))
            except Exception:  # noqa: BLE001 - its last one was an attack: start from nothing
                beat = {}
            if not isinstance(beat, dict) or "status" not in beat:
                beat = {"learner": self.learner, "status": "training", "time": time.time()}
            self.store.blobs.write(key, json.dumps(CLAIM_ATTACKS[kind](beat)).encode())
        elif not self._plant(kind):
            self.skipped += 1
            return None
        else:
            self._contribution += 1
        self.written[kind] = self.written.get(kind, 0) + 1
        self.last_kind = kind
        self._log()
        return kind

    # ---- offers --------------------------------------------------------------------------------
    def _open_round(self) -> int | None:
        """The round open for offers now, if this learner has not offered to it."""
        latest = self.store.latest_open_round()
        latest = None if latest is None else latest.round
        if not isinstance(latest, int) or self.store.get_decision(latest) is not None:
            return None
        if self.learner in self.store.list_contributions(latest) or self._taken(latest):
            return None
        return latest

    def _template(self, fragment: int, before: int
                  ) -> tuple[int, OfferManifest, bytes] | None:
        """This learner's newest honest offer of `fragment` before round `before`: (round,
        manifest, payload)."""
        for r in range(before - 1, max(-1, before - 16 * self.num_fragments), -1):
            if r % self.num_fragments != fragment or self._taken(r):
                continue      # another fragment, or one of its own planted offers
            try:
                m = self.store.contribution_manifest(r, self.learner)
            except Exception:  # noqa: BLE001 - damaged: look further back
                continue
            if m is None:
                continue
            directory = layout.contribution_dir(self.store.experiment, r, self.learner)
            try:
                payload = self.store.blobs.read(f"{directory}/{m.payload.name}")
            except Exception:  # noqa: BLE001 - damaged or gone: look further back
                continue
            return r, m, payload
        return None

    def _plant(self, kind: str) -> bool:
        """Write attack `kind` as this learner's offer to the open round (its own honest offer
        to that round is then refused by the write-once store: that costs only its own
        tokens). Offers planted before a round opens are refused as planted, so this waits
        for a round to open that it has not offered to yet."""
        target = self._open_round()
        if target is None:
            return False
        directory = layout.contribution_dir(self.store.experiment, target, self.learner)

        put = _putter(self.store, directory)
        if kind == "copy of a peer's offer":
            peers = [n for n in self.store.list_contributions(target) if n != self.learner]
            if not peers:
                return False
            try:
                manifest = self.store.contribution_manifest(target, peers[0])
            except Exception:  # noqa: BLE001 - a peer's damaged offer: nothing to copy
                return False
            if manifest is None:
                return False
            source = layout.contribution_dir(self.store.experiment, target, peers[0])
            data = self.store.blobs.read(f"{source}/{manifest.payload.name}")
            hostile = put(replace(manifest, learner=self.learner), data)
        else:
            fragment = target % self.num_fragments
            found = self._template(fragment, target)
            if found is None:
                return False
            _, manifest, payload = found
            current = self.store.current_version(fragment) or 0
            # On the current version, as a learner that received it would offer: what reaches
            # the checks is the damage, not a stale base.
            manifest = replace(manifest, round=target, base_version=current)
            if kind in OPEN_ROUND_ATTACKS:
                hostile = OPEN_ROUND_ATTACKS[kind](manifest, put, payload, current)
            elif kind in FIELD_ATTACKS:
                hostile = FIELD_ATTACKS[kind](put(manifest, payload))
            else:
                self.store.blobs.write(f"{directory}/{manifest.payload.name}", payload)
                hostile = CONTRIBUTION_ATTACKS[kind](manifest, put)
        _write_manifest(self.store, directory, hostile)
        self.targets.append({"round": target, "kind": kind})
        return True

    def _taken(self, round_index: int) -> bool:
        return any(t["round"] == round_index for t in self.targets)

    def _log(self) -> None:
        key = f"{layout.heartbeat(self.store.experiment, self.learner).rsplit('/', 1)[0]}/" \
              f"{HOSTILE_LOG}"
        self.store.blobs.write(key, json.dumps(
            {"learner": self.learner, "time": time.time(), "written": self.written,
             "skipped": self.skipped, "planted": self.targets}).encode())


def damage_offer(store: ArtifactStore, round_index: int, learner: str, kind: str) -> None:
    """Rewrite `learner`'s committed offer to `round_index` with the contribution attack
    `kind`, raw, around the store's write-once rule (as a learner owning its prefix can)."""
    directory = layout.contribution_dir(store.experiment, round_index, learner)
    manifest = store.contribution_manifest(round_index, learner)
    _write_manifest(store, directory,
                    CONTRIBUTION_ATTACKS[kind](manifest, _putter(store, directory)))


def _putter(store: ArtifactStore, directory: str) -> Put:
    """`put` for offers under `directory`: the payload written beside the manifest, and the
    manifest vouching for it."""
    def put(m: OfferManifest, data: bytes) -> OfferManifest:
        store.blobs.write(f"{directory}/{m.payload.name}", data)
        return _with_payload(m, size=len(data), sha256=hashlib.sha256(data).hexdigest())
    return put


def _write_manifest(store: ArtifactStore, directory: str, hostile: OfferManifest | dict) -> None:
    """Raw, around the store's checks (as a learner owning its prefix can)."""
    body = hostile if isinstance(hostile, dict) else hostile.to_json()
    store.blobs.write(f"{directory}/{layout.MANIFEST}", json.dumps(body).encode())


def read_log(store: ArtifactStore, learner: str) -> dict | None:
    """What a hostile learner wrote, by kind (for the soak's figures)."""
    key = f"{layout.heartbeat(store.experiment, learner).rsplit('/', 1)[0]}/{HOSTILE_LOG}"
    try:
        return json.loads(store.blobs.read(key))
    except Exception:  # noqa: BLE001 - absent or damaged: no figures
        return None
