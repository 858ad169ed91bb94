"""The run's metrics as TensorBoard event files (`--tensorboard`), written by rank 0 through tensorboardX
(the optional extra: pip install -e ".[tensorboard]" in the checkout).

    RUN_DIR/NAME.tb/events.out.tfevents.*        tensorboard --logdir RUN_DIR    (every run of the folder)

Every scalar is plotted against the images trained on so far (`samples`, the log's own count: the same
axis for any number of workers, nsync or mode):

    train/loss, train/accuracy   mean minibatch loss (nats) and accuracy of the pushes (sync, pipeline: the
                                 reports) rank 0 received since the previous point; a point per
                                 --flush-interval
    train/lr                     the step size of the last update
    train/images_per_s           images trained on since the previous point / seconds since it
    train/staleness              mean staleness of the updates since the previous point
    train/data_wait              share of the workers' compute time spent waiting for minibatches
    eval/loss, eval/top1, eval/top5   each evaluation during training (--eval-interval)
    test/loss, test/top1, test/top5   the final evaluation

A resumed run writes a new event file into the same folder, beginning with `purge_step` = the images
its checkpoint holds: TensorBoard then hides the points the replaced segment wrote after that
checkpoint (as `report` leaves out the log's superseded rows). Writing never ends the run: the first
failure is one warning, and the writer is off from then on.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

EXTRA = "pip install -e \".[tensorboard]\" in the mpiasgd checkout (or pip install tensorboardX)"


class TensorBoardUnavailable(ValueError):
    """`--tensorboard` without tensorboardX installed; the message names the extra to install."""


def require() -> None:
    """TensorBoardUnavailable unless tensorboardX can be imported (checked before a run starts)."""
    try:
        import tensorboardX  # noqa: F401
    except ImportError as e:
        raise TensorBoardUnavailable(f"--tensorboard needs the tensorboardX package, which cannot be imported here "
                                     f"({e}): {EXTRA}") from None


def tensorboard_dir(log_path: str) -> str:
    """The event-file folder of the run log at `log_path`: RUN_DIR/NAME.tb beside RUN_DIR/NAME.h5."""
    stem = log_path[:-3] if log_path.endswith(".h5") else log_path
    return stem + ".tb"


class TensorBoard:
    """Scalars into the event files of `logdir` (tensorboardX `SummaryWriter`); `purge_step` (a resumed run:
    the checkpoint's images) hides what an earlier writer logged at or after it; `warn(text)` is called once
    if writing fails, after which every call does nothing.

    tensorboardX writes from a thread of its own: `scalars` queues, `flush` makes the points visible."""

    def __init__(self, logdir: str, purge_step: int | None = None, warn: Callable[[str], None] | None = None) -> None:
        self.logdir = logdir
        self.warn = warn or (lambda text: None)
        self.writer: Any = None
        try:
            from tensorboardX import SummaryWriter

            os.makedirs(logdir, exist_ok=True)
            # the file name: tensorboardX's (the second, the host) and the images this segment starts at, so that
            # a resumed run's file never replaces the one before it, and sorts after it
            suffix = f".from{purge_step or 0:015d}.{os.getpid()}"
            self.writer = SummaryWriter(logdir=logdir, purge_step=purge_step, max_queue=100, flush_secs=30,
                                        filename_suffix=suffix)
        except Exception as e:  # a folder that cannot be made: the run goes on without TensorBoard
            self.fail(e)

    @property
    def on(self) -> bool:
        return self.writer is not None

    def _guarded(self, action: Callable[[Any], None]) -> None:
        """`action(writer)` unless the writer is off; a failure turns it off with one warning (`fail`), never
        ends the run."""
        if self.writer is None:
            return
        try:
            action(self.writer)
        except Exception as e:
            self.fail(e)

    def scalars(self, values: dict[str, float], step: int) -> None:
        """Add each {tag: value} at `step` (images trained on); values that are not finite are left out."""
        def add(writer: Any) -> None:
            for tag, value in values.items():
                if value is not None and math.isfinite(value):
                    writer.add_scalar(tag, float(value), int(step))

        self._guarded(add)

    def flush(self) -> None:
        self._guarded(lambda writer: writer.flush())

    def close(self) -> None:
        self._guarded(lambda writer: writer.close())
        self.writer = None

    def fail(self, error: BaseException) -> None:
        """Warn once (naming the folder and the error) and turn the writer off."""
        writer, self.writer = self.writer, None
        if writer is not None:
            try:
                writer.close()
            except Exception:  # already failing: the warning below says why
                pass
        self.warn(f"TensorBoard event files in '{self.logdir}' cannot be written ({type(error).__name__}: {error}); "
                  f"the run goes on without them")
