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
from pathlib import Path

from diloco_core.config import ConfigError
from diloco_core.config_loading import (
    config_from_mapping,
    config_to_mapping,
)
from diloco_core.fault_tape import TapeError
from pipelines.commands.config_layers import load_config
from pipelines.commands.sizing import add_sizing_commands


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


def _cmd_simulate(args) -> int:
    from pipelines.commands.simulate import simulate

    cfg = load_config(args.config, args.overrides)
    return simulate(cfg, baselines=args.baselines, out_dir=Path(args.out), as_json=args.json)


def _cmd_demo(args) -> int:
    import time

    from pipelines.commands.dagster_dev import check_postgres_url
    from pipelines.commands.demo import run_demo
    from pipelines.commands.workdir import WorkdirError, previous_experiment
    from pipelines.launch_defaults import ORCHESTRATED_DEFAULTS, require_orchestratable

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
    from pipelines.commands.manifests import print_manifests
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
    from pipelines.commands.listing import list_experiments, print_experiments
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
    from pipelines.commands.status import print_status, run_status, status_json

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

    add_sizing_commands(sub)
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
