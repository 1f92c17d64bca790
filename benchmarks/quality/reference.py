"""Data-parallel's reference at one budget: the configuration the DiLoCos are measured against.

Chosen the way the method's settings are (issue 38): the lowest validation loss on the
selection seeds, each candidate paired seed by seed. Three seeds cannot always tell two
configurations apart, and choosing between two that are level by a hair decides which
configuration the confirmation seeds report against. The rule, written before the runs that
it decides (stop 76):

- a candidate is **level** with the selection's best when its paired mean validation ratio
  over the best is within LEVEL_WITHIN_SE standard errors (over seeds) of 1;
- where any candidate is level, the reference is the one, of the best and those level with
  it, with the lowest validation loss over every selection and confirmation seed (all six
  ran, so the means are over the same seeds). The validation slice is disjoint from the test
  slice the confirmation reports on; the confirmation seeds' validation figures favour
  whichever baseline trained better on them, so the rule leans towards the stronger baseline,
  the conservative side for a claim that the method comes close to it;
- a level configuration not yet run on every confirmation seed leaves the reference
  provisional, and the report names it (its three confirmation runs settle it).
"""

import statistics
from dataclasses import dataclass

from benchmarks.quality.scoring import mean_and_standard_error
from benchmarks.quality.selection import CONFIRMATION_SEEDS, SELECTION_SEEDS
from benchmarks.quality.slice_report import paired_ratios, slice_loss

# About a 95% two-sided band for a normal difference; with three seeds a wide one, which only
# ever adds candidates (each costs three confirmation runs), never drops the best.
LEVEL_WITHIN_SE = 2.0
DEFAULT = "data-parallel"


@dataclass(frozen=True)
class Reference:
    label: str                     # what every arm at this budget is measured against
    level: tuple[str, ...] = ()    # others level with the selection's best (the best too)
    unconfirmed: tuple[str, ...] = ()  # of those, the ones short of a confirmation seed

    def describe(self) -> str:
        """The reference's setting and how it was chosen, for a verdict's parentheses."""
        if not self.level:
            return f"{_setting(self.label)}, its best on the validation slice"
        others = " and ".join(f'"{_setting(x)}"' for x in self.level if x != self.label)
        text = (f"{_setting(self.label)}: level with {others} on the selection seeds' "
                "validation slice, and of them the lowest over all six seeds")
        if self.unconfirmed:
            text += ("; provisional until " + " and ".join(
                f'"{_setting(x)}"' for x in self.unconfirmed) + " run on the confirmation seeds")
        return text


def _setting(label: str) -> str:
    """A data-parallel arm's label without the method's name."""
    return "its default settings" if label == DEFAULT else label.removeprefix(f"{DEFAULT}, ")


def _selection(records: dict[int, dict]) -> dict[int, dict]:
    return {s: r for s, r in records.items() if s in SELECTION_SEEDS}


def is_level(mine: dict[int, dict], best: dict[int, dict]) -> bool:
    """Whether `mine` is level with `best` on the selection seeds' validation slice."""
    ratios = paired_ratios(_selection(mine), _selection(best), "validation")
    if not ratios:
        return False
    mean, se = mean_and_standard_error(ratios)
    return mean - 1.0 <= LEVEL_WITHIN_SE * (se or 0.0)


def _pooled_validation(records: dict[int, dict]) -> float | None:
    """Mean validation loss over the selection and confirmation seeds, None if short of any."""
    losses = [slice_loss(records[s], "validation") if s in records else None
              for s in SELECTION_SEEDS + CONFIRMATION_SEEDS]
    return None if None in losses else statistics.fmean(losses)


def choose(records: dict[str, dict[int, dict]]) -> Reference:
    """The reference among data-parallel's arms at one budget, `records` each arm's runs by
    seed (selection and confirmation seeds). The selection's best is paired with a pivot: the
    default where it ran on the selection seeds, else (a default just changed, its runs to
    come) the arm run on the most of them. A candidate must have run on every selection seed
    the pivot has: a probe on seed 0 alone (experiment 12's) is a lead, not yet the
    reference."""
    selection = {label: mine for label, runs in records.items() if (mine := _selection(runs))}
    if not selection:
        return Reference(DEFAULT)
    pivot = DEFAULT if DEFAULT in selection else max(selection,
                                                     key=lambda label: len(selection[label]))
    ratio = {label: paired_ratios(mine, selection[pivot], "validation")
             for label, mine in selection.items()}
    # The pivot first: it stays the best unless another is strictly lower.
    qualified = [pivot] + [label for label in selection if label != pivot
                           and ratio[label] and len(ratio[label]) == len(selection[pivot])]
    best = min(qualified, key=lambda label: statistics.fmean(ratio[label])
               if label != pivot else 1.0)
    level = [label for label in qualified
             if label != best and is_level(records[label], records[best])]
    if not level:
        return Reference(best)
    tied = [best, *level]
    pooled = {label: p for label in tied if (p := _pooled_validation(records[label])) is not None}
    chosen = min(pooled, key=pooled.get) if pooled else best
    return Reference(chosen, tuple(tied), tuple(x for x in tied if x not in pooled))
