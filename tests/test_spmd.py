"""A learner's inner step data-parallel over 4 (forced host) devices equals the single-device
step on the same global batch, with its state replicated or FSDP-sharded: the same losses
(relative 1e-5) and, after 4 AdamW steps, the same parameters within 1e-5 (float32 summation
order differs between the two). The learner runtime trains, offers, merges, checkpoints and
restores on such a mesh with FSDP, and refuses a batch the devices do not divide."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from diloco_core.spmd import fsdp_spec, learner_mesh, place_state

REPO = Path(__file__).resolve().parent.parent


def _run(script: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, str(REPO / "tests" / script), *args],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_fsdp_splits_the_largest_divisible_dimension_and_replicates_the_rest():
    assert fsdp_spec((256, 32), 4) == P("data")            # the vocabulary rows
    assert fsdp_spec((32, 256), 4) == P(None, "data")      # the lm head's columns
    assert fsdp_spec((4, 32, 32), 4) == P(None, "data")    # a tie: the first largest
    assert fsdp_spec((6, 8), 4) == P(None, "data")         # 6 does not divide: the next one
    assert fsdp_spec((), 4) == P()                         # step counters
    assert fsdp_spec((6, 10), 4) == P()                    # nothing divides
    assert fsdp_spec((256, 32), 1) == P()                  # one device: nothing to split


def test_place_state_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="unknown sharding mode 'zero3'"):
        place_state({"w": np.zeros(4, np.float32)}, learner_mesh(), "zero3")


@pytest.mark.slow   # two fresh interpreters with 4 host devices
@pytest.mark.parametrize("preset", ["tiny", "moe-tiny"])
def test_sharded_inner_step_matches_the_single_device_one(preset):
    result = _run("spmd_check.py", preset)
    single, mesh, fsdp = result["single"], result["mesh"], result["fsdp"]
    assert result["devices"] == 4
    assert "batch size 6 is not divisible by the 4 devices" in result["uneven_batch_error"]
    assert mesh["batch_devices"] == 4 and mesh["param_devices"] == 4   # split, replicated
    assert mesh["largest"]["shard_shapes"] == [mesh["largest"]["shape"]]   # a full copy each
    # FSDP: every device holds a quarter of the embedding (256 x 32 -> 64 x 32), still after
    # the steps: the jitted step hands the state back as it was placed.
    assert fsdp["batch_devices"] == 4 and fsdp["param_devices"] == 4
    rows, cols = fsdp["largest"]["shape"]
    assert fsdp["largest"]["shard_shapes"] == [[rows // 4, cols]]
    assert fsdp["sharding_kept"] and mesh["sharding_kept"]
    assert fsdp["sharded_leaves"] > 0 and mesh["sharded_leaves"] == 0
    for run in (mesh, fsdp):
        np.testing.assert_allclose(run["losses"], single["losses"], rtol=1e-5)
        for name, values in single["params"].items():
            # 1e-5 is 0.3% of one AdamW step (lr 3e-3): Adam normalises small gradients, which
            # amplifies the float32 summation-order differences of the all-reduce.
            np.testing.assert_allclose(run["params"][name], values, rtol=1e-4, atol=1e-5,
                                       err_msg=name)


@pytest.mark.slow   # a fresh interpreter with 4 host devices, ~10 s
def test_a_learner_runtime_trains_merges_and_restores_fsdp_sharded_on_4_devices(tmp_path):
    r = _run("spmd_runtime_check.py", str(tmp_path))
    assert r["devices"] == 4
    assert r["result"]["status"] == "done" and r["result"]["step"] == 8
    assert r["result"]["offers"] == 1 and r["result"]["received"] == 1
    assert r["result"]["checkpoint_step"] == 8 and np.isfinite(r["result"]["loss"])
    assert r["offer_steps"] >= 4 and r["merged_equal"]
    assert r["mesh_log"] == ["learner-0: inner step on 4 cpu device(s) (cpu), batch split "
                             "across them, state fsdp"]
    assert r["restored_from"].startswith("own") and r["restored_step"] == 8
    for placed in (r["after_run"], r["after_restore"]):
        # params, anchor and both AdamW moments of the embedding: a quarter per device
        rows, cols = placed["shape"]
        assert placed["moments"] == 2 and placed["devices"] == [4] * 4
        assert placed["shard_shapes"] == [[[rows // 4, cols]]] * 4
        assert placed["misplaced"] == []
    # Refused when the runtime is built, naming the field to change.
    assert r["uneven_data"]["field"] == "data.batch_size"
    assert "batch of 6 sequences is not divisible by the 4 devices" in r["uneven_data"]["message"]
    assert r["uneven_learner"]["field"] == "learners.batch_sizes[1]"

    # The learner loses half its slice: its next attempt runs on 2 devices, restores the
    # 4-device FSDP checkpoint onto the smaller mesh (halves instead of quarters), trains on
    # and offers, its offer counting the tokens it processed.
    shrunk = _run("spmd_runtime_check.py", str(tmp_path), "--shrunk")
    assert shrunk["devices"] == 2
    assert shrunk["restored"]["from"].startswith("own") and shrunk["restored"]["step"] == 8
    for placed in (shrunk["restored"]["placement"], shrunk["after_run"]):
        rows, cols = placed["shape"]
        assert placed["devices"] == [2] * 4
        assert placed["shard_shapes"] == [[[rows // 2, cols]]] * 4
        assert placed["misplaced"] == []
    assert shrunk["result"]["status"] == "done" and shrunk["result"]["step"] == 12
    assert np.isfinite(shrunk["result"]["loss"])
    assert shrunk["offer"]["tokens"] == shrunk["offer"]["steps"] * shrunk["tokens_per_step"]
