"""AsyncGRPOConfig: TrainingArguments plus the asynchronous GRPO fields, with TRL's names and defaults.

Every field of TRL's `AsyncGRPOConfig` keeps its name and default (only the import changes). Values
are checked at construction: a bad value fails here with a message saying what to change, never
minutes later inside the worker process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from transformers import TrainingArguments

from asyncgrpo.off_policy import MODES as IS_MODES
from asyncgrpo.trl_compat import TrlCompatFields

WEIGHT_SYNC_BACKENDS = ("auto", "filesystem", "shared_memory", "nccl")


@dataclass
class AsyncGRPOConfig(TrlCompatFields, TrainingArguments):  # TrainingArguments' fields first (output_dir)
    """Settings of AsyncGRPOTrainer: TrainingArguments plus the asynchronous GRPO fields.

    Field names and defaults are TRL's. docs/configuration.md explains every field; the help texts
    below say what each does, its unit and why its default.
    """

    # -- TrainingArguments defaults this trainer overrides ------------------------------------------
    logging_steps: float = field(
        default=1,
        metadata={"help": "Optimizer steps per logging window (default 1: RL runs are read step by step)."},
    )
    gradient_checkpointing: bool = field(
        default=True,
        metadata={
            "help": "Recompute activations in backward. True: rows of token_budget tokens need it to fit in "
            "memory."
        },
    )
    gradient_checkpointing_to_fit: bool | None = field(
        default=None,
        metadata={
            "help": "With gradient_checkpointing, checkpoint only as many decoder layers as each row needs "
            "to fit the GPU's free memory (the recomputed forward costs about a third of a step). None: "
            "True on a CUDA GPU with one process, else False (every layer checkpointed)."
        },
    )
    torch_compile: bool | None = field(
        default=None,
        metadata={
            "help": "Compile each decoder layer (fused norms, rotary and activations: a faster fwd+bwd on a "
            "GPU, docs/gpu-performance.md). None: True when a CUDA GPU trains, else False (compiling on CPU "
            "is slow to start)."
        },
    )
    triton_adamw: bool = field(
        default=True,
        metadata={
            "help": "True: on a CUDA GPU, run the default optimizer (optim='adamw_torch_fused') as "
            "asyncgrpo's Triton AdamW: the same update, arguments, state and checkpoints, at the card's "
            "memory bandwidth (the optimizer step is the part of a step packing cannot shrink). False: "
            "torch's fused AdamW. Other optimizers and devices are never replaced."
        },
    )
    bf16: bool | None = field(
        default=None,
        metadata={
            "help": "Mixed precision in bfloat16. None: True when fp16 is unset and the training device "
            "supports bf16 (a CUDA GPU), else False, so the same script runs on a CPU-only machine."
        },
    )
    learning_rate: float = field(
        default=1e-6,
        metadata={
            "help": "Peak learning rate (scales each optimizer step). 1e-6: RL fine-tuning moves a "
            "pretrained policy gently."
        },
    )
    lr_scheduler_type: str = field(
        default="constant",
        metadata={
            "help": "Learning-rate schedule. constant: the number of optimizer steps per epoch is unknown in "
            "advance (it depends on forks and dropped groups); a decaying schedule needs max_steps > 0."
        },
    )
    ignore_data_skip: bool = field(
        default=True,
        metadata={
            "help": "Must stay True: resume repositions the rollout worker (rollout_state.json) instead."
        },
    )
    remove_unused_columns: bool = field(
        default=False,
        metadata={"help": "Must stay False: every dataset column reaches the reward functions."},
    )
    # Newer TrainingArguments have these two; declared here so TRL's signature exists on every version.
    activation_checkpointing: bool | None = field(
        default=None,
        metadata={
            "help": "Accepted for TRL compatibility, not used (default None): this trainer shards with FSDP2 "
            "itself and recomputes activations through gradient_checkpointing."
        },
    )
    activation_checkpointing_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Accepted for TRL compatibility, not used (see activation_checkpointing); None."},
    )

    # -- model ------------------------------------------------------------------------------------
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments of from_pretrained when the model is given by name (a dict or a JSON "
            "string); its `revision` also selects the tokenizer's revision, and its `dtype` wins over "
            "`dtype`. None: from_pretrained's defaults, with dtype and trust_remote_code from this config."
        },
    )
    dtype: str = field(
        default="float32",
        metadata={
            "help": "dtype the weights load in: 'auto', 'bfloat16', 'float16' or 'float32'. float32 because "
            "the train/inference mismatch is very sensitive to the trainer's precision; serve vLLM with the "
            "same dtype."
        },
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={
            "help": "Allow model and tokenizer code from the Hub. False: running downloaded code is opt-in."
        },
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={
            "help": "MoE router load-balancing loss coefficient (metric aux_loss); None: the model config's "
            "router_aux_loss_coef, what the checkpoint was trained with. Setting it on a model without "
            "routed experts is an error."
        },
    )

    # -- generation -------------------------------------------------------------------------------
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

    # -- vLLM server --------------------------------------------------------------------------------
    vllm_server_base_url: str | list[str] = field(
        default="http://localhost:8000",
        metadata={
            "help": "One URL, several separated by commas, or a list: requests go to the least busy. "
            "http://localhost:8000: where `vllm serve` listens by default."
        },
    )
    vllm_server_timeout: float = field(
        default=1800.0,
        metadata={
            "help": "Seconds bounding every wait for the server: start-up (TRL's meaning), and each request "
            "and each weight sync unless request_timeout / weight_sync_timeout say otherwise. 1800: a large "
            "model's server can take many minutes to start; a timed-out generation request is retried."
        },
    )
    request_timeout: float | None = field(
        default=None,
        metadata={
            "help": "Seconds one generation request may take before it is retried (a few times, then the run "
            "fails). None: vllm_server_timeout (TRL's default is 600)."
        },
    )
    weight_sync_timeout: float | None = field(
        default=None,
        metadata={
            "help": "Seconds each server call of a weight sync may take (pause, reload or NCCL broadcast, "
            "resume) before the sync raises instead of hanging. None: vllm_server_timeout (TRL's default is "
            "1800)."
        },
    )

    # -- loss ---------------------------------------------------------------------------------------
    epsilon: float = field(
        default=0.2,
        metadata={
            "help": "Lower trust-region half-width: the clipped loss clips the ratio at 1 - epsilon (with "
            "score_centering it only defines the clip_ratio/* metrics). 0.2: PPO/GRPO's usual value."
        },
    )
    epsilon_high: float | None = field(
        default=None,
        metadata={
            "help": "Upper trust-region half-width (ratio clipped at 1 + epsilon_high); None: epsilon. DAPO "
            "suggests 0.28."
        },
    )
    score_centering: bool = field(
        default=True,
        metadata={
            "help": "Score-centered loss (True) or GRPO's clipped surrogate (False). True: subtracting the "
            "sampler's expected score removes the pull toward the sampler that importance weighting leaves."
        },
    )
    vllm_importance_sampling_correction: bool = field(
        default=True,
        metadata={
            "help": "Correct for the sampler being off-policy (stale weights, other kernels) with "
            "vllm_importance_sampling_mode. True: TRL's default; False: no token is masked or reweighted."
        },
    )
    vllm_importance_sampling_mode: str = field(
        default="icepop",
        metadata={
            "help": "How the trainer/sampler ratio exp(logp - sampler logp) corrects the loss: 'icepop' "
            "(a trained token whose ratio leaves [clip_min, clip_max] leaves the loss, no reweighting), "
            "TRL's 'token_truncate', 'token_mask', 'sequence_truncate', 'sequence_mask' (the ratio, of "
            "the token or the whole sequence, clipped or masked, weights the token), or "
            "'sequence_geometric_mask' (a sequence whose geometric-mean ratio leaves the band leaves the "
            "loss). docs/algorithm.md gives each formula. 'icepop': masking alone keeps a rare huge "
            "ratio from dominating a step and adds no variance."
        },
    )
    vllm_importance_sampling_clip_min: float | None = field(
        default=0.5,
        metadata={
            "help": "Lower bound C_min of the ratio: masking modes drop what falls below it, truncating "
            "modes raise it to C_min. None: no lower bound. 0.5: tolerate a 2x drop, mask what is "
            "likely a mismatch."
        },
    )
    vllm_importance_sampling_clip_max: float | None = field(
        default=5.0,
        metadata={
            "help": "Upper bound C_max of the ratio: masking modes drop what rises above it, truncating "
            "modes lower it to C_max. None: no upper bound. 5.0: a ratio can fall only to 0 but rise "
            "without bound; far above 1 it is more likely a mismatch than signal, and would dominate."
        },
    )
    off_policy_mask_threshold: float | None = field(
        default=None,
        metadata={
            "help": "Off-policy sequence masking (DeepSeek-V3.2, TRL's name): a sequence with a negative "
            "advantage whose mean per-token log q - log p (sampler minus trainer) exceeds it leaves the "
            "loss. None: off. TRL suggests values around 0.5."
        },
    )
    num_sampler_logprobs: int = field(
        default=8,
        metadata={
            "help": "Top log-probs the server returns per generated token, for score centering (0 with "
            "score_centering=False). More covers more of the sampler's mass (sampling/sampler_mass shows "
            "how much) but costs the server serialization; its --max-logprobs caps it. 8: TRL's default."
        },
    )
    token_budget: int | None = field(
        default=None,
        metadata={
            "help": "Tokens one process forwards per micro-batch (a row), shared prefixes counted once, and "
            "the row's loss entries (trained tokens, counted per sample); bounds peak memory. None: the "
            "server's max_model_len, so every sample fits. Longer samples are dropped. <= 0 (TRL's "
            "fixed-count mode): a row holds per_device_train_batch_size samples, still tree-packed, "
            "whatever their tokens (no memory bound)."
        },
    )

    # -- asynchronous pipeline ------------------------------------------------------------------------
    max_concurrent_rollouts: int = field(
        default=512,
        metadata={
            "help": "Upper bound on rollouts running at once (each holds a server connection and, with "
            "tools, a thread). Set it to what environments and tools can take; the server's load may cap it "
            "lower. 512: high enough that the server's load, not this bound, usually sets the concurrency."
        },
    )
    max_staleness: int = field(
        default=4,
        metadata={
            "help": "A sample more than this many policy versions (weight syncs) behind the trainer when "
            "taken is dropped; generation may also hold max(max_staleness, 1) steps' worth of tokens queued "
            "or in flight. Versions equal steps when weight_sync_steps=1. 4: enough run-ahead for "
            "generation and training to overlap, while samples stay within a few updates of the policy."
        },
    )
    weight_sync_steps: int = field(
        default=1,
        metadata={
            "help": "Optimizer steps between weight syncs to the server; each sync is one policy version. "
            "1: the freshest samples; raise it when a sync costs much against a step."
        },
    )
    num_rollout_workers: int = field(
        default=1,
        metadata={
            "help": "Rollout worker processes. Each takes every K-th prompt of the stream and a share of "
            "the servers (server i goes to worker i mod K; with fewer servers than workers, workers share "
            "them), and all of them draw on one staleness budget. 1 is enough for a few servers: one worker "
            "runs a few hundred completions per second on one core; raise it when the servers outrun it "
            "(rollout/generated_tokens_per_s flat while the servers idle)."
        },
    )
    rollout_worker_timeout: float = field(
        default=300.0,
        metadata={
            "help": "Seconds without a heartbeat from the rollout worker before it is declared hung and "
            "training stops with an error. The heartbeat beats every second, so 300 only fires on a real "
            "hang."
        },
    )
    reward_timeout: float = field(
        default=600.0,
        metadata={
            "help": "Seconds one reward-function call (one group) may take. A call past it stops the run "
            "with an error naming the function and the dataset row, instead of hanging it: a judge that "
            "never answers must not stall training silently. 600: generous, for remote judges."
        },
    )
    weight_sync_backend: str = field(
        default="auto",
        metadata={
            "help": "'auto': nccl when the trainer has a GPU and the server runs the NCCL engine, "
            "filesystem otherwise; 'filesystem': safetensors under output_dir reloaded by the server "
            "(any server that can read output_dir: shared filesystems); 'shared_memory': the same "
            "through RAM (/dev/shm), for servers on this machine; 'nccl': GPU-to-GPU broadcast with "
            "vLLM's native weight-transfer protocol "
            '(serve with --weight-transfer-config \'{"backend":"nccl"}\').'
        },
    )

    # -- evaluation (eval_strategy, eval_steps, eval_on_start, eval_delay: TrainingArguments') ------------
    num_generations_eval: int | None = field(
        default=None,
        metadata={
            "help": "Rollouts sampled per eval prompt, the n of pass@k (TRL's name). None: num_generations. "
            "More rollouts give a steadier pass@1 and a larger k, at that many times the eval's generation."
        },
    )
    temperature_eval: float | None = field(
        default=None,
        metadata={
            "help": "Sampling temperature of the eval rollouts (>= 0; 0: greedy decoding, as nothing "
            "sampled for evaluation is trained on). None: temperature, so the eval measures the policy "
            "training samples from."
        },
    )
    eval_pass_threshold: float = field(
        default=1.0,
        metadata={
            "help": "An eval rollout passes (pass@k) when its summed reward is at least this. 1.0: the top "
            "score of a 0/1 correctness reward, such as accuracy_reward; the highest reward a function "
            "can give is not known in general, so set it for other scales."
        },
    )

    # -- logging --------------------------------------------------------------------------------------
    log_completions: bool = field(
        default=False,
        metadata={
            "help": "Print a table of recent completions (prompt, completion, reward) at each log. False: "
            "the log holds metrics only; turn it on to read what the policy writes."
        },
    )
    num_completions_to_print: int | None = field(
        default=None,
        metadata={"help": "Rows of that table; None: every sample trained since the last log (at most 64)."},
    )

    def __post_init__(self) -> None:
        if self.bf16 is None:
            self.bf16 = not self.fp16 and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        on_gpu = torch.cuda.is_available() and not self.use_cpu
        if self.torch_compile is None:
            self.torch_compile = on_gpu
        if self.gradient_checkpointing_to_fit is None:
            self.gradient_checkpointing_to_fit = on_gpu
        if isinstance(self.model_init_kwargs, str):
            self.model_init_kwargs = json.loads(self.model_init_kwargs)
        if isinstance(self.chat_template_kwargs, str):
            self.chat_template_kwargs = json.loads(self.chat_template_kwargs)
        if isinstance(self.vllm_server_base_url, str):
            self.vllm_server_base_url = [
                url.strip() for url in self.vllm_server_base_url.split(",") if url.strip()
            ]
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        if self.request_timeout is None:
            self.request_timeout = self.vllm_server_timeout
        if self.weight_sync_timeout is None:
            self.weight_sync_timeout = self.vllm_server_timeout
        if self.num_generations_eval is None:
            self.num_generations_eval = self.num_generations
        if self.temperature_eval is None:
            self.temperature_eval = self.temperature
        if (
            self.load_best_model_at_end or self.save_strategy == "best"
        ) and self.metric_for_best_model is None:
            # TrainingArguments would pick "loss", which an RL evaluation has none of: the held-out reward
            # is what "best" means here.
            self.metric_for_best_model = "reward"
        self._apply_trl_compat(_DEFAULTS["max_concurrent_rollouts"], _DEFAULTS["rollout_worker_timeout"])
        self._validate()
        super().__post_init__()

    @property
    def vllm_server_urls(self) -> list[str]:
        return list(self.vllm_server_base_url)

    def _validate(self) -> None:
        def fail(message: str) -> None:
            raise ValueError(f"AsyncGRPOConfig: {message}")

        if self.num_generations < 2:
            fail(
                f"num_generations={self.num_generations}: a group needs at least 2 rollouts to have an "
                "advantage"
            )
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
        for name in ("vllm_server_timeout", "request_timeout", "weight_sync_timeout"):
            if getattr(self, name) <= 0:
                fail(f"{name}={getattr(self, name)} must be > 0")
        if self.repetition_penalty <= 0:
            fail(f"repetition_penalty={self.repetition_penalty} must be > 0 (1 disables it)")
        clip_min, clip_max = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if not 0 < (1 if clip_min is None else clip_min) <= 1 <= (1 if clip_max is None else clip_max):
            fail(
                "need 0 < vllm_importance_sampling_clip_min <= 1 <= vllm_importance_sampling_clip_max "
                f"(None: unbounded), got {clip_min} and {clip_max}"
            )
        if self.vllm_importance_sampling_mode not in IS_MODES:
            fail(
                f"vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r} is not a mode: pick "
                f"one of {', '.join(IS_MODES)}"
            )
        if self.off_policy_mask_threshold is not None and self.off_policy_mask_threshold < 0:
            fail(
                f"off_policy_mask_threshold={self.off_policy_mask_threshold} must be >= 0 (a KL), or None "
                "to turn off-policy sequence masking off"
            )
        if self.epsilon < 0 or self.epsilon_high < 0:
            fail("epsilon and epsilon_high must be >= 0")
        if self.num_sampler_logprobs < 0:
            fail(f"num_sampler_logprobs={self.num_sampler_logprobs} must be >= 0")
        if self.score_centering and self.num_sampler_logprobs == 0:
            fail(
                "score_centering=True needs num_sampler_logprobs > 0 (the sampler's top tokens to center on)"
            )
        if self.router_aux_loss_coef is not None and self.router_aux_loss_coef < 0:
            fail(f"router_aux_loss_coef={self.router_aux_loss_coef} must be >= 0 (None: the model config's)")
        if self.token_budget is not None and 0 < self.token_budget < 16:
            fail(
                f"token_budget={self.token_budget} is too small to hold a sample: give >= 16 tokens, None "
                "(the server's max_model_len), or <= 0 for rows of per_device_train_batch_size samples"
            )
        if self.token_budget is not None and self.token_budget <= 0 and self.per_device_train_batch_size < 1:
            fail(
                f"per_device_train_batch_size={self.per_device_train_batch_size} must be >= 1: with "
                f"token_budget={self.token_budget} it is the number of samples in each process's row"
            )
        if self.max_concurrent_rollouts < 1:
            fail(f"max_concurrent_rollouts={self.max_concurrent_rollouts} must be >= 1")
        if self.max_staleness < 0:
            fail(f"max_staleness={self.max_staleness} must be >= 0")
        if self.weight_sync_steps < 1:
            fail(f"weight_sync_steps={self.weight_sync_steps} must be >= 1")
        if self.num_rollout_workers < 1:
            fail(f"num_rollout_workers={self.num_rollout_workers} must be >= 1")
        if self.rollout_worker_timeout <= 0:
            fail(f"rollout_worker_timeout={self.rollout_worker_timeout} must be > 0")
        if self.reward_timeout <= 0:
            fail(f"reward_timeout={self.reward_timeout} must be > 0 (seconds one reward call may take)")
        if self.weight_sync_backend not in WEIGHT_SYNC_BACKENDS:
            fail(f"weight_sync_backend={self.weight_sync_backend!r} must be one of {WEIGHT_SYNC_BACKENDS}")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            fail(f"dtype={self.dtype!r} must be 'auto', 'bfloat16', 'float16' or 'float32'")
        if self.max_tool_calling_iterations is not None and self.max_tool_calling_iterations < 0:
            fail("max_tool_calling_iterations must be >= 0 or None (unlimited)")
        if not self.ignore_data_skip:
            fail(
                "ignore_data_skip must stay True: resume fast-forwards the rollout worker "
                "(rollout_state.json)"
            )
        if self.remove_unused_columns:
            fail(
                "remove_unused_columns must stay False: every dataset column is passed to the reward "
                "functions"
            )
        if self.use_liger_kernel:
            fail("use_liger_kernel=True is not supported: the loss needs its own log-prob computation")
        if self.deepspeed:
            fail("DeepSpeed is not supported: use FSDP2 for sharded training")
        if self.num_generations_eval < 1:
            fail(f"num_generations_eval={self.num_generations_eval} must be >= 1 (None: num_generations)")
        if self.temperature_eval < 0:
            fail(f"temperature_eval={self.temperature_eval} must be >= 0 (0: greedy; None: temperature)")
        if self.metric_for_best_model in ("loss", "eval_loss"):
            fail(
                f"metric_for_best_model={self.metric_for_best_model!r}: an evaluation here logs no loss; use "
                "an eval figure such as 'reward' or 'pass@1' (docs/metrics.md, \"Evaluation\")"
            )
        if self.num_completions_to_print is not None and self.num_completions_to_print < 1:
            fail("num_completions_to_print must be >= 1 or None")
        self._validate_schedule(fail)
        self._validate_parallelism(fail)

    def _validate_schedule(self, fail) -> None:
        """Without max_steps, epochs end training and the number of steps is unknown in advance
        (it depends on forks and dropped groups): nothing may be sized from it."""
        if self.max_steps > 0:
            return
        if any(0 < steps < 1 for steps in (self.logging_steps, self.save_steps)):
            fail(
                "logging_steps/save_steps given as a fraction of training need max_steps > 0: the number of "
                "steps in an epoch is not known in advance"
            )
        schedule = getattr(self.lr_scheduler_type, "value", self.lr_scheduler_type)
        if schedule not in ("constant", "constant_with_warmup"):
            fail(
                f"lr_scheduler_type={schedule!r} decays over max_steps, which epochs cannot give (the number "
                "of steps depends on forks and drops): set max_steps, or use a constant schedule"
            )

    def _validate_parallelism(self, fail) -> None:
        """Tree-packed rows are split between processes by data parallelism only."""
        config = self.parallelism_config
        if config is None:
            return
        for name in ("cp_size", "sp_size"):
            if (getattr(config, name, 1) or 1) > 1:
                fail(
                    f"parallelism_config.{name}={getattr(config, name)} is not supported: context and "
                    "sequence parallelism do not apply to tree-packed rows; use FSDP2 (data parallel) only"
                )


_DEFAULTS = {f.name: f.default for f in fields(AsyncGRPOConfig)}
