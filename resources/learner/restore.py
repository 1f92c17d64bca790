"""Where a (re)starting learner takes its state from.

1. Its own latest checkpoint, if fresh: no fragment is more than `max_behind` global versions
   behind (the syncer can still rebuild its outer gradients against those bases). The learner's
   own prefix is trusted: its checkpoint is not checked like a peer's.
2. Otherwise the current global parameters plus the AdamW state of a sound peer checkpoint
   (the healthiest optimizer statistics available), and its own data position if it has one.
3. On the first start, or when no peer has a sound checkpoint: the current global parameters
   and a fresh AdamW state.

A peer's checkpoint is a claim: the peer wrote it under its own prefix and may be hostile (a
checkpoint at step 10**9 with NaN moments once made every restarting learner NaN after one
step). A peer checkpoint is taken only when it is sound:
- corroborated: the peer's heartbeat is readable and the checkpoint's step is at most the
  heartbeat's `step` (the newest of the peer's checkpoints that is, so an honest peer whose
  heartbeat lags its latest save still offers the one before). The heartbeat is the peer's own
  record too, so this bounds the step by what the peer has told the control plane, no more;
- well-formed: its meta is a JSON object whose `step` is that step and whose `versions` holds
  one integer per fragment; its arrays have the target's tree, shapes and dtypes (Orbax
  restores an array at its saved shape whatever the target says, so this is checked here);
- consistent: its train step and every optimizer `count` equal the checkpoint's step;
- finite: every floating array (params, anchors, AdamW moments) is finite;
- a possible AdamW state: the second moment `nu` is >= 0 and, given the inner optimizer's
  (b1, b2, eps), |mu| <= k * sqrt(nu) + eps, where k = 1.05 * sqrt(C) and
  C = (1 - b1)**2 / ((1 - b2) * (1 - b1**2 / b2)) bounds mu**2 / nu for any gradient sequence
  (Cauchy-Schwarz on the two moving averages; b1**2 < b2). A state past that bound would move a
  parameter by many learning rates in one step.
The cheap checks (heartbeat, checkpoint steps) run on every peer; only the best corroborated
candidate is restored and checked, then the next one if it fails. Every peer not taken is named
with its reason in the plan (`skipped`) and in its `reason` text.
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import optax

from diloco_core.config import InnerOptConfig
from diloco_core.spmd import host_value
from resources.store.checkpoints import LearnerCheckpoints, abstract_target
from resources.store.learner_view import LearnerView

REASON_CHARS = 240      # one peer's reason, at most
SKIPPED_CHARS = 2400    # every skipped peer's, together (the heartbeat's `rejoined_from` < 4096)
MOMENT_SLACK = 1.05     # on the AdamW |mu| / sqrt(nu) bound (rounding, bf16 moments)


@dataclass(frozen=True)
class RestorePlan:
    source: str                      # "own" | "peer" | "fresh"
    state: Any = None                # restored checkpoint tree ({"train", "anchors"})
    meta: dict | None = None         # its JSON meta
    peer: str | None = None
    reason: str = ""
    skipped: dict[str, str] = field(default_factory=dict)   # peer -> why it was not taken


def own_is_fresh(meta: dict, current_versions: Sequence[int], max_behind: int) -> str | None:
    """Why the learner's own checkpoint is too stale to resume from, or None if it is fresh."""
    for p, (have, current) in enumerate(zip(meta["versions"], current_versions, strict=True)):
        if current - have > max_behind:
            return (f"fragment {p} is at version {have}, {current - have} behind the global "
                    f"{current} (limit {max_behind})")
    return None


def moment_bound(b1: float, b2: float) -> float | None:
    """k such that a genuine AdamW state has |mu| <= k * sqrt(nu) (up to rounding), or None when
    (b1, b2) admit no such bound (b1**2 >= b2)."""
    if b1 * b1 >= b2:
        return None
    return MOMENT_SLACK * math.sqrt((1 - b1) ** 2 / ((1 - b2) * (1 - b1 * b1 / b2)))


def meta_problem(meta: Any, step: int, num_fragments: int) -> str | None:
    """What is wrong with a peer checkpoint's JSON meta, or None."""
    if not isinstance(meta, dict):
        return f"meta is a {type(meta).__name__}, not an object"
    claimed = meta.get("step")
    if not _is_int(claimed):
        return f"meta has no integer step (got {_short(repr(claimed), 40)})"
    if claimed != step:
        return f"meta says step {claimed}, the checkpoint is step {step}"
    versions = meta.get("versions")
    if (not isinstance(versions, list) or len(versions) != num_fragments
            or not all(_is_int(v) and v >= 0 for v in versions)):
        return (f"meta versions {_short(repr(versions), 60)} are not {num_fragments} "
                "non-negative integers")
    return None


def state_problem(state: Any, target: Any, step: int,
                  inner_opt: InnerOptConfig | None = None) -> str | None:
    """What makes a restored peer state unsound (see the module doc), or None. Every process of
    a multi-process learner calls it alike (its reductions are collectives there)."""
    if jax.tree.structure(state) != jax.tree.structure(target):
        return "its tree differs from this learner's state"
    leaves = jax.tree_util.tree_leaves_with_path(state)
    for (path, leaf), want in zip(leaves, jax.tree.leaves(target), strict=True):
        if tuple(leaf.shape) != tuple(want.shape) or leaf.dtype != want.dtype:
            return (f"{_where(path)} is {leaf.dtype}{list(leaf.shape)}, this learner's is "
                    f"{want.dtype}{list(want.shape)}")
    train = state["train"] if isinstance(state, dict) and "train" in state else None
    if train is not None:
        if _int(train.step) != step:
            return f"its train step is {_int(train.step)}, the checkpoint is step {step}"
        for path, leaf in jax.tree_util.tree_leaves_with_path(train.opt_state):
            if getattr(path[-1], "name", None) == "count" and _int(leaf) != step:
                return (f"optimizer count {_where(path)} is {_int(leaf)}, the checkpoint is "
                        f"step {step}")
    for path, leaf in leaves:
        if jnp.issubdtype(leaf.dtype, jnp.inexact) and not _all(jnp.isfinite(leaf)):
            return f"non-finite values in {_where(path)}"
    if train is None:
        return None
    k = None if inner_opt is None else moment_bound(inner_opt.b1, inner_opt.b2)
    eps = 0.0 if inner_opt is None else float(inner_opt.eps)
    adams = [s for s in jax.tree.leaves(train.opt_state, is_leaf=_is_adam) if _is_adam(s)]
    for adam in adams:
        for (path, mu), nu in zip(jax.tree_util.tree_leaves_with_path(adam.mu),
                                  jax.tree.leaves(adam.nu), strict=True):
            nu32 = nu.astype(jnp.float32)
            if not _all(nu32 >= 0):
                return f"negative AdamW second moment in nu{_where(path)}"
            if k is not None and not _all(jnp.abs(mu.astype(jnp.float32))
                                          <= k * jnp.sqrt(nu32) + eps):
                return (f"AdamW first moment mu{_where(path)} exceeds {k:.3f} * sqrt(nu) + eps, "
                        "which no gradient sequence gives")
    return None


def plan_restore(store: LearnerView, learner: str, peers: Sequence[str], template: Any,
                 current_versions: Sequence[int], max_behind: int, use_ocdbt: bool,
                 target: Any = None, agree: Callable[[int | None], int | None] | None = None,
                 inner_opt: InnerOptConfig | None = None, leader: bool = True) -> RestorePlan:
    """`target`: the abstract tree to restore into (default: `template`'s, on one device).
    `agree` (a multi-process learner): makes the leader's value every process's (a checkpoint
    step, or None), since each process restores its own shards and all must read the same step;
    it is called the same number of times on every process. `leader` False (the other processes
    of a multi-process learner): the peers' heartbeats are the leader's to read (every process
    opens and lists their checkpoints, as Orbax's manager expects); this process takes the
    leader's choice through `agree`.
    `inner_opt`: the learner's inner optimizer, for the AdamW moment bound on a peer's state
    (None: that one check is left out)."""
    target = abstract_target(template) if target is None else target
    agree = agree or (lambda step: step)
    own = LearnerCheckpoints(store.checkpoint_uri(learner), use_ocdbt=use_ocdbt, read_only=True)
    try:
        own_step = agree(own.latest_step())
        if own_step is not None:
            state, meta = own.restore(own_step, target=target)
            stale = own_is_fresh(meta, current_versions, max_behind)
            if stale is None:
                return RestorePlan("own", state, meta,
                                   reason=f"own checkpoint at step {meta['step']}")
            own_meta, why_not_own = meta, stale
        else:
            own_meta, why_not_own = None, "no own checkpoint"
    finally:
        own.close()
    skipped: dict[str, str] = {}
    # Cheap checks on every peer (one agreed value per peer, in the peers' order).
    candidates: list[tuple[int, str]] = []
    for peer in peers:
        step, why = _corroborated_step(store, peer, use_ocdbt, leader)
        agreed = agree(step)
        if agreed is None:
            skipped[peer] = _short(why or "no corroborated checkpoint", REASON_CHARS)
        else:
            candidates.append((agreed, peer))
    # Restore the best candidate; the next one if it is unsound.
    for step, peer in sorted(candidates, key=lambda c: (-c[0], c[1])):
        state, meta, problem = _restore_sound(store, peer, step, target, len(current_versions),
                                              inner_opt, use_ocdbt)
        if agree(step if problem is None else None) is None:
            skipped[peer] = _short(problem or "refused by the leader", REASON_CHARS)
            continue
        if problem is not None:
            raise RuntimeError(f"the leader took {peer}'s checkpoint at step {step}, which this "
                               f"process could not: {problem}")
        return RestorePlan("peer", state, {"own": own_meta, "peer": meta}, peer,
                           f"{why_not_own}; AdamW state from {peer} at step {step} and the "
                           f"current global parameters{_describe(skipped)}", skipped)
    return RestorePlan("fresh", None, {"own": own_meta}, None,
                       f"{why_not_own}; no sound peer checkpoint: fresh AdamW state"
                       f"{_describe(skipped)}", skipped)


def _corroborated_step(store: LearnerView, peer: str, use_ocdbt: bool, leader: bool
                       ) -> tuple[int | None, str | None]:
    """(the newest of the peer's checkpoint steps its heartbeat vouches for, None) or
    (None, why there is none). Reads the checkpoint listing and the heartbeat only. Every
    process lists (Orbax's manager synchronizes the processes that open it); only the leader
    reads the heartbeat, and the others' answer is replaced by its."""
    try:
        ckpts = LearnerCheckpoints(store.checkpoint_uri(peer), use_ocdbt=use_ocdbt,
                                   read_only=True)
        try:
            steps = ckpts.all_steps()
        finally:
            ckpts.close()
    except Exception as err:  # noqa: BLE001 - a peer's prefix must never stop a restart
        return None, f"unlistable checkpoints: {_error(err)}"
    if not steps:
        return None, "no checkpoint"
    if not leader:
        return None, "no corroborated checkpoint (the leader's view)"
    beat, why = store.read_heartbeat(peer)
    if beat is None:
        return None, f"no readable heartbeat ({why or 'none written'}) to corroborate its steps"
    vouching = beat.step
    vouched = [s for s in steps if s <= vouching]
    if not vouched:
        return None, (f"uncorroborated step: checkpoint step {steps[-1]} is past its heartbeat's "
                      f"step {vouching}")
    return vouched[-1], None


def _restore_sound(store: LearnerView, peer: str, step: int, target: Any, num_fragments: int,
                   inner_opt: InnerOptConfig | None, use_ocdbt: bool
                   ) -> tuple[Any, Any, str | None]:
    """(state, meta, None) for a sound checkpoint, or (None, None, why not)."""
    try:
        ckpts = LearnerCheckpoints(store.checkpoint_uri(peer), use_ocdbt=use_ocdbt,
                                   read_only=True)
        try:
            state, meta = ckpts.restore(step, target=target)
        finally:
            ckpts.close()
    except Exception as err:  # noqa: BLE001 - deleted mid-read, half-written or hostile: skip
        return None, None, f"unreadable checkpoint at step {step}: {_error(err)}"
    problem = meta_problem(meta, step, num_fragments) or state_problem(state, target, step,
                                                                        inner_opt)
    if problem is not None:
        return None, None, f"checkpoint at step {step}: {problem}"
    return state, meta, None


def _describe(skipped: dict[str, str]) -> str:
    if not skipped:
        return ""
    text = "; skipped " + "; ".join(f"{peer}: {why}" for peer, why in skipped.items())
    return text if len(text) <= SKIPPED_CHARS else text[:SKIPPED_CHARS - 3] + "..."


def _is_adam(x: Any) -> bool:
    return isinstance(x, optax.ScaleByAdamState)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(x: Any) -> int:
    return int(host_value(x))


def _all(x: Any) -> bool:
    return bool(host_value(jnp.all(x)))


def _where(path) -> str:
    return _short(jax.tree_util.keystr(path), 120)


def _error(err: BaseException) -> str:
    return _short(f"{type(err).__name__}: {err}", REASON_CHARS)


def _short(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."
