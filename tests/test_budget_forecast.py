"""The budget forecast (issue 36): the learners' pause targets near the end of the budget, from
the machine's own count, so that a learner's claims move no one's target but its own; and the
decider writing them to the store, near the end only, at most once a second."""

import time
from dataclasses import replace

import pytest
from learner_store_setup import committed_experiment
from test_syncer_machine import Published, _offer

from diloco_core.budget_forecast import (
    HORIZON_SECONDS,
    BudgetForecast,
    credited_now,
    forecast,
    near_end,
)
from diloco_core.config_loading import config_from_mapping, overrides_to_mapping
from diloco_core.round_records import Heartbeat, RecordError
from diloco_core.syncer_events import Observed, StopRun
from diloco_core.syncer_machine import SyncerState, step
from pipelines.syncer.forecast_publisher import ForecastPublisher
from pipelines.syncer.round_control import RoundController
from resources.store.artifact_store import RejectedArtifact

M = 4
NAMES = [f"learner-{i}" for i in range(M)]


def _cfg(*extra):
    return config_from_mapping(overrides_to_mapping([
        f"learners.num_learners={M}", "sync.num_fragments=2", "sync.sync_period=4",
        "token_budget=1000000", *extra]))


def _beat(tokens: int, cfg, status="training", t=0.0) -> Heartbeat:
    steps = tokens // cfg.learner_step_tokens[0]
    return Heartbeat(status=status, time=t, step=steps, tokens_total=tokens,
                     compute_seconds=0.01 * max(1, steps))


def _observed(cfg, claims: dict[str, int], now=1000.0, budget=None) -> Observed:
    return Observed(now, {n: _beat(c, cfg, t=now) for n, c in claims.items()},
                    budget=cfg.token_budget if budget is None else budget)


def _machine_count(state, obs, cfg) -> int:
    """The oracle: the count at which the machine writes STOP, asked of it (a step against a
    budget of one token; its STOP names the count)."""
    probe = step(state, replace(obs, budget=1, stop_request=None), cfg)
    return next((a.tokens for a in probe.actions if isinstance(a, StopRun)), 0)


def test_a_learner_claiming_2_pow_62_tokens_pauses_no_one_else():
    """Targets come from the machine's credit: the honest learners keep targets above their
    totals, the liar's is its credit. (From the raw claims nothing would remain: every
    learner would pause at once, the run stalled short of its budget.)"""
    cfg = _cfg()
    claims = dict.fromkeys(NAMES, 50_000)
    claims["learner-3"] = 2 ** 62
    state, obs = SyncerState("exp"), _observed(cfg, claims)
    credit = credited_now(state, step(state, obs, cfg).state, obs, cfg)
    assert sum(credit.values()) == _machine_count(state, obs, cfg)
    made = forecast(credit, cfg.token_budget, obs.beats, obs.absent,
                    dict.fromkeys(NAMES, 1.0), obs.now)
    left = cfg.token_budget - sum(credit.values())
    assert left > 600_000
    for name in NAMES[:3]:
        assert made.targets[name] - claims[name] >= left // M
    assert made.targets["learner-3"] < claims["learner-3"]
    raw = forecast(claims, cfg.token_budget, obs.beats, obs.absent,
                   dict.fromkeys(NAMES, 1.0), obs.now)
    assert all(raw.targets[n] == claims[n] for n in NAMES[:3])


class _Run:
    """Learners driving the machine as the real ones do, each pausing at its target in the
    forecast of the tick before: each learner steps `speeds[n]` times a tick unless at its
    target, heartbeats its total, and offers each fragment's progress since its last offer
    when a round opens for it. `liar` claims 2^62 tokens and offers nothing."""

    def __init__(self, cfg, speeds, liar=None):
        self.cfg, self.speeds, self.liar = cfg, speeds, liar
        self.names = list(speeds) + ([liar] if liar else [])
        self.state, self.now, self.store = SyncerState("exp"), 1000.0, Published(cfg)
        self.tokens = dict.fromkeys(speeds, 0)
        self.since = {n: {0: 0, 1: 0} for n in speeds}
        self.targets: dict[str, int] = {}
        self.checked = 0

    def tick(self, offers=()):
        self.now += 1.0
        beats = {n: _beat(self.tokens.get(n, 2 ** 62), self.cfg, t=self.now)
                 for n in self.names}
        before, obs = self.state, self.store.observed(self.now, beats, offers)
        self.state = self.store.after(step(before, obs, self.cfg)).state
        if not self.state.stop:
            tokens = credited_now(before, self.state, obs, self.cfg)
            assert sum(tokens.values()) == _machine_count(before, obs, self.cfg)
            self.checked += 1
            projected = credited_now(before, self.state, obs, self.cfg, in_flight=True)
            self.targets = forecast(projected, self.cfg.token_budget, beats, frozenset(),
                                    dict.fromkeys(self.names, 1.0), self.now).targets

    def run(self, limit=3000) -> int:
        per_step = self.cfg.learner_step_tokens[0]
        for _ in range(limit):
            if self.state.stop:
                return sum(self.tokens.values())
            for n in self.speeds:
                for _ in range(self.speeds[n]):
                    if self.tokens[n] >= self.targets.get(n, 2 ** 62):
                        break
                    self.tokens[n] += per_step
                    for p in self.since[n]:
                        self.since[n][p] += 1
            self.tick()
            r = self.state.round
            if r >= 0 and not self.state.decided:
                p = r % 2
                offers = [_offer(n, r, self.cfg, steps=self.since[n][p],
                                 base=self.store.base(r))
                          for n in self.speeds if self.since[n][p]]
                for n in self.speeds:
                    self.since[n][p] = 0
                self.tick(offers)
        raise AssertionError(f"no STOP in {limit} ticks: {self.tokens}, {self.targets}")


@pytest.mark.parametrize("speeds", [{"learner-0": 3}, {"learner-0": 3, "learner-1": 1},
                                    {"learner-0": 3, "learner-1": 1, "learner-2": 1,
                                     "learner-3": 2}])
@pytest.mark.parametrize("with_liar", [False, True])
def test_learners_at_their_targets_stop_at_the_budget_and_the_count_is_the_machines(
        speeds, with_liar):
    """Tick by tick the credited tokens sum to the count at which the machine stops (the
    oracle: the machine asked). Learners that pause at their targets reach STOP (no stall)
    and end within a tick of the budget, at M = 1, 2 and 4; with a learner claiming 2^62
    beside them, which the machine credits as one more honest learner, they end short of
    it, never past it."""
    liar = f"learner-{len(speeds)}" if with_liar else None
    cfg = config_from_mapping(overrides_to_mapping([
        f"learners.num_learners={len(speeds) + with_liar}", "sync.min_quorum=1",
        "sync.num_fragments=2", "sync.sync_period=8", "sync.grace_gamma=0",
        "token_budget=200000"]))
    per_step = cfg.learner_step_tokens[0]
    run = _Run(cfg, speeds, liar)
    total = run.run()
    assert run.checked > 10
    one_tick = per_step * sum(speeds.values())
    assert total <= cfg.token_budget + one_tick, (total, one_tick)
    if not with_liar:
        assert total >= cfg.token_budget


def test_what_remains_is_shared_by_speed_among_the_learners_training():
    cfg = _cfg()
    beats = {"learner-0": _beat(1_000, cfg), "learner-1": _beat(2_000, cfg),
             "learner-2": _beat(3_000, cfg, status="done"), "learner-3": _beat(4_000, cfg),
             "learner-4": None}
    speeds = {"learner-0": 1.0, "learner-1": 2.0, "learner-2": 1.0, "learner-3": 1.0}
    # Credited as claimed, but learner-1 (no peer to corroborate it) 500 short of its claim.
    credit = {"learner-0": 1_000, "learner-1": 1_500, "learner-2": 3_000, "learner-3": 4_000}
    made = forecast(credit, 9_801, beats, frozenset({"learner-3"}), speeds, 5.0)
    # 301 left, shared 1:2 between the two training learners not marked absent, on top of
    # their credit; rounded up.
    assert made.targets == {"learner-0": 1_000 + 101, "learner-1": 1_500 + 201}
    assert (made.budget, made.counted, made.at) == (9_801, 9_500, 5.0)
    # Past the budget: every learner's target is its credit (pause; STOP is on its way).
    past = forecast(credit, 9_000, beats, frozenset(), speeds, 5.0)
    assert past.targets == {"learner-0": 1_000, "learner-1": 1_500, "learner-3": 4_000}


def test_a_forecast_is_published_only_within_the_horizon_at_the_counted_rate():
    assert not near_end(0, 10**9, None)                # no rate yet: past half the budget
    assert near_end(5 * 10**8, 10**9, None)
    assert not near_end(0, 10**9, 1_000.0)
    assert not near_end(10**9 - 1, 10**9, 0.0)         # nothing moves
    assert near_end(10**9 - 1_000 * HORIZON_SECONDS, 10**9, 1_000.0)
    assert not near_end(10**9 - 1_000 * HORIZON_SECONDS - 1, 10**9, 1_000.0)


@pytest.mark.parametrize("raw", [
    None, [], {"budget": 0, "counted": 0, "at": 0.0},
    {"budget": 10, "counted": -1, "at": 0.0},
    {"budget": 10, "counted": 0, "at": "now"},
    {"budget": 10, "counted": 0, "at": 0.0, "targets": {"learner-0": 2 ** 63}},
    {"budget": 10, "counted": 0, "at": 0.0, "targets": {"learner-0": True}},
    {"budget": 10, "counted": 0, "at": 0.0, "targets": ["learner-0"]},
])
def test_a_malformed_forecast_is_refused_naming_the_field(raw):
    with pytest.raises(RecordError, match="budget_forecast"):
        BudgetForecast.from_json(raw)


# ---- the decider writes it --------------------------------------------------------------------
@pytest.fixture
def store(tmp_path):
    return committed_experiment(str(tmp_path / "store"), "exp-forecast", [
        "model.preset=tiny", "data.seq_len=32", "data.batch_size=4",
        f"learners.num_learners={M}", "sync.num_fragments=2", "token_budget=100000"])


def _put_beats(store, tokens: int, now: float) -> None:
    for name in NAMES:
        store.put_heartbeat(name, {"learner": name, "status": "training", "time": now,
                                   "attempt": 0, "step": tokens // 128,
                                   "tokens_total": tokens, "compute_seconds": 0.01,
                                   "training_seconds": 1.0})


def test_the_controller_writes_targets_that_bring_the_totals_to_the_budget(store):
    controller, now = RoundController(store, decided_by="syncer"), time.time()
    _put_beats(store, 20_000, now)
    state = controller.tick(None, now=now).state
    made = store.budget_forecast()
    assert made is not None and made.counted == 4 * 20_000 and made.budget == 100_000
    assert made.targets == dict.fromkeys(NAMES, 25_000)
    assert sum(made.targets.values()) == store.get_config()["token_budget"]
    # Once the totals reach the budget the machine stops the run and no forecast follows.
    _put_beats(store, 25_000, now + 2)
    state = controller.tick(state, now=now + 2).state
    assert state["stop"] and store.stop_requested() is not None
    assert store.budget_forecast() == made


class _Writes:
    def __init__(self, store):
        self.store, self.forecasts = store, []

    def put_budget_forecast(self, made):
        self.forecasts.append(made)
        self.store.put_budget_forecast(made)


def _publisher_ticks(store, claims_and_times, guard=lambda: None, rebuilt=False):
    """The forecasts the publisher wrote after ticks at these times, the learners' claims
    then as given (a total for learner-0, the others at 1,000 tokens, or every claim).
    `rebuilt`: a new publisher every tick from the last one's state through JSON, as the
    quorum sensor builds its controller every tick and keeps the state in its cursor."""
    import json

    cfg = config_from_mapping(store.get_config())
    writes = _Writes(store)
    publisher = ForecastPublisher(writes, cfg, guard)
    state = SyncerState(store.experiment)
    for claims, now in claims_and_times:
        if rebuilt:
            publisher = ForecastPublisher(writes, cfg, guard,
                                          json.loads(json.dumps(publisher.state())))
        if isinstance(claims, int):
            claims = {**dict.fromkeys(NAMES, 1_000), "learner-0": claims}
        obs = replace(_observed(cfg, claims, now=now), budget=None)   # no STOP: see the counts
        after = step(state, obs, cfg).state
        publisher.tick(state, replace(obs, budget=cfg.token_budget), after)
        state = after
    return writes.forecasts


def test_the_decider_writes_once_a_second_at_most_and_only_when_a_target_moved(store):
    def claims(extra: int) -> dict[str, int]:    # 1,400 tokens short, learner-0 `extra` on
        return {n: 24_500 + 100 * i + (extra if i == 0 else 0) for i, n in enumerate(NAMES)}
    written = _publisher_ticks(store, [(claims(0), 0.0), (claims(100), 0.5), (claims(200), 1.2),
                                       (claims(200), 2.4), (claims(300), 3.4),
                                       (claims(300), 7.0), (claims(300), 8.5)])
    # t = 0: written; 0.5: under a second since; 1.2: learner-0's target moved; 2.4: the same
    # targets; 3.4: moved again; 7.0: the same, but 3.6 s since (under REFRESH_SECONDS); 8.5:
    # the same, written again (a learner trains on past a target no forecast confirms).
    assert [f.at for f in written] == [0.0, 1.2, 3.4, 8.5]
    assert written[-1].targets == written[-2].targets
    assert store.budget_forecast() == written[-1]


def test_far_from_the_budget_at_the_counted_rate_nothing_is_written(store):
    # Learner i at 100 + i tokens a second, one tick a second: the count, 406 t, is within
    # 60 s of the 100,000 budget from t = 187 on (before a rate is known, two seconds of
    # counts, only past half the budget).
    ticks = [({n: (100 + i) * t for i, n in enumerate(NAMES)}, float(t)) for t in range(192)]
    written = _publisher_ticks(store, ticks)
    assert [f.at for f in written] == [float(t) for t in range(187, 192)]
    assert written[-1].counted == 406 * 191


def test_a_decider_that_rebuilds_its_writer_every_tick_writes_what_a_long_lived_one_does(
        store):
    # The quorum sensor (the fallback decider) builds a controller per tick: with the
    # writer's state carried in its cursor it knows the counted rate and writes from t = 187,
    # as the service does, not from half the budget on (t = 124) nor on every tick.
    ticks = [({n: (100 + i) * t for i, n in enumerate(NAMES)}, float(t)) for t in range(192)]
    rebuilt = _publisher_ticks(store, ticks, rebuilt=True)
    assert [f.at for f in rebuilt] == [float(t) for t in range(187, 192)]
    # And a state that is not one (a cursor from another version) starts a fresh writer.
    cfg = config_from_mapping(store.get_config())
    fresh = ForecastPublisher(_Writes(store), cfg, lambda: None, {"counts": [["x", 1]]})
    assert fresh.state()["counts"] == [] and fresh.state()["written"] is None


def test_a_fenced_decider_writes_no_forecast(store):
    def fenced():
        raise RuntimeError("lease lost")
    with pytest.raises(RuntimeError, match="lease lost"):
        _publisher_ticks(store, [(dict.fromkeys(NAMES, 24_000), 0.0)], guard=fenced)
    assert store.budget_forecast() is None


def test_a_malformed_stored_forecast_is_refused(store):
    store.blobs.write("experiments/exp-forecast/FORECAST", b'{"budget": 1, "counted": -5}')
    with pytest.raises(RejectedArtifact, match="budget_forecast.counted"):
        store.budget_forecast()


def test_a_count_that_waits_on_every_learner_at_its_target_gives_targets_from_their_totals(
        store, monkeypatch):
    """With no peer to compare with (M <= 2) a learner is credited only as its offers are
    merged: its total can run ahead of its credit, past its target, and the count then waits
    on progress no offer will credit soon. Three seconds of that, with every learner at its
    target, and the targets start from the learners' own totals (each moves only its own)."""
    import pipelines.syncer.forecast_publisher as publisher_module

    credit = {"learner-0": 40_000, "learner-1": 45_000, "learner-2": 0, "learner-3": 0}
    monkeypatch.setattr(publisher_module, "credited_now", lambda *a, **k: dict(credit))
    claims = {"learner-0": 50_000, "learner-1": 50_000, "learner-2": 0, "learner-3": 0}
    cfg = config_from_mapping(store.get_config())
    writes = _Writes(store)
    publisher = ForecastPublisher(writes, cfg, lambda: None)
    state = SyncerState(store.experiment)
    for now in (0.0, 1.0, 2.0, 3.0):
        obs = replace(_observed(cfg, claims, now=now), absent=frozenset({"learner-2",
                                                                         "learner-3"}))
        publisher.tick(state, obs, state)
    # 15,000 left, 7,500 each: from the credit both are at their targets (47,500 and 52,500
    # against 50,000 each: learner-1 is not); so no stall until learner-1 reaches its own.
    assert [f.targets for f in writes.forecasts] == [
        {"learner-0": 47_500, "learner-1": 52_500}]
    claims["learner-1"] = 52_500
    for now in (4.0, 5.0, 6.0, 7.0):
        obs = replace(_observed(cfg, claims, now=now), absent=frozenset({"learner-2",
                                                                         "learner-3"}))
        publisher.tick(state, obs, state)
    # Both at their targets, the count still 85,000 since t = 0: from their totals, and so
    # until the count moves (they train on to them meanwhile).
    assert [f.targets for f in writes.forecasts[1:]] == [
        {"learner-0": 57_500, "learner-1": 60_000}]
    credit["learner-0"] = 50_000
    publisher.tick(state, replace(_observed(cfg, claims, now=8.0), absent=frozenset({
        "learner-2", "learner-3"})), state)
    assert writes.forecasts[-1].targets == {"learner-0": 52_500, "learner-1": 47_500}


def test_the_quorum_sensor_keeps_its_forecast_writers_memory_in_its_cursor(tmp_path):
    import json

    import dagster as dg
    from orchestration_harness import Harness

    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"))     # the sensor decides (TINY)
        h.start()
        for _ in range(3):
            for name in ("learner-0", "learner-1", "learner-2"):
                h.beat(name, 2)
            h.tick(advance=1.5)
        memory = json.loads(h.cursor)["forecast"]
        assert len(memory["counts"]) == 3 and memory["counted_at"] is not None
