"""Config fields of the completions table printed (and sent to table-showing trackers) at each log."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionsTableFields:
    """Whether a table of recent completions is printed at each log, and its rows."""

    log_completions: bool = field(
        default=False,
        metadata={
            "help": "Print a table of recent completions (prompt, completion, reward) at each log, and send "
            "it to the trackers of report_to that show tables (W&B, trackio). False: the log holds metrics "
            "only; turn it on to read what the policy writes."
        },
    )
    num_completions_to_print: int | None = field(
        default=None,
        metadata={"help": "Rows of that table; None: every sample trained since the last log (at most 64)."},
    )

    def _validate_completions_table(self, fail) -> None:
        if self.num_completions_to_print is not None and self.num_completions_to_print < 1:
            fail("num_completions_to_print must be >= 1 or None")
