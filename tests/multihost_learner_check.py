"""Run by test_multihost_learner.py as one process of a 2-process learner (`jax.distributed` on
loopback, gloo collectives, 2 forced host devices each), or alone as the single-process
reference. Prints, from process 0, what the test checks as JSON.

    python tests/multihost_learner_check.py <process_id> <num_processes> <port> <store> <phase> \
        [replicated|fsdp]

phase "run": process 0 sets up a local store as the `train` job does (without Dagster) and,
from a thread, plays the syncer: opens round 0 once the learner has taken 4 steps, commits a
merged version 1 of fragment 1 once the offer is in, asks to stop after 8 steps. Every process
runs the same `LearnerRuntime` (max 8 steps). Process 0 reports the store's contributions and
the offered delta; every process reports what it wrote to and read from the store.
phase "restore": a new attempt of the same learner, on the same processes, restores from the
checkpoint the first one saved (every process its own shards) and reports its step.
phase "reference" (one process, one device): the single-process learner takes the offer's
number of steps from the same start and reports its delta of fragment 0, to compare.
"""

import json
import os
import sys
import threading
import time

process_id, num_processes, port, root, phase = sys.argv[1:6]
sharding = sys.argv[6] if len(sys.argv) > 6 else "replicated"   # learners.sharding
process_id, num_processes = int(process_id), int(num_processes)
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={2 if num_processes > 1 else 1}"
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.update(DILOCO_COORDINATOR=f"127.0.0.1:{port}",
                  DILOCO_NUM_PROCESSES=str(num_processes), DILOCO_PROCESS_ID=str(process_id))

from resources.learner.distributed import join_from_env  # noqa: E402

join_from_env()   # as pipelines/learner_entry.py does, before anything touches JAX

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from learner_store_setup import collecting_logger, committed_experiment  # noqa: E402
from learner_store_setup import wait as wait_until  # noqa: E402

from diloco_core.compression import decode  # noqa: E402
from diloco_core.round_records import Heartbeat  # noqa: E402
from diloco_core.spmd import host_value  # noqa: E402
from resources.learner.runtime import LearnerRuntime  # noqa: E402
from resources.store.artifact_store import ArtifactStore  # noqa: E402
from resources.store.backends import open_blob_store  # noqa: E402

NAME = "multihost-learner"
TINY = ["model.preset=tiny", "data.seq_len=32", "data.batch_size=4", "learners.num_learners=2",
        "sync.num_fragments=2", "sync.sync_period=4", "sync.min_quorum=2", "sync.grace_gamma=0",
        "sync.encoding=fp32", "token_budget=100000", "orchestration.eval_batches=1",
        "orchestration.checkpoint_every_steps=4", "orchestration.poll_seconds=0.05",
        "orchestration.heartbeat_seconds=0.2", "orchestration.round_timeout_seconds=0.5"]


def new_store() -> ArtifactStore:
    return committed_experiment(root, NAME, TINY + [f"learners.sharding={sharding}"])


def wait(predicate, what: str, timeout: float = 180.0) -> None:
    wait_until(predicate, what, timeout)


def params_digest(runtime: LearnerRuntime) -> float:
    """The sum of every parameter (host values: under FSDP a collective)."""
    return float(sum(np.sum(host_value(v), dtype=np.float64)
                     for _, v in sorted(runtime.train.params.items())))


def watched(store: ArtifactStore) -> tuple[ArtifactStore, dict]:
    """`store`, counting what this process writes to it (and reads from it) by key."""
    seen: dict = {"writes": [], "reads": []}
    blobs = store.blobs

    def counting(original, kind):
        def counted(key, *args, **kwargs):
            seen[kind].append(key.rsplit("/", 2)[-2:])
            return original(key, *args, **kwargs)
        return counted

    for method, kind in (("write", "writes"), ("delete", "writes"), ("read", "reads")):
        setattr(blobs, method, counting(getattr(blobs, method), kind))
    return store, seen


def play_syncer(store: ArtifactStore, errors: list) -> None:
    try:
        beat = lambda: (store.get_heartbeat("learner-0") or Heartbeat("none", 0.0))  # noqa: E731
        wait(lambda: beat().step >= 4, "4 steps")
        store.open_round(0, {"fragment": 0, "opened_at": time.time(), "final": False})
        wait(lambda: store.list_contributions(0) == ["learner-0"], "an offer")
        g = store.load_global(1)
        store.commit_global(1, 1, {k: v + np.float32(0.001) for k, v in g.params.items()},
                            g.outer_state, {"round": 1})
        wait(lambda: beat().versions == (0, 1) and beat().step >= 8,
             "the merged fragment and 8 steps")
        store.request_stop({"reason": "test"})
    except BaseException as err:  # noqa: BLE001 - reported by the main thread
        errors.append(repr(err))


def run() -> dict:
    if process_id == 0:
        store = new_store()
    multihost_utils.sync_global_devices("store set up")
    store, seen = watched(ArtifactStore(open_blob_store(root), NAME))
    logs: list[str] = []
    log = collecting_logger("runtime", logs)
    runtime = LearnerRuntime(store, "learner-0", 0, log=log, max_steps=8)
    errors: list = []
    if process_id == 0:
        threading.Thread(target=play_syncer, args=(store, errors), daemon=True).start()
    result = runtime.run()
    # What the learner itself wrote and read (the checks below read the store too).
    writes = ["/".join(k) for k in seen["writes"]]
    reads = sorted({"/".join(k) for k in seen["reads"]})
    digest = params_digest(runtime)
    largest = max(runtime.train.params.values(), key=lambda v: v.size)
    merged_name = sorted(runtime.model.plan.fragments[1])[0]
    merged_equal = bool(np.array_equal(host_value(runtime.sync.fragments[1].anchor[merged_name]),
                                       store.load_global(1).params[merged_name]))
    out = {"process_count": jax.process_count(), "devices": jax.device_count(),
           "pid": os.getpid(), "sharding": runtime.model.sharding,
           "embedding_shape": list(largest.shape),
           "embedding_shards": sorted({tuple(x.data.shape) for x in largest.addressable_shards}),
           "store_writes": writes, "store_reads": reads,
           "errors": errors, "digest": digest, "merged_equal": merged_equal,
           "result": {k: result.get(k) for k in ("status", "step", "offers", "received",
                                                  "checkpoint_step", "tokens_total")},
           "mesh_log": [m for m in logs if "device(s)" in m]}
    if process_id == 0:
        offer = store.load_contribution(0, "learner-0")
        manifest = store.contribution_manifest(0, "learner-0")
        out.update(contributions=store.list_contributions(0),
                   offer={"steps": offer.steps, "tokens": offer.tokens,
                          "learner_step": offer.learner_step,
                          "attempt": manifest.extra.get("attempt"),
                          "delta": {k: np.asarray(decode(e)).ravel().tolist()
                                    for k, e in sorted(offer.delta.items())}},
                   heartbeat=(store.get_heartbeat("learner-0") or Heartbeat("none", 0.0)).to_json(),
                   tokens_per_step=runtime.cfg.tokens_per_learner_step,
                   checkpoint_steps=runtime.checkpoints.all_steps())
    return out


def restore() -> dict:
    store, seen = watched(ArtifactStore(open_blob_store(root), NAME))
    again = LearnerRuntime(store, "learner-0", 1)
    restored_from = again._start_state()
    out = {"restored_from": restored_from, "restored_step": int(again.train.step),
           "store_writes": ["/".join(k) for k in seen["writes"]],
           "store_reads": sorted({"/".join(k) for k in seen["reads"]}),
           "digest": params_digest(again)}
    again.checkpoints.close()
    return out


def reference(steps: int) -> dict:
    """The single-process learner: `steps` inner steps from the same start, fragment 0's delta."""
    store = new_store()

    class NoLink:   # the first step's compile beacon beats through the link
        bytes_up = bytes_down = 0

        def heartbeat(self, *args, **kwargs):
            pass

    runtime = LearnerRuntime(store, "learner-0", 0)
    runtime.progress.rejoined_from = runtime._start_state()
    runtime.link, runtime.progress.status = NoLink(), "training"
    for _ in range(steps):
        runtime._step()
    s = runtime.cfg.sync
    offer = runtime.sync.contribution(runtime.train.params, runtime.model.plan, 0, 0, steps, 0.0,
                                      s.encoding, s.encoding_block_size)
    runtime.checkpoints.close()
    return {"steps": offer.steps, "tokens": offer.tokens,
            "delta": {k: np.asarray(decode(e)).ravel().tolist()
                      for k, e in sorted(offer.delta.items())}}


if __name__ == "__main__":
    if phase == "run":
        report = run()
    elif phase == "restore":
        report = restore()
    else:
        report = reference(int(phase.split("=")[1]))
    print(json.dumps(report), flush=True)   # every process: the test reads the followers' too
    if num_processes > 1:
        multihost_utils.sync_global_devices("done")
        jax.distributed.shutdown()
