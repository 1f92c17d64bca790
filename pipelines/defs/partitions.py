"""Partitions: rounds appear as the syncer opens them; learners when an experiment starts.

Both are dynamic because they come from the experiment config chosen at launch, not from code.
A learner update is one cell of round x learner; a learner that skips a round leaves its cell
empty. Round keys are zero-padded so they sort as numbers (see `round_control.round_key`).
"""

import dagster as dg

rounds = dg.DynamicPartitionsDefinition(name="rounds")
learners = dg.DynamicPartitionsDefinition(name="learners")
round_x_learner = dg.MultiPartitionsDefinition({"round": rounds, "learner": learners})

LEARNER_TAG = "diloco/learner"
REGION_TAG = "diloco/region"     # where a learner run's learner runs (learners.regions)
ROUND_TAG = "diloco/round"
FRAGMENT_TAG = "diloco/fragment"   # merges of one fragment run one at a time (dagster.yaml)
MERGE_TAG = "diloco/merge"         # every merge run: a global limit on concurrent merges
SYNCER_TAG = "diloco/syncer"       # the syncer service's runs: one at a time (dagster.yaml)
