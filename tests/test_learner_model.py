"""A learner process's model: built from shapes alone, the same plan, skeleton and step program
as a real initialisation gives (the state itself comes from the store or a checkpoint)."""

import jax
import pytest

from diloco_core.config_loading import config_from_mapping
from diloco_core.fragments import plan_fragments, split_params
from diloco_core.model import init_model
from resources.learner.model import LearnerModel


@pytest.mark.parametrize("overrides", [
    ["model.preset=tiny", "sync.num_fragments=4"],
    ["model.preset=moe-tiny", "sync.num_fragments=2"],
    ["task=digits", "model.preset=vit-digits", "data.batch_size=16", "sync.num_fragments=2"],
])
def test_the_learners_model_is_built_from_shapes_and_matches_a_real_initialisation(overrides):
    cfg = config_from_mapping({}, overrides)
    built = LearnerModel.build(cfg, 0, cfg.learners.learner_names[0])

    # Nothing allocated: every leaf of the skeleton is a shape and a dtype.
    leaves = jax.tree.leaves(built.template)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)

    model_def, params = init_model(cfg.model, cfg.seed)
    assert built.model_def == model_def
    plan = plan_fragments({k: v.shape for k, v in params.items()}, cfg.sync.num_fragments)
    assert built.plan == plan

    def skeleton(tree):
        return jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), tree)

    assert skeleton(built.template["anchors"]) == skeleton(split_params(params, plan))
    assert skeleton(built.template["train"]) == skeleton(built.inner.init(params))
    assert (jax.tree.structure(built.template["train"])
            == jax.tree.structure(built.inner.init(params)))
