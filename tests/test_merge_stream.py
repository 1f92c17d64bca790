"""The streaming merge (diloco_core/merge_stream.py, through syncer.merge_fragment) against the
fragment-wide merge it replaced (tests/merge_reference.py, kept verbatim): the same new
parameters and outer state bit for bit, the same decision record (norms to the last bits, see
merge_stream's docstring), on a fragment of several tensors of different kinds and shapes."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from merge_reference import reference_merge_fragment

from diloco_core.compression import encode
from diloco_core.config import OuterOptConfig, SyncConfig
from diloco_core.contribution import Contribution
from diloco_core.fragments import plan_fragments
from diloco_core.outer import (
    PACKED,
    build_outer_optimizer,
    join_outer_states,
    pack_outer_state,
    unpack_outer_state,
)
from diloco_core.syncer import FragmentState, SyncerState, merge_fragment, merge_round

SHAPES = {"embed": (40, 24), "blocks/0/attn/q": (24, 24), "blocks/0/moe/experts_up": (3, 24, 16),
          "blocks/0/norm/scale": (24,), "blocks/0/mlp/odd": (7, 131)}
IS_EMBEDDING = lambda name: name == "embed"  # noqa: E731

OPTIMIZERS = {
    "nesterov": OuterOptConfig(lr=0.7, momentum=0.9),
    # inject_hyperparams (momentum warm-up) and a cosine lr: shared scalars in the state
    "warm-up, cosine": OuterOptConfig(lr=0.7, momentum=0.9, momentum_warmup_steps=3,
                                      lr_schedule="inner"),
    "plain sgd": OuterOptConfig(lr=1.0, momentum=0.0),
}


def _random(rng, scale=1.0):
    return {n: jnp.asarray(rng.standard_normal(s).astype(np.float32) * scale)
            for n, s in SHAPES.items()}


def _offer(rng, learner, encoding, base_version, scale=0.01, steps=4):
    delta = {n: encode(v, encoding, 64) for n, v in _random(rng, scale).items()}
    return Contribution(learner, 0, 0, base_version, 100 * steps, steps, steps, 0.0, delta)


def _bits(tree):
    return [(np.asarray(x).dtype, np.asarray(x).tobytes()) for x in jax.tree.leaves(tree)]


def _assert_same(new, old):
    (new_params, new_opt, new_rec), (old_params, old_opt, old_rec) = new, old
    assert list(new_params) == list(old_params)
    assert _bits(new_params) == _bits(old_params)            # bit for bit
    assert jax.tree.structure(new_opt) == jax.tree.structure(old_opt)
    assert _bits(new_opt) == _bits(old_opt)
    for field in ("merged", "version", "reason", "members", "weights", "tokens", "steps",
                  "rejected", "late", "bytes_in", "clipped"):
        assert getattr(new_rec, field) == getattr(old_rec, field), field
    # Whole-fragment norms: partial sums per tensor in float64, not one float32 program.
    np.testing.assert_allclose(new_rec.outer_grad_norms, old_rec.outer_grad_norms, rtol=1e-6)
    np.testing.assert_allclose(new_rec.merged_norm, old_rec.merged_norm, rtol=1e-6)
    np.testing.assert_allclose(new_rec.update_norm, old_rec.update_norm, rtol=1e-6)
    if old_rec.mean_cosine is None:
        assert new_rec.mean_cosine is None
    else:     # a diagnostic from a float32 Gram matrix per tensor
        assert new_rec.mean_cosine == pytest.approx(old_rec.mean_cosine, abs=1e-6)


# How the merge groups the fragment's tensors: all in one group (the defaults, on these small
# tensors), or a budget that makes groups of two, two and one tensor, with the cosine's Gram
# matrices on the host for the first two and in the program for the last.
GROUPINGS = {"one group": None, "several groups": (70_000, 1_000)}


@pytest.mark.parametrize("grouping", list(GROUPINGS))
@pytest.mark.parametrize("encoding", ["int4", "bf16"])
@pytest.mark.parametrize("stale", [False, True], ids=["fresh", "stale-base"])
def test_streaming_merge_equals_the_fragment_wide_merge(encoding, stale, grouping, monkeypatch):
    import diloco_core.merge_stream as merge_stream
    if GROUPINGS[grouping] is not None:
        budget, host_gram = GROUPINGS[grouping]
        monkeypatch.setattr(merge_stream, "_GROUP_BYTES", budget)
        monkeypatch.setattr(merge_stream, "_HOST_GRAM_VALUES", host_gram)
        # 3 kept members: 4 * (3 + 8) bytes a value.
        assert [len(g) for g in merge_stream._groups(list(SHAPES), SHAPES, 44)] == [2, 2, 1]
    rng = np.random.default_rng(7)
    names = list(SHAPES)
    # Version 2 is current; version 0 is still kept, version 1 is not (refused if offered).
    current = _random(rng)
    older = _random(rng, 0.01)
    versions = {0: {n: v - older[n] for n, v in current.items()}, 2: current}
    cfg = SyncConfig(num_fragments=1, sync_period=4, encoding=encoding, anchor="global")
    for label, opt in OPTIMIZERS.items():
        tx = build_outer_optimizer(opt, horizon_steps=10)
        params, outer = versions[2], tx.init(versions[2])
        for round_index in range(2):     # the outer state carries momentum after round 0
            current = FragmentState(params, 2, outer, versions.get)
            offers = [_offer(rng, "a", encoding, 2), _offer(rng, "b", encoding, 0 if stale else 2),
                      _offer(rng, "c", encoding, 2, steps=2),
                      _offer(rng, "huge", encoding, 2, scale=50.0),     # screened out
                      _offer(rng, "gone", encoding, 1)]                 # base no longer kept
            args = (current, names, 1, round_index, 0, offers, cfg, tx, IS_EMBEDDING, "test")
            for average in (False, True):
                new = merge_fragment(*args, average=average)
                old = reference_merge_fragment(*args, average=average)
                assert set(new[2].members) == {"a", "b", "c"}, (label, new[2])
                assert "huge" in new[2].rejected and "no longer kept" in new[2].rejected["gone"]
                _assert_same(new, old)
            params, outer = new[0], new[1]


def test_one_member_and_every_member_refused_match_too():
    rng = np.random.default_rng(3)
    cfg = SyncConfig(num_fragments=1, sync_period=4, encoding="int4")
    tx = build_outer_optimizer(OPTIMIZERS["nesterov"])
    params = _random(rng)
    current = FragmentState(params, 0, tx.init(params), lambda _: None)
    nan = _offer(rng, "nan", "fp32", 0)
    nan.delta["embed"] = encode(jnp.full(SHAPES["embed"], jnp.nan), "int4", 64)
    for offers in ([_offer(rng, "solo", "int4", 0)], [nan], [_offer(rng, "x", "int4", 3)]):
        args = (current, list(SHAPES), 1, 0, 0, offers, cfg, tx, IS_EMBEDDING, "test")
        new, old = merge_fragment(*args), reference_merge_fragment(*args)
        assert new[2] == old[2] if not new[2].merged else True
        if new[0] is None:
            assert old[0] is None and new[1] is None
        else:
            _assert_same(new, old)


def test_the_outer_state_packs_by_group_and_joins_back_to_itself():
    tx = build_outer_optimizer(OPTIMIZERS["warm-up, cosine"], horizon_steps=10)
    params = _random(np.random.default_rng(0))
    state = tx.init(params)
    names = frozenset(params)
    groups = [("embed", "blocks/0/attn/q"), ("blocks/0/moe/experts_up",),
              ("blocks/0/norm/scale", "blocks/0/mlp/odd")]
    parts = []
    for group in groups:
        packed = pack_outer_state(state, names,
                                  lambda d, g=group: jnp.concatenate([d[n].ravel() for n in g]))
        # One per-tensor dict in this state (the momentum), packed into one vector; the rest
        # shared scalars, untouched.
        assert len(jax.tree.leaves(packed)) == len(jax.tree.leaves(state)) - (len(params) - 1)
        parts.append((frozenset(group), unpack_outer_state(packed, lambda v, g=group: {
            n: x.reshape(params[n].shape) for n, x in zip(
                g, jnp.split(v, np.cumsum([params[n].size for n in g])[:-1]), strict=True)})))
        assert PACKED in str(jax.tree.structure(packed))
    joined = join_outer_states(state, names, parts)
    assert jax.tree.structure(joined) == jax.tree.structure(state)
    assert _bits(joined) == _bits(state)
    with pytest.raises(ValueError, match="do not cover"):
        join_outer_states(state, names, parts[:2])


def test_every_tensor_its_own_group_equals_the_fragment_wide_merge_too(monkeypatch):
    """A budget so small that every tensor is a group of its own and the loop waits before
    each: bit for bit the reference too."""
    import diloco_core.merge_stream as merge_stream
    monkeypatch.setattr(merge_stream, "_GROUP_BYTES", 4096)
    monkeypatch.setattr(merge_stream, "_HOST_GRAM_VALUES", 0)
    assert len(merge_stream._groups(list(SHAPES), SHAPES, 4 * 11)) == len(SHAPES)
    rng = np.random.default_rng(11)
    names = list(SHAPES)
    cfg = SyncConfig(num_fragments=1, sync_period=4, encoding="int4")
    tx = build_outer_optimizer(OPTIMIZERS["nesterov"], horizon_steps=10)
    params = _random(rng)
    outer = tx.init(params)
    for round_index in range(2):
        current = FragmentState(params, 0, outer, lambda _: None)
        offers = [_offer(rng, x, "int4", 0) for x in "abc"]
        args = (current, names, 1, round_index, 0, offers, cfg, tx, IS_EMBEDDING, "test")
        new = merge_fragment(*args)
        _assert_same(new, reference_merge_fragment(*args))
        params, outer = new[0], new[1]


def test_a_block_size_sent_with_an_unquantized_encoding_compiles_nothing_new():
    """The syncer checks a block size only where there are scales (int4, int8): a learner
    sending bf16 with a block size of its choosing must not make the merge compile its
    programs again (one compile per value it sends)."""
    import diloco_core.merge_stream as merge_stream
    rng = np.random.default_rng(5)
    cfg = SyncConfig(num_fragments=1, sync_period=4, encoding="bf16")
    tx = build_outer_optimizer(OPTIMIZERS["nesterov"])
    params = _random(rng)
    current = FragmentState(params, 0, tx.init(params), lambda _: None)

    def offers(block_size):
        made = [_offer(rng, x, "bf16", 0) for x in "ab"]
        return [replace(o, delta={n: replace(e, block_size=block_size)
                                  for n, e in o.delta.items()}) for o in made]

    merged = merge_fragment(current, list(SHAPES), 1, 0, 0, offers(64), cfg, tx, IS_EMBEDDING,
                            "test")
    assert merged[2].members == ("a", "b")
    compiled = (merge_stream._decoded_stacks._cache_size(),
                merge_stream._group_stats._cache_size())
    for block_size in (7, 4096):
        merged = merge_fragment(current, list(SHAPES), 1, 0, 0, offers(block_size), cfg, tx,
                                IS_EMBEDDING, "test")
        assert merged[2].members == ("a", "b"), merged[2].rejected
    assert (merge_stream._decoded_stacks._cache_size(),
            merge_stream._group_stats._cache_size()) == compiled


def test_history_is_kept_only_for_the_global_anchor_and_only_as_deep_as_accepted():
    rng = np.random.default_rng(1)
    plan = plan_fragments(SHAPES, 1)
    tx = build_outer_optimizer(OPTIMIZERS["nesterov"])
    for anchor, depth in (("global", 3), ("base", 0)):
        cfg = SyncConfig(num_fragments=1, sync_period=4, encoding="bf16", anchor=anchor)
        state = SyncerState.start([_random(rng)], tx, history_size=3)
        for r in range(5):
            state, record = merge_round(state, plan, r, 0,
                                        [_offer(rng, "a", "bf16", state.versions[0])], cfg, tx,
                                        IS_EMBEDDING, "test")
            assert record.merged
        assert sorted(state.history[0]) == [3, 4, 5][3 - depth:]
        if depth:       # the newest version is the current fragment itself, not a copy
            assert state.history[0][5] is state.fragments[0]
