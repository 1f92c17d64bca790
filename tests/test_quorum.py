"""Table-driven tests of the quorum/grace policy: (arrivals, time) -> (decision, reason)."""

import pytest

from diloco_core.config import SyncConfig
from diloco_core.quorum import Estimates, decide, grace_window

LIVE = ("a", "b", "c", "d")
# Step 1.0 s, tau 2, quorum 0.2 s, sync 0.3 s -> slack = 2*1.0 - 0.2 - 0.3 = 1.5;
# grace = gamma * slack = 0.8 * 1.5 = 1.2 s.
EST = Estimates(step_seconds=1.0, quorum_seconds=0.2, sync_seconds=0.3)
CFG = SyncConfig(num_fragments=4, sync_period=8, overlap_steps=2, min_quorum=2, grace_gamma=0.8)


def test_grace_window_formula_and_bounds():
    assert grace_window(EST, CFG) == pytest.approx(1.2)
    assert grace_window(EST, SyncConfig(grace_gamma=0.0)) == 0.0
    capped = SyncConfig(overlap_steps=2, grace_gamma=0.8, grace_max_seconds=0.5)
    assert grace_window(EST, capped) == 0.5
    # Negative slack (sync slower than the overlap) gives no window, but the floor still applies.
    slow = Estimates(step_seconds=0.1, quorum_seconds=0.2, sync_seconds=0.3)
    assert grace_window(slow, CFG) == 0.0
    assert grace_window(slow, SyncConfig(grace_gamma=0.5, grace_min_seconds=0.05)) == 0.05


@pytest.mark.parametrize(
    "now, arrivals, live, merge, members, late, reason",
    [
        (5.0, {}, LIVE, False, (), (), "waiting for quorum: 0/2"),
        (5.0, {"a": 4.0}, LIVE, False, (), (), "waiting for quorum: 1/2 offers (from a)"),
        # Quorum at 4.5 (second arrival); window open until 4.5 + 1.2 = 5.7.
        (5.0, {"a": 4.0, "b": 4.5}, LIVE, False, (), (), "grace window open until t=5.700s"),
        # Window closed: c arrived inside it, d never offered.
        (5.8, {"a": 4.0, "b": 4.5, "c": 5.6}, LIVE, True, ("a", "b", "c"), (),
         "not offered d"),
        # d arrived after the window closed: late, not admitted.
        (6.0, {"a": 4.0, "b": 4.5, "c": 5.6, "d": 5.9}, LIVE, True, ("a", "b", "c"), ("d",),
         "late d"),
        # Everyone live offered: close early, before the window would end.
        (4.9, {"a": 4.0, "b": 4.5, "c": 4.8, "d": 4.9}, LIVE, True, ("a", "b", "c", "d"), (),
         "all 4 live learners offered"),
        # d is down: the three live learners are everyone, close early.
        (4.8, {"a": 4.0, "b": 4.5, "c": 4.8}, ("a", "b", "c"), True, ("a", "b", "c"), (),
         "all 3 live learners"),
        # Only one live learner and K=2: the round cannot reach quorum until someone is back.
        (9.0, {"a": 4.0}, ("a",), False, (), (), "quorum unreachable"),
    ])
def test_policy_table(now, arrivals, live, merge, members, late, reason):
    d = decide(now, arrivals, live, EST, CFG)
    assert d.merge is merge
    assert d.members == members
    assert d.late == late
    assert reason in d.reason, d.reason


def test_k1_without_grace_merges_on_first_offer():
    cfg = SyncConfig(min_quorum=1, grace_gamma=0.0)
    d = decide(3.0, {"b": 3.0}, LIVE, EST, cfg)
    assert d.merge and d.members == ("b",) and d.grace_seconds == 0.0


def test_arrival_order_ties_broken_by_name():
    cfg = SyncConfig(min_quorum=1, grace_gamma=0.0)
    d = decide(3.0, {"c": 3.0, "a": 3.0}, ("a", "c"), EST, cfg)
    assert d.members == ("a", "c")


def test_estimates_ema():
    e = Estimates(step_seconds=1.0).observe(0.5, step=3.0, quorum=1.0)
    assert (e.step_seconds, e.quorum_seconds, e.sync_seconds) == (2.0, 0.5, 0.0)
