"""`diloco params`, `diloco bandwidth` and `diloco goodput`: sizing a run before launching it
(parameter counts and bytes, cross-site bandwidth, goodput under chip failures). Pure
arithmetic and the goodput simulator: no store, no Dagster."""

import argparse
import json
import sys
from pathlib import Path


def number(kind: type, low: float, *, low_open: bool = False):
    """An argparse type: a number of `kind` >= `low` (> with `low_open`), refused with a one-line
    reason otherwise (argparse names the option)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value != value or value in (float("inf"), float("-inf")) or (
                value <= low if low_open else value < low):
            raise argparse.ArgumentTypeError(
                f"must be {'>' if low_open else '>='} {low:g}, got {text}")
        return value
    return parse


POSITIVE_INT = number(int, 1)
POSITIVE = number(float, 0, low_open=True)


def _cmd_params(args) -> int:
    from diloco_core.config import ModelConfig
    from diloco_core.model import param_bytes, param_count
    from diloco_core.presets import MODEL_PRESETS

    names = [args.preset] if args.preset else list(MODEL_PRESETS)
    rows = []
    for name in names:
        cfg = ModelConfig.from_preset(name)
        rows.append({"preset": name, "parameters": param_count(cfg),
                     "fp32_bytes": param_bytes(cfg, 4), "bf16_bytes": param_bytes(cfg, 2)})
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        width = max(len(r["preset"]) for r in rows)
        for r in rows:
            print(f"{r['preset']:>{width}}  {r['parameters'] / 1e6:12.2f} M params  "
                  f"{r['fp32_bytes'] / 2**30:9.3f} GiB fp32")
    return 0




def _cmd_goodput(args) -> int:
    from diloco_core.goodput import GoodputParams, goodput_with_ci
    from pipelines.reporting import optional_plot, plot_goodput

    if args.min_quorum > args.learners:
        print(f"diloco: --min-quorum ({args.min_quorum}) cannot exceed --learners "
              f"({args.learners})", file=sys.stderr)
        return 2

    def params(chips: int) -> GoodputParams:
        return GoodputParams(chips=chips - chips % 256, learners=args.learners,
                             min_quorum=args.min_quorum, mtbi_years=args.mtbi_years)

    result = goodput_with_ci(params(args.chips), seeds=args.seeds)
    figures = {k: result[k]["mean"] for k in
               ("data_parallel", "data_parallel_elastic", "synchronous_diloco", "decoupled",
                "decoupled_uptime")}
    plot = optional_plot(lambda: plot_goodput(
        lambda chips: goodput_with_ci(params(chips), seeds=args.seeds),
        Path(args.plot))) if args.plot else None
    if args.json:
        print(json.dumps({**figures, "chips": args.chips - args.chips % 256,
                          "ci95": {k: result[k]["ci95"] for k in figures},
                          "plot": str(plot) if plot else None}, indent=2))
        return 0
    used = args.chips - args.chips % 256
    rounded = f" (rounded down to {used // 256:,} slices of 256)" if used != args.chips else ""
    print(f"{used:,} chips{rounded}, {args.learners} learners, MTBI {args.mtbi_years} years "
          f"per chip, {args.seeds} seeds (mean ± 95% CI)")
    for key in figures:
        print(f"  {key:<24}{100 * result[key]['mean']:6.1f}% ± {100 * result[key]['ci95']:.1f}")
    if plot:
        print(f"plot: {plot}")
    return 0


def _cmd_bandwidth(args) -> int:
    import dataclasses

    from diloco_core.bandwidth import plan_bandwidth
    from diloco_core.config import ModelConfig
    from diloco_core.model import param_count
    from pipelines.reporting import optional_plot, plot_utilisation

    num_params = (args.params if args.params is not None
                  else param_count(ModelConfig.from_preset(args.preset)))
    kwargs = dict(sites=args.sites, sync_period=args.sync_period,
                  num_fragments=args.fragments, overlap_steps=args.overlap,
                  step_seconds=args.step_seconds, bits=args.bits, dp_bits=args.dp_bits,
                  download_bits=args.download_bits)
    plans = plan_bandwidth(num_params, available_gbps=args.available_gbps, **kwargs)
    rows = [dataclasses.asdict(p) for p in plans.values()]
    plot = optional_plot(lambda: plot_utilisation(
        lambda gbps: plan_bandwidth(num_params, available_gbps=gbps, **kwargs),
        Path(args.plot))) if args.plot else None
    if args.json:
        print(json.dumps({"num_params": num_params, **kwargs, "plans": rows,
                          "plot": str(plot) if plot else None}, indent=2))
        return 0
    print(f"{num_params / 1e9:.2f}B parameters, {args.sites} sites, H={args.sync_period}, "
          f"P={args.fragments}, tau={args.overlap}, {args.step_seconds}s/step")
    print(f"{'method':<18}{'avg Gbps':>12}{'peak Gbps':>12}{'utilisation':>13}")
    for r in rows:
        util = "" if r["utilisation"] is None else f"{r['utilisation']:.3f}"
        print(f"{r['method']:<18}{r['average_gbps']:>12.3f}{r['peak_gbps']:>12.3f}{util:>13}")
    if plot:
        print(f"plot: {plot}")
    return 0


def add_sizing_commands(sub) -> None:
    """Register the three commands on the CLI's subparsers."""
    gp = sub.add_parser("goodput", help="goodput under chip failures at datacentre scale")
    gp.add_argument("--chips", type=number(int, 256), required=True,
                    help="chips in the whole run, at least one 256-chip slice (rounded down "
                         "to whole slices)")
    gp.add_argument("--learners", type=POSITIVE_INT, default=8, help="M")
    gp.add_argument("--min-quorum", type=POSITIVE_INT, default=1, help="K")
    gp.add_argument("--mtbi-years", type=POSITIVE, default=1.0,
                    help="mean time between interruptions of one chip, in years")
    gp.add_argument("--seeds", type=POSITIVE_INT, default=5,
                    help="independent failure schedules (the 95%% CI comes from them)")
    gp.add_argument("--plot", default="runs/goodput.png", help="'' for no plot")
    gp.add_argument("--json", action="store_true",
                    help="print the figures (and their 95%% CIs) as JSON")
    gp.set_defaults(func=_cmd_goodput)

    bw = sub.add_parser("bandwidth", help="cross-site bandwidth: data-parallel vs DiLoCo vs "
                        "Decoupled DiLoCo")
    bw.add_argument("--preset", default="12b", help="model preset (ignored with --params)")
    bw.add_argument("--params", type=POSITIVE, help="parameter count, e.g. 12e9")
    bw.add_argument("--sites", type=POSITIVE_INT, default=4,
                    help="number of sites (datacentres) the run spans")
    bw.add_argument("--sync-period", type=POSITIVE_INT, default=24, help="H")
    bw.add_argument("--fragments", type=POSITIVE_INT, default=24, help="P")
    bw.add_argument("--overlap", type=number(int, 0), default=2, help="tau")
    bw.add_argument("--step-seconds", type=POSITIVE, default=1.0,
                    help="seconds per inner step")
    bw.add_argument("--bits", type=POSITIVE, default=16, help="outer-gradient bits per value")
    bw.add_argument("--dp-bits", type=POSITIVE, default=16, help="data-parallel gradient bits")
    bw.add_argument("--download-bits", type=POSITIVE, default=16,
                    help="bits per value of the merged fragment sent back to the learners")
    bw.add_argument("--available-gbps", type=POSITIVE, help="link speed per site")
    bw.add_argument("--plot", default="runs/bandwidth.png", help="'' for no plot")
    bw.add_argument("--json", action="store_true", help="print the plans as JSON")
    bw.set_defaults(func=_cmd_bandwidth)

    params = sub.add_parser("params", help="parameter counts of the model presets")
    params.add_argument("--preset", help="one preset (default: every preset, tiny to 12b)")
    params.add_argument("--json", action="store_true", help="print the counts as JSON")
    params.set_defaults(func=_cmd_params)
