"""Who may write where in the store: each learner's write rules, and the Cloud Storage IAM
bindings that enforce them on a bucket.

A learner writes only its own records: everything under `experiments/{exp}/learners/{name}/`
(heartbeat, attempt records and ledger segments, Orbax checkpoints) and its contributions,
`experiments/{exp}/rounds/r…/contributions/{name}/`; in a chaos run (an experiment with a fault
tape) also the record of a fault it fired, `experiments/{exp}/faults/fired/`. It reads
everything (the global versions, round records, config, its peers' checkpoints for a rejoin).
The control plane (the syncer service, Dagster's run workers: merges, `train`, `stop`, the
summary) writes the rest: global versions and pointers, round records and decisions, evals,
the lease, config, the tape, `ACTIVE`, `STOP`, `FINISHED`.

The rules exist twice, from one description (`LearnerRules`): as a key predicate
(`allows`, what the tests check against the keys a real learner process writes) and as the
Common Expression Language condition of an IAM role binding (`condition`), which Cloud Storage
evaluates on every object request. A contribution's directory is not a prefix of its own
(rounds come first in the key), so that rule uses the `extract` function of IAM conditions:
the path segment after the first `/contributions/` must be the learner's name. `extract` is
not anchored: it looks at the whole object name, bucket and store prefix included, so a store
whose bucket or prefix has a `contributions` segment is refused (its first `/contributions/`
would be the prefix's, and a prefix like `contributions/learner-0` would let learner-0 write
every round's decision); experiment and learner names cannot be `contributions` (reserved).
"""

import re
from dataclasses import dataclass

from resources.store import layout
from resources.store.names import check_name

# What may appear inside a quoted CEL string here: a bucket, an object prefix, names. Checked,
# never escaped: a value that needs escaping is refused (a quote would end the string and let
# the rest of the value widen the condition).
_SAFE = re.compile(r"[A-Za-z0-9._/-]*")
CONTRIBUTIONS_MARKER = "/contributions/"


def _safe(what: str, value: str) -> str:
    if not _SAFE.fullmatch(value) or ".." in value:
        raise ValueError(f"{what} {value!r}: only letters, digits and . _ / - may appear in "
                         "an IAM condition here")
    return value


@dataclass(frozen=True)
class LearnerRules:
    """Where one learner of one experiment may write, as keys relative to the store root."""

    experiment: str
    learner: str
    chaos: bool = False        # the experiment has a fault tape: fired-fault records too

    def __post_init__(self):
        check_name("experiment", self.experiment)
        check_name("learner", self.learner)

    @property
    def own_prefix(self) -> str:
        return layout.heartbeat(self.experiment, self.learner).rsplit("/", 1)[0] + "/"

    @property
    def rounds_prefix(self) -> str:
        return layout.experiment(self.experiment) + "/rounds/"

    @property
    def fired_prefix(self) -> str:
        return layout.fired_prefix(self.experiment)

    def allows(self, key: str) -> bool:
        """Whether this learner may create, overwrite or delete the object at `key`; the same
        decision as `condition` (with `extract` taking the first `/contributions/`: in `key`,
        since `condition` refuses a bucket or prefix holding one)."""
        if key.startswith(self.own_prefix):
            return True
        if key.startswith(self.rounds_prefix) and CONTRIBUTIONS_MARKER in key:
            rest = key.split(CONTRIBUTIONS_MARKER, 1)[1]
            if "/" in rest and rest.split("/", 1)[0] == self.learner:
                return True
        return self.chaos and key.startswith(self.fired_prefix)

    def condition(self, bucket: str, prefix: str = "") -> str:
        """The IAM condition expression for the store at gs://{bucket}/{prefix}."""
        root = f"projects/_/buckets/{_safe('bucket', bucket)}/objects/"
        if prefix.strip("/"):
            root += _safe("prefix", prefix.strip("/")) + "/"
        if CONTRIBUTIONS_MARKER in root:
            where = (f"bucket {bucket!r}" if CONTRIBUTIONS_MARKER in f"/{bucket}/"
                     else f"store prefix {prefix!r}")
            raise ValueError(
                f"{where}: a 'contributions' path segment cannot be expressed in the IAM "
                f"condition (its extract() takes the first '{CONTRIBUTIONS_MARKER}' of the "
                "object name, which would be this one and not a round's): use a store "
                "location without that segment")
        own = f'resource.name.startsWith("{root}{self.own_prefix}")'
        contributions = (f'(resource.name.startsWith("{root}{self.rounds_prefix}") && '
                         f'resource.name.extract("{CONTRIBUTIONS_MARKER}{{learner}}/") == '
                         f'"{self.learner}")')
        parts = [own, contributions]
        if self.chaos:
            parts.append(f'resource.name.startsWith("{root}{self.fired_prefix}")')
        return " || ".join(parts)


def bucket_bindings(bucket: str, prefix: str, experiment: str, members: dict[str, str],
                    control_members: list[str], chaos: bool = False) -> dict:
    """An IAM policy (version 3, conditions need it) for the store bucket: every learner and
    the control plane may read; each learner may write only under its rules; the control
    plane may write everything. `members` maps learner name -> IAM member (one identity per
    learner: a condition cannot tell two learners sharing one service account apart)."""
    if len(set(members.values())) != len(members):
        raise ValueError("each learner needs its own IAM member (service account)")
    bindings = [{"role": "roles/storage.objectViewer",
                 "members": sorted({*members.values(), *control_members})},
                {"role": "roles/storage.objectUser", "members": sorted(control_members)}]
    for learner, member in sorted(members.items()):
        rules = LearnerRules(experiment, learner, chaos)
        bindings.append({"role": "roles/storage.objectUser", "members": [member],
                         "condition": {
                             "title": f"diloco-{experiment}-{learner}"[:100],
                             "description": f"{learner} writes only its own records and "
                                            f"contributions in experiment {experiment}",
                             "expression": rules.condition(bucket, prefix)}})
    return {"version": 3, "bindings": bindings}
