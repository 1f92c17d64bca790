"""A learner's sync bookkeeping as pure state transitions.

Per fragment the learner keeps the anchor (the global values it last received), that version
number, and the steps and tokens it has processed since. It never waits for the syncer: it makes
contributions from its current parameters and takes a newer merged version of a fragment when it
arrives, by one of three receive rules:

- overwrite (the paper): theta <- merged. Whatever the learner computed on the fragment after
  its offer is discarded; the counters restart at zero.
- blend: theta <- alpha * theta + (1 - alpha) * merged (Streaming DiLoCo's mixing).
- rebase: theta <- merged + (theta - theta_at_offer). The merged fragment replaces what the
  learner offered, and the progress it made since the offer (not yet in any merge) is kept on
  top, with its counters, for its next offer. Nothing is discarded however long the merge takes,
  at the cost of one copy of the fragment per offer in flight. With no offer since the last
  receipt, everything since the anchor is kept.

  Only a merge that took the learner's offer may replace what it offered. The receiver says
  which (`OfferFate`): a merge of the offer's own round (or a later one) without it (a late
  offer, one not admitted, or refused by the merge) keeps everything since the anchor, and
  the offer's counters return to the next offer; a merge of an earlier round, with the offer
  still pending, keeps everything too and moves the offered values by the same change, so
  that the merge that does take the offer later removes exactly what it offered.
"""

from collections.abc import Mapping
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp

from diloco_core.compression import encode
from diloco_core.contribution import Contribution
from diloco_core.fragments import FragmentPlan

FlatParams = dict[str, jax.Array]

# What a merged version did with the learner's pending offer of that fragment (rebase only):
# "merged" (it is in the version, or nothing says otherwise), "not_merged" (its round was
# decided or merged without it: it never will be), "pending" (a merge of an earlier round).
OfferFate = str
OFFER_FATES = ("merged", "not_merged", "pending")


@dataclass(frozen=True)
class FragmentSync:
    anchor: FlatParams      # global values of this fragment as last received
    version: int            # their version
    steps: int = 0          # inner steps since the anchor was received
    tokens: int = 0         # tokens processed since the anchor was received
    # "rebase" only: the fragment's values and counters when it was last offered.
    offered_values: FlatParams | None = None
    offered_steps: int = 0
    offered_tokens: int = 0
    offered_round: int | None = None


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

    def after_offer(self, params: Mapping[str, jax.Array], plan: FragmentPlan,
                    fragment: int, round_index: int | None = None) -> "LearnerSync":
        """Remember what was offered of `fragment`, and to which round (for the "rebase"
        receive rule)."""
        sync = self.fragments[fragment]
        # Copies: the learner's params are donated to its jitted step.
        values = {name: jnp.array(params[name], copy=True) for name in plan.fragments[fragment]}
        fragments = list(self.fragments)
        fragments[fragment] = replace(sync, offered_values=values, offered_steps=sync.steps,
                                      offered_tokens=sync.tokens, offered_round=round_index)
        return replace(self, fragments=tuple(fragments))

    def offer_fate(self, fragment: int, merged_round: int | None,
                   merged_with: Mapping[int, bool], complete: bool = False) -> OfferFate:
        """What a merged version of `fragment`, made by the merge of `merged_round`, did with
        the pending offer: `merged_with` maps the rounds whose merges made the versions since
        the one held (this version's and any skipped) to whether each took this learner's
        offer; `complete` says it names every one of them, so a round missing from it made no
        version (merged nothing). Where it cannot tell (an unknown merged round, or the
        offer's round missing from an incomplete map) the offer counts as "merged", the rule
        before offers' fates were known."""
        offered = self.fragments[fragment].offered_round
        if offered is None or merged_round is None:
            return "merged"
        if merged_round < offered:
            return "pending"
        if offered not in merged_with:
            return "not_merged" if complete else "merged"
        return "merged" if merged_with[offered] else "not_merged"

    def receive(self, params: FlatParams, fragment: int, merged: Mapping[str, jax.Array],
                version: int, rule: str = "overwrite", alpha: float = 0.5,
                offer: OfferFate = "merged") -> tuple[FlatParams, "LearnerSync"]:
        """Take a merged fragment by `rule` (see the module docstring) and reset its counters
        (under "rebase", to what was processed since the offer, or since the anchor when
        `offer` says the merge did not take it).

        A version not newer than the one held is ignored, so out-of-order deliveries are safe.
        """
        sync = self.fragments[fragment]
        if version <= sync.version:
            return params, self
        if rule not in ("overwrite", "blend", "rebase"):
            raise ValueError(f"unknown receive rule {rule!r}")
        if offer not in OFFER_FATES:
            raise ValueError(f"unknown offer fate {offer!r}")
        taken = offer == "merged" and sync.offered_values is not None
        base = sync.offered_values if taken else sync.anchor
        new_params = dict(params)
        for name, value in merged.items():
            if rule == "overwrite":
                # A fresh buffer: the learner's params are donated to its jitted step, and the
                # merged values are also the syncer's (and the anchor's).
                new_params[name] = jnp.array(value, copy=True)
            elif rule == "blend":
                new_params[name] = alpha * params[name] + (1.0 - alpha) * value
            else:
                new_params[name] = value + (params[name] - base[name])
        steps = tokens = 0
        kept: dict = {}
        if rule == "rebase":
            steps = sync.steps - (sync.offered_steps if taken else 0)
            tokens = sync.tokens - (sync.offered_tokens if taken else 0)
            if offer == "pending" and sync.offered_values is not None:
                # The offer may still be merged: what it offered moves with the anchor.
                kept = {"offered_values": {k: sync.offered_values[k] + (merged[k] - sync.anchor[k])
                                           for k in sync.offered_values},
                        "offered_steps": sync.offered_steps,
                        "offered_tokens": sync.offered_tokens,
                        "offered_round": sync.offered_round}
        fragments = list(self.fragments)
        fragments[fragment] = FragmentSync({k: jnp.asarray(v) for k, v in merged.items()}, version,
                                           steps, tokens, **kept)
        return new_params, replace(self, fragments=tuple(fragments))
