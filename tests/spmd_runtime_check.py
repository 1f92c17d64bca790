"""Run in a fresh interpreter by test_spmd.py: a `LearnerRuntime` on 4 forced host devices with
`learners.sharding=fsdp`, against a local store set up as the `train` job does (without
Dagster, to stay light). It trains, offers, takes a merged fragment, checkpoints, stops and
restores; prints what test_spmd.py checks as JSON. Then runtimes whose batch does not split
across the 4 devices must be refused at construction.

    python tests/spmd_runtime_check.py [STORE_DIR]            # the above, on 4 devices
    python tests/spmd_runtime_check.py STORE_DIR --shrunk     # then: relaunched on 2 devices

`--shrunk` is the same learner after losing half its slice: a new attempt on 2 devices restores
its 4-device FSDP checkpoint onto the smaller mesh, trains on, and offers the next round."""

import json
import os
import sys
import tempfile
import threading
import time

SHRUNK = "--shrunk" in sys.argv
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={2 if SHRUNK else 4}"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from learner_store_setup import collecting_logger, committed_experiment, wait  # noqa: E402

from diloco_core.config import ConfigError  # noqa: E402
from diloco_core.round_records import Heartbeat  # noqa: E402
from diloco_core.spmd import fsdp_spec  # noqa: E402
from resources.learner.runtime import LearnerRuntime  # noqa: E402
from resources.store import layout  # noqa: E402
from resources.store.artifact_store import ArtifactStore  # noqa: E402
from resources.store.backends import open_blob_store  # noqa: E402

TINY = ["model.preset=tiny", "data.seq_len=32", "data.batch_size=4", "learners.num_learners=3",
        "sync.num_fragments=2", "sync.sync_period=4", "sync.min_quorum=2",
        "sync.grace_gamma=0", "token_budget=100000", "orchestration.eval_batches=1",
        "orchestration.checkpoint_every_steps=4", "orchestration.poll_seconds=0.05",
        "orchestration.heartbeat_seconds=0.2", "orchestration.round_timeout_seconds=0.5"]


def new_store(root: str, name: str, overrides: list[str]) -> ArtifactStore:
    return committed_experiment(root, name, TINY + overrides)


def placement(runtime: LearnerRuntime) -> dict:
    """How the runtime's state lies on the devices: the largest param and its AdamW moments."""
    params = runtime.train.params
    name = max(params, key=lambda k: params[k].size)
    moments = [x for x in jax.tree.leaves(runtime.train.opt_state) if x.shape == params[name].shape]
    anchor = next(f.anchor[name] for f in runtime.sync.fragments if name in f.anchor)
    arrays = [params[name], anchor, *moments]
    # Every array (params, moments, step counters, every fragment's anchor, the merged one
    # included) where FSDP puts it.
    state = (runtime.train, [f.anchor for f in runtime.sync.fragments])
    misplaced = [str(x.sharding.spec) for x in jax.tree.leaves(state)
                 if x.sharding.spec != fsdp_spec(x.shape, runtime.model.mesh.size)]
    return {"name": name, "shape": list(params[name].shape), "moments": len(moments),
            "devices": [len(x.sharding.device_set) for x in arrays],
            "shard_shapes": [sorted({tuple(s.data.shape) for s in x.addressable_shards})
                             for x in arrays],
            "misplaced": misplaced}


def train_offer_merge_restore(root: str) -> dict:
    store = new_store(root, "spmd-fsdp", ["learners.sharding=fsdp"])
    logs: list[str] = []
    log = collecting_logger("runtime", logs)
    runtime = LearnerRuntime(store, "learner-0", 0, log=log, max_steps=8)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(runtime.run()), daemon=True)
    thread.start()
    beat = lambda: (store.get_heartbeat("learner-0") or Heartbeat("none", 0.0))  # noqa: E731
    wait(lambda: beat().step >= 4, "4 steps")
    store.open_round(0, {"fragment": 0, "opened_at": time.time(), "final": False})
    wait(lambda: store.list_contributions(0) == ["learner-0"], "an offer")
    g = store.load_global(1)   # a merge of fragment 1 commits version 1
    store.commit_global(1, 1, {k: v + np.float32(0.001) for k, v in g.params.items()},
                        g.outer_state, {"round": 1})
    wait(lambda: beat().versions == (0, 1) and beat().step >= 8,
         "the merged fragment and 8 steps")
    store.request_stop({"reason": "test"})
    thread.join(60)
    offer = store.load_contribution(0, "learner-0")
    merged_name = next(iter(g.params))
    out = {"result": {k: result.get(k) for k in ("status", "step", "offers", "received",
                                                  "checkpoint_step", "loss")},
           "offer_steps": offer.steps, "mesh_log": [m for m in logs if "device(s)" in m],
           "after_run": placement(runtime),
           # What it holds of the merged fragment is the committed version 1 (overwrite).
           "merged_equal": bool(np.array_equal(
               np.asarray(runtime.sync.fragments[1].anchor[merged_name]),
               store.load_global(1).params[merged_name]))}
    again = LearnerRuntime(store, "learner-0", 1, log=log)
    out["restored_from"] = again._start_state()
    out["restored_step"] = int(again.train.step)
    out["after_restore"] = placement(again)
    return out


def refusal(root: str, name: str, overrides: list[str], learner: str) -> dict | None:
    store = new_store(root, name, overrides)
    try:
        LearnerRuntime(store, learner, 0)
    except ConfigError as err:
        return {"field": err.field, "message": str(err)}
    return None


def continue_on_fewer_devices(root: str) -> dict:
    """Attempt 2 of learner-0, on 2 devices: restore, 4 more steps, offer round 1."""
    store = ArtifactStore(open_blob_store(root), "spmd-fsdp")
    # The first part ended its process with the run's stop record; this run goes on.
    store.blobs.delete(layout.stop(store.experiment))
    runtime = LearnerRuntime(store, "learner-0", 2, max_steps=12)
    restored_from = runtime._start_state()
    restored = {"from": restored_from, "step": int(runtime.train.step),
                "placement": placement(runtime)}
    runtime = LearnerRuntime(store, "learner-0", 2, max_steps=12)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(runtime.run()), daemon=True)
    thread.start()
    beat = lambda: (store.get_heartbeat("learner-0") or Heartbeat("none", 0.0))  # noqa: E731
    wait(lambda: beat().step >= 12, "4 more steps")
    store.open_round(1, {"fragment": 1, "opened_at": time.time(), "final": False})
    wait(lambda: store.list_contributions(1) == ["learner-0"], "an offer")
    store.request_stop({"reason": "test"})
    thread.join(60)
    offer = store.load_contribution(1, "learner-0")
    return {"devices": jax.device_count(), "restored": restored,
            "result": {k: result.get(k) for k in ("status", "step", "loss")},
            "offer": {"steps": offer.steps, "tokens": offer.tokens},
            "tokens_per_step": runtime.cfg.tokens_per_learner_step,
            "after_run": placement(runtime)}


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if SHRUNK:
        report = continue_on_fewer_devices(args[0])
    else:
        with tempfile.TemporaryDirectory() as scratch:
            root = args[0] if args else scratch
            report = {"devices": jax.device_count(), **train_offer_merge_restore(root),
                      "uneven_data": refusal(root, "uneven-data", ["data.batch_size=6"],
                                             "learner-0"),
                      "uneven_learner": refusal(root, "uneven-learner",
                                                ["learners.batch_sizes=[4, 6, 4]"],
                                                "learner-1")}
    print(json.dumps(report))
    sys.stdout.flush()
