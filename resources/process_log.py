"""How the project's own processes log: the standard `logging` module, with levels.

The learner and the syncer are processes of their own. Under Dagster Pipes they log through
the Pipes session's logger, so each line reaches the run's log at its level (a refused offer
as a warning, a failed merge as an error); started by hand, or as the syncer's standby, they
log to stdout with a time and a level. Components take the `logging.Logger` to write to as
`log`, so the caller (the process's entry, a test) decides where lines go; left out, they write
to their module's logger under `diloco.` (which goes wherever the application sends it).

`DILOCO_LOG_LEVEL` (DEBUG, INFO, WARNING, ERROR; default INFO) sets the level in every process,
read once at start: a bad value stops the process with the variable and the reason.
"""

import logging
import os
import sys

LEVEL_ENV = "DILOCO_LOG_LEVEL"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def log_level() -> int:
    """The level `DILOCO_LOG_LEVEL` names (INFO when unset)."""
    name = os.environ.get(LEVEL_ENV, "INFO").strip().upper()
    if name not in LEVELS:
        raise SystemExit(f"{LEVEL_ENV}={name[:20]!r}: not a log level (one of "
                         f"{', '.join(LEVELS)})")
    return getattr(logging, name)


def at_level(logger: logging.Logger) -> logging.Logger:
    """`logger` (a Pipes session's, say) filtered at the process's level."""
    logger.setLevel(log_level())
    return logger


def stdout_logger(role: str, prefix: str = "") -> logging.Logger:
    """The logger of a process started outside Pipes: stdout, one line a record, time and
    level first. `prefix` marks lines of processes that share one log (a multi-host learner's
    non-leading processes)."""
    logger = logging.getLogger(f"diloco.process.{role}")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter(
            f"%(asctime)s %(levelname)s {prefix}%(message)s", datefmt="%H:%M:%S"))
        logger.addHandler(handler)
        # Its own handler only: a root handler the application set up would print it twice.
        logger.propagate = False
    return at_level(logger)
