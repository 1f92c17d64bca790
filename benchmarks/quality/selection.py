"""Selection separate from confirmation: which seeds choose a configuration, which report it, and
how many configurations each method was given.

Configurations are chosen on the selection seeds (0-2) and the validation slice, and reported on
fresh confirmation seeds (3-5) and the test slice, so a reported figure is not the best draw of
the search that picked it. A method's tuning budget is the number of distinct settings of its
own hyperparameters (sync.*, outer.*, inner.*, warm start) that the experiments ran at one token
budget in the default scenario (data, model, learners, speeds, faults as experiment 1's).
"""

from dataclasses import replace

from benchmarks.quality.experiments import EXPERIMENTS, Arm

SELECTION_SEEDS = (0, 1, 2)
CONFIRMATION_SEEDS = (3, 4, 5)
ROLES = {"selection": SELECTION_SEEDS, "confirmation": CONFIRMATION_SEEDS}
# Config fields a method tunes; every other field is the scenario it is tuned in.
HYPERPARAMETERS = ("sync.", "outer.", "inner.", "learners.warm_start_fraction")
# The arm's identity, not a setting: each seed or budget is the same configuration.
NOT_SETTINGS = ("seed", "token_budget")


def parse_seeds(words: list[str]) -> tuple[int, ...]:
    """`selection`, `confirmation` or seed numbers (mixable) -> sorted distinct seeds."""
    seeds: set[int] = set()
    for word in words:
        if word in ROLES:
            seeds.update(ROLES[word])
        elif word.isdigit():
            seeds.add(int(word))
        else:
            raise ValueError(f"unknown seeds {word!r}: use selection, confirmation or numbers")
    return tuple(sorted(seeds))


def role(seeds) -> str:
    """What a group of seeds is for: selection, confirmation, mixed (a figure that mixes the
    two is not a confirmation) or other (seeds outside both)."""
    seeds = set(seeds)
    if seeds <= set(SELECTION_SEEDS):
        return "selection"
    if seeds <= set(CONFIRMATION_SEEDS):
        return "confirmation"
    return "mixed" if seeds & set(SELECTION_SEEDS + CONFIRMATION_SEEDS) else "other"


def reseed(arms, seeds, labels=None, tokens=None) -> list[Arm]:
    """Each distinct configuration among `arms` (optionally only these labels / this budget)
    at each of `seeds`, in the arms' order."""
    out: dict[tuple, Arm] = {}
    for arm in arms:
        if (labels and arm.label not in labels) or (tokens is not None and arm.tokens != tokens):
            continue
        for seed in seeds:
            out.setdefault((arm.label, arm.method, arm.overrides, arm.tokens, seed),
                           replace(arm, seed=seed))
    return list(out.values())


def _settings(arm: Arm) -> tuple[dict, dict]:
    """(hyperparameters, scenario): the arm's config fields that differ from the defaults."""
    from benchmarks.quality.runner import _leaves, arm_config
    from diloco_core.config import ExperimentConfig
    from diloco_core.config_loading import config_to_mapping

    defaults = _leaves(config_to_mapping(ExperimentConfig()))
    changed = {k: v for k, v in _leaves(config_to_mapping(arm_config(arm))).items()
               if k not in NOT_SETTINGS and defaults.get(k) != v}
    tuned = {k: v for k, v in changed.items() if k.startswith(HYPERPARAMETERS)}
    return tuned, {k: v for k, v in changed.items() if k not in tuned}


def configurations_tried(method: str, tokens: int, experiments=None, ran=None) -> int:
    """How many distinct hyperparameter settings of `method` the experiments define at `tokens`
    in the default scenario (any seed); with `ran` (arm -> whether it has a result), only
    those that have been run."""
    seen = set()
    for exp in experiments or EXPERIMENTS.values():
        for arm in exp.arms:
            if arm.method != method or arm.tokens != tokens or (ran and not ran(arm)):
                continue
            tuned, scenario = _settings(arm)
            if not scenario:
                seen.add(tuple(sorted((k, repr(v)) for k, v in tuned.items())))
    return len(seen)


def observed_arms(exp, load) -> list[Arm]:
    """The experiment's own arms, plus each of its configurations at the selection and
    confirmation seeds where `load` (the runner's `load_arm`) finds a stored result: runs made
    with --seeds belong in the experiment's report."""
    arms = {(a.label, a.seed, a.tokens): a for a in exp.arms}
    for arm in reseed(exp.arms, SELECTION_SEEDS + CONFIRMATION_SEEDS):
        key = (arm.label, arm.seed, arm.tokens)
        if key not in arms and load(arm) is not None:
            arms[key] = arm
    return list(arms.values())
