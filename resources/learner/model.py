"""What one learner process trains and where: the model, its fragments, the jitted inner step, the
shapes of its state, and the mesh of its slice. Built once when the process starts.

The mesh spans every device of the slice: a single-process learner's own, or every process's on
a multi-host slice (jax.devices() lists all of them). The state is replicated over it or
FSDP-sharded (`learners.sharding`; `diloco_core/spmd.py`).
"""

import dataclasses
from typing import Any

import jax

from diloco_core.config import ConfigError, ExperimentConfig
from diloco_core.fragments import FragmentPlan, plan_fragments, split_params
from diloco_core.inner_step import InnerStep
from diloco_core.model import abstract_params, make_model_def
from diloco_core.spmd import learner_mesh, place_state, state_shardings


@dataclasses.dataclass(frozen=True, eq=False)
class LearnerModel:
    model_def: Any
    plan: FragmentPlan
    inner: InnerStep
    template: dict          # shapes: {"train": a train state's, "anchors": one dict per fragment}
    mesh: jax.sharding.Mesh
    sharding: str           # `learners.sharding`

    @classmethod
    def build(cls, cfg: ExperimentConfig, index: int, learner: str) -> "LearnerModel":
        # Checked here, not at the first step: an indivisible batch must fail the launch, not a
        # learner that has already joined the run.
        mesh = learner_mesh(jax.devices())
        batch_size, devices = cfg.learner_batch_sizes[index], mesh.size
        if batch_size % devices:
            field = (f"learners.batch_sizes[{index}]" if cfg.learners.batch_sizes
                     else "data.batch_size")
            raise ConfigError(field, f"{learner}'s batch of {batch_size} sequences is not "
                                     f"divisible by the {devices} devices of its slice")
        # Shapes only: the state comes from the store or a checkpoint, so the template is a
        # skeleton (what the plan, the mesh placement and a restore need). A real
        # initialisation here cost every start 1.5 CPU-s at the demo's 1.6M parameters, and a
        # large model's full fp32 params and AdamW state in one process's memory.
        model_def = make_model_def(cfg.model)
        shapes = abstract_params(cfg.model)
        template_params = {k: shapes[k] for k in model_def.names}
        plan = plan_fragments({k: v.shape for k, v in template_params.items()},
                              cfg.sync.num_fragments)
        inner = InnerStep(model_def, cfg.inner, cfg.total_learner_steps)
        template = {"train": jax.eval_shape(inner.init, template_params),
                    "anchors": split_params(template_params, plan)}
        return cls(model_def, plan, inner, template, mesh, cfg.learners.sharding)

    def place(self, tree):
        """`tree` on the mesh, replicated or sharded like the state (arrays already there stay)."""
        return place_state(tree, self.mesh, self.sharding)

    def fragment_shapes(self) -> list[dict]:
        return [{k: (tuple(v.shape), v.dtype) for k, v in anchor.items()}
                for anchor in self.template["anchors"]]

    def sharded_target(self):
        """The checkpoint tree's abstract target, each array with the sharding it has here."""
        shardings = state_shardings(self.template, self.mesh, self.sharding)
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            self.template, shardings)

    def describe(self, learner: str) -> str:
        devices = self.mesh.devices.ravel()
        return (f"{learner}: inner step on {len(devices)} {devices[0].platform} device(s) "
                f"({devices[0].device_kind}), batch split across them, state {self.sharding}")
