"""Config fields of generation: the group size, sampling settings, chat template and tool turns."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class GenerationFields:
    """What the servers sample for training, and how rollouts are rendered."""

    # GRPO compares a group's rollouts, so a group needs two; a trainer whose loss needs no group
    # (distillation: config/distillation.py) clears it.
    _group_needs_advantage = True

    num_generations: int = field(
        default=8,
        metadata={
            "help": "Rollouts per prompt (the GRPO group); >= 2, since advantages compare a group's "
            "rollouts. 8 (TRL's): enough for a group to differ in reward on most prompts, at 8x generation "
            "per prompt."
        },
    )
    max_completion_length: int = field(
        default=2048,
        metadata={
            "help": "Max generated tokens per vLLM request, i.e. per turn (the server's max_model_len also "
            "caps it). 2048 (TRL's): room for a short reasoning chain; watch completions/clipped_ratio."
        },
    )
    temperature: float = field(
        default=1.0,
        metadata={
            "help": "Sampling temperature (> 0). The trainer's log-probs use logits / temperature, as the "
            "sampler. 1.0: the policy's own distribution."
        },
    )
    top_p: float = field(
        default=1.0,
        metadata={
            "help": "Nucleus sampling mass in (0, 1]; 1.0 disables it. < 1 requires top_k and a server "
            "started with --return-sampling-mask --enable-scale-out (the trainer renormalizes over each "
            "candidate set)."
        },
    )
    top_k: int = field(
        default=0,
        metadata={
            "help": "Top-k sampling: the k most likely tokens; 0 disables it (the policy's own "
            "distribution). Required with top_p < 1 or min_p > 0 (it bounds the set vLLM returns)."
        },
    )
    min_p: float | None = field(
        default=None,
        metadata={
            "help": "Min-p sampling in [0, 1] (relative to the top token's probability); None/0 disables it. "
            "Needs top_k."
        },
    )
    repetition_penalty: float = field(
        default=1.0,
        metadata={
            "help": "vLLM's repetition penalty (> 1 discourages repeating prompt or generated tokens); 1.0 "
            "disables it. The trainer's log-probs do not apply it, so a value != 1 widens the "
            "train/inference mismatch that masked importance sampling corrects (more masked tokens, "
            "sampling/masked_mean)."
        },
    )
    chat_template_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": "Extra keyword arguments of apply_chat_template (e.g. {'enable_thinking': False}). "
            "None: the template's own defaults."
        },
    )
    max_tool_calling_iterations: int | None = field(
        default=None,
        metadata={
            "help": "Cap on tool-calling turns per rollout; None: until a turn calls no tool (TRL's default)."
        },
    )
    parse_reasoning: bool = field(
        default=False,
        metadata={
            "help": "Move a <think>...</think> block out of each assistant message's content into "
            "reasoning_content (as TRL's parse_response does for the chat templates it knows). False: "
            "content is the text as generated (less tool-call blocks), which format rewards such as "
            "r'^<think>.*?</think><answer>.*?</answer>$' match; True: content is the answer alone."
        },
    )

    harness_max_request_mb: float = field(
        default=16.0,
        metadata={
            "help": "The largest request body, in MiB, that a harness agent may send to the trainer's "
            "capture proxy (HarnessAsyncGRPOTrainer); a larger one is refused with a 413 that says so, "
            "before it is read. 16: a chat history of a million tokens of text, JSON-escaped, fits; a body "
            "past it cannot fit a model's context and would only cost the worker memory and parsing time."
        },
    )

    def _resolve_generation(self) -> None:
        if isinstance(self.chat_template_kwargs, str):
            self.chat_template_kwargs = json.loads(self.chat_template_kwargs)

    def _validate_generation(self, fail) -> None:
        if self._group_needs_advantage and self.num_generations < 2:
            fail(
                f"num_generations={self.num_generations}: a group needs at least 2 rollouts to have an "
                "advantage"
            )
        if self.num_generations < 1:
            fail(f"num_generations={self.num_generations} must be >= 1")
        if self.max_completion_length < 1:
            fail(f"max_completion_length={self.max_completion_length} must be >= 1")
        if self.temperature <= 0:
            fail(f"temperature={self.temperature} must be > 0: GRPO needs different rollouts in a group")
        if not 0 < self.top_p <= 1:
            fail(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            fail(f"top_k={self.top_k} must be >= 0 (0 disables top-k)")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            fail(f"min_p={self.min_p} must be in [0, 1]")
        if (self.top_p < 1 or (self.min_p or 0) > 0) and self.top_k == 0:
            fail(
                "top_p < 1 or min_p > 0 needs top_k > 0 as well: vLLM bounds the candidate set it returns by "
                "top_k, and the trainer renormalizes over that set (e.g. top_k=512)"
            )
        if self.repetition_penalty <= 0:
            fail(f"repetition_penalty={self.repetition_penalty} must be > 0 (1 disables it)")
        if self.max_tool_calling_iterations is not None and self.max_tool_calling_iterations < 0:
            fail("max_tool_calling_iterations must be >= 0 or None (unlimited)")
        if not self.harness_max_request_mb > 0:
            fail(f"harness_max_request_mb={self.harness_max_request_mb} must be > 0 (MiB of a request body)")
