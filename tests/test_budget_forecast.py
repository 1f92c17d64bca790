"""The budget forecast (issue 36): the learners' pause targets near the end of the budget, from
the machine's own count, so that a learner's claims move no one's target but its own; and the
decider writing them to the store, near the end only, at most once a second."""

import time

import pytest
from learner_store_setup import committed_experiment

from diloco_core.budget_forecast import (
    HORIZON_SECONDS,
    BudgetForecast,
    counted_tokens,
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


def _stops(state, obs, cfg) -> bool:
    return any(isinstance(a, StopRun) for a in step(state, obs, cfg).actions)


@pytest.mark.parametrize("liar", [False, True])
def test_the_count_is_the_one_the_machine_stops_at(liar):
    cfg = _cfg()
    claims = {n: 40_000 + 8_192 * i for i, n in enumerate(NAMES)}
    if liar:
        claims["learner-3"] = 2 ** 62
    state = SyncerState("exp")
    counted = counted_tokens(state, _observed(cfg, claims), cfg)
    assert counted > 0
    # STOP at a budget of exactly the count, none a token above it.
    assert _stops(state, _observed(cfg, claims, budget=counted), cfg)
    assert not _stops(state, _observed(cfg, claims, budget=counted + 1), cfg)
    if liar:   # the machine credits the liar as one more honest learner, not 2^62
        assert counted < 4 * 100_000
    else:
        assert counted == sum(claims.values())
    assert counted_tokens(SyncerState("exp", stop=True), _observed(cfg, claims), cfg) is None


def test_a_learner_claiming_2_pow_62_tokens_pauses_no_one_else():
    """The remaining tokens are the budget less the machine's credited count: the honest
    learners keep targets above their totals. (From the raw claims, nothing would remain and
    every learner would pause at once, the run stalled short of its budget.)"""
    cfg = _cfg()
    claims = dict.fromkeys(NAMES, 50_000)
    claims["learner-3"] = 2 ** 62
    obs = _observed(cfg, claims)
    counted = counted_tokens(SyncerState("exp"), obs, cfg)
    made = forecast(counted, cfg.token_budget, obs.beats, obs.absent,
                    dict.fromkeys(NAMES, 1.0), obs.now)
    left = cfg.token_budget - counted
    assert left > 600_000
    for name in NAMES[:3]:
        assert made.targets[name] - claims[name] >= left // M
    raw = forecast(sum(claims.values()), cfg.token_budget, obs.beats, obs.absent,
                   dict.fromkeys(NAMES, 1.0), obs.now)
    assert all(raw.targets[n] == claims[n] for n in NAMES[:3])


def test_what_remains_is_shared_by_speed_among_the_learners_training():
    cfg = _cfg()
    beats = {"learner-0": _beat(1_000, cfg), "learner-1": _beat(2_000, cfg),
             "learner-2": _beat(3_000, cfg, status="done"), "learner-3": _beat(4_000, cfg),
             "learner-4": None}
    speeds = {"learner-0": 1.0, "learner-1": 2.0, "learner-2": 1.0, "learner-3": 1.0}
    made = forecast(10_000, 10_301, beats, frozenset({"learner-3"}), speeds, 5.0)
    # 301 left, shared 1:2 between the two training learners not marked absent; rounded up.
    assert made.targets == {"learner-0": 1_000 + 101, "learner-1": 2_000 + 201}
    assert (made.budget, made.counted, made.at) == (10_301, 10_000, 5.0)
    # Past the budget: every learner's target is its total (pause; STOP is on its way).
    past = forecast(11_000, 10_301, beats, frozenset(), speeds, 5.0)
    assert past.targets == {"learner-0": 1_000, "learner-1": 2_000, "learner-3": 4_000}


def test_a_forecast_is_published_only_within_the_horizon_at_the_counted_rate():
    assert near_end(0, 10**9, None)                    # no rate yet
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


def _publisher_ticks(store, claims_and_times, guard=lambda: None):
    """The forecasts the publisher wrote after ticks at these times, the learners' claims
    then as given (a total for learner-0, the others at 1,000 tokens, or every claim)."""
    cfg = config_from_mapping(store.get_config())
    writes = _Writes(store)
    publisher = ForecastPublisher(writes, cfg, guard)
    state = SyncerState(store.experiment)
    for claims, now in claims_and_times:
        if isinstance(claims, int):
            claims = {**dict.fromkeys(NAMES, 1_000), "learner-0": claims}
        publisher.tick(state, _observed(cfg, claims, now=now), state)
    return writes.forecasts


def test_the_decider_writes_once_a_second_at_most_and_only_when_a_target_moved(store):
    def claims(extra: int) -> dict[str, int]:    # 1,400 tokens short, learner-0 `extra` on
        return {n: 24_500 + 100 * i + (extra if i == 0 else 0) for i, n in enumerate(NAMES)}
    written = _publisher_ticks(store, [(claims(0), 0.0), (claims(100), 0.5), (claims(200), 1.2),
                                       (claims(200), 2.4), (claims(300), 3.4)])
    # t = 0: written; 0.5: under a second since; 1.2: learner-0's target moved; 2.4: the same
    # targets; 3.4: moved again.
    assert [f.at for f in written] == [0.0, 1.2, 3.4]
    assert store.budget_forecast() == written[-1]


def test_far_from_the_budget_at_the_counted_rate_nothing_is_written(store):
    # Learner i at 100 + i tokens a second, one tick a second: the count, 406 t, is within
    # 60 s of the 100,000 budget from t = 187 on. Before the rate is known (two seconds of
    # counts) every tick whose targets moved writes.
    ticks = [({n: (100 + i) * t for i, n in enumerate(NAMES)}, float(t)) for t in range(192)]
    written = _publisher_ticks(store, ticks)
    assert [f.at for f in written] == [0.0, 1.0] + [float(t) for t in range(187, 192)]
    assert written[-1].counted == 406 * 191


def test_a_fenced_decider_writes_no_forecast(store):
    def fenced():
        raise RuntimeError("lease lost")
    with pytest.raises(RuntimeError, match="lease lost"):
        _publisher_ticks(store, [(1_000, 0.0)], guard=fenced)
    assert store.budget_forecast() is None


def test_a_malformed_stored_forecast_is_refused(store):
    store.blobs.write("experiments/exp-forecast/FORECAST", b'{"budget": 1, "counted": -5}')
    with pytest.raises(RejectedArtifact, match="budget_forecast.counted"):
        store.budget_forecast()
