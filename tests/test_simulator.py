"""The reference simulator: determinism, failures and rejoin, and the equivalences that pin it down
(M=1 is plain training; K=M, P=1, tau=0 with equal tokens is synchronous DiLoCo)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco_core.baselines import run_data_parallel, run_synchronous_diloco, synchronous_config
from diloco_core.config_loading import config_from_mapping
from diloco_core.fragments import join_fragments
from diloco_core.inner_step import InnerStep
from diloco_core.merge import weighted_mean
from diloco_core.model import init_model, param_count
from diloco_core.objectives import concat_batches
from diloco_core.outer import outer_optimizer_for, outer_step
from diloco_core.shards import learner_data
from diloco_core.simulator import Simulation, run_simulation
from resources.corpus import load_corpus

TINY = {
    "model": {"preset": "tiny"},
    "data": {"seq_len": 32, "batch_size": 4},
    "inner": {"warmup_steps": 2},
    "learners": {"num_learners": 3},
    "sync": {"num_fragments": 2, "sync_period": 4, "overlap_steps": 1, "min_quorum": 1},
    "simulation": {"eval_points": 4, "eval_batches": 2, "sync_seconds": 0.3},
    # 3 learners x 24 steps x 128 tokens
    "token_budget": 3 * 24 * 128,
}


def tiny_cfg(*overrides):
    return config_from_mapping(TINY, list(overrides))


@pytest.fixture(scope="module")
def corpus():
    return load_corpus("stdlib", 3, 0.05, max_bytes_per_split=300_000)


def _streams(corpus, m):
    return corpus.learner_streams[:m]


def _assert_trees_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)


def test_same_seed_and_schedule_give_bitwise_identical_runs(corpus):
    cfg = tiny_cfg("simulation.step_jitter=0.1",
                   "simulation.outages=[{learner: 2, start: 4.0, end: 9.0}]")
    a = run_simulation(cfg, corpus.learner_streams, corpus.heldout_stream)
    b = run_simulation(cfg, corpus.learner_streams, corpus.heldout_stream)
    _assert_trees_equal(a.final_params, b.final_params)
    assert [dataclasses.astuple(m) for m in a.merges] == [dataclasses.astuple(m) for m in b.merges]
    assert a.evals == b.evals and a.wall_seconds == b.wall_seconds


def test_global_model_keeps_advancing_while_a_learner_is_down_and_it_rejoins(corpus):
    cfg = tiny_cfg("simulation.outages=[{learner: 1, start: 4.0, end: 10.0}]")
    result = run_simulation(cfg, corpus.learner_streams, corpus.heldout_stream)
    during = [m for m in result.merges if m.merged and 4.0 <= _merge_time(result, m) < 10.0]
    assert len(during) >= 3, "merges must continue during the outage"
    assert all("learner-1" not in m.members for m in during)
    assert result.uptime == pytest.approx(1.0)
    (rejoin,) = result.rejoins
    assert rejoin.learner == "learner-1" and rejoin.up_at == 10.0
    assert rejoin.first_merge_at is not None and rejoin.first_merge_at < 10.0 + 4 * 1.0
    stats = {s.name: s for s in result.learners}
    assert stats["learner-1"].down_seconds == pytest.approx(6.0)
    assert result.tokens_processed >= cfg.token_budget
    assert np.isfinite(result.final_loss)


def _merge_time(result, record):
    return result.merge_times[record.round]


def test_synchronous_diloco_stalls_during_the_same_outage(corpus):
    cfg = tiny_cfg("simulation.outages=[{learner: 1, start: 4.0, end: 10.0}]")
    sync = run_synchronous_diloco(cfg, corpus.learner_streams, corpus.heldout_stream)
    decoupled = run_simulation(cfg, corpus.learner_streams, corpus.heldout_stream)
    assert sync.uptime < 0.85 < decoupled.uptime
    assert sync.goodput < decoupled.goodput
    # Every learner in every merge (in arrival order: a learner back from its outage answers
    # the round its own step opened one step later, as a real learner does).
    assert all(sorted(m.members) == ["learner-0", "learner-1", "learner-2"]
               for m in sync.merges if m.merged)


def test_slow_learners_cost_goodput_only_when_the_quorum_waits_for_them(corpus):
    # Slow learner: 2 steps per round take 5 s; fast ones run tau=1 step ahead (3 s), then
    # wait (pacing); with K=1 the rounds go at the fast learners' pace and nobody waits.
    speeds = "learners.speeds=[1.0, 1.0, 0.4]"
    wait_all = run_simulation(tiny_cfg(speeds, "sync.min_quorum=3", "sync.grace_gamma=0",
                                       "sync.block_on_overlap=true"),
                              corpus.learner_streams, corpus.heldout_stream)
    k1 = run_simulation(tiny_cfg(speeds, "sync.min_quorum=1", "sync.block_on_overlap=true"),
                        corpus.learner_streams, corpus.heldout_stream)
    assert wait_all.goodput < 0.85
    assert k1.goodput > 0.97


def test_one_learner_with_outer_lr_1_and_no_momentum_is_plain_training(corpus):
    # Pacing with tau = 0: the learner waits for each merge (a barrier), as plain training.
    cfg = tiny_cfg("learners.num_learners=1", "sync.num_fragments=1", "sync.overlap_steps=0",
                   "sync.block_on_overlap=true", "outer.lr=1.0", "outer.momentum=0.0",
                   "sync.encoding=fp32", "token_budget=3072")  # 24 steps of 128 tokens
    result = run_simulation(cfg, corpus.learner_streams[:1], corpus.heldout_stream)
    model_def, params = init_model(cfg.model, cfg.seed)
    inner = InnerStep(model_def, cfg.inner, cfg.total_learner_steps)
    state = inner.init(params)
    data = learner_data(cfg, 0, corpus.learner_streams[0])
    for _ in range(cfg.total_learner_steps):
        state, _ = inner.step(state, data.next())
    # Equal up to float32 rounding: the outer step theta - 1.0 * (theta - s) lands within an
    # ulp of s each round, and AdamW's normalised steps carry that on (at inner lr 8e-3 one
    # weight in 8,192 drifted 1e-5 over the 24 steps); a step lost or taken twice moves the
    # weights by about the lr.
    for k in params:
        np.testing.assert_allclose(result.final_params[k], state.params[k], atol=2e-5, err_msg=k)


def test_full_quorum_single_fragment_no_overlap_is_synchronous_diloco(corpus):
    # The last sync falls on the budget, so it is a final round: an outer step here, as in
    # the plain loop below (the "average" final rounds are tested on their own).
    cfg = tiny_cfg("sync.min_quorum=3", "sync.num_fragments=1", "sync.overlap_steps=0",
                   "sync.block_on_overlap=true",
                   "sync.grace_gamma=0", "sync.encoding=fp32", "sync.merge_rule=mean",
                   "outer.final_rounds=outer_step")
    result = run_simulation(cfg, corpus.learner_streams, corpus.heldout_stream)
    # An independent, plain synchronous DiLoCo loop on the same data.
    m, h = cfg.learners.num_learners, cfg.sync.sync_period
    model_def, theta = init_model(cfg.model, cfg.seed)
    inner = InnerStep(model_def, cfg.inner, cfg.total_learner_steps)
    tx = outer_optimizer_for(cfg)
    opt = tx.init(theta)
    states = [inner.init(jax.tree.map(jnp.array, theta)) for _ in range(m)]
    data = [learner_data(cfg, i, corpus.learner_streams[i]) for i in range(m)]
    for _ in range(cfg.total_learner_steps // h):
        for i in range(m):
            for _ in range(h):
                states[i], _ = inner.step(states[i], data[i].next())
        grads = {k: weighted_mean(jnp.stack([theta[k] - s.params[k] for s in states]),
                                  jnp.full((m,), 1 / m)) for k in theta}
        theta, opt = outer_step(tx, theta, opt, grads)
        states = [s.replace(params=jax.tree.map(jnp.array, theta)) for s in states]
    merged = [r for r in result.merges if r.merged]
    assert len(merged) == cfg.total_learner_steps // h
    assert all(len(r.members) == 3 for r in merged)
    for k in theta:
        np.testing.assert_allclose(result.final_params[k], theta[k], atol=2e-6, err_msg=k)
    # And the synchronous-DiLoCo baseline is exactly this configuration (with uniform weights,
    # which equal token weights here because every learner processes the same tokens).
    sync_cfg = synchronous_config(tiny_cfg("sync.encoding=fp32"))
    assert (sync_cfg.sync.min_quorum, sync_cfg.sync.num_fragments,
            sync_cfg.sync.overlap_steps, sync_cfg.sync.block_on_overlap) == (3, 1, 0, True)


def test_data_parallel_baseline_uses_the_same_budget(corpus):
    cfg = tiny_cfg()
    dp = run_data_parallel(cfg, corpus.learner_streams, corpus.heldout_stream)
    assert dp.tokens_processed == cfg.token_budget
    assert dp.method == "data_parallel" and np.isfinite(dp.final_loss)
    assert dp.goodput == pytest.approx(1.0)


def _assert_time_accounts_for_wall(result):
    for s in result.learners:
        total = (s.busy_seconds + s.idle_seconds + s.down_seconds + s.lost_seconds
                 + s.closing_seconds)
        assert total == pytest.approx(result.wall_seconds, abs=1e-6), s


@pytest.mark.parametrize("overrides", [
    # The paper's shape: one fragment per step (P = H), two in flight (tau = 2), uneven speeds.
    ["sync.num_fragments=2", "sync.sync_period=2", "sync.overlap_steps=2", "sync.min_quorum=2",
     "learners.speeds=[1.0, 1.0, 1.7]", "simulation.step_jitter=0.3"],
    ["sync.num_fragments=1", "sync.sync_period=1", "sync.overlap_steps=2",
     "simulation.outages=[{learner: 0, start: 2.5, end: 7.2}]"],
    ["sync.min_quorum=3", "sync.grace_min_seconds=2.0", "simulation.step_jitter=0.2",
     "simulation.outages=[{learner: 2, start: 3.3, end: 5.1}, {learner: 2, start: 8, end: 9}]"],
    # Rebase carries steps past a receipt: still none may be merged twice.
    ["sync.receive_rule=rebase", "sync.overlap_steps=3", "simulation.sync_seconds=2.5",
     "simulation.step_jitter=0.2", "simulation.outages=[{learner: 1, start: 6.5, end: 9}]"],
])
def test_accounting_is_exact_and_no_step_is_merged_twice(corpus, overrides):
    result = run_simulation(tiny_cfg(*overrides), corpus.learner_streams, corpus.heldout_stream)
    _assert_time_accounts_for_wall(result)
    assert 0 < result.goodput <= 1.0
    # Each learner step counts in at most one merge per fragment: a learner's merged steps per
    # fragment never exceed the steps it took.
    for s in result.learners:
        for fragment in {m.fragment for m in result.merges}:
            merged = sum(st for m in result.merges if m.merged and m.fragment == fragment
                         for name, st in zip(m.members, m.steps, strict=True) if name == s.name)
            assert merged <= s.steps, (s.name, fragment, merged, s.steps)


def test_data_parallel_loses_the_step_a_failure_interrupts(corpus):
    cfg = tiny_cfg("simulation.outages=[{learner: 1, start: 4.2, end: 4.8}]")
    dp = run_data_parallel(cfg, corpus.learner_streams, corpus.heldout_stream)
    # 24 steps of 1 s, plus 0.2 s of the interrupted step and 0.6 s stalled.
    assert dp.wall_seconds == pytest.approx(24.8)
    _assert_time_accounts_for_wall(dp)


def test_unequal_batch_sizes_count_tokens_per_learner_and_weight_by_them(corpus):
    cfg = tiny_cfg("learners.batch_sizes=[2, 4, 6]")
    assert cfg.learner_step_tokens == (64, 128, 192)
    assert cfg.total_learner_steps == cfg.token_budget // (64 + 128 + 192)
    result = run_simulation(cfg, corpus.learner_streams, corpus.heldout_stream)
    for stats, step_tokens in zip(result.learners, cfg.learner_step_tokens, strict=True):
        assert stats.tokens == stats.steps * step_tokens
    # w = tokens^2 / steps: at equal steps a learner with 3x the batch gets 9x the weight.
    full = [m for m in result.merges if m.merged and len(m.members) == 3
            and len(set(m.steps)) == 1]
    assert full, "expected rounds that merged all three learners at equal steps"
    for m in full:
        w = dict(zip(m.members, m.weights, strict=True))
        assert w["learner-2"] / w["learner-0"] == pytest.approx(9.0, rel=1e-5)
    uniform = run_simulation(tiny_cfg("learners.batch_sizes=[2, 4, 6]", "sync.weighting=uniform"),
                             corpus.learner_streams, corpus.heldout_stream)
    assert all(len(set(m.weights)) == 1 for m in uniform.merges if m.merged)
    dp = run_data_parallel(cfg, corpus.learner_streams, corpus.heldout_stream)
    for stats, step_tokens in zip(dp.learners, cfg.learner_step_tokens, strict=True):
        assert stats.tokens == stats.steps * step_tokens


def test_merge_records_the_learners_pairwise_cosine(corpus):
    result = run_simulation(tiny_cfg("sync.min_quorum=3"), corpus.learner_streams,
                            corpus.heldout_stream)
    multi = [m for m in result.merges if m.merged and len(m.members) >= 2]
    assert multi
    # Learners on different shards move in related but far from identical directions.
    assert all(-1.0 <= m.mean_cosine < 0.99 for m in multi)
    assert all(m.mean_cosine is None for m in result.merges if len(m.members) == 1)


def test_rebase_merges_the_steps_overwrite_discards_under_merge_latency(corpus):
    slow = ("simulation.sync_seconds=2.5", "sync.overlap_steps=3")
    overwrite = run_simulation(tiny_cfg(*slow, "sync.receive_rule=overwrite"),
                               corpus.learner_streams, corpus.heldout_stream)
    rebase = run_simulation(tiny_cfg(*slow, "sync.receive_rule=rebase"), corpus.learner_streams,
                            corpus.heldout_stream)
    # With 2.5 steps of merge latency, overwrite discards the steps taken while an offer is in
    # flight; rebase keeps them for the next offer, so nearly every processed token is merged.
    assert overwrite.merged_token_fraction < 0.8
    assert rebase.merged_token_fraction > 0.97


def test_equal_learners_without_jitter_are_all_admitted_to_every_round(corpus):
    # Equal step times put every learner's step end at the same instant as the one that opens
    # a round; none of them may fall a step behind and miss rounds because of event order.
    result = run_simulation(tiny_cfg("sync.overlap_steps=1"), corpus.learner_streams,
                            corpus.heldout_stream)
    regular = [m for m in result.merges if "final round" not in m.reason]
    assert len(regular) >= 8
    assert all(len(m.members) == 3 for m in regular), [m.members for m in regular]


def test_the_simulator_runs_the_round_protocol(corpus):
    """The rules the orchestrated deciders run (tests/test_round_protocol.py), checked on a
    simulated run with jitter, K = 2 < M and an outage: one round open at a time, round r on
    fragment r mod P, no learner offers a fragment again while its offer is in flight."""
    from diloco_core.simulator import Simulation

    cfg = tiny_cfg("sync.min_quorum=2", "simulation.step_jitter=0.2",
                   "simulation.outages=[{learner: 1, start: 3.0, end: 8.0}]")
    sim = Simulation(cfg, corpus.learner_streams, corpus.heldout_stream)
    sim.run()
    rounds = [sim.control.rounds[r] for r in sorted(sim.control.rounds)]
    assert len(rounds) >= 8
    for previous, rnd in zip(rounds, rounds[1:], strict=False):
        assert rnd.fragment == rnd.index % cfg.sync.num_fragments
        assert rnd.opened_at >= sim.control.merge_times.get(previous.index, previous.opened_at)
    # Offers of one fragment by one learner: each covers steps no other offer covers.
    for learner in cfg.learners.learner_names:
        steps = [(r.fragment, r.contributions[learner].learner_step,
                  r.contributions[learner].steps) for r in rounds if learner in r.contributions]
        for p in range(cfg.sync.num_fragments):
            mine = [(at, n) for f, at, n in steps if f == p]
            for (at_a, _), (at_b, n_b) in zip(mine, mine[1:], strict=False):
                assert at_b - n_b >= at_a - 1e-9, (learner, p, mine)


def test_a_merge_delivered_during_the_last_step_does_not_hold_a_final_round():
    """At STOP a slow learner (0.4x) may hold a merge delivered during its dropped last step,
    for a fragment whose offer it has in flight. It applies that merge before it answers, as
    the learner runtime applies what a poll brought before it offers; left queued, the offer
    stayed in flight, the learner could not answer the fragment's final round, and the round
    (which waits for every live learner) waited out its 300 s timeout (seed 5: 326 s for a
    26 s run; experiment 4 on the tiny model at 4M tokens: 1,000 s for a 700 s run)."""
    corpus = load_corpus("stdlib", 4, 0.05, max_bytes_per_split=300_000)
    cfg = tiny_cfg("learners.num_learners=4", "learners.speeds=[1.0, 1.0, 0.4, 0.4]",
                   "simulation.step_jitter=0.2", "sync.grace_gamma=0", "seed=5",
                   "sync.num_fragments=4", "sync.sync_period=4")
    result = run_simulation(cfg, corpus.learner_streams, corpus.heldout_stream)
    finals = [m for m in result.merges if "final round" in m.reason]
    assert len(finals) == 4 and not [m.reason for m in finals if "timed out" in m.reason]
    assert result.wall_seconds < 2 * cfg.nominal_run_seconds < \
        cfg.orchestration.round_timeout_seconds


@pytest.mark.parametrize("final_rounds", ["average", "outer_step"])
def test_average_final_rounds_publish_the_learners_own_parameters(corpus, final_rounds):
    """One learner (fp32, momentum 0.9): an "average" final round publishes exactly what the
    learner holds when it offers; an outer step there (the old behaviour) moves past it on
    momentum."""
    from diloco_core.simulator import Simulation

    class Watched(Simulation):
        gaps: list[float] = []

        def _merge(self, decision, t):
            rnd = self.control.rounds[decision.round]
            held = {k: v for k, v in self.learners[0].train.params.items()
                    if k in self.plan.fragments[rnd.fragment]}
            super()._merge(decision, t)
            if decision.final and decision.members:
                published = self.syncer.fragments[rnd.fragment]
                self.gaps.append(max(float(jnp.max(jnp.abs(published[k] - held[k])))
                                     for k in held))

    cfg = tiny_cfg("learners.num_learners=1", "sync.encoding=fp32", "token_budget=3072",
                   f"outer.final_rounds={final_rounds}")
    sim = Watched(cfg, corpus.learner_streams[:1], corpus.heldout_stream)
    sim.run()
    assert sim.gaps, "no final round merged anything"
    if final_rounds == "average":
        assert max(sim.gaps) < 1e-6
    else:
        assert min(sim.gaps) > 1e-4


def test_warm_start_forks_every_learner_from_a_data_parallel_phase(corpus):
    cfg = tiny_cfg("learners.warm_start_fraction=0.5", "simulation.step_jitter=0.1")
    sim = Simulation(cfg, corpus.learner_streams, corpus.heldout_stream)
    sim._warm_start()
    # By hand: 12 lock-step AdamW steps on the three learners' batches together (half of
    # 3 x 24 x 128 tokens), on the learners' own seeded shards, on the run's inner schedule.
    model_def, params = init_model(cfg.model, cfg.seed)
    inner = InnerStep(model_def, cfg.inner, cfg.total_learner_steps)
    state = inner.init(params)
    data = [learner_data(cfg, i, s) for i, s in enumerate(corpus.learner_streams)]
    for _ in range(12):
        state, _ = inner.step(state, concat_batches([d.next() for d in data]))
    assert sim.totals.tokens == 3 * 12 * 128 and sim.now > 0
    for learner in sim.learners:
        _assert_trees_equal(learner.train.params, state.params)
        assert int(learner.train.step) == 12 and learner.stats.steps == 12
        # Each learner's next batch is the one after its warm-start batches: no data re-read.
        np.testing.assert_array_equal(learner.data.next(), data[learner.index].next())
    _assert_trees_equal(dict(join_fragments(sim.syncer.fragments)), state.params)

    result = run_simulation(cfg, corpus.learner_streams, corpus.heldout_stream)
    _assert_time_accounts_for_wall(result)
    assert result.tokens_processed >= cfg.token_budget
    assert sum(s.tokens for s in result.learners) == result.tokens_processed
    assert result.merges and all(m.merged for m in result.merges[:2])


def test_warm_start_refuses_outages_it_would_not_model():
    from diloco_core.config import ConfigError

    with pytest.raises(ConfigError) as err:
        tiny_cfg("learners.warm_start_fraction=0.25",
                 "simulation.outages=[{learner: 0, start: 1, end: 2}]")
    assert err.value.field == "learners.warm_start_fraction"
    with pytest.raises(ConfigError, match=r"must be in \[0, 1\)"):
        tiny_cfg("learners.warm_start_fraction=1.0")


SCAVENGED = "simulation.capacity=[{learner: 2, join: 0.25, leave: 0.75}]"


def test_scavenged_capacity_joins_from_the_global_model_and_leaves_for_good(corpus):
    """Learner 2 is there for the middle half of the run only: it joins from the global
    parameters with a peer's AdamW state and step (as a rejoining learner does), trains on its
    own shard, leaves for good, and the run reaches the budget sooner than without it."""
    cfg = tiny_cfg(SCAVENGED)
    # 2 learners throughout and 1 for half the run: 2.5 learners' steps of 128 tokens.
    assert cfg.total_learner_steps == 9216 // 320 == 28
    run_seconds = cfg.nominal_run_seconds
    joined = {}

    class Watched(Simulation):
        def _on_join(self, t, index):
            super()._on_join(t, index)
            learner = self.learners[index]
            peers = [p for p in self.learners if p.up and p.index != index]
            donor = max(peers, key=lambda p: p.stats.steps)
            joined.update(t=t, step=int(learner.train.step), donor_step=int(donor.train.step),
                          params=jax.device_get(learner.train.params),
                          global_params=jax.device_get(join_fragments(self.syncer.fragments)),
                          read=learner.data.state())

    result = Watched(cfg, corpus.learner_streams, corpus.heldout_stream).run()
    assert joined["t"] == 0.25 * run_seconds
    assert joined["step"] == joined["donor_step"] > 0
    _assert_trees_equal(joined["params"], joined["global_params"])
    # Nothing of its shard was read before it joined: its data is nobody else's.
    fresh = learner_data(cfg, 2, corpus.learner_streams[2]).state()
    assert joined["read"] == fresh
    extra = result.learners[2]
    assert 0.5 * run_seconds - 2 <= extra.steps <= 0.5 * run_seconds + 1
    assert extra.absent_seconds == pytest.approx(result.wall_seconds - 0.5 * run_seconds)
    assert extra.down_seconds == 0.0 and result.rejoins == []
    assert result.tokens_processed >= cfg.token_budget
    # Faster than the two base learners alone (36 s), slower than three throughout (24 s).
    assert 24 < result.wall_seconds < 36

    # Data-parallel with an elastic batch: the extra learner's batches join the global batch
    # while it is there.
    dp = run_data_parallel(cfg, corpus.learner_streams, corpus.heldout_stream)
    assert 0.5 * run_seconds - 2 <= dp.learners[2].steps <= 0.5 * run_seconds + 1
    assert dp.learners[0].steps > dp.learners[2].steps and 24 < dp.wall_seconds < 36
    # Bytes: the bf16 gradients of the learners present at each step.
    assert dp.bytes_up == param_count(cfg.model) * 2 * sum(s.steps for s in dp.learners)


def test_scavenged_capacity_pays_its_start_up_and_data_parallel_its_link_and_restarts(corpus):
    """The prices of capacity that comes and goes (issue 38's scavenging model): a DiLoCo
    learner starts training only after its start-up (its capacity idle, booked as down time);
    data-parallel's steps wait for an all-reduce over the inter-site link while the remote
    capacity is in the batch, and each join and leave restarts the whole job."""
    prices = ("simulation.capacity_start_seconds=3", "simulation.capacity_allreduce_seconds=0.5",
              "simulation.capacity_restart_seconds=2")
    cfg = tiny_cfg(SCAVENGED, *prices)
    run_seconds = cfg.nominal_run_seconds
    joined = {}

    class Watched(Simulation):
        def _on_join(self, t, index):
            joined[index] = t
            super()._on_join(t, index)

    result = Watched(cfg, corpus.learner_streams, corpus.heldout_stream).run()
    assert joined == {2: 0.25 * run_seconds + 3}
    extra = result.learners[2]
    assert extra.down_seconds == pytest.approx(3.0)
    assert extra.absent_seconds == pytest.approx(result.wall_seconds - 0.5 * run_seconds)
    assert 0.5 * run_seconds - 5 <= extra.steps <= 0.5 * run_seconds - 2
    for s in result.learners:     # every second of the run booked once, absence included
        assert (s.busy_seconds + s.idle_seconds + s.down_seconds + s.lost_seconds
                + s.closing_seconds + s.absent_seconds) == pytest.approx(result.wall_seconds)

    free = run_data_parallel(tiny_cfg(SCAVENGED), corpus.learner_streams,
                             corpus.heldout_stream)
    dp = run_data_parallel(cfg, corpus.learner_streams, corpus.heldout_stream)
    base, remote = dp.learners[0], dp.learners[2]
    # Two restarts (the join and the leave) for the base learners, one for the joiner; every
    # step with the joiner in the batch waited 0.5 s for the link (1 s steps, no jitter).
    assert base.down_seconds == pytest.approx(4.0) and remote.down_seconds == pytest.approx(2.0)
    assert dp.wall_seconds == pytest.approx(base.steps * 1.0 + remote.steps * 0.5 + 4.0)
    # The window is time: slower steps fit fewer of the joiner's batches into it.
    assert remote.steps < free.learners[2].steps
    assert dp.wall_seconds > free.wall_seconds
    for s in dp.learners:
        assert (s.busy_seconds + s.idle_seconds + s.down_seconds + s.lost_seconds
                + s.absent_seconds) == pytest.approx(dp.wall_seconds)


def test_a_standby_learner_never_joins_without_a_window_and_the_schedule_ignores_it(corpus):
    """`learners.standby` is capacity that may not come: the schedule is the base's, and in the
    simulator a standby learner without a capacity window takes no step; with one, it joins."""
    base = tiny_cfg("learners.num_learners=2", "learners.speeds=[1.0, 1.0]")
    cfg = tiny_cfg("learners.standby=1")
    assert cfg.total_learner_steps == base.total_learner_steps == 9216 // 256
    result = run_simulation(cfg, corpus.learner_streams, corpus.heldout_stream)
    assert result.learners[2].steps == 0 and result.learners[0].steps > 0
    assert result.tokens_processed >= cfg.token_budget
    dp = run_data_parallel(cfg, corpus.learner_streams, corpus.heldout_stream)
    assert dp.learners[2].steps == 0
    windowed = tiny_cfg("learners.standby=1", SCAVENGED)
    assert windowed.total_learner_steps == 28     # its window counts, as without standby
    assert run_simulation(windowed, corpus.learner_streams,
                          corpus.heldout_stream).learners[2].steps > 0


@pytest.mark.parametrize("overrides, field", [
    (["simulation.capacity=[{learner: 0, join: 0.1}, {learner: 1, join: 0.2}]",
      "sync.min_quorum=2"], "sync.min_quorum"),
    (["simulation.capacity=[{learner: 2, join: 0.1}, {learner: 2, join: 0.5}]"],
     "simulation.capacity[1].learner"),
    (["simulation.capacity=[{learner: 3, join: 0.1}]"], "simulation.capacity[0].learner"),
    (["simulation.capacity=[{learner: 2, join: 0.5, leave: 0.5}]"], "leave"),
    ([SCAVENGED, "simulation.outages=[{learner: 0, start: 1, end: 2}]"], "simulation.capacity"),
])
def test_a_capacity_schedule_that_cannot_run_is_refused_by_field(overrides, field):
    from diloco_core.config import ConfigError

    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        tiny_cfg(*overrides)


def test_by_default_no_learner_waits_for_a_round_in_the_simulator_either(corpus):
    # The simulator paces learners by the real path's rule and default (off): a fast learner
    # runs on while the quorum waits for a slow one; on, it idles at H/P + tau steps.
    speeds = "learners.speeds=[1.0, 1.0, 0.4]"
    free = run_simulation(tiny_cfg(speeds, "sync.min_quorum=3", "sync.grace_gamma=0"),
                          corpus.learner_streams, corpus.heldout_stream)
    paced = run_simulation(tiny_cfg(speeds, "sync.min_quorum=3", "sync.grace_gamma=0",
                                    "sync.block_on_overlap=true"),
                           corpus.learner_streams, corpus.heldout_stream)
    assert all(s.idle_seconds == 0 for s in free.learners)
    assert paced.learners[0].idle_seconds > 0


def test_every_simulated_decision_is_the_syncer_machines(corpus, monkeypatch):
    """The simulator decides nothing itself: its rounds open, merge, stop and finish exactly
    as the syncer's state machine (the one the syncer service runs) says, and feeding the
    machine the simulator's observations again reproduces every action, as the replay of a
    real run's trace does (tests/test_syncer_trace.py). An outage and jitter, K = 2 < M."""
    import diloco_core.simulated_syncer as simulated_syncer
    from diloco_core.syncer_events import Decide, FinishRun, OpenRound, StopRun
    from diloco_core.syncer_machine import step

    ticks = []

    def recording_step(state, observed, cfg, decided_by):
        stepped = step(state, observed, cfg, decided_by)
        ticks.append((state, observed, stepped))
        return stepped

    monkeypatch.setattr(simulated_syncer, "step", recording_step)
    cfg = tiny_cfg("sync.min_quorum=2", "simulation.step_jitter=0.2",
                   "simulation.outages=[{learner: 2, start: 3.0, end: 9.0}]")
    result = run_simulation(cfg, corpus.learner_streams, corpus.heldout_stream)
    state = ticks[0][0]
    for before, observed, stepped in ticks:
        assert before == state                       # nothing but the machine changes it
        again = step(state, observed, cfg, "simulator")
        assert again.actions == stepped.actions
        state = again.state
    actions = [a for _, _, s in ticks for a in s.actions]
    decided = [a.decision for a in actions if isinstance(a, Decide) and a.decision.members]
    assert [(m.round, m.members) for m in result.merges] == [
        (d.round, d.members) for d in decided]
    assert sum(isinstance(a, StopRun) for a in actions) == 1
    assert isinstance(actions[-1], FinishRun)
    opened = [a.record.round for a in actions if isinstance(a, OpenRound)]
    assert opened == list(range(len(opened)))
