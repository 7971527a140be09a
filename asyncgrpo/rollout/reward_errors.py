"""What a reward function that raises costs: its group, not the run (docs/reliability.md, "Reward
functions that fail").

A judge that answers 503 once in ten thousand calls must not end a run of days. With
`reward_error_tolerance > 0` an exception raised by a reward function drops the group it was scoring
(its prompt counts as consumed, as a group without signal does) and is counted
(`rollout/reward_failed_groups`); each distinct error is logged once, with its traceback. A function
that fails more than that fraction of the last `reward_error_window` groups is broken rather than
flaky: the run stops, naming it and quoting its last traceback. `reward_error_tolerance=0` keeps
TRL's behaviour: the first exception ends the run.

Only exceptions raised by the function count. A call past `reward_timeout` and a value that cannot be
trained on (inf, NaN, a wrong length) still stop the run at once: the first leaves a thread that
cannot be stopped behind, the second is a bug in the function, not bad luck.
"""

from __future__ import annotations

import logging
import re
from collections import deque
from dataclasses import dataclass

from asyncgrpo.errors import RewardError

logger = logging.getLogger(__name__)

# Distinct errors logged in full; past them a new one is counted only, so a function whose messages
# all differ cannot fill the log.
MAX_ERRORS_LOGGED = 100
# Numbers and hex words with a digit (times, ids, addresses): what makes each occurrence of one error new.
_NUMBERS = re.compile(r"\b(?:0x)?[0-9a-fA-F]*\d[0-9a-fA-F]*\b")


class RewardFunctionError(RewardError):
    """A reward function broke its contract: too slow, a value that cannot be trained on, or failing
    on too many groups."""


@dataclass
class RewardCallFailure:
    """A reward function's call that raised, kept in place of its rewards."""

    function: str
    error: BaseException
    traceback: str

    def kind(self) -> tuple[str, str, str]:
        """What makes two failures the same error: the function, the exception's type and its
        message with numbers and ids left out (a request id or a time must not make each one new)."""
        return self.function, type(self.error).__name__, _NUMBERS.sub("N", str(self.error))[:300]


class RewardErrorBudget:
    """The failures of the last `window` groups scored, against `tolerance` (a fraction of them)."""

    def __init__(self, tolerance: float, window: int):
        self.tolerance = tolerance
        self.recent: deque[bool] = deque(maxlen=window)  # per group scored: did a function raise?
        self.logged: set[tuple[str, str, str]] = set()

    @property
    def catches(self) -> bool:
        """Whether exceptions are caught at all (tolerance 0: the first one ends the run)."""
        return self.tolerance > 0

    def group_failed(self, results: list, where: str) -> bool:
        """Count one group's results (per function: rewards, or a RewardCallFailure) and say whether
        it failed; raise RewardFunctionError when failures pass the tolerance."""
        failures = [result for result in results if isinstance(result, RewardCallFailure)]
        self.recent.append(bool(failures))
        for failure in failures:
            self._log_once(failure, where)
        failed = sum(self.recent)
        if failures and failed > self.tolerance * self.recent.maxlen:
            last = failures[-1]
            raise RewardFunctionError(
                f"reward function {last.function!r} raised on {failed} of the last {len(self.recent)} groups "
                f"scored{where}, more than reward_error_tolerance={self.tolerance:g} of "
                f"reward_error_window={self.recent.maxlen}: it is broken, not flaky. Its last error:\n"
                f"{last.traceback}"
            )
        return bool(failures)

    def _log_once(self, failure: RewardCallFailure, where: str) -> None:
        kind = failure.kind()
        if kind in self.logged or len(self.logged) >= MAX_ERRORS_LOGGED:
            return
        self.logged.add(kind)
        logger.warning(
            "reward function %r raised%s; its group is dropped and counted (rollout/reward_failed_groups), "
            "and this error is not logged again:\n%s",
            failure.function,
            where,
            failure.traceback,
        )
