"""Config fields of the asynchronous pipeline: how far generation runs ahead, weight syncs, the
rollout workers and their timeouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

WEIGHT_SYNC_BACKENDS = ("auto", "filesystem", "shared_memory", "nccl")


@dataclass
class PipelineFields:
    """How generation and training run side by side."""

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
    tool_timeout: float = field(
        default=600.0,
        metadata={
            "help": "Seconds one tool call may take: a tool or environment method of the built-in tool "
            "loop, and a white-box harness session's tool. A call past it becomes an error the model sees "
            "(the rollout goes on) and counts in tools/timeout_count, instead of holding its rollout's "
            "place forever; a sync tool's thread cannot be stopped and is left to finish. 600: generous, "
            "for tools that call remote services."
        },
    )
    reward_error_tolerance: float = field(
        default=0.5,
        metadata={
            "help": "Fraction of the last reward_error_window groups whose scoring may fail (a reward "
            "function raised) before the run stops, naming the function and its last traceback. A group "
            "whose scoring failed is dropped and counted (rollout/reward_failed_groups), each distinct "
            "error logged once: a judge that fails now and then, or is down for a short while, costs its "
            "groups, not a run of days. 0.5: a broken function (failing every call) still stops the run "
            "within about half a window. 0: TRL's behaviour, the first exception ends the run."
        },
    )
    reward_error_window: int = field(
        default=200,
        metadata={
            "help": "How many of the most recent scored groups (num_generations rollouts each) "
            "reward_error_tolerance is counted over. 200: long enough that a burst of failures is not "
            "mistaken for a broken function, short enough that a broken one stops the run within a few "
            "steps' worth of rollouts."
        },
    )
    stop_when_saturated: bool = field(
        default=True,
        metadata={
            "help": "What a whole pass over the prompts that brings nothing to train (every group's "
            "rollouts got equal rewards) does once the run has trained: True ends training as at max_steps "
            "(final save, on_train_end, the report) with a warning naming the prompts the policy always "
            "and never solves; False trains on through such passes (TRL's behaviour), warning once a pass. "
            "A run that has not trained since its start or resume fails either way (its reward functions "
            "or data are broken). For data without a length, 1,000 prompts in a row count as a pass. True: "
            "a saturated run has learnt what it can of its data, and waiting costs generation for nothing."
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

    def _validate_pipeline(self, fail) -> None:
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
        if self.tool_timeout <= 0:
            fail(f"tool_timeout={self.tool_timeout} must be > 0 (seconds one tool call may take)")
        if not 0 <= self.reward_error_tolerance < 1:
            fail(
                f"reward_error_tolerance={self.reward_error_tolerance} must be in [0, 1): the fraction of "
                "recent groups whose reward functions may raise (0: the first exception ends the run)"
            )
        if self.reward_error_window < 1:
            fail(f"reward_error_window={self.reward_error_window} must be >= 1 (scored groups)")
        if self.weight_sync_backend not in WEIGHT_SYNC_BACKENDS:
            fail(f"weight_sync_backend={self.weight_sync_backend!r} must be one of {WEIGHT_SYNC_BACKENDS}")
