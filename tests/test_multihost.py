"""A learner spanning several processes (a multi-host TPU slice: one JAX program per host,
`jax.distributed`) trains exactly as the single-device learner on the same global batch: two
processes of two (forced host) devices each, gloo collectives on loopback, state replicated or
FSDP-sharded across all four devices of both processes."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "multihost_check.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _learner(num_processes: int, devices: int, mode: str) -> dict:
    port = str(_free_port()) if num_processes > 1 else "none"
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), str(i), str(num_processes), port,
                               str(devices), mode], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for i in range(num_processes)]
    outs = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        assert proc.returncode == 0, err[-3000:]
        outs.append(out)
    return json.loads(outs[0].strip().splitlines()[-1])


@pytest.fixture(scope="module")
def single():
    return _learner(1, 1, "replicated")


@pytest.mark.slow   # three fresh interpreters per mode, ~15 s each on 2 cores
@pytest.mark.parametrize("mode", ["replicated", "fsdp"])
def test_a_two_process_learner_steps_like_the_single_device_one(single, mode):
    multi = _learner(2, 2, mode)
    assert (multi["process_count"], multi["devices"], multi["local_devices"]) == (2, 4, 2)
    big = multi["largest"]
    assert big["devices"] == 4                     # the mesh spans both processes' devices
    rows, cols = big["shape"]
    # What process 0 holds of the embedding: a full copy per device, or a quarter (FSDP).
    assert big["local_shard_shapes"] == ([[rows, cols]] if mode == "replicated"
                                         else [[rows // 4, cols]])
    np.testing.assert_allclose(multi["losses"], single["losses"], rtol=1e-5)
    for name, values in single["params"].items():
        # Same tolerance as the single-process mesh (test_spmd.py): only the float32
        # summation order of the cross-device reduction differs.
        np.testing.assert_allclose(multi["params"][name], values, rtol=1e-4, atol=1e-5,
                                   err_msg=name)
