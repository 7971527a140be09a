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
from dataclasses import dataclass
from typing import Any, Callable

import torch

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.generation.background import BackgroundLoop
from asyncgrpo.generation.client import VLLMClient, VLLMUnavailableError
from asyncgrpo.generation.server_info import ServerInfo, check_logprobs_mode, check_routing_replay
from asyncgrpo.generation.server_list import starting_servers
from asyncgrpo.modeling.routing_replay import moe_routers
from asyncgrpo.records.metrics import MetricsWindow, Reduce, Stat
from asyncgrpo.records.sample import Sample
from asyncgrpo.rollout.advantages import scale_over_batch
from asyncgrpo.rollout.chat import render_prompt_ids
from asyncgrpo.rollout.environments import EnvironmentOwnedData
from asyncgrpo.rollout.worker import RolloutWorkerPool, check_worker_payload, worker_inputs
from asyncgrpo.run import timeline
from asyncgrpo.trainer.checkpoint import ResumePoint
from asyncgrpo.trainer.checks import check_prompt_lengths
from asyncgrpo.trainer.distributed import Processes
from asyncgrpo.trainer.intake import SampleIntake, ServersLostWeights, StepBatch, StepOutcome
from asyncgrpo.trainer.mismatch_watch import MismatchWatch
from asyncgrpo.trainer.nonfinite import NonFiniteTrainingError, weights_are_finite
from asyncgrpo.trainer.prompt_ledger import PromptLedger
from asyncgrpo.trainer.rollout_inputs import RolloutInputs
from asyncgrpo.trainer.server_roster import ServerRoster
from asyncgrpo.weight_sync import LoraAdapterSync, make_sender, make_weight_sync
from asyncgrpo.weight_sync.merged import sync_policy

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionInputs:
    """What a run's generation session is opened with (rank 0 reads all of it)."""

    args: AsyncGRPOConfig
    model: torch.nn.Module  # the policy, unwrapped: its dtype, routers and weights reach the servers
    rollout: RolloutInputs  # what the rollout workers' loops are built from
    train_dataset: Any  # the prompts (EnvironmentOwnedData when an environment owns the data)
    streaming: bool  # the prompts have no length

    @property
    def prompts_per_epoch(self) -> int | None:
        """The prompts of a pass; None for data without one. Environment-owned data has no pass over
        prompts (its length is not a pass: one degenerate group is not a dead dataset); the intake then
        counts a fixed number of prompts as one."""
        if self.streaming or isinstance(self.train_dataset, EnvironmentOwnedData):
            return None
        return len(self.train_dataset)


@dataclass(frozen=True)
class ServersReached:
    """The run's first servers, as they answered when the session opened."""

    urls: list[str]
    max_model_len: int
    info: ServerInfo | None  # None: a server that does not say (no /server_info)


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

    def open(self, inputs: SessionInputs, ledger: PromptLedger, stop_condition: Callable[[], bool]) -> None:
        """Reach the servers, size the rows, start the weight-sync backend and build the rollout
        worker and the intake (rank 0); the other processes learn the row size and the backend from
        it. The worker is spawned here and starts up while the trainer syncs the starting weights;
        it generates once `start_rollouts` lets it."""
        args = inputs.args
        self.advantage_scaling = (args.scale_rewards, args.multi_objective_aggregation)
        if not self.processes.is_main:
            self.token_budget, backend = self.processes.broadcast(None)
            self.weight_sync = make_weight_sync(backend, is_sender=False)
            return
        # Before anything slow: a lambda fails here.
        rollout = inputs.rollout
        check_worker_payload(
            rollout.reward_funcs, rollout.loop_cls, rollout.tools, rollout.environment_factory
        )
        servers = self._reach_servers(args)
        self._check_servers_fit(inputs, servers)
        self._start_weight_sync(inputs, servers)
        self._build_worker_pool(inputs, servers)
        self._start_roster(args, servers)
        # Spawned now: its start-up (a fresh interpreter's imports, the servers, setup()) overlaps the
        # trainer's remaining set-up and the first weight sync (bench/RESULTS.md, "timeline").
        self.worker.spawn()
        self._open_intake(inputs, servers, ledger, stop_condition)
        self.processes.broadcast((self.token_budget, self.weight_sync.name))

    def _reach_servers(self, args: AsyncGRPOConfig) -> ServersReached:
        """The client of the run's first servers, once they answer, and what they say of themselves;
        the rows' size follows from their context length."""
        self.http = BackgroundLoop(
            default_timeout_s=max(args.vllm_server_timeout, args.weight_sync_timeout) + 60
        )
        initial = first_servers(args)
        self.client = VLLMClient(initial, timeout=args.vllm_server_timeout)
        logger.info("waiting for the vLLM server at %s", ", ".join(initial))
        self.http.run(self.client.wait_until_ready())
        max_model_len = self.http.run(self.client.max_model_len())
        self.served_name = self.http.run(self.client.model_name())
        server_info = self.http.run(self.client.server_info())
        # token_budget <= 0: rows of per_device_train_batch_size samples, no token cap (TRL's fixed count)
        self.token_budget = max_model_len if args.token_budget is None else args.token_budget
        return ServersReached(initial, max_model_len, server_info)

    def _check_servers_fit(self, inputs: SessionInputs, servers: ServersReached) -> None:
        """What the servers run must fit the policy and the data, checked before the worker starts."""
        args, rollout = inputs.args, inputs.rollout
        check_logprobs_mode(servers.info, servers.urls[0])
        self.mismatch_watch = MismatchWatch(servers.info.dtype if servers.info else None, inputs.model)
        if args.moe_routing_replay:
            moe_routers(inputs.model)  # a model without top-k routers has nothing to replay
            check_routing_replay(servers.info, servers.urls[0])

        def prompt_length(prompt) -> int:
            # The trainer's tools only: an environment's tools depend on the instance a rollout gets.
            return len(
                render_prompt_ids(rollout.processing_class, prompt, rollout.tools, args.chat_template_kwargs)
            )

        check_prompt_lengths(inputs.train_dataset, prompt_length, servers.max_model_len)

    def _start_weight_sync(self, inputs: SessionInputs, servers: ServersReached) -> None:
        """The sending side of the weight-sync backend, reaching the servers."""
        args = inputs.args
        self.weight_sync = make_sender(
            args.weight_sync_backend,
            inputs.model,
            servers.info,
            self.client,
            self.http,
            args.output_dir,
            args.weight_sync_timeout,
            args.max_staleness,
            trainer_on_gpu=args.device.type == "cuda",
        )
        adapter_sync = self.weight_sync if isinstance(self.weight_sync, LoraAdapterSync) else None
        self.lora_name = adapter_sync.prefix if adapter_sync is not None else None

    def _build_worker_pool(self, inputs: SessionInputs, servers: ServersReached) -> None:
        """The rollout workers (not spawned yet), starting where the resumed run left its prompts."""
        args, rollout = inputs.args, self.resume.rollout
        held = {sample.stream_index for sample in self.resume.held_samples}
        self.worker = RolloutWorkerPool(
            inputs.rollout.loop_cls,
            worker_inputs(
                **inputs.rollout.loop_kwargs(
                    args,
                    self.served_name,
                    inputs.train_dataset,
                    self.lora_name,
                    dataset_start_index=rollout.first_untrained_index,
                    skip_stream_indices=frozenset(rollout.consumed_after) | held,
                )
            ),
            num_workers=args.num_rollout_workers,
            initial_allowance=0.0,  # SampleIntake publishes the allowance
            worker_timeout=args.rollout_worker_timeout,
            server_urls=servers.urls,
        )

    def _start_roster(self, args: AsyncGRPOConfig, servers: ServersReached) -> None:
        """The watch over the run's servers, starting with the first ones."""
        self.roster = ServerRoster(
            self.client,
            self.http,
            self.weight_sync,
            servers.info,
            self.served_name,
            servers.max_model_len,
            args,
            publish=self.worker.publish_servers,
            window=self.window,
        )
        self.roster.start(servers.urls)

    def _open_intake(
        self,
        inputs: SessionInputs,
        servers: ServersReached,
        ledger: PromptLedger,
        stop_condition: Callable[[], bool],
    ) -> None:
        """The trainer's side of the rollout queue, holding first the samples a checkpoint carried."""
        args = inputs.args
        self.intake = SampleIntake(
            self.worker,
            ledger,
            args.max_staleness,
            self.token_budget,
            num_rows=self.processes.world_size,
            rows_per_step=args.gradient_accumulation_steps * self.processes.world_size,
            samples_per_row=args.per_device_train_batch_size,
            max_sample_tokens=servers.max_model_len,
            prompts_per_epoch=inputs.prompts_per_epoch,
            stop_condition=stop_condition,
            check_servers=self.check_servers,
            stop_when_saturated=args.stop_when_saturated,
        )
        self.intake.restore(self.resume.held_samples)
        self.worker.publish_model_version(self.model_version)

    def start_rollouts(self, ready_timeout: float) -> None:
        """Rank 0, once the servers run the starting weights: wait for the rollout workers to be
        ready and let them generate."""
        if self.worker is not None:
            self.worker.start_generating(ready_timeout=ready_timeout)

    def next_batch(self, gradient_accumulation_steps: int) -> StepOutcome:
        """Rank 0: the step's samples, planned into rows for every process; ServersLostWeights for
        servers to push the policy to again first (every rank learns it, and helps push the weights);
        TrainingComplete once the last prompts were consumed while waiting."""
        lost = self.check_servers()
        if lost is not None:
            return lost
        outcome = self.intake.next_step(gradient_accumulation_steps, self.window, self.model_version)
        if isinstance(outcome, StepBatch):
            # What the step's advantages need of the whole batch (scale_rewards="batch", GDPO), before
            # the plan is broadcast: docs/algorithm.md, "Advantages".
            scale_over_batch(outcome.samples, *self.advantage_scaling)
        return outcome

    def check_servers(self) -> ServersLostWeights | None:
        """Rank 0: act on what the watch over the servers saw (trainer/server_roster.py): servers
        lost leave the run, servers back or new join it with the served weights. Returns the servers
        that need a full sync with every process to join (NCCL); raises ServerLostError when the run
        has lost more servers than it may."""
        joining = self.roster.refresh(self.model_version)
        return ServersLostWeights(joining) if joining else None

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


def first_servers(args: AsyncGRPOConfig) -> list[str]:
    """The servers the run starts with (generation/server_list.py, `starting_servers`); with no
    vllm_server_base_url, those vllm_server_urls_file lists once it lists one (within
    vllm_server_timeout)."""
    deadline = time.monotonic() + args.vllm_server_timeout
    if not args.vllm_server_urls:
        logger.info("waiting for %s to list a vLLM server", args.vllm_server_urls_file)
    while not (listed := starting_servers(args.vllm_server_urls, args.vllm_server_urls_file)):
        if time.monotonic() > deadline:
            raise VLLMUnavailableError(
                f"{args.vllm_server_urls_file} listed no vLLM server within vllm_server_timeout="
                f"{args.vllm_server_timeout:g} s, and vllm_server_base_url is empty"
            )
        time.sleep(1.0)
    return listed
