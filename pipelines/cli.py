"""The `diloco` command line.

    diloco simulate [--config FILE] [--set field.path=value ...]   # the main job for now
    diloco config   [--config FILE] [--set ...]                    # validate and print a config
    diloco params   [--preset NAME]                                # parameter counts and bytes

Heavy imports (JAX) happen inside the commands so `diloco --help` and config errors are instant.
"""

import argparse
import json
import sys
from pathlib import Path

from diloco_core.config import ConfigError, ExperimentConfig
from diloco_core.config_loading import config_from_mapping, config_to_mapping, parse_config_text


def load_config(path: str | None, overrides: list[str]) -> ExperimentConfig:
    """Defaults <- file (YAML or TOML by extension) <- --set overrides."""
    mapping = {}
    if path:
        file = Path(path)
        if not file.is_file():
            raise ConfigError("--config", f"no such file: {path}")
        fmt = "toml" if file.suffix == ".toml" else "yaml"
        mapping = parse_config_text(file.read_text(), fmt)
    return config_from_mapping(mapping, overrides)


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML or TOML experiment config")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="FIELD=VALUE", help="override one field, e.g. sync.min_quorum=2")


def _cmd_config(args) -> int:
    import yaml

    cfg = load_config(args.config, args.overrides)
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


def _cmd_simulate(args) -> int:
    from pipelines.simulate_command import simulate

    cfg = load_config(args.config, args.overrides)
    return simulate(cfg, baselines=args.baselines, out_dir=Path(args.out), as_json=args.json)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diloco", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    sim = sub.add_parser("simulate", help="run Decoupled DiLoCo and baselines in the reference "
                         "simulator (real model and data, simulated clock)")
    _add_config_args(sim)
    sim.add_argument("--baselines", default="data_parallel,synchronous_diloco",
                     help="comma-separated: data_parallel, synchronous_diloco (or 'none')")
    sim.add_argument("--out", default="runs/simulate", help="where results and plots go")
    sim.add_argument("--json", action="store_true", help="print the summary as JSON")
    sim.set_defaults(func=_cmd_simulate)

    cfg = sub.add_parser("config", help="validate a config and print it with every default")
    _add_config_args(cfg)
    cfg.set_defaults(func=_cmd_config)

    params = sub.add_parser("params", help="parameter counts of the model presets")
    params.add_argument("--preset")
    params.add_argument("--json", action="store_true")
    params.set_defaults(func=_cmd_params)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"diloco: invalid config: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
