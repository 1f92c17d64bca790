"""Running many arms at once: each arm once, in fresh processes.

Kept out of `runner.py` on purpose: the runner is hashed into every stored result's code
identity (`code_identity.ROOTS`), and how arms are scheduled cannot change a figure.
"""

import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from benchmarks.quality.code_identity import code_hash
from benchmarks.quality.experiments import Arm
from benchmarks.quality.runner import RUNS_DIR, arm_key, is_usable, load_arm, run_arm
from benchmarks.quality.scoring import DEFAULT_SIZES, SliceSizes

# How often a worker looks for its parent. A run takes minutes, so a second is prompt enough.
PARENT_POLL_SECONDS = 1.0


def start_worker(parent: int) -> None:
    """Each worker's start: take the code hash (before it imports and runs the code: taken at
    its first result instead, a commit landing mid-run would label that run), and end the
    worker when `parent` is gone. The pool's workers otherwise outlive a killed sweep: a worker
    in a run notices nothing until the run ends (minutes), and a queued task can start
    another; two such orphans of a killed scavenging sweep went on training and writing runs,
    both cores, until killed by pid."""
    code_hash()
    threading.Thread(target=exit_when_orphaned, args=(parent,), daemon=True,
                     name="parent-watch").start()


def exit_when_orphaned(parent: int, poll_seconds: float = PARENT_POLL_SECONDS) -> None:
    """Exit the process, at once, when its parent is no longer `parent` (the parent died and
    the process was re-parented); until then, wait. A run file is written whole or not at all
    (`run_arm`), so exiting mid-run loses only that run."""
    while os.getppid() == parent:
        time.sleep(poll_seconds)
    os._exit(1)


def arms_to_run(arms: Iterable[Arm], runs_dir: Path = RUNS_DIR,
                sizes: SliceSizes = DEFAULT_SIZES) -> dict[str, Arm]:
    """The arms without a usable stored result, each once, by key."""
    todo: dict[str, Arm] = {}
    for arm in arms:
        if not is_usable(load_arm(arm, runs_dir), sizes):
            todo.setdefault(arm_key(arm), arm)
    return todo


def run_arms(arms: Iterable[Arm], runs_dir: Path = RUNS_DIR, workers: int = 1,
             sizes: SliceSizes = DEFAULT_SIZES,
             on_done: Callable[[Arm, dict], None] | None = None) -> dict[str, dict]:
    """Run each arm once (or take its stored result) in `workers` fresh processes (spawned: JAX
    does not survive a fork) and return every arm's record by key. The arms to run go longest
    first (tokens ~ compute), so a sweep does not end on one long arm running alone while the
    other processes sit idle. `on_done(arm, record)` as each run finishes. On 2 cores, 2
    workers finish a sweep about 1.6 times sooner than one."""
    arms = list(arms)
    todo = sorted(arms_to_run(arms, runs_dir, sizes).values(), key=lambda a: -a.tokens)
    records: dict[str, dict] = {}

    def finished(arm: Arm, record: dict) -> None:
        records[arm_key(arm)] = record
        if on_done:
            on_done(arm, record)

    if workers <= 1:
        for arm in todo:
            finished(arm, run_arm(arm, runs_dir, sizes=sizes))
    else:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(workers, mp_context=context, initializer=start_worker,
                                 initargs=(os.getpid(),)) as pool:
            futures = {pool.submit(run_arm, arm, runs_dir, sizes=sizes): arm for arm in todo}
            for future in as_completed(futures):
                finished(futures[future], future.result())
    for arm in arms:
        key = arm_key(arm)
        if key not in records:
            records[key] = load_arm(arm, runs_dir)
    return records
