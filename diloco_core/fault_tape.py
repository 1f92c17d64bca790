"""Fault tapes: deterministic, replayable schedules of injected faults.

A tape is plain data (JSON round trip, validated field by field) so the same faults can be
replayed against another system (e.g. synchronous DiLoCo) or after a fix. Triggers are in the
units each fault lives in, never in wall-clock time where that would make replays diverge:
- learner faults fire at a learner's inner step (`at_step`), the same step in every replay;
- contribution, merge and syncer faults fire at a round (`at_round`; a syncer fault as the
  syncer service is about to merge that round);
- Dagster restarts fire `at_seconds` after launch (they are about the orchestrator, not the
  algorithm; the driver executes them);
- capacity changes (a learner joins or leaves: scavenged compute coming and going) take effect
  once round `at_round` is open (the learner supervisor applies them).
Every fault has an id; the injector records a fault as fired before it acts, so a learner
relaunched from a checkpoint below `at_step` does not die at the same step forever.
"""

import math
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

LEARNER_KINDS = ("learner_kill", "learner_hang", "learner_slow", "clock_skew", "store_errors",
                 "hostile_records")
ROUND_KINDS = ("bad_contribution", "merge_crash", "merge_store_errors", "syncer_kill",
               "syncer_hang")
DAGSTER_KINDS = ("daemon_restart", "webserver_restart", "instance_restart")
CAPACITY_KINDS = ("learner_join", "learner_leave")
FAULT_KINDS = LEARNER_KINDS + ROUND_KINDS + DAGSTER_KINDS + CAPACITY_KINDS

BAD_CONTRIBUTIONS = ("nan", "truncated", "absurd", "pickle", "wrong_shape")
MERGE_PHASES = ("before_commit", "during_commit", "after_commit")
STORE_ERROR_KINDS = ("transient", "timeout", "slow")

# Parameters each kind accepts, with their defaults.
_PARAMS: dict[str, dict[str, Any]] = {
    "learner_kill": {},
    "learner_hang": {"seconds": math.inf},          # inf: until the supervisor ends it
    "learner_slow": {"factor": 4.0, "steps": 50},   # steps take `factor` times longer
    "clock_skew": {"seconds": 3600.0},              # the learner's clock is off by this much
    "store_errors": {"rate": 0.2, "steps": 50, "kinds": list(STORE_ERROR_KINDS),
                     "slow_seconds": 0.5},
    # Besides training honestly, the learner writes one malformed or adversarial record every
    # `every_steps` steps for `steps` steps, wherever its own write rules let it (its records,
    # its contributions to coming rounds): `resources.chaos.hostile_records`.
    "hostile_records": {"every_steps": 2, "steps": math.inf},
    "bad_contribution": {"mode": "nan"},
    "merge_crash": {"phase": "before_commit"},
    "merge_store_errors": {"rate": 0.3, "kinds": ["transient", "timeout"],
                           "slow_seconds": 0.5},
    "syncer_kill": {},                              # SIGKILL the syncer service
    "syncer_hang": {"seconds": math.inf},           # inf: until the supervisor ends it
    "daemon_restart": {},
    "webserver_restart": {},
    "instance_restart": {},
    "learner_join": {},     # a standby (or departed) learner gets compute and is launched
    "learner_leave": {},    # a learner's compute is reclaimed: it offers what it has, exits
}


# Parameters that may be "inf": a hang until the supervisor ends it, a window to the run's end.
_UNBOUNDED = (("learner_hang", "seconds"), ("learner_slow", "steps"), ("store_errors", "steps"),
              ("syncer_hang", "seconds"), ("hostile_records", "steps"))

_ID = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")   # ids become store keys


class TapeError(ValueError):
    """A tape that cannot be replayed as written; the message names the field."""


@dataclass(frozen=True)
class Fault:
    id: str
    kind: str
    learner: str | None = None     # learner faults and bad contributions
    at_step: int | None = None     # learner faults
    at_round: int | None = None    # contribution and merge faults
    at_seconds: float | None = None  # Dagster restarts
    params: Mapping[str, Any] = field(default_factory=dict)

    def param(self, name: str) -> Any:
        return self.params.get(name, _PARAMS[self.kind][name])

    def to_mapping(self) -> dict:
        out = {"id": self.id, "kind": self.kind}
        for key in ("learner", "at_step", "at_round", "at_seconds"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.params:
            out["params"] = {k: ("inf" if v == math.inf else v) for k, v in self.params.items()}
        return out


@dataclass(frozen=True)
class FaultTape:
    seed: int | None
    faults: tuple[Fault, ...]

    def for_learner(self, learner: str) -> tuple[Fault, ...]:
        return tuple(f for f in self.faults if f.learner == learner and f.kind in LEARNER_KINDS)

    def at_round(self, kind: str, round_index: int, learner: str | None = None
                 ) -> tuple[Fault, ...]:
        return tuple(f for f in self.faults if f.kind == kind and f.at_round == round_index
                     and (learner is None or f.learner == learner))

    def capacity_changes(self) -> tuple[Fault, ...]:
        """learner_join / learner_leave, in the order they take effect (round, then tape)."""
        return tuple(sorted((f for f in self.faults if f.kind in CAPACITY_KINDS),
                            key=lambda f: f.at_round))

    def dagster_faults(self) -> tuple[Fault, ...]:
        return tuple(sorted((f for f in self.faults if f.kind in DAGSTER_KINDS),
                            key=lambda f: f.at_seconds))

    def count(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for f in self.faults:
            counts[f.kind] = counts.get(f.kind, 0) + 1
        return counts

    def to_mapping(self) -> dict:
        return {"seed": self.seed, "faults": [f.to_mapping() for f in self.faults]}


def tape_from_mapping(data: Mapping[str, Any], learners: Sequence[str] | None = None
                      ) -> FaultTape:
    """Validate a tape (e.g. parsed from JSON). `learners`, when given, are the experiment's
    learner names; a fault naming another learner is an error, not a silent no-op."""
    if not isinstance(data, Mapping):
        raise TapeError("fault tape: expected an object with 'faults'")
    unknown = set(data) - {"seed", "faults"}
    if unknown:
        raise TapeError(f"fault tape: unknown field(s) {sorted(unknown)}")
    seed = data.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise TapeError(f"fault tape: seed must be an integer, got {seed!r}")
    raw = data.get("faults", [])
    if not isinstance(raw, list):
        raise TapeError("fault tape: faults must be a list")
    faults, ids, crashes = [], set(), set()
    for i, item in enumerate(raw):
        fault = _fault(f"faults[{i}]", i, item, learners)
        if fault.id in ids:
            raise TapeError(f"faults[{i}].id: duplicate id {fault.id!r}")
        ids.add(fault.id)
        if fault.kind == "merge_crash":
            # A merge run crashes at a phase once; a second crash there could never fire.
            where = (fault.at_round, fault.param("phase"))
            if where in crashes:
                raise TapeError(f"faults[{i}]: a second merge_crash at round {where[0]}, "
                                f"phase {where[1]}")
            crashes.add(where)
        faults.append(fault)
    return FaultTape(seed, tuple(faults))


def _fault(where: str, index: int, item: Any, learners: Sequence[str] | None) -> Fault:
    if not isinstance(item, Mapping):
        raise TapeError(f"{where}: expected an object")
    unknown = set(item) - {"id", "kind", "learner", "at_step", "at_round", "at_seconds",
                           "params"}
    if unknown:
        raise TapeError(f"{where}: unknown field(s) {sorted(unknown)}")
    kind = item.get("kind")
    if kind not in FAULT_KINDS:
        raise TapeError(f"{where}.kind: {kind!r} is not one of {', '.join(FAULT_KINDS)}")
    fid = item.get("id", f"f{index:03d}-{kind}")
    if not isinstance(fid, str) or _ID.fullmatch(fid) is None:
        raise TapeError(f"{where}.id: use 1-63 characters of a-z, 0-9, '-' and '_', got "
                        f"{fid!r}")
    learner = item.get("learner")
    needs_learner = (kind in LEARNER_KINDS or kind in CAPACITY_KINDS
                     or kind == "bad_contribution")
    if needs_learner:
        if not isinstance(learner, str):
            raise TapeError(f"{where}.learner: required for {kind}")
        if learners is not None and learner not in learners:
            raise TapeError(f"{where}.learner: {learner!r} is not a learner of this experiment "
                            f"({', '.join(learners)})")
    elif learner is not None:
        raise TapeError(f"{where}.learner: {kind} does not take a learner")
    trigger = {"at_step": LEARNER_KINDS, "at_round": ROUND_KINDS + CAPACITY_KINDS,
               "at_seconds": DAGSTER_KINDS}
    values: dict[str, Any] = {}
    for key, kinds in trigger.items():
        value = item.get(key)
        if kind in kinds:
            number = int if key != "at_seconds" else (int, float)
            if (not isinstance(value, number) or isinstance(value, bool)
                    or not math.isfinite(value) or value < 0):
                raise TapeError(f"{where}.{key}: {kind} needs a number >= 0, got {value!r}")
            values[key] = value
        elif value is not None:
            raise TapeError(f"{where}.{key}: {kind} is not triggered by {key}")
    raw = item.get("params")
    raw = {} if raw is None else raw
    if not isinstance(raw, Mapping):
        raise TapeError(f"{where}.params: a mapping of parameter names to values, got "
                        f"{type(raw).__name__}")
    params = dict(raw)
    allowed = _PARAMS[kind]
    for name, value in params.items():
        if name not in allowed:
            raise TapeError(f"{where}.params.{name}: {kind} takes "
                            f"{', '.join(allowed) or 'no parameters'}")
        if value == "inf":
            if (kind, name) not in _UNBOUNDED:
                raise TapeError(f"{where}.params.{name}: only "
                                f"{', '.join(f'{k}.{n}' for k, n in _UNBOUNDED)} may be \"inf\"")
            params[name] = value = math.inf
        _check_param(f"{where}.params.{name}", kind, name, value)
    return Fault(fid, kind, learner, params=params, **values)


def _check_param(where: str, kind: str, name: str, value: Any) -> None:
    if name == "mode" and value not in BAD_CONTRIBUTIONS:
        raise TapeError(f"{where}: {value!r} is not one of {', '.join(BAD_CONTRIBUTIONS)}")
    if name == "phase" and value not in MERGE_PHASES:
        raise TapeError(f"{where}: {value!r} is not one of {', '.join(MERGE_PHASES)}")
    if name == "kinds" and (not isinstance(value, list) or not value
            or any(k not in STORE_ERROR_KINDS for k in value)):
        raise TapeError(f"{where}: a non-empty list of {', '.join(STORE_ERROR_KINDS)}")
    if name == "rate" and (isinstance(value, bool) or not isinstance(value, int | float)
                           or not 0 <= value <= 1):
        raise TapeError(f"{where}: a fraction in [0, 1], got {value!r}")
    if name == "seconds" and kind == "clock_skew":
        # A clock may be behind as well as ahead.
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(
                value):
            raise TapeError(f"{where}: a finite number of seconds, got {value!r}")
        return
    if name == "every_steps" and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
        raise TapeError(f"{where}: a whole number of steps >= 1, got {value!r}")
    if name in ("seconds", "slow_seconds", "factor", "steps"):
        if (not isinstance(value, int | float) or isinstance(value, bool) or value < 0
                or math.isnan(value) or (math.isinf(value) and name in ("slow_seconds",
                                                                        "factor"))):
            raise TapeError(f"{where}: a finite number >= 0, got {value!r}")
        if name == "steps" and not (isinstance(value, int) or math.isinf(value)):
            raise TapeError(f"{where}: a whole number of steps, got {value!r}")
        if name == "factor" and value < 1:
            raise TapeError(f"{where}: a slowdown factor >= 1, got {value!r}")


def kill_loop_tape(seed: int, learners: Sequence[str], steps: int, kills: int,
                   min_gap_steps: int, first_step: int = 0,
                   restarts: Sequence[tuple[str, float]] = ()) -> FaultTape:
    """The soak's random kill/restart loop as a tape: `kills` SIGKILLs spread over learners
    (uniformly at random, seeded) at steps in [first_step, steps), at least `min_gap_steps`
    apart on any one learner, plus the given Dagster restarts (kind, at_seconds)."""
    if not learners:
        raise TapeError("kill loop: no learners to kill")
    if min_gap_steps < 1:
        raise TapeError(f"kill loop: min_gap_steps must be >= 1, got {min_gap_steps}")
    if kills and not 0 <= first_step < steps:
        raise TapeError(f"kill loop: no steps in [first_step={first_step}, steps={steps})")
    for kind, _ in restarts:
        if kind not in DAGSTER_KINDS:
            raise TapeError(f"kill loop: restart kind {kind!r} is not one of "
                            f"{', '.join(DAGSTER_KINDS)}")
    rng = random.Random(seed)
    chosen: dict[str, list[int]] = {name: [] for name in learners}
    attempts = 0
    while sum(map(len, chosen.values())) < kills:
        attempts += 1
        if attempts > 100 * max(kills, 1):
            raise TapeError(f"cannot place {kills} kills {min_gap_steps} steps apart in "
                            f"{steps - first_step} steps of {len(learners)} learners")
        name = rng.choice(list(learners))
        step = rng.randrange(first_step, steps)
        if all(abs(step - s) >= min_gap_steps for s in chosen[name]):
            chosen[name].append(step)
    faults = [Fault(f"kill-{name}-{step}", "learner_kill", name, at_step=step)
              for name, steps_ in chosen.items() for step in sorted(steps_)]
    faults.sort(key=lambda f: (f.at_step, f.learner))
    faults += [Fault(f"{kind}-{i}", kind, at_seconds=float(at))
               for i, (kind, at) in enumerate(restarts)]
    return FaultTape(seed, tuple(faults))
