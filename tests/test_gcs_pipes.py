"""The GCS Pipes channel end to end, against the loopback GCS server: the `learner` job
dispatches a real learner process that shares nothing with its run but a bucket (a local
subprocess standing in for a TPU host in another region). Its log lines and final record come
back into the Dagster run through objects in the bucket, and its contribution reaches the store.
"""

import threading
import time
import uuid

import dagster as dg
import pytest
from gcs_emulator import BUCKET
from orchestration_harness import Harness, wait_until

from resources.compute import LearnerCompute

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

FAST = ["orchestration.checkpoint_every_steps=1000", "orchestration.poll_seconds=0.2",
        "orchestration.heartbeat_seconds=0.5", "orchestration.round_timeout_seconds=1",
        "learners.regions=[edge, edge, local]"]


def _wait(predicate, timeout, what):
    wait_until(predicate, what, timeout, interval=0.2)


def test_a_learner_over_the_gcs_channel_reports_back_through_the_bucket(tmp_path, gcs_server):
    from google.cloud import storage

    deployment = tmp_path / "deployment.yaml"
    deployment.write_text(f"regions:\n  edge:\n    backend: local\n    channel: gcs\n"
                          f"    bucket: {BUCKET}\n    pipes_interval_seconds: 0.5\n")
    client = storage.Client()
    before = {b.name for b in client.list_blobs(BUCKET)}
    with dg.instance_for_test() as instance:
        h = Harness(instance, f"gs://{BUCKET}/pipes-{uuid.uuid4().hex[:8]}", FAST,
                    resources={"learner_compute": LearnerCompute(
                        deployment_file=str(deployment))})
        h.start()
        result = {}

        def dispatch():
            result["run"] = h.defs.resolve_job_def("learner").execute_in_process(
                instance=instance, raise_on_error=False,
                tags={"diloco/experiment": h.store.experiment},
                run_config={"ops": {"run_learner": {"config": {"learner": "learner-0"}}}})

        thread = threading.Thread(target=dispatch, daemon=True)
        thread.start()
        _wait(lambda: getattr(h.store.get_heartbeat("learner-0"), "step", 0) >= 4, 300,
              "the remote learner's first steps")
        h.store.open_round(0, {"fragment": 0, "opened_at": time.time(), "final": False})
        _wait(lambda: h.store.list_contributions(0) == ["learner-0"], 60, "its contribution")
        h.store.request_stop({"reason": "test"})
        thread.join(240)
        assert not thread.is_alive()
        run = result["run"]
        assert run.success
        offer = h.store.load_contribution(0, "learner-0")
        assert offer.fragment == 0 and offer.steps >= 4

        messages = [e.user_message for e in instance.all_logs(run.run_id)]
        # The learner's own log line (pipes.log in the learner process) ...
        assert any("learner-0 (attempt 0) starting from" in m for m in messages), messages
        # ... and its final record (a Pipes custom message), both read back from the bucket.
        assert any("learner-0 finished: done" in m and "1 offers" in m for m in messages)
        assert any("Pipes over gs://" in m for m in messages)

    # The channel really was the bucket: message chunks the learner wrote, and no context
    # object left behind (the run deletes it when the session closes).
    new = {b.name for b in client.list_blobs(BUCKET)} - before
    chunks = [n for n in new if n.endswith("/1.json") and "/" not in n[:-len("/1.json")]]
    assert chunks, sorted(new)[:20]
    assert not [n for n in new if n.startswith("diloco-pipes/context-")]
