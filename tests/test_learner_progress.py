"""When a learner's heartbeat goes out early: on the step that makes it ready for the next
round (`resources.learner.progress.ready_beat_due`)."""

from diloco_core.round_records import RoundOpen
from resources.learner.progress import ready_beat_due


def _open(round_index: int, tokens: dict[str, int]) -> RoundOpen:
    return RoundOpen(round=round_index, fragment=round_index % 4, opened_at=0.0,
                     learner_tokens=tokens)


def test_a_beat_is_due_once_a_round_when_the_learner_has_the_tokens_one_round_needs():
    # Before round 0: ready at `needed` tokens of its own.
    assert ready_beat_due(None, "a", 99, 100, None) is None
    assert ready_beat_due(None, "a", 100, 100, None) == -1
    assert ready_beat_due(None, "a", 150, 100, -1) is None          # beaten for it already
    # Round 3 opened with the learner at 400: ready at 500, once.
    rnd = _open(3, {"a": 400, "b": 10})
    assert ready_beat_due(rnd, "a", 499, 100, -1) is None
    assert ready_beat_due(rnd, "a", 500, 100, -1) == 3
    assert ready_beat_due(rnd, "a", 900, 100, 3) is None
    # A learner the round did not record (a joiner): counted from zero, as the syncer does.
    assert ready_beat_due(rnd, "c", 100, 100, -1) == 3
    # A round older than the one it beat for (the pointer read before a newer write).
    assert ready_beat_due(_open(2, {"a": 0}), "a", 1000, 100, 3) is None
