"""The generation session: what a training run opens to get samples, and closes at its end.

Rank 0 reaches the vLLM servers, sizes the rows from them and starts the weight-sync backend, the
rollout worker and the sample intake; the other processes learn the row size and the backend from
it. The session pushes each new policy to the live servers, and keeps the set of them
(trainer/server_roster.py): servers lost leave it, servers back or new join it with the current
weights. `close` shuts down whatever was opened, even after a set-up that failed half-way.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

import torch

from asyncgrpo import timeline
from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.generation.background import BackgroundLoop
from asyncgrpo.generation.client import VLLMClient, VLLMUnavailableError
from asyncgrpo.generation.server_info import check_logprobs_mode, check_routing_replay
from asyncgrpo.metrics import MetricsWindow, Reduce, Stat
from asyncgrpo.rollout.advantages import scale_over_batch
from asyncgrpo.rollout.chat import render_prompt_ids
from asyncgrpo.rollout.environments import EnvironmentOwnedData
from asyncgrpo.rollout.worker import RolloutWorkerPool, check_worker_payload, worker_inputs
from asyncgrpo.routing_replay import moe_routers
from asyncgrpo.sample import Sample
from asyncgrpo.trainer.checkpoint import ResumePoint
from asyncgrpo.trainer.checks import check_prompt_lengths
from asyncgrpo.trainer.distributed import Processes
from asyncgrpo.trainer.intake import SampleIntake, ServersLostWeights, StepBatch, TrainingComplete
from asyncgrpo.trainer.mismatch_watch import MismatchWatch
from asyncgrpo.trainer.nonfinite import NonFiniteTrainingError, weights_are_finite
from asyncgrpo.trainer.prompt_ledger import PromptLedger
from asyncgrpo.trainer.server_roster import ServerRoster, read_server_list
from asyncgrpo.weight_sync import LoraAdapterSync, make_sender, make_weight_sync
from asyncgrpo.weight_sync.merged import sync_policy

if TYPE_CHECKING:
    from asyncgrpo.trainer.async_grpo_trainer import AsyncGRPOTrainer

logger = logging.getLogger(__name__)


class GenerationSession:
    def __init__(self, processes: Processes, window: MetricsWindow, resume: ResumePoint):
        self.processes = processes
        self.window = window  # where the weight syncs' metrics go
        self.resume = resume  # where the rollout worker starts, and the samples the intake holds first
        self.model_version = resume.rollout.model_version  # the policy version the servers run
        self.token_budget: int | None = None  # tokens of one row: known once the servers answer
        # What `close` shuts down, once opened. Rank 0 holds all of it, the other ranks a weight-sync
        # receiver only.
        self.http: BackgroundLoop | None = None
        self.client: VLLMClient | None = None
        self.weight_sync = None
        self.worker: RolloutWorkerPool | None = None
        self.intake: SampleIntake | None = None
        self.roster: ServerRoster | None = None  # the live servers, and those that come and go
        # Rank 0, once open: the name the servers serve the model under, and the prefix of the policy
        # adapters with adapter-only weight sync (None otherwise); an evaluation samples with both.
        self.served_name: str | None = None
        self.lora_name: str | None = None
        self.mismatch_watch: MismatchWatch | None = None  # rank 0, once open
        self.advantage_scaling = ("group", "sum_then_normalize")  # scale_rewards, the aggregation

    def open(
        self, trainer: AsyncGRPOTrainer, ledger: PromptLedger, stop_condition: Callable[[], bool]
    ) -> None:
        """Reach the servers, size the rows, start the weight-sync backend and build the rollout
        worker and the intake (rank 0); the other processes learn the row size and the backend from
        it. The worker is spawned here and starts up while the trainer syncs the starting weights;
        it generates once `start_rollouts` lets it."""
        args = trainer.args
        self.advantage_scaling = (args.scale_rewards, args.multi_objective_aggregation)
        if not self.processes.is_main:
            self.token_budget, backend = self.processes.broadcast(None)
            self.weight_sync = make_weight_sync(backend, is_sender=False)
            return
        # Before anything slow: a lambda fails here.
        check_worker_payload(
            trainer.reward_funcs, trainer.loop_cls, trainer.tools, trainer.environment_factory
        )
        self.http = BackgroundLoop(
            default_timeout_s=max(args.vllm_server_timeout, args.weight_sync_timeout) + 60
        )
        initial = args.vllm_server_urls or first_listed_servers(args)
        self.client = VLLMClient(initial, timeout=args.vllm_server_timeout)
        logger.info("waiting for the vLLM server at %s", ", ".join(initial))
        self.http.run(self.client.wait_until_ready())
        max_model_len = self.http.run(self.client.max_model_len())
        served_name = self.served_name = self.http.run(self.client.model_name())
        server_info = self.http.run(self.client.server_info())
        check_logprobs_mode(server_info, initial[0])
        self.mismatch_watch = MismatchWatch(server_info.dtype if server_info else None, trainer.model)
        if args.moe_routing_replay:
            moe_routers(trainer.model)  # a model without top-k routers has nothing to replay
            check_routing_replay(server_info, initial[0])
        # token_budget <= 0: rows of per_device_train_batch_size samples, no token cap (TRL's fixed count)
        self.token_budget = max_model_len if args.token_budget is None else args.token_budget

        def prompt_length(prompt) -> int:
            # The trainer's tools only: an environment's tools depend on the instance a rollout gets.
            tokenizer = trainer.processing_class
            return len(render_prompt_ids(tokenizer, prompt, trainer.tools, args.chat_template_kwargs))

        check_prompt_lengths(trainer.train_dataset, prompt_length, max_model_len)  # before the worker starts
        self.weight_sync = make_sender(
            args.weight_sync_backend,
            trainer.model,
            server_info,
            self.client,
            self.http,
            args.output_dir,
            args.weight_sync_timeout,
            args.max_staleness,
            trainer_on_gpu=args.device.type == "cuda",
        )
        adapter_sync = self.weight_sync if isinstance(self.weight_sync, LoraAdapterSync) else None
        self.lora_name = adapter_sync.prefix if adapter_sync is not None else None
        rollout = self.resume.rollout
        self.worker = RolloutWorkerPool(
            trainer.loop_cls,
            worker_inputs(
                config=args,
                model_name=served_name,
                dataset=trainer.train_dataset,
                reward_funcs=trainer.reward_funcs,
                processing_class=trainer.processing_class,
                eos_token_ids=eos_token_ids(trainer.model, trainer.processing_class),
                tools=trainer.tools,
                environment_factory=trainer.environment_factory,
                dataset_start_index=rollout.first_untrained_index,
                skip_stream_indices=frozenset(rollout.consumed_after)
                | {sample.stream_index for sample in self.resume.held_samples},
                lora_name=self.lora_name,
            ),
            num_workers=args.num_rollout_workers,
            initial_allowance=0.0,  # SampleIntake publishes the allowance
            worker_timeout=args.rollout_worker_timeout,
            server_urls=initial,
        )
        self.roster = ServerRoster(
            self.client,
            self.http,
            self.weight_sync,
            server_info,
            served_name,
            max_model_len,
            args,
            publish=self.worker.publish_servers,
            window=self.window,
        )
        self.roster.start(initial)
        # Spawned now: its start-up (a fresh interpreter's imports, the servers, setup()) overlaps the
        # trainer's remaining set-up and the first weight sync (bench/RESULTS.md, "timeline").
        self.worker.spawn()
        self.intake = SampleIntake(
            self.worker,
            ledger,
            args.max_staleness,
            self.token_budget,
            num_rows=self.processes.world_size,
            rows_per_step=args.gradient_accumulation_steps * self.processes.world_size,
            samples_per_row=args.per_device_train_batch_size,
            max_sample_tokens=max_model_len,
            # Environment-owned data has no pass over prompts (its length is not a pass: one degenerate
            # group is not a dead dataset); the intake then counts a fixed number of prompts as one.
            prompts_per_epoch=None
            if trainer.streaming or isinstance(trainer.train_dataset, EnvironmentOwnedData)
            else len(trainer.train_dataset),
            stop_condition=stop_condition,
            check_servers=self.check_servers,
            stop_when_saturated=args.stop_when_saturated,
        )
        self.intake.restore(self.resume.held_samples)
        self.worker.publish_model_version(self.model_version)
        self.processes.broadcast((self.token_budget, self.weight_sync.name))

    def start_rollouts(self, ready_timeout: float) -> None:
        """Rank 0, once the servers run the starting weights: wait for the rollout workers to be
        ready and let them generate."""
        if self.worker is not None:
            self.worker.start_generating(ready_timeout=ready_timeout)

    def next_batch(self, gradient_accumulation_steps: int) -> StepBatch | ServersLostWeights | None:
        """Rank 0: the step's samples, planned into rows for every process; ServersLostWeights for
        servers to push the policy to again first; None once training is complete (the last prompts
        were consumed while waiting)."""
        try:
            self.check_servers()
            batch = self.intake.next_step(gradient_accumulation_steps, self.window, self.model_version)
            # What the step's advantages need of the whole batch (scale_rewards="batch", GDPO), before
            # the plan is broadcast: docs/algorithm.md, "Advantages".
            scale_over_batch(batch.samples, *self.advantage_scaling)
            return batch
        except TrainingComplete:
            return None
        except ServersLostWeights as lost:  # every rank learns it, and helps push the weights again
            return lost

    def check_servers(self) -> None:
        """Rank 0: act on what the watch over the servers saw (trainer/server_roster.py): servers
        lost leave the run, servers back or new join it with the served weights. Raises
        ServersLostWeights for servers that need a full sync with every process to join (NCCL), and
        ServerLostError when the run has lost more servers than it may."""
        joining = self.roster.refresh(self.model_version)
        if joining:
            raise ServersLostWeights(joining)

    def restore_server_weights(self, model: torch.nn.Module, lost: ServersLostWeights) -> None:
        """Servers back after a loss, restarted or new, that only a full sync can give the weights
        (a new NCCL group): push the current policy to them and to the live ones. Rollouts a restarted
        server sampled meanwhile are regenerated by the worker."""
        logger.warning("%s: pushing policy version %d to every server", lost, self.model_version)
        self.weight_sync.reconnect()
        self.sync_weights(model, joining=lost.urls)

    def sync_weights(self, model: torch.nn.Module, joining: list[str] = ()) -> None:
        """Push `model` (unwrapped) to the live servers, and those `joining`, as the current policy
        version; every process takes part. Weights that are not finite are never sent. A server the
        sync cannot reach is lost (trainer/server_roster.py)."""
        with timeline.span("weight sync", version=self.model_version):
            # Requests frozen by the pause make it generation's idle time; with none in flight the
            # worker counts that time as idle already.
            frozen = self.worker is not None and self.worker.requests_running() > 0
            waiting = time.perf_counter()
            with timeline.span("barrier"):
                finite = self.processes.gather(weights_are_finite(model))  # every process reaches the sync
            barrier_s = time.perf_counter() - waiting
            if not all(finite):
                raise NonFiniteTrainingError(
                    f"the weights of policy version {self.model_version} hold inf or NaN: they were not "
                    "sent to the vLLM server. The optimizer produced them from finite gradients: lower "
                    "learning_rate."
                )
            targets = self.roster.live() + list(joining) if self.roster is not None else None
            timings, sent_bytes = sync_policy(self.weight_sync, model, self.model_version, targets)
        if self.roster is not None:
            self.roster.after_sync(targets, timings.missed, list(joining))
        if self.processes.is_main:
            self.window.record("perf/sync_pause_s", timings.paused_s)
        if frozen:  # the seconds join the worker's idle seconds, over the worker's elapsed ones
            self.window.add("perf/generation_idle_frac", Stat(Reduce.RATE, timings.paused_s, 0.0))
        self.window.record("perf/weight_sync_bytes", sent_bytes)
        if self.worker is not None:
            self.worker.publish_model_version(self.model_version)
        self.window.record("perf/weight_sync_s", barrier_s + timings.total_s)
        self.window.record("perf/weight_sync_pause_s", timings.pause_s)
        self.window.record("perf/weight_sync_barrier_s", barrier_s)
        self.window.record("perf/weight_sync_transfer_s", timings.transfer_s)

    def collect_worker_metrics(self) -> None:
        """Rank 0: what the rollout worker recorded since the last call, into the window."""
        if self.roster is not None:
            self.roster.mark_timeline()
        if self.worker is not None:
            for stats in self.worker.drain_metrics():
                self.window.merge(stats)
            recorder = timeline.active()
            for events, dropped in self.worker.drain_timeline():
                if isinstance(recorder, timeline.TimelineRecorder):
                    recorder.add_worker_events(events, dropped)

    def held_samples(self) -> list[Sample]:
        """Samples taken from the worker and not trained yet (rank 0; none elsewhere)."""
        return self.intake.held_samples() if self.intake is not None else []

    def close(self) -> None:
        """Close what `open` got to open, even when it failed half-way."""
        closers = []
        if self.worker is not None:
            closers.append(self.worker.stop)
        if self.weight_sync is not None:
            closers.append(self.weight_sync.close)
        if self.roster is not None:
            closers.append(self.roster.close)
        if self.http is not None:
            closers += [lambda: self.http.run(self.client.close(), timeout=10), self.http.close]
        for closer in closers:
            try:
                closer()
            except Exception as error:  # shutting down: report, keep closing the rest
                logger.warning("while shutting down: %s", error)


def first_listed_servers(args: AsyncGRPOConfig) -> list[str]:
    """With no vllm_server_base_url, the run starts with the servers vllm_server_urls_file lists
    once it lists one (within vllm_server_timeout)."""
    deadline = time.monotonic() + args.vllm_server_timeout
    logger.info("waiting for %s to list a vLLM server", args.vllm_server_urls_file)
    while not (listed := read_server_list(args.vllm_server_urls_file)):
        if time.monotonic() > deadline:
            raise VLLMUnavailableError(
                f"{args.vllm_server_urls_file} listed no vLLM server within vllm_server_timeout="
                f"{args.vllm_server_timeout:g} s, and vllm_server_base_url is empty"
            )
        time.sleep(1.0)
    return listed


def eos_token_ids(model: torch.nn.Module, processing_class) -> list[int]:
    ids = {processing_class.eos_token_id}
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(generation_eos, int):
        ids.add(generation_eos)
    elif generation_eos:
        ids.update(generation_eos)
    return sorted(token for token in ids if token is not None)
