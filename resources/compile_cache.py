"""JAX's persistent compilation cache for the long-lived processes (learners, the syncer).

A learner relaunched after a preemption or a kill compiles its step program again before its
first token (seconds on a laptop, minutes for a large model on a TPU slice); with the cache, a
process whose program was compiled before on the same host loads it instead. JAX keys every
entry by the program, its compile options, the backend and JAX's version, so an entry can
only ever serve the program it was compiled from. A damaged entry (a process killed while
writing it) is read as a miss: JAX warns and compiles.

The directory is host-local on purpose (`orchestration.compilation_cache_dir` refuses URLs):
an entry is executable code, and the store is written by parties (learners) that must not
choose what another process runs.
"""

import os
from pathlib import Path

import jax

# Bounded so that a week of relaunches with changing programs cannot fill the disk: beyond
# this, JAX evicts the least recently used entries (under a file lock, which also serialises
# writers on the host).
MAX_BYTES = 4 << 30


def enable_compilation_cache(directory: str, min_compile_seconds: float = 1.0) -> str | None:
    """Point this process's JAX at the cache under `directory` (created if missing); None when
    `directory` is empty. Call before the process compiles anything: JAX opens the cache at its
    first compilation. Only compilations longer than `min_compile_seconds` are stored."""
    if not directory:
        return None
    path = Path(os.path.expanduser(directory))
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return str(path)
