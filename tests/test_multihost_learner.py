"""A learner spanning two processes (a multi-host slice: `jax.distributed`, gloo on loopback,
two forced host devices each) runs the real `LearnerRuntime` against a local store: process 0
alone talks to the store, and both processes train in lock-step. It trains, offers round 0
exactly once (its steps and tokens counted once, not once per process), takes a merged
fragment, checkpoints and stops on the store's stop record; a new two-process attempt restores
its multi-host checkpoint. The offered delta equals the single-process learner's on the same
batches."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "multihost_learner_check.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(num_processes: int, root: Path, phase: str, sharding: str = "replicated",
            timeout: float = 300) -> list[dict]:
    """Every process's report, process 0's first."""
    port = str(_free_port())   # a fresh coordinator port per launch
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), str(i), str(num_processes), port,
                               str(root), phase, sharding], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for i in range(num_processes)]
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, f"{phase}: {err[-4000:]}"
            outs.append(out)
    finally:
        for proc in procs:   # never leave a process waiting on a collective
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return [json.loads(out.strip().splitlines()[-1]) for out in outs]


@pytest.mark.slow   # five fresh interpreters, ~30-60 s per mode on 2 cores
@pytest.mark.parametrize("sharding", ["replicated", "fsdp"])
def test_a_two_process_learner_offers_once_merges_checkpoints_and_restores(tmp_path, sharding):
    run, follower = _launch(2, tmp_path / "store", "run", sharding)
    assert run["sharding"] == sharding
    # What each process holds of the largest array: whole copies, or a quarter of it (FSDP,
    # split over the 4 devices of both processes; the checkpoint is then written in shards).
    rows, cols = run["embedding_shape"]
    assert run["embedding_shards"] == ([[rows, cols]] if sharding == "replicated"
                                       else [[rows // 4, cols]])
    # The follower never writes to the store; it reads only the experiment's config.
    assert follower["store_writes"] == []
    assert follower["store_reads"] == ["multihost-learner/config.json"], follower["store_reads"]
    assert follower["result"]["step"] == 8 and follower["digest"] == run["digest"]
    assert run["store_writes"]
    assert (run["process_count"], run["devices"]) == (2, 4)
    assert run["errors"] == []
    assert "4 cpu device(s)" in run["mesh_log"][0]   # one mesh over both processes' devices
    assert run["result"]["status"] == "done"
    assert run["result"]["step"] == 8
    assert run["result"]["offers"] == 1 and run["result"]["received"] == 1
    assert run["merged_equal"]
    # One contribution, from attempt 0, written once (the heartbeat is process 0's).
    assert run["contributions"] == ["learner-0"]
    assert run["heartbeat"]["pid"] == run["pid"]
    offer = run["offer"]
    assert offer["attempt"] == 0
    # Counted once: its tokens are its steps' tokens, not twice as many.
    assert offer["tokens"] == offer["steps"] * run["tokens_per_step"]
    assert offer["steps"] == offer["learner_step"] >= 4
    assert run["heartbeat"]["tokens_total"] == 8 * run["tokens_per_step"]
    assert run["result"]["checkpoint_step"] == 8 and run["checkpoint_steps"][-1] == 8

    again, again_follower = _launch(2, tmp_path / "store", "restore", sharding)
    assert again_follower["store_writes"] == []
    assert again_follower["restored_step"] == again["restored_step"]
    assert again["restored_from"].startswith("own")
    assert again["restored_step"] == run["result"]["checkpoint_step"]
    assert again["digest"] == pytest.approx(run["digest"], rel=1e-6)

    [single] = _launch(1, tmp_path / "reference", f"reference={offer['steps']}")
    assert (single["steps"], single["tokens"]) == (offer["steps"], offer["tokens"])
    assert single["delta"].keys() == offer["delta"].keys()
    for name, values in single["delta"].items():
        np.testing.assert_allclose(offer["delta"][name], values, rtol=1e-3, atol=1e-6,
                                   err_msg=name)


def test_the_learner_process_joins_a_multi_host_learner_only_when_told_to():
    from resources.learner.distributed import join_from_env

    assert join_from_env({}) == (0, 1)   # no variables: a single-process learner, no init
    assert join_from_env({"DILOCO_NUM_PROCESSES": "1"}) == (0, 1)
    with pytest.raises(ValueError, match="DILOCO_COORDINATOR"):
        join_from_env({"DILOCO_NUM_PROCESSES": "2", "DILOCO_PROCESS_ID": "1"})
    with pytest.raises(ValueError, match="not in 0..1"):
        join_from_env({"DILOCO_NUM_PROCESSES": "2", "DILOCO_PROCESS_ID": "2",
                       "DILOCO_COORDINATOR": "127.0.0.1:1"})
