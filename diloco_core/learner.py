"""A learner's sync bookkeeping as pure state transitions.

Per fragment the learner keeps the anchor (the global values it last received), that version
number, and the steps and tokens it has processed since. It never waits for the syncer: it makes
contributions from its current parameters, and overwrites (or blends) a fragment whenever a newer
merged version arrives, which resets that fragment's counters.
"""

from collections.abc import Mapping
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp

from diloco_core.compression import encode
from diloco_core.contribution import Contribution
from diloco_core.fragments import FragmentPlan

FlatParams = dict[str, jax.Array]


@dataclass(frozen=True)
class FragmentSync:
    anchor: FlatParams      # global values of this fragment as last received
    version: int            # their version
    steps: int = 0          # inner steps since the anchor was received
    tokens: int = 0         # tokens processed since the anchor was received


@dataclass(frozen=True)
class LearnerSync:
    name: str
    fragments: tuple[FragmentSync, ...]

    @classmethod
    def start(cls, name: str, global_fragments: list[FlatParams], versions: list[int]
              ) -> "LearnerSync":
        """A learner starting (or rejoining) from the current global parameters."""
        return cls(name, tuple(FragmentSync(dict(f), v)
                               for f, v in zip(global_fragments, versions, strict=True)))

    def after_step(self, tokens: int) -> "LearnerSync":
        """Count one inner step of `tokens` tokens against every fragment."""
        return replace(self, fragments=tuple(
            replace(f, steps=f.steps + 1, tokens=f.tokens + tokens) for f in self.fragments))

    def contribution(self, params: Mapping[str, jax.Array], plan: FragmentPlan, fragment: int,
                     round_index: int, learner_step: int, clock: float, encoding: str,
                     block_size: int) -> Contribution:
        """Offer fragment `fragment`: delta = anchor - theta, encoded, with its counters."""
        sync = self.fragments[fragment]
        delta = {name: encode(sync.anchor[name] - params[name], encoding, block_size)
                 for name in plan.fragments[fragment]}
        return Contribution(self.name, fragment, round_index, sync.version, sync.tokens,
                            sync.steps, learner_step, clock, delta)

    def receive(self, params: FlatParams, fragment: int, merged: Mapping[str, jax.Array],
                version: int, rule: str = "overwrite", alpha: float = 0.5
                ) -> tuple[FlatParams, "LearnerSync"]:
        """Take a merged fragment: overwrite (alpha = 0) or blend, then reset its counters.

        A version not newer than the one held is ignored, so out-of-order deliveries are safe.
        """
        if version <= self.fragments[fragment].version:
            return params, self
        new_params = dict(params)
        for name, value in merged.items():
            if rule == "overwrite":
                # A fresh buffer: the learner's params are donated to its jitted step, and the
                # merged values are also the syncer's (and the anchor's).
                new_params[name] = jnp.array(value, copy=True)
            elif rule == "blend":
                new_params[name] = alpha * params[name] + (1.0 - alpha) * value
            else:
                raise ValueError(f"unknown receive rule {rule!r}")
        fragments = list(self.fragments)
        fragments[fragment] = FragmentSync({k: jnp.asarray(v) for k, v in merged.items()}, version)
        return new_params, replace(self, fragments=tuple(fragments))
