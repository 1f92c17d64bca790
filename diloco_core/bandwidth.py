"""The bandwidth planner: cross-site traffic and required bandwidth of each training method.

A model of N parameters trains on S sites (datacentres, regions), one learner per site, each
inner step taking `step_seconds`. Per method, what crosses site boundaries:

- data-parallel: every step, the gradients are all-reduced across the S sites. With a
  bandwidth-optimal ring (reduce-scatter + all-gather) each site sends and receives
  2 (S-1)/S * N values per step. Nothing overlaps: the step waits for it.
- DiLoCo (synchronous): every H steps, each site uploads its outer gradient (N values) to the
  syncer and downloads the merged parameters (N values). The learners wait at the sync, so the
  transfer must fit in the sync pause.
- Decoupled DiLoCo (streaming fragments): every H/P steps one fragment (N/P values) goes up and
  comes back, overlapped with tau inner steps: it must land within tau steps, after which the
  learner would wait.

Average bandwidth is bytes per second over a long run; peak is what one transfer needs to finish
in the time it is allowed without slowing compute. Compute utilisation at a given link speed is
compute time over compute plus the waiting that link forces. Uploads use the outer-gradient
encoding (`bits`); downloads of merged parameters use `download_bits` (bf16 by default).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class LinkPlan:
    """One method's cross-site traffic, per site."""

    method: str
    bytes_per_step: float          # average bytes per inner step (up + down)
    average_gbps: float            # average bandwidth over the run
    peak_gbps: float               # bandwidth one transfer needs to not slow compute
    utilisation: float | None      # compute utilisation at the available bandwidth (if given)


def _gbps(bytes_per_second: float) -> float:
    return bytes_per_second * 8 / 1e9


def _utilisation(compute_s: float, transfer_bytes: float, hidden_s: float,
                 available_gbps: float | None) -> float | None:
    """compute / (compute + waiting), where a transfer can hide behind `hidden_s` of compute."""
    if available_gbps is None:
        return None
    transfer_s = transfer_bytes * 8 / (available_gbps * 1e9)
    return compute_s / (compute_s + max(0.0, transfer_s - hidden_s))


def plan_bandwidth(num_params: float, *, sites: int, sync_period: int, num_fragments: int,
                   overlap_steps: int, step_seconds: float, bits: float = 16,
                   dp_bits: float = 16, download_bits: float = 16,
                   available_gbps: float | None = None) -> dict[str, LinkPlan]:
    """Traffic per site for data-parallel, synchronous DiLoCo and Decoupled DiLoCo."""
    if sites < 1 or num_params <= 0 or step_seconds <= 0:
        raise ValueError("sites >= 1, num_params > 0 and step_seconds > 0 are required")
    if sync_period % num_fragments:
        raise ValueError("sync_period must be a multiple of num_fragments")
    n, s, h, p, tau = num_params, sites, sync_period, num_fragments, overlap_steps

    ring = 2 * (s - 1) / s if s > 1 else 0.0
    dp_bytes = ring * n * dp_bits / 8
    dp = LinkPlan("data_parallel", dp_bytes, _gbps(dp_bytes / step_seconds),
                  _gbps(dp_bytes / step_seconds),
                  _utilisation(step_seconds, dp_bytes, 0.0, available_gbps))

    sync_bytes = n * (bits + download_bits) / 8 if s > 1 else 0.0
    # The sync pause is not compute; "peak" is what finishes it within one step's time.
    diloco = LinkPlan("diloco", sync_bytes / h, _gbps(sync_bytes / (h * step_seconds)),
                      _gbps(sync_bytes / step_seconds),
                      _utilisation(h * step_seconds, sync_bytes, 0.0, available_gbps))

    frag_bytes = sync_bytes / p
    interval_s = h / p * step_seconds        # one fragment goes out every H/P steps
    hidden_s = tau * step_seconds            # ... and may be in flight for tau steps
    peak = _gbps(frag_bytes / (hidden_s if tau else step_seconds))
    decoupled = LinkPlan("decoupled_diloco", frag_bytes / (h / p),
                         _gbps(frag_bytes / interval_s), peak,
                         _utilisation(interval_s, frag_bytes, hidden_s, available_gbps))
    return {plan.method: plan for plan in (dp, diloco, decoupled)}


def exchange_ratio(sync_period: int, dp_bits: float, bits: float) -> float:
    """Bytes data-parallel sends per byte of DiLoCo outer gradients (one direction):
    DP sends dp_bits per value every step, DiLoCo bits per value every H steps."""
    return sync_period * dp_bits / bits


def describe(plans: dict[str, LinkPlan]) -> list[dict]:
    rows = []
    for plan in plans.values():
        rows.append({"method": plan.method, "bytes_per_step": plan.bytes_per_step,
                     "average_gbps": plan.average_gbps, "peak_gbps": plan.peak_gbps,
                     "utilisation": plan.utilisation})
    return rows
