"""accuracy_reward: is the completion's final answer mathematically equal to the reference?

Works on `\\boxed{}` answers and on DeepMath-style data (a `solution` column holding the reference
answer). Uses math-verify, which compares parsed expressions (2/4 equals \\frac{1}{2}), not strings.
Reward functions run in the rollout worker's threads, where math-verify's signal-based timeouts
cannot work, so they are turned off here.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

logger = logging.getLogger(__name__)


def _math_verify():
    try:
        import math_verify
        from math_verify import LatexExtractionConfig
    except ImportError as error:  # an optional dependency
        raise ImportError("accuracy_reward needs math-verify: pip install 'asyncgrpo[math]'") from error
    return math_verify, LatexExtractionConfig


def _quiet_timeout_args() -> dict[str, Any]:
    in_main = threading.current_thread() is threading.main_thread()
    return {} if in_main else {"parsing_timeout": None}


def _parse_reference(solution: str):
    math_verify, _ = _math_verify()
    kwargs = _quiet_timeout_args()
    for text in (f"${solution}$", f"\\boxed{{{solution}}}", solution):
        parsed = math_verify.parse(text, **kwargs)
        if parsed:
            return parsed
    return []


def accuracy_reward(completions: list[list[dict[str, str]]], solution: list[str], **kwargs) -> list[float | None]:
    """1.0 when the completion's last message answers `solution` correctly, 0.0 when not, None when
    the reference itself cannot be parsed (the item is left out of the reward)."""
    math_verify, LatexExtractionConfig = _math_verify()
    kwargs_parse = _quiet_timeout_args()
    verify_kwargs = {} if not kwargs_parse else {"timeout_seconds": None}
    rewards: list[float | None] = []
    for completion, reference in zip(completions, solution):
        content = completion[-1]["content"] if completion else ""
        gold = _parse_reference(str(reference))
        if not gold:
            logger.debug("accuracy_reward: cannot parse the reference %r", reference)
            rewards.append(None)
            continue
        answer = math_verify.parse(
            content,
            extraction_config=[LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)],
            extraction_mode="first_match",
            **kwargs_parse,
        )
        rewards.append(float(math_verify.verify(gold, answer, **verify_kwargs)) if answer else 0.0)
    return rewards
