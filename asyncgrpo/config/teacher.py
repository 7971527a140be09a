"""Config fields of a teacher: the vLLM servers that score the student's samples teacher-forced, how they
score, and, in a GRPO run, how much their judgement weighs beside the reward (`teacher_kl_coef`).

AsyncDistillationConfig trains on the teachers alone (config/distillation.py); AsyncGRPOConfig may add
a teacher to its rewards: each trained token's advantage gains teacher_kl_coef x (log q_teacher - log
p_sampler) of the token, the per-token reverse KL to the teacher that on-policy distillation recipes
add to RL (docs/distillation.md, "A reward and a teacher").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from urllib.parse import urlparse

from asyncgrpo.errors import ConfigurationError

# vLLM caps prompt_logprobs at 20 unless the server runs with --max-logprobs -1.
VLLM_DEFAULT_MAX_LOGPROBS = 20


@dataclass
class TeacherFields:
    teacher_server_urls: dict[str, str] | str | None = field(
        default=None,
        metadata={
            "help": "Teacher vLLM servers by teacher id ({'math': url, 'code': url}), a JSON object, or one "
            "URL; never sent weights, each must share the student's tokenizer. A dataset row's `teacher_id` "
            "column picks its teacher when there are several. None: no teacher (GRPO alone); "
            "AsyncDistillationConfig reads None as TRL's default, {'default': 'http://localhost:8001'}."
        },
    )
    teacher_temperature: float = field(
        default=1.0,
        metadata={
            "help": "Temperature the teacher scores at (its server applies it to the log-probs it reports); "
            "in distillation the student's side of the divergence too. Unrelated to temperature, which "
            "shapes sampling. 1.0: the teacher's own distribution."
        },
    )
    teacher_top_k: int = field(
        default=8,
        metadata={
            "help": "Candidate tokens per position the teacher reports (prompt_logprobs), beside the "
            f"realized token; above {VLLM_DEFAULT_MAX_LOGPROBS} its server needs --max-logprobs -1. 8: "
            "TRL's default, light; 16 to 64 is usual for distillation in production."
        },
    )
    teacher_kl_coef: float = field(
        default=0.0,
        metadata={
            "help": "GRPO with a teacher: each trained token's advantage gains this coefficient x (log "
            "q_teacher - log p_sampler) of the token, a per-token reverse KL to the teacher beside the "
            "reward. 0.0: no teacher term. Needs teacher_server_urls."
        },
    )

    def _resolve_teacher(self) -> None:
        if self.teacher_server_urls is not None:
            try:
                self.teacher_server_urls = parse_teacher_urls(self.teacher_server_urls)
            except ValueError as error:  # a malformed JSON object too
                raise ConfigurationError(f"{type(self).__name__}: {error}") from None

    def _validate_teacher(self, fail) -> None:
        """GRPO: a teacher and teacher_kl_coef > 0 come together (a teacher without the term would
        score every sample for nothing)."""
        self._validate_teacher_scoring(fail)
        if self.teacher_kl_coef < 0:
            fail(f"teacher_kl_coef={self.teacher_kl_coef} must be >= 0 (0: no teacher term)")
        if self.teacher_server_urls is None and self.teacher_kl_coef > 0:
            fail(f"teacher_kl_coef={self.teacher_kl_coef} needs a teacher: set teacher_server_urls")
        if self.teacher_server_urls is not None and self.teacher_kl_coef == 0:
            fail(
                "teacher_server_urls without teacher_kl_coef > 0: the teacher would score every sample and "
                "nothing would read it; set teacher_kl_coef (e.g. 0.1), or use AsyncDistillationConfig to "
                "train on the teacher alone"
            )

    def _validate_teacher_scoring(self, fail) -> None:
        if self.teacher_temperature <= 0:
            fail(f"teacher_temperature={self.teacher_temperature} must be > 0")
        if self.teacher_top_k < 1:
            fail(f"teacher_top_k={self.teacher_top_k} must be >= 1: the teacher's support is its top-k")
        if self.teacher_server_urls is None:
            return
        if not self.teacher_server_urls:
            fail("teacher_server_urls has no teacher: give at least one {teacher_id: url}")
        for teacher_id, url in self.teacher_server_urls.items():
            parsed = urlparse(str(url))
            if not teacher_id or parsed.scheme not in ("http", "https") or not parsed.netloc:
                fail(
                    f"teacher_server_urls[{teacher_id!r}]={url!r} must map a non-empty teacher id to an "
                    "http(s) URL such as 'http://localhost:8001'"
                )


def parse_teacher_urls(value: dict[str, str] | str) -> dict[str, str]:
    """teacher_server_urls as {teacher id: URL without a trailing slash}: a string is a JSON object (a
    config file, the command line) or a single URL."""
    if isinstance(value, str):
        text = value.strip()
        value = json.loads(text) if text.startswith("{") else {"default": text}
    if not isinstance(value, dict):
        raise ConfigurationError(
            f"teacher_server_urls must be a dict {{teacher_id: url}}, got {type(value).__name__}"
        )
    return {str(key): str(url).rstrip("/") for key, url in value.items()}
