"""The goodput simulator against closed forms it must agree with."""

import pytest

from diloco_core.goodput import SECONDS_PER_YEAR, GoodputParams, goodput_with_ci, simulate_goodput


def test_no_failures_means_full_goodput():
    r = simulate_goodput(GoodputParams(chips=4096, mtbi_years=1e12), seed=0)
    assert r["failures"] == 0
    assert r["data_parallel"] == r["data_parallel_elastic"] == r["decoupled"] == 1.0
    assert r["synchronous_diloco"] == pytest.approx(1.0)
    assert r["decoupled_uptime"] == 1.0


def test_non_elastic_matches_the_renewal_formula():
    # Failures at rate lam while running, each stopping the job for R: goodput = 1 / (1 + lam R).
    p = GoodputParams(chips=300_032, horizon_seconds=4 * 86400.0)
    lam = p.chips / (p.mtbi_years * SECONDS_PER_YEAR)
    r = goodput_with_ci(p, seeds=4)["data_parallel"]
    assert r["mean"] == pytest.approx(1 / (1 + lam * p.restart_seconds), abs=3 * r["ci95"] + 0.01)


def test_decoupled_beats_elastic_beats_static_and_degrades_with_scale():
    small = goodput_with_ci(GoodputParams(chips=150_016), seeds=3)
    large = goodput_with_ci(GoodputParams(chips=1_200_128), seeds=3)
    for r in (small, large):
        assert (r["decoupled"]["mean"] > r["data_parallel_elastic"]["mean"]
                > r["data_parallel"]["mean"])
        assert r["decoupled"]["mean"] > r["synchronous_diloco"]["mean"]
        assert r["decoupled_uptime"]["mean"] == 1.0
    for key in ("data_parallel", "data_parallel_elastic", "decoupled"):
        assert large[key]["mean"] < small[key]["mean"]


def test_same_seed_same_answer_and_bad_params():
    p = GoodputParams(chips=65_536)
    assert simulate_goodput(p, 3) == simulate_goodput(p, 3)
    with pytest.raises(ValueError, match="multiple of slice_chips"):
        GoodputParams(chips=1000)
    with pytest.raises(ValueError, match="min_quorum"):
        GoodputParams(chips=4096, min_quorum=9)


def test_goodput_rises_with_learners_and_full_quorum_never_has_better_uptime():
    by_m = {m: goodput_with_ci(GoodputParams(chips=1_200_128, learners=m), seeds=3)
            for m in (2, 4, 8, 16)}
    means = [by_m[m]["decoupled"]["mean"] for m in (2, 4, 8, 16)]
    assert means == sorted(means), means
    for seed in range(3):
        k1 = simulate_goodput(GoodputParams(chips=600_064, learners=8, min_quorum=1), seed)
        k8 = simulate_goodput(GoodputParams(chips=600_064, learners=8, min_quorum=8), seed)
        assert k8["decoupled_uptime"] <= k1["decoupled_uptime"]
        assert k8["decoupled_uptime"] < 1.0
