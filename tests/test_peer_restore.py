"""A restarting learner without a fresh checkpoint of its own takes a peer's AdamW state, and
only a sound one (resources/learner/restore.py). A hostile peer once wrote a checkpoint at step
10**9 with NaN moments under its own prefix: every restarting learner took it (the highest step)
and was NaN after one step. Real Orbax checkpoints in a real local store; the hostile ones are
written the way a hostile learner could write them."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from diloco_core.config import InnerOptConfig, ModelConfig
from diloco_core.fragments import plan_fragments, split_params
from diloco_core.inner_step import InnerStep
from diloco_core.model import init_model
from resources.learner.restore import moment_bound, plan_restore, state_problem
from resources.store.artifact_store import ArtifactStore
from resources.store.backends import open_blob_store
from resources.store.checkpoints import LearnerCheckpoints, abstract_target

pytestmark = pytest.mark.timeout(300)

FRAGMENTS = 2
INNER = InnerOptConfig(warmup_steps=1)
HUGE = 10 ** 9
PEERS = ["learner-1", "learner-2", "learner-3"]


@pytest.fixture(scope="module")
def genuine():
    """The template and a genuinely trained state at steps 3 and 5 (params, AdamW, anchors)."""
    model_def, params = init_model(ModelConfig.from_preset("tiny"), 0)
    plan = plan_fragments({k: v.shape for k, v in params.items()}, FRAGMENTS)
    inner = InnerStep(model_def, INNER, 100)
    anchors = split_params(params, plan)
    template = {"train": inner.init(params), "anchors": anchors}
    state, rng, states = inner.init(params), np.random.default_rng(0), {}
    for step in range(1, 6):
        state, _ = inner.step(state, rng.integers(0, 256, (2, 16), dtype=np.int32))
        if step in (3, 5):
            states[step] = jax.device_get({"train": state, "anchors": anchors})
    return template, states


@pytest.fixture
def store(tmp_path):
    return ArtifactStore(open_blob_store(str(tmp_path / "store")), "peer-restore")


def _save(store, peer, tree, step, meta=None):
    ckpts = LearnerCheckpoints(store.checkpoint_uri(peer), max_to_keep=3)
    meta = {"learner": peer, "step": step, "versions": [0] * FRAGMENTS} if meta is None else meta
    ckpts.save(step, tree, meta)
    ckpts.close()


def _beat(store, peer, step):
    store.put_heartbeat(peer, {"learner": peer, "status": "training", "time": time.time(),
                               "step": step, "tokens_total": 0})


def _forge(tree, step, mu=None, nu=None):
    """`tree` as a hostile learner writes it: every step counter at `step`, and the AdamW
    moments mapped by `mu` / `nu` (each a function of the genuine array)."""
    def fix(x):
        if isinstance(x, optax.ScaleByAdamState):
            return x._replace(count=np.int32(step),
                              mu=jax.tree.map(mu or (lambda a: a), x.mu),
                              nu=jax.tree.map(nu or (lambda a: a), x.nu))
        if isinstance(x, optax.ScaleByScheduleState):
            return x._replace(count=np.int32(step))
        return x
    train = tree["train"]
    opt = jax.tree.map(fix, train.opt_state,
                       is_leaf=lambda x: isinstance(x, (optax.ScaleByAdamState,
                                                        optax.ScaleByScheduleState)))
    return {**tree, "train": train.replace(opt_state=opt, step=np.int32(step))}


def _nan(a):
    return np.full_like(a, np.nan)


def _plan(store, template, peers=PEERS):
    return plan_restore(store, "learner-0", peers, template, [0] * FRAGMENTS, max_behind=1,
                        use_ocdbt=True, inner_opt=INNER)


def _mu(tree):
    return jax.tree.leaves([s.mu for s in jax.tree.leaves(
        tree["train"].opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
        if isinstance(s, optax.ScaleByAdamState)])


def test_a_hostile_peer_at_step_1e9_with_nan_moments_loses_to_an_honest_one(store, genuine):
    template, states = genuine
    _save(store, "learner-1", states[3], 3)
    _beat(store, "learner-1", 4)
    _save(store, "learner-2", _forge(states[3], HUGE, mu=_nan, nu=_nan), HUGE)
    _beat(store, "learner-2", 7)                  # what it told the control plane
    plan = _plan(store, template)
    assert plan.source == "peer" and plan.peer == "learner-1", plan.reason
    assert int(plan.state["train"].step) == 3
    for got, want in zip(_mu(plan.state), _mu(states[3]), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    assert plan.skipped["learner-2"] == (f"uncorroborated step: checkpoint step {HUGE} is past "
                                         "its heartbeat's step 7")
    assert plan.skipped["learner-3"] == "no checkpoint"
    assert "AdamW state from learner-1 at step 3" in plan.reason
    assert "skipped learner-2: uncorroborated step" in plan.reason


def test_a_hostile_peer_with_a_matching_forged_heartbeat_is_refused_for_nan_moments(
        store, genuine):
    # Its heartbeat vouches for its step, so it is the best candidate and is restored: the
    # finiteness check refuses it, and the next peer (honest) is taken.
    template, states = genuine
    _save(store, "learner-1", states[3], 3)
    _beat(store, "learner-1", 3)
    _save(store, "learner-2", _forge(states[3], HUGE, mu=_nan), HUGE)
    _beat(store, "learner-2", HUGE)
    plan = _plan(store, template)
    assert plan.source == "peer" and plan.peer == "learner-1", plan.reason
    why = plan.skipped["learner-2"]
    assert why.startswith(f"checkpoint at step {HUGE}: non-finite values in ['train']"), why
    assert ".mu[" in why, why
    assert f"learner-2: checkpoint at step {HUGE}: non-finite values" in plan.reason


def test_only_hostile_peers_leave_a_fresh_adamw_state_with_every_reason(store, genuine):
    template, states = genuine
    _save(store, "learner-1", _forge(states[3], HUGE, mu=_nan, nu=_nan), HUGE)  # no heartbeat
    _save(store, "learner-2", _forge(states[3], 50, nu=_nan), 50)
    _beat(store, "learner-2", 50)
    _save(store, "learner-3", _forge(states[3], 9, nu=lambda a: -np.abs(a) - 1), 9)
    _beat(store, "learner-3", 9)
    plan = _plan(store, template)
    assert plan.source == "fresh" and plan.state is None and plan.peer is None, plan.reason
    assert plan.skipped["learner-1"] == ("no readable heartbeat (none written) to "
                                         "corroborate its steps"), plan.skipped
    assert plan.skipped["learner-2"].startswith("checkpoint at step 50: non-finite values in")
    assert ".nu[" in plan.skipped["learner-2"]
    assert plan.skipped["learner-3"].startswith(
        "checkpoint at step 9: negative AdamW second moment in nu[")
    assert plan.reason.startswith("no own checkpoint; no sound peer checkpoint: fresh AdamW "
                                  "state; skipped learner-1: no readable heartbeat")
    for peer in PEERS:
        assert f"{peer}: " in plan.reason


def test_an_honest_peer_whose_heartbeat_lags_its_newest_save_offers_the_one_before(
        store, genuine):
    template, states = genuine
    _save(store, "learner-1", states[3], 3)
    _save(store, "learner-1", states[5], 5)
    _beat(store, "learner-1", 4)                  # the beat after step 5's save not yet written
    plan = _plan(store, template, ["learner-1"])
    assert plan.source == "peer" and plan.peer == "learner-1" and plan.skipped == {}
    assert int(plan.state["train"].step) == 3 and "learner-1 at step 3" in plan.reason


def _first_mu_wrong_shape(tree):
    state = _forge(tree, 3)
    adam = state["train"].opt_state[1][0]
    name = next(iter(adam.mu))
    mu = {**adam.mu, name: np.zeros((1,), np.float32)}
    opt = (state["train"].opt_state[0], (adam._replace(mu=mu), *state["train"].opt_state[1][1:]))
    return {**state, "train": state["train"].replace(opt_state=opt)}


UNSOUND = {
    # finite, but no gradient sequence gives |mu| = 10 sqrt(nu): one step would move each
    # parameter by about 10 learning rates
    "moments past the AdamW bound": (
        lambda t: _forge(t, 3, mu=lambda a: 10 * np.sign(a) * np.maximum(np.abs(a), 1e-3),
                         nu=lambda a: np.full_like(a, 1e-6)),
        None, "AdamW first moment mu["),
    "counters that disagree with the step": (
        lambda t: _forge(t, 3) | {"train": _forge(t, 3)["train"].replace(step=np.int32(7))},
        None, "its train step is 7, the checkpoint is step 3"),
    # Orbax refuses this one itself (a jax array restored at another shape); a leaf it restores
    # at its saved shape instead is refused by the shape check (the next test)
    "an array of another shape": (
        _first_mu_wrong_shape, None, "Requested shape: (32, 32) is not compatible"),
    "meta versions of the wrong length": (
        lambda t: t, {"step": 3, "versions": [0]}, "meta versions [0] are not 2"),
    "meta without a step": (
        lambda t: t, {"versions": [0, 0]}, "meta has no integer step (got None)"),
    "a non-integer version": (
        lambda t: t, {"step": 3, "versions": [0, "1"]}, "are not 2 non-negative integers"),
}


@pytest.mark.parametrize("case", list(UNSOUND))
def test_an_unsound_peer_checkpoint_is_skipped_for_the_next_sound_one(store, genuine, case):
    template, states = genuine
    forge, meta, reason = UNSOUND[case]
    _save(store, "learner-1", forge(states[3]), 3, meta)      # the higher step: tried first
    _beat(store, "learner-1", 3)
    _save(store, "learner-2", _forge(states[3], 2), 2)        # honest shape, lower step
    _beat(store, "learner-2", 2)
    plan = _plan(store, template, ["learner-1", "learner-2"])
    assert plan.source == "peer" and plan.peer == "learner-2", plan.reason
    assert plan.skipped["learner-1"].startswith(("checkpoint at step 3: ",
                                                 "unreadable checkpoint at step 3: ")), plan.skipped
    assert reason in plan.skipped["learner-1"], plan.skipped


def test_a_restored_tree_of_other_shapes_or_dtypes_is_unsound(genuine):
    # Orbax hands a leaf back at its saved shape when the target's differs (seen with numpy
    # leaves), so the check does not rely on it.
    template, states = genuine
    target = abstract_target(template)
    assert state_problem(states[3], target, 3, INNER) is None
    name = next(iter(states[3]["anchors"][0]))
    for bad, said in ((np.zeros((1,), np.float32), "is float32[1], this learner's is float32["),
                      (np.asarray(states[3]["anchors"][0][name], np.float16), "is float16[")):
        anchors = [{**states[3]["anchors"][0], name: bad}, states[3]["anchors"][1]]
        problem = state_problem({**states[3], "anchors": anchors}, target, 3, INNER)
        assert problem is not None and problem.startswith(f"['anchors'][0]['{name}'] "), problem
        assert said in problem, problem


def test_a_genuine_adamw_state_is_within_the_moment_bound(genuine):
    _, states = genuine
    k = moment_bound(INNER.b1, INNER.b2)
    assert 1.0 < k < 1.3                          # sqrt(1.357) * 1.05 at b1 = 0.9, b2 = 0.95
    assert moment_bound(0.99, 0.95) is None       # b1**2 >= b2: no bound, no check
    adam = states[5]["train"].opt_state[1][0]
    for mu, nu in zip(jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu), strict=True):
        assert np.all(np.abs(mu) <= k * np.sqrt(nu) + INNER.eps)
    # and an adversarial gradient sequence (the Cauchy-Schwarz extremal: g_t growing as
    # (b2 / b1)**t) stays within it
    b1, b2 = INNER.b1, INNER.b2
    m = v = jnp.zeros(())
    for t in range(200):
        g = (b2 / b1) ** (t % 60)
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        assert abs(float(m)) <= k * float(jnp.sqrt(v))
