"""The TensorBoard sink: the syncer service and the fallback merge runs write every merged
round's figures and the evals as event files, one subdirectory per experiment."""

import struct

import dagster as dg
import pytest
from orchestration_harness import Harness
from tensorboardX.proto.event_pb2 import Event

pytestmark = pytest.mark.timeout(300)
NAMES = ["learner-0", "learner-1", "learner-2"]


def _read_scalars(directory) -> dict[str, dict[int, float]]:
    """tag -> step -> value over every event file (TFRecord framing: length, its CRC, the
    Event protobuf, its CRC)."""
    out: dict[str, dict[int, float]] = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                out.setdefault(value.tag, {})[event.step] = value.simple_value
    return out


@pytest.mark.parametrize("path", ["service", "sensor"])
def test_each_merge_and_eval_reaches_tensorboard(tmp_path, path):
    logdir = tmp_path / "tb"
    with dg.instance_for_test() as instance:
        h = Harness(instance, str(tmp_path / "store"), overrides=[
            f"orchestration.syncer={path}", f"orchestration.tensorboard_dir={logdir}"])
        h.start()
        step, service = h.decider(path)
        for r in range(2):
            for name in NAMES:
                h.beat(name, 2)
            step()
            for name in NAMES[:2]:
                h.offer(name, r)
            step()
        if path == "service":
            service.metrics.close()
    scalars = _read_scalars(logdir / "exp-test")
    assert scalars["merge/admitted"] == {0: 2.0, 1: 2.0}
    assert scalars["merge/fragment"] == {0: 0.0, 1: 1.0}
    assert scalars["weight/learner-0"][0] > 0 and scalars["weight/learner-2"][0] == 0.0
    assert set(scalars["merge/decision_to_publish_seconds"]) == {0, 1}
    # The syncer evaluates once per outer step (P = 2 rounds); each merge run after its merge.
    assert set(scalars["eval/loss"]) == ({1} if path == "service" else {0, 1})
    assert not [k for k in scalars if "members" in k or k.split("/")[-1] == "merged"]
