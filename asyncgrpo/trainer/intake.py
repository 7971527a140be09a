"""The trainer's side of the rollout queue: taking samples, dropping stale ones, planning a step.

Samples come off the worker's queue into a local buffer (so its size is the queue's size when the
trainer takes from it). A sample older than `max_staleness` weight updates when taken is dropped.
A step is `gradient_accumulation_steps` micro-batches planned by the TokenBudgetBatcher (rows of
`token_budget` tokens, or with `token_budget <= 0` of `samples_per_row` samples); a sample that
closes a micro-batch is the first of the next one (it waits at the head of the buffer).

Taking a step's samples ends one of three ways, each a value the caller reads (`StepOutcome`): the
step's batch, `ServersLostWeights` (servers to give the policy first; the samples taken wait), or
`TrainingComplete` (the stop condition met while waiting, or a pass without signal after training).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from asyncgrpo.errors import TrainingError
from asyncgrpo.packing.planner import MIN_SHARED_TOKENS, MicroBatchPlan, Placement, TokenBudgetBatcher
from asyncgrpo.records.metrics import MetricsWindow, Reduce
from asyncgrpo.records.sample import Sample
from asyncgrpo.rollout.worker import RolloutWorkerPool
from asyncgrpo.run import timeline
from asyncgrpo.trainer.prompt_ledger import PromptLedger

logger = logging.getLogger(__name__)

WAIT_LOG_INTERVAL_S = 30.0
# While the trainer waits for samples, how often it looks at its servers (trainer/server_roster.py):
# a lost one may be back, a new one listed, and rollouts wait for the trainer to give them weights.
SERVER_CHECK_INTERVAL_S = 5.0


class NoTrainingSignalError(TrainingError):
    """A whole pass over the prompts produced nothing to train on."""


@dataclass(frozen=True)
class TrainingComplete:
    """The stop condition was met while waiting for samples (epochs counted in prompts), or a pass
    without signal came after training (docs/reliability.md)."""


@dataclass(frozen=True)
class ServersLostWeights:
    """vLLM servers that answer but do not run the trainer's weights (back after a loss, restarted, or
    new), which only a sync with every training process can give them (NCCL)."""

    urls: list[str]

    def __str__(self) -> str:
        return f"vLLM server(s) {', '.join(self.urls)} need the trainer's weights"


# What stops the taking of a step's samples before the batch is planned.
Interruption = ServersLostWeights | TrainingComplete


# Data without a length (a streaming dataset, environment-owned episodes) has no pass to wait out: this
# many prompts in a row with nothing to train on count as one. Without it a policy that collapsed to
# equal rewards was waited on forever (seen with an environment); dropped groups do not use the token
# allowance, so the worker keeps generating and the streak grows at generation speed.
UNBOUNDED_PASS_PROMPTS = 1000


@dataclass
class PassVerdict:
    """What the prompts of a pass without signal scored, each group on every one of its rollouts."""

    solved_rows: list[int]  # the best reward the run has seen
    unsolved_rows: list[int]  # a lower reward
    filtered_rows: list[int]  # nothing scored (filter_prompt rejected the prompt, or no reward)


class SignalHistory:
    """What the groups of the run scored, for the policy on a pass that brings nothing to train
    (docs/reliability.md, "A pass without signal"). A run that has trained and then saturates (every
    group of a pass got equal rewards, whatever they are) has learnt what it can of its data; a run
    that never trained since its start or resume has broken reward functions or data."""

    def __init__(self, span: int):
        self.best = -math.inf  # the highest reward any rollout of the run scored
        # Some group of this run brought samples. Not carried over a resume: a resumed run must train
        # once before a pass without signal counts as saturation.
        self.trained = False
        # (dataset row, top reward) of the groups since the last one with samples: the last `span`.
        self.streak: deque[tuple[int, float | None]] = deque(maxlen=span)

    def add(self, row_index: int, top_reward: float | None, num_samples: int) -> None:
        if top_reward is not None:
            self.best = max(self.best, top_reward)
        if num_samples:
            self.trained = True
            self.streak.clear()
        else:
            self.streak.append((row_index, top_reward))

    def verdict(self) -> PassVerdict:
        """The distinct prompts of the last pass, by what their latest group scored."""
        latest = dict(self.streak)  # a prompt seen twice in the pass counts once, as it scored last
        verdict = PassVerdict([], [], [])
        for row, top in sorted(latest.items()):
            rows = (
                verdict.filtered_rows
                if top is None
                else verdict.solved_rows
                if top >= self.best
                else verdict.unsolved_rows
            )
            rows.append(row)
        return verdict

    @property
    def lowest_top(self) -> float:
        """The lowest group reward of the streak (-inf where a prompt scored nothing)."""
        return min((-math.inf if top is None else top for _, top in self.streak), default=math.inf)


@dataclass
class StepBatch:
    plans: list[MicroBatchPlan]
    wait_s: float = 0.0  # time the step waited on an empty queue
    samples: list[Sample] = field(default_factory=list)
    model_version: int = 0  # the trainer's policy version when the samples were taken


# How taking a step's samples ended: its batch, or what interrupted it.
StepOutcome = StepBatch | ServersLostWeights | TrainingComplete


ROWS_NAMED = 20  # dataset rows a saturation warning lists of each kind


def saturation_message(verdict: PassVerdict, best: float, streak: int, what: str) -> str:
    """The warning of a run that trained and then saturated: how many prompts the policy always and
    never solves, and which rows to add or remove."""

    def rows(indices: list[int]) -> str:
        shown = ", ".join(str(row) for row in indices[:ROWS_NAMED])
        return shown + (f" and {len(indices) - ROWS_NAMED} more" if len(indices) > ROWS_NAMED else "")

    message = (
        f"the last {streak} prompts ({what}) brought nothing to train: every group's rollouts got equal "
        f"rewards. Of the distinct prompts of the last pass, the policy always solves "
        f"{len(verdict.solved_rows)} (every rollout at reward {best:.4g}, the best this run has seen) and "
        f"never solves {len(verdict.unsolved_rows)} (every rollout at a lower reward)"
    )
    if verdict.filtered_rows:
        message += f"; {len(verdict.filtered_rows)} scored nothing (filtered out, or no reward)"
    message += ": it has learnt what it can of this data."
    if verdict.solved_rows:
        solved = rows(verdict.solved_rows)
        message += f" Remove the solved prompts (dataset rows {solved}) or add harder ones."
    if verdict.unsolved_rows:
        message += (
            f" The never-solved prompts (rows {rows(verdict.unsolved_rows)}) are beyond the policy as it "
            "samples now: check their answers, or add easier prompts of their kind."
        )
    return message


class SampleIntake:
    """Takes samples for the trainer and publishes the worker's token allowance (staleness budget).

    All token counts are sample tokens (unpacked): what the worker produces and the trainer takes.
    The worker may hold `factor` x (the last step's tokens) queued or in flight beyond what the
    trainer consumed. Samples the trainer already holds for the step it is planning are not queued
    any more: while it waits for more, they are added to the allowance, or a step that needs more
    tokens than the budget allows would wait forever.
    """

    def __init__(
        self,
        worker: RolloutWorkerPool,
        ledger: PromptLedger,
        max_staleness: int,
        token_budget: int,
        num_rows: int,
        rows_per_step: int,
        samples_per_row: int = 0,
        max_sample_tokens: int = 0,
        prompts_per_epoch: int | None = None,
        stop_condition=lambda: False,
        check_servers: Callable[[], ServersLostWeights | None] = lambda: None,
        stop_when_saturated: bool = True,
    ):
        self.worker = worker
        self.check_servers = check_servers
        self.prompts_per_epoch = prompts_per_epoch
        self.stop_condition = stop_condition
        self.ledger = ledger
        self.max_staleness = max_staleness
        self.token_budget = token_budget
        self.num_rows = num_rows
        self.samples_per_row = samples_per_row  # used when token_budget <= 0 (fixed-count rows)
        self.buffer: deque[Sample] = deque()
        self.consumed_tokens_total = 0
        self.allowance_factor = max(max_staleness, 1)
        # Before the first step, assume every row of a step is full (fixed-count rows: of samples of
        # `max_sample_tokens`, the server's max_model_len).
        row_tokens = token_budget if token_budget > 0 else samples_per_row * max_sample_tokens
        self.last_step_tokens = row_tokens * rows_per_step
        self._warned_oversize = False
        self.stop_when_saturated = stop_when_saturated
        self.pass_span = prompts_per_epoch or UNBOUNDED_PASS_PROMPTS
        self.signal = SignalHistory(self.pass_span)
        self._saturated_passes = 0  # passes without signal trained through (stop_when_saturated=False)
        self._publish_allowance(held_tokens=0)

    def restore(self, samples: list[Sample]) -> None:
        """Samples a checkpoint carried (held, not yet trained): they are trained first."""
        by_prompt: dict[int, int] = {}
        for sample in samples:
            by_prompt[sample.stream_index] = by_prompt.get(sample.stream_index, 0) + 1
        for stream_index, count in by_prompt.items():
            self.ledger.add_group(stream_index, count)
        self.buffer.extend(samples)

    def held_samples(self) -> list[Sample]:
        """Every sample taken from the worker and not trained yet: each belongs to a prompt the ledger
        has not consumed, so a checkpoint that keeps them can resume exactly."""
        return list(self.buffer)

    def _publish_allowance(self, held_tokens: int) -> None:
        self.worker.publish_allowance(
            self.consumed_tokens_total + held_tokens + self.allowance_factor * self.last_step_tokens
        )

    def _drain(self, wait_s: float) -> None:
        """Move what the worker queued into the buffer; wait up to `wait_s` for the first result."""
        result = self.worker.next_result(timeout=wait_s)
        while result is not None:
            for sample in result.samples:
                sample.validate()  # a malformed sample fails here, naming the broken invariant
            self.ledger.add_group(result.stream_index, len(result.samples))
            self.signal.add(result.row_index, result.top_reward, len(result.samples))
            self.buffer.extend(result.samples)
            result = self.worker.next_result(timeout=0.0)

    def _wait_for_samples(self, batch: StepBatch) -> Interruption | None:
        """Until the buffer holds a sample (results without samples only move the ledger), or what
        interrupted the wait."""
        self._drain(0.0)
        if self.buffer:
            return None
        self._publish_allowance(held_tokens=sum(sample.num_tokens for sample in batch.samples))
        with timeline.span("wait for samples"):
            return self._wait_until_buffered(batch)

    def _wait_until_buffered(self, batch: StepBatch) -> Interruption | None:
        started = last_note = last_server_check = time.monotonic()
        while not self.buffer:
            self._drain(1.0)
            complete = self._check_progress_possible()
            if complete is not None:
                batch.wait_s += time.monotonic() - started
                return complete
            if time.monotonic() - last_server_check > SERVER_CHECK_INTERVAL_S:
                batch.wait_s += time.monotonic() - started
                lost = self.check_servers()
                if lost is not None:
                    return lost
                started = last_server_check = time.monotonic()
            if time.monotonic() - last_note > WAIT_LOG_INTERVAL_S:
                logger.warning(
                    "waiting for rollouts for %.0f s; the last %d prompts brought no sample to train on "
                    "(groups with equal rewards are dropped)",
                    time.monotonic() - started,
                    self.ledger.prompts_without_samples_streak,
                )
                last_note = time.monotonic()
        batch.wait_s += time.monotonic() - started
        return None

    def _check_progress_possible(self) -> TrainingComplete | None:
        """Never wait forever: stop when training is over; at a pass without signal, end (or train on
        through it) when the run has trained, fail when it never has (docs/reliability.md)."""
        if self.stop_condition():
            return TrainingComplete()
        streak = self.ledger.prompts_without_samples_streak
        if streak < self.pass_span * (self._saturated_passes + 1):
            return None
        what = (
            "a whole pass over the dataset"
            if self.prompts_per_epoch
            else "data without a length, so that many in a row count as a pass"
        )
        if not self.signal.trained:
            raise NoTrainingSignalError(
                f"the last {streak} prompts ({what}) produced "
                "nothing to train on: every group's rollouts got equal rewards (or "
                "every prompt was filtered out, or with mask_truncated_completions every rollout was cut "
                "at max_completion_length: see completions/clipped_ratio), so no advantage is non-zero. "
                "Check the reward functions (logged as rewards/<name>/mean) against a few "
                "completions, or make the task easier for the model." + self._reward_note()
            )
        message = saturation_message(self.signal.verdict(), self.signal.best, streak, what)
        if self.stop_when_saturated:
            logger.warning("%s Training ends here, as at max_steps.", message)
            return TrainingComplete()
        self._saturated_passes += 1
        logger.warning("%s Training goes on (stop_when_saturated=False).", message)
        return None

    def _reward_note(self) -> str:
        if self.signal.best == -math.inf:
            return ""
        lowest = "nothing scored" if self.signal.lowest_top == -math.inf else f"{self.signal.lowest_top:.4g}"
        return (
            f" Lowest group reward in that pass: {lowest}; the best any rollout of this run scored: "
            f"{self.signal.best:.4g}."
        )

    def _next_sample(
        self, batch: StepBatch, metrics: MetricsWindow, model_version: int
    ) -> Sample | Interruption:
        """The next sample that is fresh enough, waiting for the worker when the buffer is empty."""
        while True:
            if not self.buffer:
                interruption = self._wait_for_samples(batch)
                if interruption is not None:
                    return interruption
            sample = self.buffer.popleft()
            staleness = model_version - sample.model_version
            if staleness > self.max_staleness:
                self._consumed(sample, trained=False)
                metrics.record("sample/dropped_stale_count", 1, Reduce.SUM)
                continue
            return sample

    def _consumed(self, sample: Sample, trained: bool) -> None:
        self.ledger.sample_done(sample.stream_index, trained)
        self.consumed_tokens_total += sample.num_tokens

    def next_step(
        self, gradient_accumulation_steps: int, metrics: MetricsWindow, model_version: int
    ) -> StepOutcome:
        """Plan one optimizer step's micro-batches from the queue, or say what interrupted it."""
        batch = StepBatch(plans=[], model_version=model_version)
        self._drain(0.0)  # what the worker queued joins the buffer, so the size counts samples only
        metrics.record("rollout/queue_size", len(self.buffer))
        interruption = self._plan(batch, gradient_accumulation_steps, metrics, model_version)
        if isinstance(interruption, ServersLostWeights):
            # Nothing of this batch was trained: its samples wait at the head of the buffer.
            self.buffer.extendleft(reversed(batch.samples))
        if interruption is not None:
            return interruption
        for sample in batch.samples:
            self._consumed(sample, trained=True)
        self.last_step_tokens = sum(sample.num_tokens for sample in batch.samples)
        self._publish_allowance(held_tokens=0)
        return batch

    def _plan(
        self, batch: StepBatch, gradient_accumulation_steps: int, metrics: MetricsWindow, model_version: int
    ) -> Interruption | None:
        batcher = TokenBudgetBatcher(
            self.token_budget, self.num_rows, MIN_SHARED_TOKENS, samples_per_row=self.samples_per_row
        )
        while len(batch.plans) < gradient_accumulation_steps:
            sample = self._next_sample(batch, metrics, model_version)
            if not isinstance(sample, Sample):
                return sample
            placement = batcher.offer(sample)
            if placement is Placement.PLACED:
                batch.samples.append(sample)
                self._record_taken(sample, metrics, model_version)
            elif placement is Placement.DROPPED_OVERSIZE:
                self._consumed(sample, trained=False)
                metrics.record("batch/dropped_oversize_count", 1, Reduce.SUM)
                if not self._warned_oversize:
                    self._warned_oversize = True
                    logger.warning(
                        "dropped a sample of %d tokens: longer than token_budget=%d (raise token_budget or "
                        "lower max_completion_length)",
                        sample.num_tokens,
                        self.token_budget,
                    )
            else:  # CLOSED: this sample opens the next micro-batch
                self.buffer.appendleft(sample)
                batch.plans.append(batcher.close())
        return None

    def _record_taken(self, sample: Sample, metrics: MetricsWindow, model_version: int) -> None:
        staleness = model_version - sample.model_version
        metrics.record("sample/staleness_mean", staleness)
        metrics.record("sample/staleness_max", staleness, Reduce.MAX)
        metrics.record("sample/time_in_queue_s", max(0.0, time.time() - sample.queued_at))
        metrics.record("sample/forwarded_tokens_mean", sample.num_tokens)
        metrics.record("sample/forwarded_tokens_max", sample.num_tokens, Reduce.MAX)
        metrics.record("sample/trained_tokens_mean", sample.num_trained)
        metrics.record("reward_trained", sample.reward)
