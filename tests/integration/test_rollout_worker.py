"""The rollout worker process against a real vLLM server (tiny model on CPU)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from support_paths import SUPPORT

pytest.importorskip(
    "datasets", reason="datasets is not installed (a GPU host may lack the non-torch dependencies)"
)
pytest.importorskip(
    "msgspec", reason="msgspec is not installed (a GPU host may lack the non-torch dependencies)"
)

from transformers import AutoTokenizer  # noqa: E402
from worker_side import (  # noqa: E402 (what the rollout worker imports: tests/support/worker_side.py says why)
    FastPollLoop,
    counting_prompts,
    even_token_reward,
    exploding_reward,
    nobody_scores,
)

from asyncgrpo.config import AsyncGRPOConfig  # noqa: E402
from asyncgrpo.generation.client import VLLMClient, policy_label  # noqa: E402
from asyncgrpo.records.metrics import MetricsWindow  # noqa: E402
from asyncgrpo.rollout.loop import AsyncRolloutLoop  # noqa: E402
from asyncgrpo.rollout.scoring import group_advantages  # noqa: E402
from asyncgrpo.rollout.worker import (  # noqa: E402
    RolloutWorker,
    RolloutWorkerError,
    RolloutWorkerPool,
    worker_inputs,
)

pytestmark = pytest.mark.vllm


def label_server(url: str, version: int = 0) -> None:
    """What a trainer does before its worker starts: label the weights the server runs as one of its
    policy versions (rollouts sampled by unlabelled weights are regenerated, see docs/reliability.md)."""

    async def run():
        async with VLLMClient(url, timeout=60) as client:
            await client._on_all("POST", "/update_weight_version", {"new_version": policy_label(version)})

    asyncio.run(run())


def make_worker(
    server_url,
    model_dir,
    reward_funcs,
    allowance=1e9,
    loop_cls=AsyncRolloutLoop,
    num_workers=None,
    resume=(0, frozenset()),
    **config_overrides,
):
    """A RolloutWorker; with `num_workers`, a RolloutWorkerPool of that many, starting the prompt
    stream at `resume` (the first untrained index, the indices resolved after it)."""
    label_server(server_url)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    options = dict(
        output_dir="/tmp/unused",
        vllm_server_base_url=server_url,
        num_generations=4,
        max_completion_length=24,
        vllm_server_timeout=60,
        report_to="none",
    )
    options.update(config_overrides)
    config = AsyncGRPOConfig(**options)
    inputs = worker_inputs(
        config=config,  # its settings built as the trainer builds them
        model_name=str(model_dir),
        dataset=counting_prompts(),
        reward_funcs=reward_funcs,
        processing_class=tokenizer,
        eos_token_ids=[tokenizer.eos_token_id],
        dataset_start_index=resume[0],
        skip_stream_indices=resume[1],
    )
    if num_workers is not None:
        return RolloutWorkerPool(
            loop_cls, inputs, num_workers, initial_allowance=allowance, worker_timeout=60
        )
    return RolloutWorker(loop_cls, inputs, initial_allowance=allowance, worker_timeout=60)


def collect(worker, count: int, timeout: float = 120):
    results, deadline = [], time.monotonic() + timeout
    while len(results) < count and time.monotonic() < deadline:
        result = worker.next_result(timeout=deadline - time.monotonic())
        if result is not None:
            results.append(result)
    return results


def collect_until_stalled(worker, allowance: float, timeout: float = 120):
    """Results until the worker can start no group: every token it holds against the budget (queued
    plus the estimate of the groups in flight, which it publishes for the other workers) has arrived
    here, so nothing is in flight, and that reaches `allowance`, so no group may start before the
    trainer raises it. Waiting for this state, not for a fixed time, proves the stall on any load."""
    commitments = worker.channels.committed_tokens
    results, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        committed, received = sum(commitments[:]), sum(result.num_tokens for result in results)
        if committed >= allowance and committed == received:
            return results
        result = worker.next_result(timeout=0.2)
        if result is not None:
            results.append(result)
    pytest.fail(f"generation did not stall at the allowance within {timeout} s: {committed} tokens committed")


def merged_metrics(worker) -> dict[str, float]:
    window = MetricsWindow()
    for stats in worker.drain_metrics():
        window.merge(stats)
    return window.summarize()


def test_worker_produces_scored_groups_with_correct_advantages(vllm_server, tiny_model_dir):
    worker = make_worker(vllm_server.url, tiny_model_dir, [even_token_reward])
    worker.start(ready_timeout=120)
    try:
        results = collect(worker, 6)
        time.sleep(1.5)  # one metrics flush
        metrics = merged_metrics(worker)
    finally:
        worker.stop()
    assert len(results) == 6
    assert sorted(r.stream_index for r in results) == sorted(set(r.stream_index for r in results))
    kept = [r for r in results if r.samples]
    assert kept, "with a per-token reward some groups must carry signal"
    for result in kept:
        assert len(result.samples) == 4 and {s.group_id for s in result.samples} == {result.group_id}
        rewards = []
        for sample in result.samples:
            completion = sample.token_ids[sample.trained.argmax() :]
            rewards.append(even_token_reward([completion.tolist()])[0])
            assert sample.reward == pytest.approx(rewards[-1])
            assert sample.num_trained == len(completion) and sample.top_ids.shape == (len(completion), 8)
            assert np.all(sample.sampler_logprobs <= 0)
        np.testing.assert_allclose([s.advantage for s in result.samples], group_advantages(np.array(rewards)))
    for name in (
        "reward",
        "rewards/even_token_reward/mean",
        "frac_zero_std_groups",
        "completions/mean_length",
        "rollout/duration_s",
        "rollout/generated_tokens_per_s",
        "rollout/concurrency_cap",
    ):
        assert name in metrics, name
    assert worker.process.exitcode is not None, "stopped worker must have exited"


def test_groups_nobody_scores_are_dropped_and_counted(vllm_server, tiny_model_dir):
    worker = make_worker(vllm_server.url, tiny_model_dir, [nobody_scores])
    worker.start(ready_timeout=120)
    try:
        results = collect(worker, 3)
        time.sleep(1.5)
        metrics = merged_metrics(worker)
    finally:
        worker.stop()
    assert len(results) == 3 and all(not r.samples for r in results)
    assert metrics["frac_zero_std_groups"] == 1.0
    assert "reward_zero_std_groups" not in metrics and "reward" not in metrics


def test_a_raising_reward_stops_the_trainer_side_with_the_original_traceback(vllm_server, tiny_model_dir):
    # TRL's behaviour, kept by reward_error_tolerance=0: the first exception ends the run (the
    # tolerated failures: tests/integration/test_faults.py).
    worker = make_worker(vllm_server.url, tiny_model_dir, [exploding_reward], reward_error_tolerance=0)
    worker.start(ready_timeout=120)
    started = time.monotonic()
    with pytest.raises(RolloutWorkerError) as error:
        collect(worker, 1, timeout=60)
    assert time.monotonic() - started < 30
    message = str(error.value)
    assert "ZeroDivisionError" in message and "divided by zero on purpose" in message
    assert "exploding_reward" in message, "the worker's traceback must reach the trainer"
    assert not worker.process.is_alive()


def test_a_lambda_reward_fails_before_spawning_naming_it(vllm_server, tiny_model_dir):
    worker = make_worker(
        vllm_server.url, tiny_model_dir, [lambda completions, **kw: [0.0] * len(completions)]
    )
    with pytest.raises(TypeError, match="reward function #0 .*lambda.* cannot be sent to the rollout worker"):
        worker.start(ready_timeout=10)
    assert worker.process is None


def test_backpressure_holds_queued_and_in_flight_tokens_within_the_allowance(vllm_server, tiny_model_dir):
    allowance = 1500.0
    worker = make_worker(vllm_server.url, tiny_model_dir, [even_token_reward], allowance=allowance)
    worker.start(ready_timeout=120)
    try:
        results = collect_until_stalled(worker, allowance)  # nobody trains: generation must stall
        queued = sum(r.num_tokens for r in results)
        largest_group = max(r.num_tokens for r in results)
        stalled = collect(worker, 1, timeout=4)
        metrics = merged_metrics(worker)
        worker.publish_allowance(allowance + 2000)  # the trainer consumed: generation resumes
        resumed = collect(worker, 2, timeout=60)
    finally:
        worker.stop()
    # A group starts only while produced + in-flight estimate < allowance, so the overshoot is at
    # most the group that started last (plus the estimate's error on it).
    assert queued <= allowance + 2 * largest_group
    assert not stalled
    assert metrics.get("rollout/backpressure_s", 0) > 0
    assert resumed


def test_two_workers_split_the_prompts_share_the_budget_and_resume_exactly(vllm_server, tiny_model_dir):
    allowance = 1500.0
    pool = make_worker(
        vllm_server.url, tiny_model_dir, [even_token_reward], allowance=allowance, num_workers=2
    )
    pool.start(ready_timeout=120)
    try:
        # A fixed wait here, not collect_until_stalled: the commitments were once all received and
        # at the allowance before the second worker had published any (a CI run saw one worker's
        # groups only).
        first = collect(pool, 100, timeout=25)  # nobody trains: generation must stall
        metrics = merged_metrics(pool)
    finally:
        pool.stop()
    assert not any(process.is_alive() for process in pool.processes)
    # Worker k takes the prompts k, k + 2, ... and numbers its groups the same way.
    indices = [result.stream_index for result in first]
    assert len(set(indices)) == len(indices), "a prompt was generated twice"
    assert {result.group_id % 2 for result in first} == {0, 1}, "both workers generated"
    assert all(result.group_id % 2 == result.stream_index % 2 for result in first)
    # One budget for both: the overshoot is at most the last group each worker started.
    largest_group = max(result.num_tokens for result in first)
    assert sum(result.num_tokens for result in first) <= allowance + 3 * largest_group
    assert metrics.get("rollout/backpressure_s", 0) > 0
    # Resume as the trainer would after a crash: from the first index not generated, skipping those
    # generated after it. Each new worker generates the prompts of its share not yet seen, in order.
    generated = set(indices)
    watermark = min(set(range(max(indices) + 2)) - generated)
    resume = (watermark, frozenset(index for index in generated if index > watermark))
    pool = make_worker(vllm_server.url, tiny_model_dir, [even_token_reward], num_workers=2, resume=resume)
    pool.start(ready_timeout=120)
    try:
        second = collect(pool, 8, timeout=60)
    finally:
        pool.stop()
    resumed = [result.stream_index for result in second]
    assert len(second) == 8 and not generated & set(resumed), (sorted(generated), resumed)
    # Groups end out of order (one still in flight when a later one is collected), but each worker
    # numbers its groups as it starts them: its j-th group (id share + 2j) must hold its share's j-th
    # prompt not seen before.
    for share in (0, 1):
        unseen = [i for i in range(watermark, watermark + 64) if i % 2 == share and i not in generated]
        started = {result.group_id: result.stream_index for result in second if result.group_id % 2 == share}
        assert all(index == unseen[(group_id - share) // 2] for group_id, index in started.items()), (
            share,
            started,
            unseen,
        )


@pytest.fixture(scope="module")
def tiny_kv_server(vllm_servers):
    # 6 blocks of 128 tokens = 768 tokens of KV cache: a few long requests fill it.
    args = ("--num-gpu-blocks-override", "6", "--max-model-len", "512")
    yield vllm_servers.get(*args)
    vllm_servers.release(*args)


def test_concurrency_cap_falls_under_kv_pressure_and_recovers(tiny_kv_server, tiny_model_dir):
    worker = make_worker(
        tiny_kv_server.url,
        tiny_model_dir,
        [even_token_reward],
        loop_cls=FastPollLoop,
        max_completion_length=300,
        max_concurrent_rollouts=64,
    )
    worker.start(ready_timeout=120)
    caps = []
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            worker.next_result(timeout=0.5)
            for stats in worker.drain_metrics():
                if "rollout/concurrency_cap" in stats:
                    caps.append(stats["rollout/concurrency_cap"].result())
            if _fell_and_recovered(caps):
                break
    finally:
        worker.stop()
    assert caps[0] == 1, "initial cap = KV tokens (768) // max_model_len (512)"
    assert _fell_and_recovered(caps), f"cap history: {caps}"


def _fell_and_recovered(caps: list[float]) -> bool:
    """The cap rose, then fell (KV > 80%), then rose again."""
    peak = None
    for index in range(1, len(caps)):
        if caps[index] < caps[index - 1]:
            peak = index
        if peak is not None and caps[index] > caps[index - 1] and index > peak:
            return True
    return False


def test_worker_exits_when_the_trainer_process_is_killed(vllm_server, tiny_model_dir, tmp_path):
    """No orphan: a trainer killed with SIGKILL leaves no rollout process behind."""
    script = tmp_path / "trainer.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys, time
            sys.path[:0] = [{os.path.dirname(__file__)!r}, {str(SUPPORT)!r}]
            from test_rollout_worker import make_worker, even_token_reward
            if __name__ == "__main__":
                worker = make_worker({vllm_server.url!r}, {str(tiny_model_dir)!r}, [even_token_reward])
                worker.start(ready_timeout=120)
                print(worker.process.pid, flush=True)
                time.sleep(600)
            """
        )
    )
    trainer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    worker_pid = int(trainer.stdout.readline())
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and _alive(worker_pid):
        time.sleep(0.2)
    assert not _alive(worker_pid), "the rollout process outlived its trainer"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) counts as gone.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"
