"""Where a (re)starting learner takes its state from.

1. Its own latest checkpoint, if fresh: no fragment is more than `max_behind` global versions
   behind (the syncer can still rebuild its outer gradients against those bases).
2. Otherwise the current global parameters plus the AdamW state of a peer's latest checkpoint
   (the healthiest optimizer statistics available), and its own data position if it has one.
3. On the first start: the current global parameters and a fresh AdamW state.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from resources.store.artifact_store import ArtifactStore
from resources.store.checkpoints import LearnerCheckpoints, abstract_target


@dataclass(frozen=True)
class RestorePlan:
    source: str                      # "own" | "peer" | "fresh"
    state: Any = None                # restored checkpoint tree ({"train", "anchors"})
    meta: dict | None = None         # its JSON meta
    peer: str | None = None
    reason: str = ""


def own_is_fresh(meta: dict, current_versions: Sequence[int], max_behind: int) -> str | None:
    """Why the learner's own checkpoint is too stale to resume from, or None if it is fresh."""
    for p, (have, current) in enumerate(zip(meta["versions"], current_versions, strict=True)):
        if current - have > max_behind:
            return (f"fragment {p} is at version {have}, {current - have} behind the global "
                    f"{current} (limit {max_behind})")
    return None


def plan_restore(store: ArtifactStore, learner: str, peers: Sequence[str], template: Any,
                 current_versions: Sequence[int], max_behind: int, use_ocdbt: bool,
                 target: Any = None, agree: Callable[[int | None], int | None] | None = None
                 ) -> RestorePlan:
    """`target`: the abstract tree to restore into (default: `template`'s, on one device).
    `agree` (a multi-process learner): makes the leader's choice of a checkpoint step every
    process's, since each process restores its own shards and all must read the same step."""
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
    best: tuple[int, str, Any, dict] | None = None
    for peer in peers:
        ckpts = LearnerCheckpoints(store.checkpoint_uri(peer), use_ocdbt=use_ocdbt,
                                   read_only=True)
        try:
            step = agree(ckpts.latest_step())
            if step is not None and (best is None or step > best[0]):
                state, meta = ckpts.restore(step, target=target)
                best = (step, peer, state, meta)
        except (FileNotFoundError, ValueError, KeyError) as err:
            # A peer deleting an old checkpoint mid-read, or a half-written one: try another.
            del err
        finally:
            ckpts.close()
    if best is not None:
        step, peer, state, meta = best
        return RestorePlan("peer", state, {"own": own_meta, "peer": meta}, peer,
                           f"{why_not_own}; AdamW state from {peer} at step {step} and the "
                           "current global parameters")
    return RestorePlan("fresh", None, {"own": own_meta}, None,
                       f"{why_not_own}; no peer checkpoint: fresh AdamW state")
