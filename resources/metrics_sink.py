"""Metrics outside Dagster: TensorBoard event files, for teams whose dashboards are there.

Opt-in (`orchestration.tensorboard_dir`). The syncer service writes one event file per attempt
and the sensor's fallback merge runs one per run, all under `{tensorboard_dir}/{experiment}`,
so `tensorboard --logdir DIR` shows every experiment, each with the per-round figures the
Dagster UI plots (members, weights, train loss and staleness per learner, norms, latencies)
and the held-out evals, stepped by round.

A sink never stops a merge: a failing write is logged and the sink turns itself off.
"""

import math
import os
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

from resources.store.names import check_name


class TensorBoardSink:
    def __init__(self, logdir: str, experiment: str, writer_name: str,
                 log: Callable[[str], None] = print):
        from tensorboardX import SummaryWriter

        directory = Path(logdir) / check_name("experiment", experiment)
        directory.mkdir(parents=True, exist_ok=True)
        self.log = log
        # Event files are named by the second they open in: a unique suffix keeps two
        # writers opened in one second (two assets of one merge run) from sharing a file.
        suffix = f".{check_name('writer', writer_name)}.{uuid.uuid4().hex[:8]}"
        self.writer = SummaryWriter(logdir=str(directory), filename_suffix=suffix)

    def scalars(self, step: int, values: Mapping[str, object]) -> None:
        """Every finite number in `values` (not booleans, not rich metadata) at `step`."""
        if self.writer is None:
            return
        try:
            for tag, value in values.items():
                if isinstance(value, bool) or not isinstance(value, int | float):
                    continue
                if math.isfinite(value):
                    self.writer.add_scalar(tag, value, step)
            self.writer.flush()
        except OSError as err:
            self.log(f"TensorBoard sink off after a failed write: {err}")
            self.close()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def open_sink(logdir: str, experiment: str, writer_name: str,
              log: Callable[[str], None] = print) -> TensorBoardSink | None:
    """A sink, or None when `logdir` is empty (the default: no metrics outside Dagster)."""
    if not logdir:
        return None
    return TensorBoardSink(os.path.expanduser(logdir), experiment, writer_name, log)
