"""How a learner process learns that it is one of several (a multi-host slice): environment
variables, set per process by whatever launches them (on GKE a JobSet gives each pod its index).

    DILOCO_COORDINATOR      host:port of process 0's coordination service
    DILOCO_NUM_PROCESSES    how many processes the learner spans (unset or 1: a single process)
    DILOCO_PROCESS_ID       this process's index, 0 .. DILOCO_NUM_PROCESSES - 1 (0: the leader)

`join_from_env` must run before anything touches a JAX backend (jax.distributed's rule).
"""

import os


def join_from_env(environ=os.environ) -> tuple[int, int]:
    """Initialize `jax.distributed` as the variables say; (process id, number of processes)."""
    count = int(environ.get("DILOCO_NUM_PROCESSES", "1") or "1")
    if count <= 1:
        return 0, 1
    missing = [k for k in ("DILOCO_COORDINATOR", "DILOCO_PROCESS_ID") if not environ.get(k)]
    if missing:
        raise ValueError(f"DILOCO_NUM_PROCESSES={count} needs {' and '.join(missing)}")
    process_id = int(environ["DILOCO_PROCESS_ID"])
    if not 0 <= process_id < count:
        raise ValueError(f"DILOCO_PROCESS_ID={process_id} is not in 0..{count - 1}")
    import jax

    # Collectives between the processes' CPU devices (tests, CPU-only hosts) go over gloo;
    # TPU and GPU devices use their own interconnect and ignore this.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(environ["DILOCO_COORDINATOR"], num_processes=count,
                               process_id=process_id)
    return process_id, count
