"""AsyncDistillationConfig: AsyncGRPOConfig's pipeline fields plus TRL 1.16's on-policy distillation fields.

TRL's `AsyncDistillationConfig` mirrors its `AsyncGRPOConfig` (the same pipeline, server and logging
fields) with GRPO's loss fields replaced by the teacher's; here it is a subclass of ours, so every
pipeline setting means what it means for GRPO, and the teacher's fields keep TRL's names, defaults
and meaning. Two fields change meaning or default: `beta` is the divergence's interpolation (not a KL
coefficient: distillation keeps no reference model) and `num_generations` is 1 (TRL scores one
completion per dataset row). docs/distillation.md explains the loss and the teachers' servers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from urllib.parse import urlparse

from asyncgrpo.config.async_grpo_config import AsyncGRPOConfig
from asyncgrpo.trl_compat import warn_once

# TRL 1.16's default teacher when teacher_server_urls is None.
DEFAULT_TEACHER_URL = "http://localhost:8001"
# vLLM caps prompt_logprobs at 20 unless the server runs with --max-logprobs -1.
VLLM_DEFAULT_MAX_LOGPROBS = 20


@dataclass
class AsyncDistillationConfig(AsyncGRPOConfig):
    """Settings of AsyncDistillationTrainer: AsyncGRPOConfig's pipeline plus the teacher's fields.

    Field names and defaults are TRL 1.16's; docs/distillation.md explains each teacher field.
    """

    num_generations: int = field(
        default=1,
        metadata={
            "help": "Completions sampled per prompt; >= 1. 1: TRL's distillation scores one completion per "
            "dataset row; more share the prompt's forward in a packed row (no group baseline is needed)."
        },
    )
    score_centering: bool | None = field(
        default=False,
        metadata={
            "help": "Unused by the distillation loss; False: the servers are asked for no sampler top "
            "log-probs, which only GRPO's score-centered loss reads."
        },
    )
    beta: float = field(
        default=0.0,
        metadata={
            "help": "Interpolation of the generalized Jensen-Shannon divergence, a fraction in [0, 1]: 0.0 "
            "is forward KL(teacher || student) over the teacher's top-k support, 1.0 reverse KL over the "
            "realized token, values between the mixture over the teacher's top-1 and the realized token "
            "(TRL 1.16's supports). 0.0: TRL's default."
        },
    )
    teacher_server_urls: dict[str, str] | str | None = field(
        default=None,
        metadata={
            "help": "Teacher vLLM servers by teacher id ({'math': url, 'code': url}), or a JSON object, or "
            "one URL. Each row's `teacher_id` column picks its teacher when there are several (MOPD); one "
            f"teacher scores every row. None: {{'default': '{DEFAULT_TEACHER_URL}'}} (TRL's default). "
            "Teachers are never sent weights; each must share the student's tokenizer."
        },
    )
    teacher_temperature: float = field(
        default=1.0,
        metadata={
            "help": "Softmax temperature of the divergence, on both sides: sent to the teacher (its server "
            "applies it to the log-probs it reports) and applied to the student's logits in the loss. "
            "Unrelated to temperature, which only shapes sampling. 1.0: both models' own distributions."
        },
    )
    teacher_top_k: int = field(
        default=8,
        metadata={
            "help": "Candidate tokens per position the teacher reports (prompt_logprobs), plus the realized "
            f"token; above {VLLM_DEFAULT_MAX_LOGPROBS} its server needs --max-logprobs -1 (`asyncgrpo serve "
            "--teacher-top-k K` adds it). 8: TRL's default, light; 16 to 64 is usual in production."
        },
    )
    add_tail_bucket: bool = field(
        default=True,
        metadata={
            "help": "Add a bucket holding the probability mass outside the support on both sides, so a "
            "small support cannot make the divergence trivially small. True: TRL's default."
        },
    )
    log_completions_steps: int = field(
        default=100,
        metadata={
            "help": "Accepted for TRL scripts; no effect here (warns when changed): completions are logged "
            "at each logging step, log_completions' schedule. 100 (samples): TRL's default, i.e. unset."
        },
    )

    # No GRPO group: one rollout per prompt is a whole sample (config/generation.py reads it).
    _group_needs_advantage = False

    def __post_init__(self) -> None:
        self.teacher_server_urls = parse_teacher_urls(self.teacher_server_urls)
        super().__post_init__()

    def _validate(self) -> None:
        super()._validate()

        def fail(message: str) -> None:
            raise ValueError(f"AsyncDistillationConfig: {message}")

        if not 0.0 <= self.beta <= 1.0:
            fail(f"beta={self.beta} must be in [0, 1] (0: forward KL, 1: reverse KL)")
        if self.beta == 1.0 and not self.add_tail_bucket:
            fail(
                "beta=1.0 with add_tail_bucket=False: reverse KL runs over the realized token alone, "
                "which renormalized is probability 1 on both sides, so the divergence is 0 and nothing "
                "trains; keep add_tail_bucket=True or lower beta"
            )
        if self.teacher_temperature <= 0:
            fail(f"teacher_temperature={self.teacher_temperature} must be > 0")
        if self.teacher_top_k < 1:
            fail(f"teacher_top_k={self.teacher_top_k} must be >= 1: the teacher's support is its top-k")
        if not self.teacher_server_urls:
            fail("teacher_server_urls has no teacher: give at least one {teacher_id: url}")
        for teacher_id, url in self.teacher_server_urls.items():
            parsed = urlparse(str(url))
            if not teacher_id or parsed.scheme not in ("http", "https") or not parsed.netloc:
                fail(
                    f"teacher_server_urls[{teacher_id!r}]={url!r} must map a non-empty teacher id to an "
                    "http(s) URL such as 'http://localhost:8001'"
                )
        if self.log_completions_steps != 100:
            warn_once(
                "log_completions_steps",
                f"log_completions_steps={self.log_completions_steps} has no effect in asyncgrpo: completions "
                "are logged at each logging step when log_completions=True",
            )

    def _validate_reference(self, fail) -> None:
        """`beta` here is the divergence's interpolation: distillation keeps no reference model."""
        if self.sync_ref_model:
            fail("sync_ref_model=True: distillation keeps no reference model to update (beta is the JSD's)")


def parse_teacher_urls(value: dict[str, str] | str | None) -> dict[str, str]:
    """teacher_server_urls as {teacher id: URL without a trailing slash}: None is TRL's default
    teacher, a string is a JSON object (a config file, the command line) or a single URL."""
    if value is None:
        return {"default": DEFAULT_TEACHER_URL}
    if isinstance(value, str):
        text = value.strip()
        value = json.loads(text) if text.startswith("{") else {"default": text}
    if not isinstance(value, dict):
        raise ValueError(
            f"AsyncDistillationConfig: teacher_server_urls must be a dict {{teacher_id: url}}, got "
            f"{type(value).__name__}"
        )
    return {str(key): str(url).rstrip("/") for key, url in value.items()}
