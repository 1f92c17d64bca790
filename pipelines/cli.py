"""The `diloco` command line: simulate, run and inspect Decoupled DiLoCo training.

    diloco demo      [--config FILE] [--set field.path=value ...] [--chaos]   # an orchestrated run
    diloco status    [--store URI] [--experiment NAME]     # where a run stands, from its store
    diloco list      [--store URI]                         # the experiments in a store
    diloco stop      [--store URI] [--reason TEXT]         # end a run before its budget
    diloco export    --out DIR [--store URI]               # the global model, safetensors + Orbax
    diloco capacity  [--join L] [--leave L]                # learners joining or leaving a run
    diloco simulate  [--config FILE] [--set ...]           # the in-process reference simulator
    diloco config    [--config FILE] [--set ...]           # validate and print a config
    diloco manifests --deployment FILE                     # learners' GKE Pods/JobSets
    diloco iam       --store gs://...                      # the bucket's IAM bindings
    diloco params    [--preset NAME]                       # parameter counts and bytes
    diloco bandwidth [--params N] [--sites S] ...          # cross-site bandwidth plan
    diloco goodput   --chips N [--learners M] [--json]     # goodput under failures

Heavy imports (JAX) happen inside the commands so `diloco --help` and config errors are instant.
"""

import argparse
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from diloco_core.config import ConfigError, ExperimentConfig
from diloco_core.config_loading import (
    config_from_mapping,
    config_to_mapping,
    merge_mappings,
    overrides_to_mapping,
    parse_config_text,
)
from diloco_core.fault_tape import TapeError


def load_config(path: str | None, overrides: list[str],
                base: Sequence[str] = (), form: dict | None = None) -> ExperimentConfig:
    """Defaults <- `base` overrides (e.g. the orchestrated defaults) <- file (YAML or TOML by
    extension) <- `form` (the launchpad's typed fields a user filled in) <- --set overrides.

    A user who sets the number of learners but not a per-learner list (speeds, batch sizes,
    regions, names) gets that list's default for the new M, not the base's list for its M:
    `demo --set learners.num_learners=2` must not fail on four speeds nobody asked for; nor
    `num_learners=1` on the base's quorum K = 2 (K becomes M when the base's K exceeds it)."""
    mapping = {}
    if path:
        file = Path(path)
        if not file.is_file():
            raise ConfigError("--config", f"no such file: {path}")
        fmt = "toml" if file.suffix == ".toml" else "yaml"
        mapping = parse_config_text(file.read_text(), fmt)
    mapping = merge_mappings(mapping, form or {})
    base_mapping = overrides_to_mapping(base)
    user = merge_mappings(mapping, overrides_to_mapping(overrides))
    chosen = user.get("learners") if isinstance(user.get("learners"), dict) else {}
    if "num_learners" in chosen and isinstance(base_mapping.get("learners"), dict):
        for per_learner in ("names", "regions", "speeds", "batch_sizes"):
            if per_learner not in chosen:
                base_mapping["learners"].pop(per_learner, None)
        # Likewise the base's quorum: K = 2 must not refuse `num_learners=1`, a K the user
        # never set. A K the user sets is checked as given.
        base_sync = base_mapping.get("sync")
        user_sync = user.get("sync") if isinstance(user.get("sync"), dict) else {}
        m, k = chosen["num_learners"], (base_sync or {}).get("min_quorum")
        if ("min_quorum" not in user_sync and isinstance(m, int) and isinstance(k, int)
                and 1 <= m < k):
            base_sync["min_quorum"] = m
    return config_from_mapping(merge_mappings(base_mapping, mapping), overrides)


def _number(kind: type, low: float, *, low_open: bool = False):
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


POSITIVE_INT = _number(int, 1)
POSITIVE = _number(float, 0, low_open=True)


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML or TOML experiment config")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="FIELD=VALUE", help="override one field, e.g. sync.min_quorum=2")


def _cmd_config(args) -> int:
    import yaml

    base = ()
    if args.orchestrated:
        from pipelines.launch_defaults import ORCHESTRATED_DEFAULTS

        base = ORCHESTRATED_DEFAULTS
    cfg = load_config(args.config, args.overrides, base=base)
    print(yaml.safe_dump(config_to_mapping(cfg), sort_keys=False), end="")
    return 0


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
        for r in rows:
            print(f"{r['preset']:>6}  {r['parameters'] / 1e6:12.2f} M params  "
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


def _cmd_simulate(args) -> int:
    from pipelines.simulate_command import simulate

    cfg = load_config(args.config, args.overrides)
    return simulate(cfg, baselines=args.baselines, out_dir=Path(args.out), as_json=args.json)


def _cmd_demo(args) -> int:
    import time

    from pipelines.dagster_dev import check_postgres_url
    from pipelines.demo_command import run_demo
    from pipelines.launch_defaults import ORCHESTRATED_DEFAULTS, require_orchestratable
    from pipelines.workdir import WorkdirError, previous_experiment

    postgres_url = args.postgres_url or None  # an empty DILOCO_POSTGRES_URL means SQLite
    if postgres_url is not None:
        try:
            check_postgres_url(postgres_url)
        except ValueError as err:
            print(f"diloco: invalid --postgres-url: {err}", file=sys.stderr)
            return 2
    # Each demo is its own experiment, named after its start (TensorBoard runs and exports
    # stay apart); a demo on an earlier demo's workdir resumes that one's experiment. A name
    # from --config or --set wins over both.
    stamp = time.strftime("%Y%m%d-%H%M%S")
    workdir = Path(args.workdir or f"runs/demo-{stamp}")
    name = previous_experiment(workdir) or f"diloco-demo-{stamp}"
    cfg = load_config(args.config, args.overrides, base=[*ORCHESTRATED_DEFAULTS, f"name={name}"])
    require_orchestratable(cfg)
    # A SIGTERM unwinds like Ctrl-C, so that the demo's Dagster instance is stopped with it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return run_demo(cfg, chaos=args.chaos, json_path=args.json, workdir=str(workdir),
                        port=args.port, timeout=args.timeout, fault_tape_path=args.fault_tape,
                        postgres_url=postgres_url,
                        resume_command=_resume_command(args.argv, workdir.resolve()))
    except WorkdirError as err:
        print(f"diloco demo: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130      # the line saying how to resume was printed as the interrupt came


def _resume_command(argv: list[str], workdir: Path) -> str:
    """The command line that resumes this demo: the same options (a resume must launch the
    same config), with --workdir pointing at this one."""
    import shlex

    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--workdir":
            skip = True
        elif not arg.startswith("--workdir="):
            kept.append(arg)
    if kept and kept[0] == "demo":
        kept = kept[1:]
    return shlex.join(["diloco", "demo", *kept, "--workdir", str(workdir)])


def _cmd_manifests(args) -> int:
    from pipelines.launch_defaults import ORCHESTRATED_DEFAULTS
    from resources.extras import require_extra

    require_extra("k8s", "diloco manifests", ("kubernetes",))
    from pipelines.manifests_command import print_manifests
    from resources.compute.placement import load_deployment

    if not args.deployment:
        print("diloco: --deployment (or $DILOCO_DEPLOYMENT) is required", file=sys.stderr)
        return 2
    deployment = load_deployment(args.deployment)
    cfg = load_config(args.config, args.overrides, base=ORCHESTRATED_DEFAULTS)
    return print_manifests(cfg, deployment, args.attempt)


# The Dagster run workers' service account (docs/scale_out.md), which runs the syncer too.
CONTROL_MEMBER = "serviceAccount:dagster-run@{project}.iam.gserviceaccount.com"


def _cmd_iam(args) -> int:
    import json

    from pipelines.launch_defaults import ORCHESTRATED_DEFAULTS
    from resources.store.access import bucket_bindings

    cfg = load_config(args.config, args.overrides, base=ORCHESTRATED_DEFAULTS)
    if not args.store.startswith("gs://") or len(args.store) <= len("gs://"):
        print(f"diloco: --store must be gs://bucket[/prefix], got {args.store!r}",
              file=sys.stderr)
        return 2
    bucket, _, prefix = args.store[len("gs://"):].partition("/")
    fill = {"project": args.project}
    try:
        members = {name: args.learner_member.format(learner=name, **fill)
                   for name in cfg.learners.learner_names}
        control = [m.format(**fill) for m in args.control_member or [CONTROL_MEMBER]]
        policy = bucket_bindings(bucket, prefix, cfg.name, members, control, chaos=args.chaos)
    except (KeyError, ValueError) as err:
        print(f"diloco: {err}", file=sys.stderr)
        return 2
    print(json.dumps(policy, indent=2))
    return 0


def _open_experiment(args):
    """The experiment `--experiment` names, else the active one, else the only one, in the
    store `--store` names (else the most recent under runs/: `run_address`); None after a
    one-line error naming the store and what is missing."""
    from pipelines.run_address import AddressError, choose_experiment, open_existing

    uri = _store_uri(args)
    if uri is None:
        return None
    try:
        return choose_experiment(open_existing(uri), uri, args.experiment)
    except AddressError as err:
        print(f"diloco {args.command}: {err}", file=sys.stderr)
    except Exception as err:  # noqa: BLE001 - credentials, network, permissions: say which
        print(f"diloco: cannot read the store {uri}: {type(err).__name__}: "
              f"{' '.join(str(err).split())[:300]}", file=sys.stderr)
    return None


def _store_uri(args) -> str | None:
    """--store, else $DILOCO_STORE_URI, else the most recent store under runs/ (said on
    stderr, so that --json output stays clean); None after a one-line error."""
    from pipelines.run_address import AddressError, resolve_store

    try:
        uri, note = resolve_store(args.store)
    except AddressError as err:
        print(f"diloco {args.command}: {err}", file=sys.stderr)
        return None
    if note:
        print(f"diloco {args.command}: {note}", file=sys.stderr)
    return uri


STORE_HELP = ("the store: a directory or gs://bucket/prefix (default $DILOCO_STORE_URI, else "
              "the most recently used store under runs/: the last demo's)")


def _add_store_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", help=STORE_HELP)
    parser.add_argument("--experiment",
                        help="default: the store's active experiment, else its only one")


def _cmd_list(args) -> int:
    from pipelines.list_command import list_experiments, print_experiments
    from pipelines.run_address import AddressError, open_existing

    uri = _store_uri(args)
    if uri is None:
        return 2
    try:
        rows = list_experiments(open_existing(uri))
    except AddressError as err:
        print(f"diloco list: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - credentials, network, permissions: say which
        print(f"diloco: cannot read the store {uri}: {type(err).__name__}: "
              f"{' '.join(str(err).split())[:300]}", file=sys.stderr)
        return 2
    print_experiments(rows, uri, args.json)
    return 0


def _cmd_status(args) -> int:
    from pipelines.status_command import print_status, run_status, status_json

    store = _open_experiment(args)
    if store is None:
        return 2
    status = run_status(store, last_rounds=args.rounds)
    if args.json:
        print(status_json(status))
    else:
        print_status(status)
    return 0


def _cmd_export(args) -> int:
    from resources.model_export import ExportError, export_global

    store = _open_experiment(args)
    if store is None:
        return 2
    formats = tuple(f.strip() for f in args.format.split(",") if f.strip())
    try:
        manifest = export_global(store, args.out, formats)
    except ExportError as err:
        print(f"diloco export: {err}", file=sys.stderr)
        return 2
    versions = ", ".join(f"f{f['fragment']} v{f['version']}" for f in manifest["fragments"])
    print(f"exported {manifest['experiment']} ({manifest['num_params']:,} parameters; "
          f"{versions}) to {args.out} as {', '.join(manifest['formats'])}")
    print("load it with: from resources.model_export import load_exported; "
          f"model = load_exported({str(args.out)!r})")
    return 0


def _cmd_stop(args) -> int:
    import getpass

    from pipelines.run_control import request_stop

    store = _open_experiment(args)
    if store is None:
        return 2
    print(request_stop(store, f"{getpass.getuser()} (diloco stop)", args.reason))
    return 0


def _cmd_capacity(args) -> int:
    import getpass

    from diloco_core.capacity import CapacityError
    from diloco_core.config_loading import config_from_mapping
    from pipelines.capacity_control import change_capacity, current_capacity, describe

    store = _open_experiment(args)
    if store is None:
        return 2
    cfg = config_from_mapping(store.get_config())
    join, leave = _names(args.join), _names(args.leave)
    if not join and not leave:
        print(describe(current_capacity(store, cfg), cfg))
        return 0
    try:
        record = change_capacity(store, cfg, join=join, leave=leave,
                                 requested_by=f"{getpass.getuser()} (diloco capacity)",
                                 reason=args.reason)
    except CapacityError as err:
        print(f"diloco capacity: {err}", file=sys.stderr)
        return 2
    print(describe(record, cfg))
    print("the learner supervisor launches joining learners at its next tick; leaving ones "
          "offer what they have to the coming rounds, then exit (watch with `diloco status`)")
    return 0


def _names(values: list[str] | None) -> list[str]:
    """--join a,b --join c -> [a, b, c]"""
    return [n.strip() for v in values or [] for n in v.split(",") if n.strip()]


class DefaultsFormatter(argparse.HelpFormatter):
    """Says an option's default after its help, unless the help already states one (argparse's
    ArgumentDefaultsHelpFormatter would say it twice) or there is none (no "default: None")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or "default" in text.lower()
                or action.default in (None, False, "", [], argparse.SUPPRESS)):
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("decoupled-diloco")
    except PackageNotFoundError:
        release = "unknown"
    parser = argparse.ArgumentParser(
        prog="diloco", description=__doc__.splitlines()[0],
        epilog="Each command has its own --help. The orchestrated run (Dagster UI, daemon, "
               "learner processes): `diloco demo`.")
    parser.add_argument("--version", action="version", version=f"diloco {release}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_parser = sub.add_parser

    def described(name: str, **kw) -> argparse.ArgumentParser:
        # The one-line help doubles as the command's description in `diloco NAME --help`.
        return add_parser(name, description=kw.get("help"), formatter_class=DefaultsFormatter,
                          **kw)

    sub.add_parser = described

    sim = sub.add_parser("simulate", help="run Decoupled DiLoCo and baselines in the reference "
                         "simulator (real model and data, simulated clock)")
    _add_config_args(sim)
    sim.add_argument("--baselines", default="data_parallel,synchronous_diloco",
                     help="comma-separated: data_parallel, synchronous_diloco (or 'none')")
    sim.add_argument("--out", default="runs/simulate", help="where results and plots go")
    sim.add_argument("--json", action="store_true", help="print the summary as JSON")
    sim.set_defaults(func=_cmd_simulate)

    demo = sub.add_parser("demo", help="a complete orchestrated training run: Dagster daemon, "
                          "sensors, learner processes and merges on this machine")
    _add_config_args(demo)
    demo.add_argument("--chaos", action="store_true",
                      help="kill one learner process mid-run and show it rejoining, then kill "
                           "the syncer service: its warm standby takes the lease over within "
                           "about a second and the supervisor relaunches the syncer (the "
                           "quorum sensor decides rounds only while neither is live)")
    demo.add_argument("--fault-tape", metavar="PATH",
                      help="replay a fault tape (JSON, see docs/chaos.md): learner faults are "
                           "injected by the learners and merges, Dagster restarts by this "
                           "command at their times")
    demo.add_argument("--json", metavar="PATH", help="write the run summary as JSON")
    demo.add_argument("--workdir", help="where DAGSTER_HOME and the store go (default "
                      "runs/demo-<time>); a workdir an interrupted demo left resumes its run")
    demo.add_argument("--port", type=int, help="Dagster UI port (default: a free one)")
    demo.add_argument("--timeout", type=float, default=1800, help="give up after this many s")
    demo.add_argument("--postgres-url", default=os.environ.get("DILOCO_POSTGRES_URL"),
                      metavar="URL",
                      help="keep the Dagster instance's runs, event logs and sensor state in "
                           "this PostgreSQL database (postgresql://USER[:PASSWORD]@HOST[:PORT]"
                           "/DB) instead of SQLite files; default $DILOCO_POSTGRES_URL")
    demo.set_defaults(func=_cmd_demo)

    st = sub.add_parser("status", help="rounds, learners (live, late, down, rejoining) and "
                        "the last merge decisions of a run, read from its store")
    _add_store_args(st)
    st.add_argument("--rounds", type=int, default=5, help="how many recent decisions to show")
    st.add_argument("--json", action="store_true", help="print the status as JSON")
    st.set_defaults(func=_cmd_status)

    ls = sub.add_parser("list", help="the experiments in a store, each with its state (active, "
                        "stopping, finished, stopped, inactive)")
    ls.add_argument("--store", help=STORE_HELP)
    ls.add_argument("--json", action="store_true", help="print the list as JSON")
    ls.set_defaults(func=_cmd_list)

    ex = sub.add_parser("export", help="write an experiment's current global model as "
                        "safetensors and an Orbax checkpoint, with its config (load it with "
                        "resources.model_export.load_exported)")
    _add_store_args(ex)
    ex.add_argument("--out", required=True, metavar="DIR",
                    help="a new or empty directory (an export never overwrites)")
    ex.add_argument("--format", default="safetensors,orbax",
                    help="comma-separated: safetensors, orbax")
    ex.set_defaults(func=_cmd_export)

    sp = sub.add_parser("stop", help="end a run cleanly before its token budget: at its next "
                        "tick the syncer writes STOP, the learners stop, the final rounds merge "
                        "and the summary is written")
    _add_store_args(sp)
    sp.add_argument("--reason", default="", help="why (kept in the STOP record)")
    sp.set_defaults(func=_cmd_stop)

    cp = sub.add_parser("capacity", help="add learners to a running experiment or release "
                        "them (scavenged capacity); without --join/--leave, show who is "
                        "present. The roster is fixed at launch (learners.num_learners; "
                        "learners.standby start absent)")
    _add_store_args(cp)
    cp.add_argument("--join", action="append", metavar="LEARNER[,LEARNER]",
                    help="learners that get compute: launched at the supervisor's next tick")
    cp.add_argument("--leave", action="append", metavar="LEARNER[,LEARNER]",
                    help="learners whose compute is reclaimed: they offer what they have, then "
                         "exit, and are not relaunched")
    cp.add_argument("--reason", default="", help="why (kept in the capacity record)")
    cp.set_defaults(func=_cmd_capacity)

    man = sub.add_parser("manifests", help="the Pod or JobSet of every learner placed on GKE by "
                         "the deployment file, validated, as YAML (for review or kubectl "
                         "dry-run)")
    _add_config_args(man)
    man.add_argument("--deployment", default=os.environ.get("DILOCO_DEPLOYMENT", ""),
                     metavar="PATH", help="deployment file (default $DILOCO_DEPLOYMENT)")
    man.add_argument("--attempt", type=int, default=0, help="the launch attempt to render")
    man.set_defaults(func=_cmd_manifests)

    iam = sub.add_parser("iam", help="the store bucket's IAM bindings for an experiment: each "
                         "learner writes only its own records and contributions, the control "
                         "plane writes the rest (JSON policy, version 3)")
    _add_config_args(iam)
    iam.add_argument("--store", required=True, help="the store, gs://bucket[/prefix]")
    iam.add_argument("--project", default="PROJECT",
                     help="the GCP project of the service accounts (default: PROJECT)")
    iam.add_argument("--learner-member",
                     default="serviceAccount:diloco-{learner}@{project}.iam.gserviceaccount.com",
                     help="each learner's IAM member; {learner} and {project} are filled in "
                          "(default: %(default)s)")
    iam.add_argument("--control-member", action="append",
                     help="the control plane's member (repeat for several): Dagster runs and "
                          f"the syncer (default: {CONTROL_MEMBER})")
    iam.add_argument("--chaos", action="store_true",
                     help="the experiment runs a fault tape: learners also record fired faults")
    iam.set_defaults(func=_cmd_iam)

    cfg = sub.add_parser("config", help="validate a config and print it with every default")
    _add_config_args(cfg)
    cfg.add_argument("--orchestrated", action="store_true",
                     help="start from the orchestrated launch defaults, as `diloco demo` and "
                          "the `train` job do (without it: the simulator's defaults)")
    cfg.set_defaults(func=_cmd_config)

    gp = sub.add_parser("goodput", help="goodput under chip failures at datacentre scale")
    gp.add_argument("--chips", type=_number(int, 256), required=True,
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
    bw.add_argument("--overlap", type=_number(int, 0), default=2, help="tau")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"diloco: invalid config: {err}", file=sys.stderr)
        return 2
    except TapeError as err:
        print(f"diloco: invalid fault tape: {err}", file=sys.stderr)
        return 2
    except ValueError as err:
        # The core's own checks on a combination the options allow (e.g. P > H); set
        # DILOCO_DEBUG=1 for the traceback.
        if os.environ.get("DILOCO_DEBUG"):
            raise
        print(f"diloco {args.command}: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        # A path the command cannot create, write or read (read-only, a file where a directory
        # should be, permissions): the path and the reason; DILOCO_DEBUG=1 for the traceback.
        if os.environ.get("DILOCO_DEBUG"):
            raise
        print(f"diloco {args.command}: {_os_error_line(err)}", file=sys.stderr)
        return 1


def _os_error_line(err: OSError) -> str:
    reason = err.strerror or type(err).__name__
    if err.filename is None:
        return f"{reason}: {' '.join(str(err).split())[:300]}" if err.strerror else str(err)
    return f"cannot use {err.filename}: {reason}"


if __name__ == "__main__":
    sys.exit(main())
