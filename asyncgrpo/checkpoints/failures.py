"""A checkpoint that could not be written: reported, retried, and never half kept.

A save can fail for a reason that passes (a disk filled by another job, a file server that hiccups)
or one that stays. Either way its staging directory is removed (its space given back) and the
checkpoints written before it stay as they were. Then (docs/reliability.md, "Durable checkpoints"):

- the failure is logged, naming the step, the rank and the error, and counted;
- the save is tried again at the next step, with the state of that step;
- `MAX_FAILED_SAVES_IN_A_ROW` failures in a row stop the run with the last error: a run that cannot
  checkpoint must not train on for days with nothing to resume from;
- at the end of training, a last save that failed is tried once more at once, and a second failure
  stops the run (there is no later step to retry at).
"""

from __future__ import annotations

import logging

from asyncgrpo.checkpoints.background import SaveResult
from asyncgrpo.errors import CheckpointError

logger = logging.getLogger(__name__)

MAX_FAILED_SAVES_IN_A_ROW = 3


class CheckpointSaveError(CheckpointError, OSError):
    """A checkpoint could not be written (raised on the ranks that did not see the error itself)."""


class FailedSaves:
    """Failed saves of one run, in a row, and whether a retry is due at the next step."""

    def __init__(self, limit: int = MAX_FAILED_SAVES_IN_A_ROW):
        self.limit = limit
        self.in_a_row = 0
        self.retry_due = False

    def succeeded(self) -> None:
        self.in_a_row = 0
        self.retry_due = False

    def failed(self, result: SaveResult, final: bool = False) -> None:
        """Record a failed save; raises when the run must stop (`final`: no later step retries it)."""
        self.in_a_row += 1
        if final or self.in_a_row >= self.limit:
            error = result.local_error or CheckpointSaveError(result.error)
            attempts = f"{self.in_a_row} save(s) in a row failed"
            error.add_note(
                f"checkpoint of step {result.step}: {attempts}; the checkpoints written before it are kept "
                "(free space, or fix the output_dir's filesystem, then resume_from_checkpoint=True)"
            )
            raise error
        self.retry_due = True
        logger.warning(
            "the checkpoint of step %d could not be written (%s): the checkpoints written before it are "
            "kept, and the save is tried again at the next step (%d of %d failures in a row stop the run)",
            result.step,
            result.error,
            self.in_a_row,
            self.limit,
        )
