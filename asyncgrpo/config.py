"""AsyncGRPOConfig: TrainingArguments plus the asynchronous GRPO fields, with the seed's defaults.

Every field of TRL's `AsyncGRPOConfig` keeps its name and default (only the import changes). Values
are checked at construction: a bad value fails here with a message saying what to change, never
minutes later inside the worker process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import TrainingArguments

WEIGHT_SYNC_BACKENDS = ("auto", "filesystem", "nccl")


@dataclass
class AsyncGRPOConfig(TrainingArguments):
    # -- TrainingArguments defaults this trainer overrides (see the seed) -----------------------
    logging_steps: float = field(default=1, metadata={"help": "Log every step: RL runs are read step by step."})
    gradient_checkpointing: bool = field(
        default=True, metadata={"help": "Rows of token_budget tokens need activation checkpointing to fit."}
    )
    bf16: bool | None = field(
        default=None,
        metadata={
            "help": "None: True when fp16 is unset and the training device supports bf16 (a CUDA GPU), "
            "else False. The seed's default is True; on a CPU-only machine that would fail at start."
        },
    )
    learning_rate: float = field(default=1e-6, metadata={"help": "RL fine-tuning moves a pretrained policy gently."})
    lr_scheduler_type: str = field(
        default="constant",
        metadata={"help": "The number of optimizer steps is unknown in advance (it depends on forks and drops)."},
    )
    ignore_data_skip: bool = field(
        default=True,
        metadata={"help": "Resume fast-forwards the rollout worker instead (rollout_state.json); always True."},
    )
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Every dataset column reaches the reward functions; must stay False."}
    )
    # Newer TrainingArguments have these; kept here so every seed field exists on every version.
    activation_checkpointing: bool | None = field(
        default=None, metadata={"help": "FSDP activation checkpointing (preferred over gradient_checkpointing)."}
    )
    activation_checkpointing_kwargs: dict[str, Any] | str | None = field(default=None)

    # -- model ------------------------------------------------------------------------------------
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "Keyword arguments of from_pretrained when the model is given by name."}
    )
    dtype: str = field(
        default="float32",
        metadata={
            "help": "dtype the weights load in: 'auto', 'bfloat16', 'float16' or 'float32'. float32 because the "
            "train/inference mismatch is very sensitive to the trainer's precision; serve vLLM with the same dtype."
        },
    )
    trust_remote_code: bool = field(default=False)
    router_aux_loss_coef: float | None = field(
        default=None, metadata={"help": "MoE load-balancing loss coefficient; None: the model config's; error on non-MoE."}
    )

    # -- generation -------------------------------------------------------------------------------
    num_generations: int = field(default=8, metadata={"help": "Rollouts per prompt (the GRPO group)."})
    max_completion_length: int = field(default=2048, metadata={"help": "Max tokens per vLLM request (per turn)."})
    temperature: float = field(default=1.0)
    top_p: float = field(default=1.0, metadata={"help": "< 1 requires top_k and a server with candidate sets."})
    top_k: int = field(default=0, metadata={"help": "0 disables top-k."})
    min_p: float | None = field(default=None)
    chat_template_kwargs: dict | str | None = field(default=None)
    max_tool_calling_iterations: int | None = field(
        default=None,
        metadata={"help": "Most tool turns per rollout; None: until a turn calls no tool (TRL's default)."},
    )
    parse_reasoning: bool = field(
        default=True,
        metadata={
            "help": "Split a <think>...</think> block off each assistant message into reasoning_content, so "
            "reward functions see the answer alone in content (TRL's parse_response). False: content keeps it."
        },
    )

    # -- vLLM server --------------------------------------------------------------------------------
    vllm_server_base_url: str | list[str] = field(
        default="http://localhost:8000",
        metadata={"help": "One URL, several separated by commas, or a list: requests go to the least busy."},
    )
    vllm_server_timeout: float = field(
        default=1800.0, metadata={"help": "Bound on every wait for the server (start, each request, each sync)."}
    )

    # -- loss ---------------------------------------------------------------------------------------
    epsilon: float = field(default=0.2)
    epsilon_high: float | None = field(default=None, metadata={"help": "None: epsilon. DAPO suggests 0.28."})
    score_centering: bool = field(default=True)
    vllm_importance_sampling_clip_min: float = field(default=0.5)
    vllm_importance_sampling_clip_max: float = field(default=5.0)
    num_sampler_logprobs: int = field(default=8)
    token_budget: int | None = field(
        default=None, metadata={"help": "Forwarded tokens per row (shared counted once); None: server max_model_len."}
    )

    # -- asynchronous pipeline ------------------------------------------------------------------------
    max_concurrent_rollouts: int = field(default=512)
    max_staleness: int = field(default=4)
    weight_sync_steps: int = field(default=1)
    rollout_worker_timeout: float = field(default=300.0)
    weight_sync_backend: str = field(
        default="auto",
        metadata={
            "help": "'auto': nccl when the trainer has a GPU and the server runs the NCCL engine, filesystem "
            "otherwise; 'filesystem': safetensors under output_dir reloaded by the server (CPU, shared "
            "filesystems); 'nccl': GPU-to-GPU broadcast with vLLM's native weight-transfer protocol "
            "(serve with --weight-transfer-config '{\"backend\":\"nccl\"}')."
        },
    )

    # -- logging --------------------------------------------------------------------------------------
    log_completions: bool = field(default=False)
    num_completions_to_print: int | None = field(default=None)

    def __post_init__(self) -> None:
        if self.bf16 is None:
            self.bf16 = not self.fp16 and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        if isinstance(self.model_init_kwargs, str):
            self.model_init_kwargs = json.loads(self.model_init_kwargs)
        if isinstance(self.chat_template_kwargs, str):
            self.chat_template_kwargs = json.loads(self.chat_template_kwargs)
        if isinstance(self.vllm_server_base_url, str):
            self.vllm_server_base_url = [url.strip() for url in self.vllm_server_base_url.split(",") if url.strip()]
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        self._validate()
        super().__post_init__()

    @property
    def vllm_server_urls(self) -> list[str]:
        return list(self.vllm_server_base_url)

    def _validate(self) -> None:
        def fail(message: str) -> None:
            raise ValueError(f"AsyncGRPOConfig: {message}")

        if self.num_generations < 2:
            fail(f"num_generations={self.num_generations}: a group needs at least 2 rollouts to have an advantage")
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
        if not self.vllm_server_base_url:
            fail("vllm_server_base_url is empty: give the URL of a running `vllm serve`")
        for url in self.vllm_server_base_url:
            if not url.startswith(("http://", "https://")):
                fail(f"vllm_server_base_url {url!r} must start with http:// or https://")
        if self.vllm_server_timeout <= 0:
            fail(f"vllm_server_timeout={self.vllm_server_timeout} must be > 0")
        if not 0 < self.vllm_importance_sampling_clip_min <= 1 <= self.vllm_importance_sampling_clip_max:
            fail(
                "need 0 < vllm_importance_sampling_clip_min <= 1 <= vllm_importance_sampling_clip_max, got "
                f"{self.vllm_importance_sampling_clip_min} and {self.vllm_importance_sampling_clip_max}"
            )
        if self.epsilon < 0 or self.epsilon_high < 0:
            fail("epsilon and epsilon_high must be >= 0")
        if self.num_sampler_logprobs < 0:
            fail(f"num_sampler_logprobs={self.num_sampler_logprobs} must be >= 0")
        if self.score_centering and self.num_sampler_logprobs == 0:
            fail("score_centering=True needs num_sampler_logprobs > 0 (the sampler's top tokens to center on)")
        if self.token_budget is not None and self.token_budget < 16:
            fail(f"token_budget={self.token_budget} is too small to hold a sample")
        if self.max_concurrent_rollouts < 1:
            fail(f"max_concurrent_rollouts={self.max_concurrent_rollouts} must be >= 1")
        if self.max_staleness < 0:
            fail(f"max_staleness={self.max_staleness} must be >= 0")
        if self.weight_sync_steps < 1:
            fail(f"weight_sync_steps={self.weight_sync_steps} must be >= 1")
        if self.rollout_worker_timeout <= 0:
            fail(f"rollout_worker_timeout={self.rollout_worker_timeout} must be > 0")
        if self.weight_sync_backend not in WEIGHT_SYNC_BACKENDS:
            fail(f"weight_sync_backend={self.weight_sync_backend!r} must be one of {WEIGHT_SYNC_BACKENDS}")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            fail(f"dtype={self.dtype!r} must be 'auto', 'bfloat16', 'float16' or 'float32'")
        if self.max_tool_calling_iterations is not None and self.max_tool_calling_iterations < 0:
            fail("max_tool_calling_iterations must be >= 0 or None (unlimited)")
        if not self.ignore_data_skip:
            fail("ignore_data_skip must stay True: resume fast-forwards the rollout worker (rollout_state.json)")
        if self.remove_unused_columns:
            fail("remove_unused_columns must stay False: every dataset column is passed to the reward functions")
        if self.use_liger_kernel:
            fail("use_liger_kernel=True is not supported: the loss needs its own log-prob computation")
        if self.deepspeed:
            fail("DeepSpeed is not supported: use FSDP2 for sharded training")
        if self.num_completions_to_print is not None and self.num_completions_to_print < 1:
            fail("num_completions_to_print must be >= 1 or None")
