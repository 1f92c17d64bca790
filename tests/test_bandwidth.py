"""The bandwidth planner, checked against numbers worked out by hand."""

import pytest

from diloco_core.bandwidth import exchange_ratio, plan_bandwidth


def test_streaming_diloco_exchange_ratio():
    # Data-parallel sends bf16 gradients every step; Streaming DiLoCo 4-bit outer gradients every
    # H = 100 steps: 100 * 16 / 4 = 400x fewer bytes (the Streaming DiLoCo paper's "400x").
    assert exchange_ratio(100, dp_bits=16, bits=4) == 400


def test_plans_by_hand():
    # N = 1e9 params, S = 4 sites, H = 8, P = 4, tau = 1, 1 s per step, bf16 everywhere.
    plans = plan_bandwidth(1e9, sites=4, sync_period=8, num_fragments=4, overlap_steps=1,
                           step_seconds=1.0, bits=16, dp_bits=16, download_bits=16,
                           available_gbps=10.0)
    dp, diloco, dec = plans["data_parallel"], plans["diloco"], plans["decoupled_diloco"]
    # DP ring: 2*(4-1)/4 * 1e9 values * 2 bytes = 3e9 bytes per step = 24 Gbps.
    assert dp.bytes_per_step == pytest.approx(3e9)
    assert dp.average_gbps == pytest.approx(24.0) and dp.peak_gbps == pytest.approx(24.0)
    # At 10 Gbps the 3e9-byte transfer takes 2.4 s per 1 s step: utilisation 1 / 3.4.
    assert dp.utilisation == pytest.approx(1 / 3.4)
    # DiLoCo: up + down 1e9 * (2 + 2) bytes = 4e9 bytes every 8 steps = 5e8 B/step = 4 Gbps.
    assert diloco.bytes_per_step == pytest.approx(5e8)
    assert diloco.average_gbps == pytest.approx(4.0)
    # It waits 4e9 * 8 / 10e9 = 3.2 s every 8 s of compute: 8 / 11.2.
    assert diloco.utilisation == pytest.approx(8 / 11.2)
    # Decoupled: the same average, but 1e9 bytes every 2 steps, hidden behind tau = 1 step:
    # peak = 1e9 bytes in 1 s = 8 Gbps; at 10 Gbps it takes 0.8 s < 1 s: no waiting.
    assert dec.average_gbps == pytest.approx(diloco.average_gbps)
    assert dec.peak_gbps == pytest.approx(8.0)
    assert dec.utilisation == pytest.approx(1.0)
    # At 4 Gbps a fragment takes 2 s, 1 s more than tau allows, every 2 s: 2 / 3.
    slow = plan_bandwidth(1e9, sites=4, sync_period=8, num_fragments=4, overlap_steps=1,
                          step_seconds=1.0, available_gbps=4.0)["decoupled_diloco"]
    assert slow.utilisation == pytest.approx(2 / 3)


def test_bad_inputs():
    with pytest.raises(ValueError, match="multiple of num_fragments"):
        plan_bandwidth(1e6, sites=2, sync_period=10, num_fragments=4, overlap_steps=1,
                       step_seconds=1.0)
    with pytest.raises(ValueError):
        plan_bandwidth(1e6, sites=0, sync_period=8, num_fragments=4, overlap_steps=1,
                       step_seconds=1.0)
