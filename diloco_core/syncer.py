"""The syncer's state and the merge of one round, as pure transitions.

The syncer owns the global parameters Theta, one per fragment with a version number, and one
outer-optimizer state per fragment. A merge validates each admitted contribution, turns it into
an outer gradient, weights the learners by tokens^2/steps, combines them (RDA or mean), takes one
outer Nesterov step on that fragment only, and records what it did and why.

Outer gradient anchor ("global", the paper's Appendix D.2): g = Theta_current - theta_m, which a
learner whose base version is older rebuilds as (Theta_current - Theta_base) + delta_m; the
syncer keeps recent versions for that. With anchor "base", g = delta_m (the learner's own
progress only).
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import jax
import jax.numpy as jnp
import optax

from diloco_core.compression import encoded_problem
from diloco_core.config import SyncConfig
from diloco_core.contribution import Contribution
from diloco_core.corroboration import cap_shares, credit_offer, offer_step_bound, share_caps
from diloco_core.fragments import FragmentPlan
from diloco_core.merge_stream import GradSource, gradient_stats, merge_streamed
from diloco_core.screening import screen_norms
from diloco_core.weights import normalized_weights

FlatParams = dict[str, jax.Array]


@dataclass(frozen=True)
class SyncerState:
    fragments: tuple[FlatParams, ...]                 # current Theta_p
    versions: tuple[int, ...]
    outer_states: tuple[optax.OptState, ...]
    # Recent versions of each fragment, for learners anchored at an older one ("global"
    # anchor only; see `_kept_history`). The newest shares its arrays with `fragments`.
    history: tuple[dict[int, FlatParams], ...]
    history_size: int = 32

    @classmethod
    def start(cls, fragments: Sequence[FlatParams], tx: optax.GradientTransformation,
              history_size: int = 32) -> "SyncerState":
        frags = tuple(dict(f) for f in fragments)
        return cls(frags, (0,) * len(frags), tuple(tx.init(f) for f in frags),
                   tuple({0: f} for f in frags), history_size)


@dataclass(frozen=True)
class MergeRecord:
    """The decision record of one round: who was merged with what weight, who was not, and why."""

    round: int
    fragment: int
    merged: bool
    version: int                                       # version after this round
    reason: str
    members: tuple[str, ...] = ()
    weights: tuple[float, ...] = ()
    tokens: tuple[int, ...] = ()
    steps: tuple[int, ...] = ()
    rejected: dict[str, str] = field(default_factory=dict)
    late: tuple[str, ...] = ()
    outer_grad_norms: tuple[float, ...] = ()
    merged_norm: float = 0.0
    update_norm: float = 0.0
    bytes_in: int = 0
    # Mean pairwise cosine of the members' outer gradients (None with fewer than two): near 0,
    # learners' progress is near-orthogonal and a plain mean shrinks it (why RDA exists).
    mean_cosine: float | None = None
    # Members whose claimed tokens or steps were more than the syncer could corroborate, and
    # what they were credited (`tokens` and `steps` above are the credited figures).
    clipped: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class FragmentState:
    """What a merge of one fragment needs: Theta_p, its version, its outer-optimizer state, and
    a way to look up an older version (for learners whose base version is behind)."""

    params: FlatParams
    version: int
    outer_state: optax.OptState
    base_of: Callable[[int], FlatParams | None]


def _validate(current: FragmentState, names: Sequence[str], fragment: int, num_fragments: int,
              c: Contribution, cfg: SyncConfig,
              step_tokens: Mapping[str, int] | None = None) -> str | None:
    """Why a contribution cannot be merged, or None if it can. Everything is checked against
    the plan before a byte is decoded: names, shapes, the encoding the experiment uses and
    the dtype and element count of every array."""
    if c.fragment != fragment:
        if not 0 <= c.fragment < num_fragments:
            return f"fragment {c.fragment} does not exist (P={num_fragments})"
        return f"offered fragment {c.fragment} to a round of fragment {fragment}"
    if set(c.delta) != set(names):
        return "tensor names do not match the fragment"
    for name, enc in c.delta.items():
        if tuple(enc.shape) != tuple(current.params[name].shape):
            return (f"tensor {name} has shape {tuple(enc.shape)}, expected "
                    f"{tuple(current.params[name].shape)}")
        # One encoding per experiment: another block size would also compile another decode
        # program, in the merge, for every value a learner cares to try.
        if enc.encoding != cfg.encoding or (enc.scales is not None
                                            and enc.block_size != cfg.encoding_block_size):
            return (f"tensor {name} is encoded {enc.encoding}/{enc.block_size}, the "
                    f"experiment uses {cfg.encoding}/{cfg.encoding_block_size}")
        problem = encoded_problem(enc)
        if problem is not None:
            return f"tensor {name}: {problem}"
    if c.steps < 1 or c.tokens < 1:
        return f"no progress to merge (steps={c.steps}, tokens={c.tokens})"
    # Token weighting trusts the count, so a learner claiming more tokens than its steps can
    # process would take the merge over (w = tokens^2 / steps).
    per_step = None if step_tokens is None else step_tokens.get(c.learner)
    if per_step is not None and c.tokens > c.steps * per_step:
        return (f"claims {c.tokens} tokens in {c.steps} steps: more than the {per_step} a step "
                "of this learner processes")
    if c.base_version > current.version:
        return f"base version {c.base_version} is newer than the syncer's {current.version}"
    return None


@jax.jit
def _all_finite_device(tree: FlatParams) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(v)) for v in tree.values()]))


def all_finite(tree: FlatParams) -> bool:
    return bool(_all_finite_device(tree))


def _grad_source(current: FragmentState, c: Contribution, anchor: str,
                 bases: dict[int, FlatParams | None]) -> tuple[GradSource, str | None]:
    """How to rebuild c's outer gradient, and why it cannot be (None if it can): its delta, and
    with the "global" anchor and an older base the version it is anchored at, looked up once per
    version and merge (`bases`)."""
    if anchor == "base" or c.base_version == current.version:
        return GradSource(c.delta), None
    if c.base_version not in bases:
        bases[c.base_version] = current.base_of(c.base_version)
    base = bases[c.base_version]
    if base is None:
        return GradSource(c.delta), f"base version {c.base_version} is no longer kept by the syncer"
    return GradSource(c.delta, base), None


def _outer_grad_norm(current: FragmentState, names: Sequence[str], c: Contribution, anchor: str,
                     bases: dict[int, FlatParams | None]) -> tuple[GradSource, float] | str:
    """Pass 1 of the streaming merge for one contribution: its outer gradient's source and
    whole-fragment norm, or why it is refused (non-finite first, as the reasons always read)."""
    source, why = _grad_source(current, c, anchor, bases)
    finite, norm = gradient_stats(current.params, source, names)
    if not finite:
        return "outer gradient contains NaN or Inf"
    if why is not None:
        return why
    return source, norm


def merge_fragment(current: FragmentState, names: Sequence[str], num_fragments: int,
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
    # Pass 1 (diloco_core/merge_stream.py): each contribution checked and reduced to its norm
    # one group of tensors at a time; nothing decoded is kept.
    accepted: list[tuple[Contribution, GradSource, float]] = []
    bases: dict[int, FlatParams | None] = {}
    for c in contributions:
        try:
            why = _validate(current, names, fragment, num_fragments, c, cfg, step_tokens)
            grad = why if why is not None else _outer_grad_norm(current, names, c, cfg.anchor,
                                                                bases)
        except Exception as err:  # noqa: BLE001 - one learner's bytes never sink the round
            # The checks above are meant to leave nothing to fail here; whatever still does is
            # that contribution's problem, refused with the error, and the round goes on.
            grad = f"could not be decoded: {type(err).__name__}: {str(err)[:200]}"
        if isinstance(grad, str):
            rejected[c.learner] = grad
        else:
            accepted.append((c, *grad))
    # Counters as far as the syncer can bound them (steps by the protocol's pace and the
    # offer's staleness, tokens by its steps): the screen and the weights see only these.
    clipped: dict[str, str] = {}
    credited = []
    for c, _, _ in accepted:
        bound = offer_step_bound(cfg.sync_period, current.version - c.base_version,
                                 cfg.max_speed_ratio)
        tokens, steps, why = credit_offer(
            c.tokens, c.steps, None if step_tokens is None else step_tokens.get(c.learner),
            bound)
        credited.append(replace(c, tokens=tokens, steps=steps))
        if why is not None:
            clipped[c.learner] = why
    accepted = [(c, g, n) for c, (_, g, n) in zip(credited, accepted, strict=True)]
    norms = [n for _, _, n in accepted]
    outliers = screen_norms([c.learner for c, _, _ in accepted], norms,
                            [c.steps for c, _, _ in accepted], cfg.max_norm_ratio,
                            reference_norm)
    rejected.update(outliers)
    kept = [(c, g, n) for c, g, n in accepted if c.learner not in outliers]
    bytes_in = sum(c.nbytes for c in contributions)
    if not kept:
        return None, None, MergeRecord(
            round_index, fragment, False, current.version,
            f"{reason}; nothing merged: every contribution was rejected",
            rejected=rejected, late=tuple(late), bytes_in=bytes_in, clipped=clipped)

    members = [c for c, _, _ in kept]
    weights = cap_shares(normalized_weights([c.tokens for c in members],
                                            [c.steps for c in members], cfg.weighting),
                         share_caps([c.learner for c in members], step_tokens,
                                    cfg.max_weight_share))
    # Pass 2: group by group, merged across the kept members and stepped.
    merged = merge_streamed(current.params, current.outer_state, [g for _, g, _ in kept],
                            weights, cfg.merge_rule, is_embedding, tx, average=average)
    record = MergeRecord(
        round_index, fragment, True, current.version + 1, reason,
        members=tuple(c.learner for c in members),
        weights=tuple(float(w) for w in weights),
        tokens=tuple(c.tokens for c in members), steps=tuple(c.steps for c in members),
        rejected=rejected, late=tuple(late),
        outer_grad_norms=tuple(n for _, _, n in kept),
        merged_norm=merged.merged_norm, update_norm=merged.update_norm, bytes_in=bytes_in,
        mean_cosine=merged.mean_cosine, clipped=clipped)
    return merged.params, merged.outer_state, record


def _kept_history(history: dict[int, FlatParams], version: int, fragment: FlatParams,
                  anchor: str, size: int) -> dict[int, FlatParams]:
    """The versions of a fragment a later merge may still need as a learner's base.

    Only the "global" anchor reads an older version (g = (Theta - Theta_base) + delta); under
    "base" none is kept. Under "global" the newest `size` are: an offer older than that is
    refused, so `size` is the staleness this syncer accepts, and the memory it costs is `size`
    fragments at most, whatever the length of the run. Whole versions, not deltas between them:
    Theta - Theta_base must be the same float32 subtraction at every staleness (a sum of
    per-round deltas rounds differently), and a version costs what a delta costs. This history
    is the in-process syncer's (the simulator's); the syncer service reads a base from the
    store, one version at a time (pipelines/syncer/store_merge.py), within the store's retention.
    """
    if anchor != "global":
        return {}
    kept = dict(history)
    kept[version] = fragment
    for old in sorted(kept)[:-size]:
        del kept[old]
    return kept


def merge_round(state: SyncerState, plan: FragmentPlan, round_index: int, fragment: int,
                contributions: Sequence[Contribution], cfg: SyncConfig,
                tx: optax.GradientTransformation, is_embedding: Callable[[str], bool],
                reason: str, late: Sequence[str] = (), average: bool = False,
                step_tokens: Mapping[str, int] | None = None
                ) -> tuple[SyncerState, MergeRecord]:
    """Merge the admitted contributions of one round into fragment `fragment` of `state`
    (`step_tokens`: learner -> tokens of one of its inner steps, as in `merge_fragment`)."""
    current = FragmentState(state.fragments[fragment], state.versions[fragment],
                            state.outer_states[fragment], state.history[fragment].get)
    new_fragment, new_opt, record = merge_fragment(
        current, plan.fragments[fragment], plan.num_fragments, round_index, fragment,
        contributions, cfg, tx, is_embedding, reason, late, average=average,
        step_tokens=step_tokens)
    if new_fragment is None:
        return state, record
    version = record.version
    history = _kept_history(state.history[fragment], version, new_fragment, cfg.anchor,
                            state.history_size)

    def put(seq, value):
        items = list(seq)
        items[fragment] = value
        return tuple(items)

    return replace(state, fragments=put(state.fragments, new_fragment),
                   versions=put(state.versions, version),
                   outer_states=put(state.outer_states, new_opt),
                   history=put(state.history, history)), record
