"""The Dagster partition keys of rounds and learners: one experiment's rounds and learners
never share a partition with another's on one Dagster instance."""


def round_key(round_index: int) -> str:
    """The Dagster partition key of a round, zero-padded to 8 digits as in the store's layout,
    so keys sort as numbers (5 digits sorted round 100,000 before 99,999: a week at one round
    a second)."""
    return f"{round_index:08d}"


def partition_key(experiment: str, round_index: int, per_partition: int = 1) -> str:
    """The Dagster partition of a round's assets (`cfg.rounds_per_partition` rounds each):
    the experiment, then the round's own key or the window of rounds holding it, e.g.
    "diloco-demo/00000012" or "diloco-demo/00000064-00000127". The experiment is part of the
    key so that two experiments on one Dagster instance never share a partition (their round
    numbers overlap)."""
    if per_partition == 1:
        return f"{experiment}/{round_key(round_index)}"
    start = round_index - round_index % per_partition
    return f"{experiment}/{round_key(start)}-{round_key(start + per_partition - 1)}"


def partition_rounds(key: str) -> range:
    """The rounds a partition key holds (the inverse of `partition_key`)."""
    first, _, last = key.rpartition("/")[2].partition("-")
    return range(int(first), int(last or first) + 1)


def partition_experiment(key: str) -> str:
    """The experiment a round or learner partition key belongs to ("" for a key from before
    keys carried it)."""
    return key.rpartition("/")[0]


def learner_partition_key(experiment: str, learner: str) -> str:
    """The `learners` partition of one experiment's learner (learner names repeat across
    experiments: learner-0 of two runs is two partitions)."""
    return f"{experiment}/{learner}"
