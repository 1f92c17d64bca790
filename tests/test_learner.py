"""A learner's sync bookkeeping: counters, contributions, overwrite/blend/rebase on receipt."""

import jax.numpy as jnp
import numpy as np

from diloco_core.compression import decode
from diloco_core.fragments import plan_fragments, split_params
from diloco_core.learner import LearnerSync


def _setup():
    params = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([3.0])}
    plan = plan_fragments({k: v.shape for k, v in params.items()}, 2)   # a -> 0, b -> 1
    return params, plan, LearnerSync.start("l0", split_params(params, plan), [0, 0])


def test_counters_count_every_fragment_and_contribution_is_anchor_minus_theta():
    params, plan, sync = _setup()
    sync = sync.after_step(128).after_step(64)
    assert [(f.steps, f.tokens) for f in sync.fragments] == [(2, 192), (2, 192)]
    trained = {"a": jnp.array([0.5, 2.5]), "b": jnp.array([3.0])}
    c = sync.contribution(trained, plan, 0, round_index=7, learner_step=2, clock=1.5,
                          encoding="fp32", block_size=64)
    assert (c.learner, c.fragment, c.round, c.base_version) == ("l0", 0, 7, 0)
    assert (c.tokens, c.steps, c.learner_step, c.clock) == (192, 2, 2, 1.5)
    # delta = anchor - theta = (1 - 0.5, 2 - 2.5) = (0.5, -0.5): the outer-gradient sign.
    np.testing.assert_allclose(decode(c.delta["a"]), [0.5, -0.5])
    assert c.nbytes == 2 * 4


def test_overwrite_resets_only_that_fragment_and_ignores_stale_versions():
    params, plan, sync = _setup()
    sync = sync.after_step(100)
    local = {"a": jnp.array([9.0, 9.0]), "b": jnp.array([9.0])}
    merged = {"a": jnp.array([4.0, 5.0])}
    new, sync2 = sync.receive(local, 0, merged, version=1)
    np.testing.assert_allclose(new["a"], [4.0, 5.0])
    np.testing.assert_allclose(new["b"], [9.0])               # other fragment untouched
    assert (sync2.fragments[0].steps, sync2.fragments[0].tokens, sync2.fragments[0].version) \
        == (0, 0, 1)
    assert (sync2.fragments[1].steps, sync2.fragments[1].tokens) == (1, 100)
    np.testing.assert_allclose(sync2.fragments[0].anchor["a"], [4.0, 5.0])
    # A fresh buffer: the learner's params get donated, the merged values must survive.
    assert new["a"] is not merged["a"]
    # An older or equal version arriving late changes nothing.
    same, sync3 = sync2.receive(new, 0, {"a": jnp.array([0.0, 0.0])}, version=1)
    assert sync3 is sync2 and same is new


def test_blend_mixes_local_and_global():
    params, plan, sync = _setup()
    local = {"a": jnp.array([2.0, 4.0]), "b": jnp.array([0.0])}
    new, sync = sync.receive(local, 0, {"a": jnp.array([0.0, 0.0])}, version=1,
                             rule="blend", alpha=0.25)
    # 0.25 * local + 0.75 * global = (0.5, 1.0)
    np.testing.assert_allclose(new["a"], [0.5, 1.0])
    assert sync.fragments[0].steps == 0


def test_rebase_keeps_the_progress_made_since_the_offer():
    params, plan, sync = _setup()
    sync = sync.after_step(100).after_step(100)
    offered = {"a": jnp.array([0.5, 1.5]), "b": jnp.array([3.0])}
    sync = sync.after_offer(offered, plan, 0)
    offered["a"] = offered["a"].at[0].set(-99.0)   # the snapshot is a copy (params are donated)
    sync = sync.after_step(50)                      # one more step while the offer is in flight
    now = {"a": jnp.array([0.25, 1.75]), "b": jnp.array([2.0])}
    merged = {"a": jnp.array([0.75, 1.25])}
    new, sync2 = sync.receive(now, 0, merged, version=1, rule="rebase")
    # merged + (now - offered) = (0.75 - 0.25, 1.25 + 0.25)
    np.testing.assert_allclose(new["a"], [0.5, 1.5])
    np.testing.assert_allclose(new["b"], [2.0])
    f = sync2.fragments[0]
    assert (f.version, f.steps, f.tokens, f.offered_values) == (1, 1, 50, None)
    np.testing.assert_allclose(f.anchor["a"], [0.75, 1.25])
    # The next offer carries exactly the kept progress: anchor - theta = -(now - offered).
    c = sync2.contribution(new, plan, 0, 3, 3, 0.0, "fp32", 64)
    np.testing.assert_allclose(decode(c.delta["a"]), [0.25, -0.25])
    assert (c.steps, c.tokens) == (1, 50)


def test_rebase_without_an_offer_keeps_everything_since_the_anchor():
    params, plan, sync = _setup()
    sync = sync.after_step(100)
    now = {"a": jnp.array([1.5, 2.5]), "b": jnp.array([3.0])}
    new, sync2 = sync.receive(now, 0, {"a": jnp.array([0.0, 0.0])}, version=1, rule="rebase")
    np.testing.assert_allclose(new["a"], [0.5, 0.5])     # merged + (now - anchor (1, 2))
    assert (sync2.fragments[0].steps, sync2.fragments[0].tokens) == (1, 100)


def _offered_then_stepped():
    """Anchor (1, 2); offered at (0.5, 1.5) after 200 tokens, then one more step of 50."""
    params, plan, sync = _setup()
    sync = sync.after_step(100).after_step(100)
    sync = sync.after_offer({"a": jnp.array([0.5, 1.5]), "b": jnp.array([3.0])}, plan, 0,
                            round_index=4)
    sync = sync.after_step(50)
    return plan, sync, {"a": jnp.array([0.25, 1.75]), "b": jnp.array([2.0])}


def test_rebase_on_a_merge_without_the_offer_keeps_everything_since_the_anchor():
    # A late or refused offer: the merge of its round does not hold its progress, so nothing
    # of it may be dropped (it goes into the next offer, with its counters).
    plan, sync, now = _offered_then_stepped()
    fate = sync.offer_fate(0, merged_round=4, merged_with={4: False})
    assert fate == "not_merged"
    new, sync2 = sync.receive(now, 0, {"a": jnp.array([0.75, 1.25])}, version=1,
                              rule="rebase", offer=fate)
    np.testing.assert_allclose(new["a"], [0.0, 1.0])     # merged + (now - anchor (1, 2))
    f = sync2.fragments[0]
    assert (f.steps, f.tokens, f.offered_values, f.offered_round) == (3, 250, None, None)


def test_rebase_on_an_earlier_rounds_merge_keeps_the_offer_pending_until_its_own():
    plan, sync, now = _offered_then_stepped()
    assert sync.offer_fate(0, merged_round=2, merged_with={2: False}) == "pending"
    # Round 2's merge (without this learner) moves the fragment by (+0.5, +0.5).
    mid, sync2 = sync.receive(now, 0, {"a": jnp.array([1.5, 2.5])}, version=1,
                              rule="rebase", offer="pending")
    np.testing.assert_allclose(mid["a"], [0.75, 2.25])   # everything kept
    f = sync2.fragments[0]
    assert (f.steps, f.tokens, f.offered_round) == (3, 250, 4)
    np.testing.assert_allclose(f.offered_values["a"], [1.0, 2.0])   # moved by the same change
    # Round 4's merge takes the offer: what it offered goes, the step after it stays.
    assert sync2.offer_fate(0, merged_round=4, merged_with={4: True}) == "merged"
    new, sync3 = sync2.receive(mid, 0, {"a": jnp.array([3.0, 3.0])}, version=2,
                               rule="rebase", offer="merged")
    np.testing.assert_allclose(new["a"], [2.75, 3.25])   # merged + (now - offered)
    assert (sync3.fragments[0].steps, sync3.fragments[0].tokens) == (1, 50)


def test_an_offer_fate_nobody_can_speak_for_is_taken_as_merged():
    plan, sync, _ = _offered_then_stepped()
    assert sync.offer_fate(0, merged_round=None, merged_with={}) == "merged"
    assert sync.offer_fate(0, merged_round=6, merged_with={6: False}) == "merged"
    # Every version since the one held is known, and none came from round 4: it merged nothing.
    assert sync.offer_fate(0, merged_round=6, merged_with={6: False}, complete=True) == (
        "not_merged")
    assert sync.offer_fate(0, merged_round=6, merged_with={4: False, 6: False}) == "not_merged"
    assert sync.offer_fate(1, merged_round=6, merged_with={}) == "merged"   # nothing offered
