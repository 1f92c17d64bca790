"""The merge of one fragment as it was before the streaming merge (diloco_core/merge_stream.py),
kept verbatim as the reference the streaming path is compared with, bit for bit (tests) and for
time and memory (benchmarks/merge_cost.py). It decodes every admitted contribution into a whole
outer-gradient fragment and keeps them all: peak memory ~M+ fragments.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import optax

from diloco_core.compression import decode
from diloco_core.config import SyncConfig
from diloco_core.contribution import Contribution
from diloco_core.corroboration import cap_shares, credit_offer, offer_step_bound, share_caps
from diloco_core.merge import mean_pairwise_cosine, merge_outer_grads, tree_norm
from diloco_core.outer import outer_step
from diloco_core.screening import screen_norms
from diloco_core.syncer import FlatParams, FragmentState, MergeRecord, _validate, all_finite
from diloco_core.weights import normalized_weights


def _outer_grad(current: FragmentState, c: Contribution, anchor: str) -> FlatParams | str:
    delta = {name: decode(enc) for name, enc in c.delta.items()}
    if not all_finite(delta):
        return "outer gradient contains NaN or Inf"
    if anchor == "base" or c.base_version == current.version:
        return delta
    base = current.base_of(c.base_version)
    if base is None:
        return f"base version {c.base_version} is no longer kept by the syncer"
    return {name: (current.params[name] - base[name]) + delta[name] for name in delta}


def reference_merge_fragment(current: FragmentState, names: Sequence[str], num_fragments: int,
                   round_index: int, fragment: int, contributions: Sequence[Contribution],
                   cfg: SyncConfig, tx: optax.GradientTransformation,
                   is_embedding: Callable[[str], bool], reason: str, late: Sequence[str] = (),
                   reference_norm: float | None = None, average: bool = False,
                   step_tokens: Mapping[str, int] | None = None
                   ) -> tuple[FlatParams | None, optax.OptState | None, MergeRecord]:
    """Merge the admitted contributions of one round into one fragment.

    `average` (a final round under `outer.final_rounds = "average"`): publish Theta - g, the
    weighted average of the members' fragments, instead of an outer step, and leave the
    outer state as it is. `step_tokens` (learner -> tokens of one of its inner steps), when
    given, refuses a contribution claiming more tokens than its steps can process.

    Returns the new fragment values and outer state (None when nothing could be merged) and the
    decision record. Each contribution is validated, turned into an outer gradient, and screened
    for an absurd norm (`screen_norms`, against `reference_norm`, the previous merge's median
    per-step norm, when there are fewer than three); the rest are weighted, combined, applied.
    """
    rejected: dict[str, str] = {}
    accepted: list[tuple[Contribution, FlatParams]] = []
    for c in contributions:
        try:
            why = _validate(current, names, fragment, num_fragments, c, cfg, step_tokens)
            grad = why if why is not None else _outer_grad(current, c, cfg.anchor)
        except Exception as err:  # noqa: BLE001 - one learner's bytes never sink the round
            # The checks above are meant to leave nothing to fail here; whatever still does is
            # that contribution's problem, refused with the error, and the round goes on.
            grad = f"could not be decoded: {type(err).__name__}: {str(err)[:200]}"
        if isinstance(grad, str):
            rejected[c.learner] = grad
        else:
            accepted.append((c, grad))
    # Counters as far as the syncer can bound them (steps by the protocol's pace and the
    # offer's staleness, tokens by its steps): the screen and the weights see only these.
    clipped: dict[str, str] = {}
    credited = []
    for c, _ in accepted:
        bound = offer_step_bound(cfg.sync_period, current.version - c.base_version,
                                 cfg.max_speed_ratio)
        tokens, steps, why = credit_offer(
            c.tokens, c.steps, None if step_tokens is None else step_tokens.get(c.learner),
            bound)
        credited.append(replace(c, tokens=tokens, steps=steps))
        if why is not None:
            clipped[c.learner] = why
    accepted = [(c, g) for c, (_, g) in zip(credited, accepted, strict=True)]
    norms = [tree_norm(g) for _, g in accepted]
    outliers = screen_norms([c.learner for c, _ in accepted], norms,
                            [c.steps for c, _ in accepted], cfg.max_norm_ratio,
                            reference_norm)
    rejected.update(outliers)
    kept = [(c, g, n) for (c, g), n in zip(accepted, norms, strict=True)
            if c.learner not in outliers]
    bytes_in = sum(c.nbytes for c in contributions)
    if not kept:
        return None, None, MergeRecord(
            round_index, fragment, False, current.version,
            f"{reason}; nothing merged: every contribution was rejected",
            rejected=rejected, late=tuple(late), bytes_in=bytes_in, clipped=clipped)

    members = [c for c, _, _ in kept]
    grads = [g for _, g, _ in kept]
    weights = cap_shares(normalized_weights([c.tokens for c in members],
                                            [c.steps for c in members], cfg.weighting),
                         share_caps([c.learner for c in members], step_tokens,
                                    cfg.max_weight_share))
    merged = merge_outer_grads(grads, weights, cfg.merge_rule, is_embedding)
    if average:
        new_params = {k: current.params[k] - merged[k] for k in current.params}
        new_opt = current.outer_state
    else:
        new_params, new_opt = outer_step(tx, current.params, current.outer_state, merged)
    update = {k: new_params[k] - current.params[k] for k in new_params}
    record = MergeRecord(
        round_index, fragment, True, current.version + 1, reason,
        members=tuple(c.learner for c in members),
        weights=tuple(float(w) for w in weights),
        tokens=tuple(c.tokens for c in members), steps=tuple(c.steps for c in members),
        rejected=rejected, late=tuple(late),
        outer_grad_norms=tuple(n for _, _, n in kept),
        merged_norm=tree_norm(merged), update_norm=tree_norm(update), bytes_in=bytes_in,
        mean_cosine=mean_pairwise_cosine(grads), clipped=clipped)
    return new_params, new_opt, record
