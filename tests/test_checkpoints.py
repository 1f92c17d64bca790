"""Orbax learner checkpoints: bit-identical save -> restore on a local path and on loopback GCS."""

import threading
import time
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco_core.config import InnerOptConfig, ModelConfig
from diloco_core.data import BatchIterator
from diloco_core.inner_step import InnerStep
from diloco_core.model import init_model
from resources.store.checkpoints import LearnerCheckpoints, abstract_target


# Orbax through TensorStore makes hundreds of requests per checkpoint; the pure-Python loopback
# server answers them slowly (6-27 s per test), so the GCS variants are marked slow.
@pytest.fixture(params=["local", pytest.param("gcs", marks=pytest.mark.slow)])
def directory(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "ckpt")
    request.getfixturevalue("gcs_server")
    return f"gs://diloco-test/ckpt-{uuid.uuid4().hex[:12]}"


def _checkpoints(directory, **kwargs):
    # OCDBT (Orbax's default) on both: the loopback server sends object generations now.
    return LearnerCheckpoints(directory, **kwargs)


@pytest.fixture(scope="module")
def trained():
    model_def, params = init_model(ModelConfig.from_preset("tiny"), 0)
    inner = InnerStep(model_def, InnerOptConfig(warmup_steps=1), 10)
    state = inner.init(params)
    rng = np.random.default_rng(0)
    for _ in range(2):
        state, _ = inner.step(state, rng.integers(0, 256, (2, 16), dtype=np.int32))
    return inner, state


def _tree(state, key):
    return {"train": state, "rng": jax.random.key_data(key)}


def test_save_restore_is_bit_identical_and_training_continues_identically(directory, trained):
    inner, state = trained
    stream = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8)
    data = BatchIterator(stream, 2, 16, seed=3)
    for _ in range(5):
        data.next()
    meta = {"learner": "learner-0", "data": data.state(), "steps": 2,
            "fragments": [{"version": 1, "steps": 2, "tokens": 64}]}
    ckpts = _checkpoints(directory, max_to_keep=3)
    tree = _tree(state, jax.random.key(7))
    ckpts.save(2, tree, meta)
    restored, meta_back = ckpts.restore(target=abstract_target(tree))
    assert meta_back == meta
    assert jax.tree.structure(restored) == jax.tree.structure(tree)
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(restored), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The restored iterator and state continue exactly like the originals.
    resumed = BatchIterator(stream, 2, 16, seed=3, state=meta_back["data"])
    batch = data.next()
    np.testing.assert_array_equal(resumed.next(), batch)
    copy = jax.tree.map(jnp.array, state)
    expected, _ = inner.step(copy, batch)
    got, _ = inner.step(restored["train"], batch)
    for a, b in zip(jax.tree.leaves(expected.params), jax.tree.leaves(got.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ckpts.close()


def test_keep_last_gc_latest_and_missing_steps(directory, trained):
    _, state = trained
    ckpts = _checkpoints(directory, max_to_keep=3)
    tree = _tree(state, jax.random.key(0))
    for step in (1, 2, 3, 4):
        ckpts.save(step, tree, {"step": step})
    assert ckpts.all_steps() == [2, 3, 4] and ckpts.latest_step() == 4
    assert ckpts.gc(keep_last=1) == [2, 3]
    assert ckpts.all_steps() == [4]
    with pytest.raises(FileNotFoundError, match="no checkpoint at step 2"):
        ckpts.restore(2)
    ckpts.close()


def test_plain_orbax_reads_a_learner_checkpoint(directory, trained):
    """Interoperability: the documented layout ({dir}/{step}/state) opens with plain Orbax."""
    import orbax.checkpoint as ocp

    _, state = trained
    ckpts = _checkpoints(directory)
    ckpts.save(5, _tree(state, jax.random.key(1)), {"step": 5})
    ckpts.close()
    plain = ocp.StandardCheckpointer().restore(f"{directory}/5/state")
    np.testing.assert_array_equal(np.asarray(plain["train"]["params"]["lm_head/kernel"]),
                                  np.asarray(state.params["lm_head/kernel"]))


def test_a_background_save_is_unharmed_by_the_step_that_donates_its_arrays(tmp_path, trained):
    """`wait=False` returns while Orbax still writes; the learner's next jitted step donates
    (reuses) the very buffers it saved. The checkpoint must hold the values of the save."""
    inner, state = trained
    state = jax.tree.map(jnp.array, state)                 # our own buffers, to donate
    expected = jax.tree.map(lambda x: np.array(x, copy=True), state)
    ckpts = _checkpoints(str(tmp_path / "ckpt"), max_to_keep=3)
    ckpts.save(2, jax.device_get(state), {"step": 2}, wait=False)
    batch = np.random.default_rng(2).integers(0, 256, (2, 16), dtype=np.int32)
    for _ in range(3):                                     # overwrite the donated buffers
        state, _ = inner.step(state, batch)
    assert ckpts.wait() == 2 and ckpts.durable_step == 2
    restored, meta = ckpts.restore(target=abstract_target(expected))
    assert meta == {"step": 2}
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    # The next save waits for nothing left in flight and replaces the same step.
    ckpts.save(2, jax.device_get(state), {"step": 2, "again": True}, wait=False)
    ckpts.close()                                          # finishes the write in flight
    assert _checkpoints(str(tmp_path / "ckpt"), read_only=True).restore()[1]["again"] is True


@pytest.mark.parametrize("wait", [True, False], ids=["blocking", "background"])
def test_two_learners_in_one_process_save_side_by_side(tmp_path, wait):
    """Two managers saving at once in one process (learner runtimes as threads, as the
    orchestration tests run them). Orbax numbers its save operations process-wide, and with
    its directories created asynchronously one manager's JSON item was written before its
    directory existed (FileNotFoundError in `meta.orbax-checkpoint-tmp`), or a save waited
    forever on a signal the other manager had consumed: both seen within 100 saves here."""
    saves = 60
    errors: list[str] = []

    def learner(name: str) -> None:
        ckpts = LearnerCheckpoints(str(tmp_path / name), max_to_keep=2)
        state = {"a": np.full((32, 32), len(name), np.float32), "step": np.int32(0)}
        try:
            for step in range(saves):
                ckpts.save(step, {**state, "step": np.int32(step)}, {"learner": name,
                                                                       "step": step}, wait=wait)
            ckpts.wait()
        except Exception as err:  # noqa: BLE001 - collected, asserted below
            errors.append(f"{name}: {type(err).__name__}: {str(err)[:200]}")
        finally:
            ckpts.close()

    threads = [threading.Thread(target=learner, args=(n,), daemon=True)
               for n in ("learner-0", "learner-1")]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 90       # about 3 s each when right; a hang is the bug
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a save hung"
    assert not errors, errors
    for name in ("learner-0", "learner-1"):
        reader = LearnerCheckpoints(str(tmp_path / name), read_only=True)
        assert reader.all_steps() == [saves - 2, saves - 1]
        state, meta = reader.restore()
        assert meta == {"learner": name, "step": saves - 1} and int(state["step"]) == saves - 1
