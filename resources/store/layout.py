"""Where everything lives, per experiment (keys relative to the store root).

    experiments/{exp}/config.json                                  experiment config (write-once)
    experiments/{exp}/global/f{p:03d}/CURRENT                      pointer to the current version
    experiments/{exp}/global/f{p:03d}/v{ver:08d}/manifest.json     commit point of that version
    experiments/{exp}/global/f{p:03d}/v{ver:08d}/params-{sha}.npz  fragment values
    experiments/{exp}/global/f{p:03d}/v{ver:08d}/outer-{sha}.npz   outer-optimizer state
    experiments/{exp}/global/f{p:03d}/v{ver:08d}/PRUNED            its arrays were deleted
    experiments/{exp}/global/f{p:03d}/archive/b{first:08d}.json.gz  pruned versions' records,
    experiments/{exp}/global/f{p:03d}/ARCHIVED                       compacted (as rounds')
    experiments/{exp}/rounds/r{round:08d}/contributions/{learner}/manifest.json   commit point
    experiments/{exp}/rounds/r{round:08d}/contributions/{learner}/delta-{sha}.npz
    experiments/{exp}/rounds/OPEN                                  the newest opened round (moves)
    experiments/{exp}/rounds/r{round:08d}/open.json                when and why it opened
    experiments/{exp}/rounds/r{round:08d}/decision.json            the quorum decision record
    experiments/{exp}/rounds/r{round:08d}/PRUNED                   its contributions' arrays were
                                                                   deleted (manifests stay)
    experiments/{exp}/rounds/archive/b{first:08d}.json.gz         the records of a block of rounds
                                                                   beyond retention, compacted
                                                                   (`record_archive.py`)
    experiments/{exp}/rounds/ARCHIVED                              rounds below it: read from
                                                                   their block (moves)
    experiments/{exp}/evals/r{round:08d}.json                      held-out eval of that round
    experiments/{exp}/learners/{learner}/checkpoints/              Orbax CheckpointManager
    experiments/{exp}/learners/{learner}/heartbeat.json            its latest progress (moves)
    experiments/{exp}/learners/{learner}/attempts/a{n:05d}.json    that process's token ledger
    experiments/{exp}/faults/tape.json                             the fault tape (write-once)
    experiments/{exp}/faults/fired/{fault}.json                    a fault that fired (write-once)
    experiments/{exp}/STOP                                         token budget reached
    experiments/{exp}/STOP_REQUEST                                 an operator asked to stop
    experiments/{exp}/CAPACITY                                     learners absent now, every
                                                                   join and leave (moves)
    experiments/{exp}/BUDGET                                       a raised token budget (moves)
    experiments/{exp}/FORECAST                                     where each learner pauses
                                                                   near the budget (moves)
    experiments/{exp}/syncer/LEASE                                 who may decide and merge (moves)
    experiments/{exp}/syncer/RETENTION                             how far retention got (moves)
    experiments/{exp}/FINISHED                                     final rounds done (write-once)
    experiments/{exp}/summary.json                                 the run summary

    ACTIVE                                                         the experiment sensors drive

Payload objects carry their SHA-256 prefix in their name, so every object is written once under
a unique name; the manifest is written last and is what makes a write visible.
"""

import inspect
import re

from resources.store.names import check_name, join_key, reserve

MANIFEST = "manifest.json"
# Written before retention deletes the arrays (`*.npz`) under a version or a round directory,
# so that a reader tells "pruned by retention" from "never written" or "lost".
PRUNED = "PRUNED"
PAYLOAD_SUFFIX = ".npz"


def experiment(exp: str) -> str:
    return join_key("experiments", check_name("experiment", exp))


def config(exp: str) -> str:
    return f"{experiment(exp)}/config.json"


def fragment_dir(exp: str, fragment: int) -> str:
    return f"{experiment(exp)}/global/f{_index(fragment, 'fragment'):03d}"


def pointer(exp: str, fragment: int) -> str:
    return f"{fragment_dir(exp, fragment)}/CURRENT"


def version_dir(exp: str, fragment: int, version: int) -> str:
    return f"{fragment_dir(exp, fragment)}/v{_index(version, 'version'):08d}"


def round_dir(exp: str, round_index: int) -> str:
    return f"{experiment(exp)}/rounds/r{_index(round_index, 'round'):08d}"


def contributions_prefix(exp: str, round_index: int) -> str:
    return f"{round_dir(exp, round_index)}/contributions/"


def contribution_dir(exp: str, round_index: int, learner: str) -> str:
    return contributions_prefix(exp, round_index) + check_name("learner", learner)


def decision(exp: str, round_index: int) -> str:
    return f"{round_dir(exp, round_index)}/decision.json"


def round_outcome(exp: str, round_index: int) -> str:
    """Why a decided round committed nothing (every contribution refused, non-finite)."""
    return f"{round_dir(exp, round_index)}/not_merged.json"


def evaluation(exp: str, round_index: int) -> str:
    return f"{experiment(exp)}/evals/r{_index(round_index, 'round'):08d}.json"


def checkpoints(exp: str, learner: str) -> str:
    return f"{experiment(exp)}/learners/{check_name('learner', learner)}/checkpoints"


def summary(exp: str) -> str:
    return f"{experiment(exp)}/summary.json"


def _index(value: int, kind: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{kind} must be an integer >= 0, got {value!r}")
    return value


def rounds_dir(exp: str) -> str:
    return f"{experiment(exp)}/rounds"


def open_pointer(exp: str) -> str:
    return f"{experiment(exp)}/rounds/OPEN"


def round_open(exp: str, round_index: int) -> str:
    return f"{round_dir(exp, round_index)}/open.json"


def heartbeat(exp: str, learner: str) -> str:
    return f"{experiment(exp)}/learners/{check_name('learner', learner)}/heartbeat.json"


def attempts_prefix(exp: str, learner: str) -> str:
    return f"{experiment(exp)}/learners/{check_name('learner', learner)}/attempts/"


def attempt(exp: str, learner: str, attempt_index: int) -> str:
    return f"{attempts_prefix(exp, learner)}a{_index(attempt_index, 'attempt'):05d}.json"


def claim_segment(exp: str, learner: str, attempt_index: int, segment: int) -> str:
    """A sealed, write-once run of one attempt's ledger claims (see `put_attempt_record`)."""
    return (f"{experiment(exp)}/learners/{check_name('learner', learner)}/claims/"
            f"a{_index(attempt_index, 'attempt'):05d}/s{_index(segment, 'segment'):06d}.json")


def fault_tape(exp: str) -> str:
    return f"{experiment(exp)}/faults/tape.json"


def fired_prefix(exp: str) -> str:
    return f"{experiment(exp)}/faults/fired/"


def fired_fault(exp: str, fault_id: str) -> str:
    return fired_prefix(exp) + check_name("fault", fault_id)


def stop(exp: str) -> str:
    return f"{experiment(exp)}/STOP"


def stop_request(exp: str) -> str:
    return f"{experiment(exp)}/STOP_REQUEST"


def budget(exp: str) -> str:
    return f"{experiment(exp)}/BUDGET"


def budget_forecast(exp: str) -> str:
    return f"{experiment(exp)}/FORECAST"


def capacity(exp: str) -> str:
    return f"{experiment(exp)}/CAPACITY"


def syncer_lease(exp: str) -> str:
    return f"{experiment(exp)}/syncer/LEASE"


def retention(exp: str) -> str:
    return f"{experiment(exp)}/syncer/RETENTION"


def finished(exp: str) -> str:
    return f"{experiment(exp)}/FINISHED"


ACTIVE = "ACTIVE"


def _fixed_segments() -> frozenset[str]:
    """The fixed path segments of the keys above that could pass for a name (`experiments`,
    `rounds`, `contributions`, `learners`, `syncer`, ...), found by laying out every key with
    placeholder names and indices: what no experiment or learner may be called."""
    placeholder = "x"
    names = {"exp": placeholder, "learner": placeholder, "fault_id": placeholder}
    segments: set[str] = set()
    for name, function in list(globals().items()):
        if (name.startswith("_") or not inspect.isfunction(function)
                or function.__module__ != __name__):
            continue
        args = [names.get(p, 0) for p in inspect.signature(function).parameters]
        segments.update(function(*args).split("/"))
    index = re.compile(r"[a-z][0-9]+")     # r00000001, f000, v00000001, a00000, s000000
    return frozenset(s for s in segments if s != placeholder and index.fullmatch(s) is None
                     and re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,62}", s))


reserve(_fixed_segments())
