"""An experiment's config from its layers: the defaults, a base (the orchestrated launch
defaults), a file, the launchpad's form and `--set` overrides. The CLI, the Dagster jobs and the
launchpad's schema all build configs this one way."""

from collections.abc import Sequence
from pathlib import Path

from diloco_core.config import ConfigError, ExperimentConfig
from diloco_core.config_loading import (
    config_from_mapping,
    merge_mappings,
    overrides_to_mapping,
    parse_config_text,
)


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
