"""Two rollout workers killed mid-stream and resumed from the trainer's prompt ledger, against a
server that answers at once (tests/support/instant_vllm.py): every prompt is trained once, none is lost, and
each new worker takes up exactly the prompts of its share that were not trained yet, in order."""

from __future__ import annotations

import os
import signal
import tempfile
import time

import pytest

pytest.importorskip(
    "datasets", reason="datasets is not installed (a GPU host may lack the non-torch dependencies)"
)
pytest.importorskip(
    "msgspec", reason="msgspec is not installed (a GPU host may lack the non-torch dependencies)"
)

from datasets import Dataset  # noqa: E402
from instant_vllm import start_instant_server  # noqa: E402
from worker_side import noisy_reward  # noqa: E402 (what the rollout worker imports: tests/support/worker_side.py says why)

from asyncgrpo.cli.tiny_model import build_tokenizer  # noqa: E402
from asyncgrpo.config import AsyncGRPOConfig  # noqa: E402
from asyncgrpo.rollout.loop import AsyncRolloutLoop  # noqa: E402
from asyncgrpo.rollout.worker import RolloutWorkerPool, worker_inputs  # noqa: E402
from asyncgrpo.trainer.prompt_ledger import PromptLedger  # noqa: E402

WORKERS = 2
PROMPTS = 512
COMPLETION_TOKENS = 8
TOP_N = 2
TAKEN_BEFORE_THE_KILL = 30
# Spawning a worker imports torch and transformers: slow on a loaded machine, never the thing tested.
READY_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def instant_servers():
    vocab = len(build_tokenizer())
    started = [start_instant_server(vocab, COMPLETION_TOKENS, TOP_N) for _ in range(WORKERS)]
    yield [url for url, _ in started]
    for _, process in started:
        process.kill()
        process.join(10)


def make_pool(urls, resume: tuple[int, list[int]]) -> RolloutWorkerPool:
    tokenizer = build_tokenizer()
    config = AsyncGRPOConfig(
        output_dir=tempfile.mkdtemp(),
        vllm_server_base_url=urls,
        num_generations=4,
        max_completion_length=COMPLETION_TOKENS,
        num_sampler_logprobs=TOP_N,
        num_rollout_workers=WORKERS,
        report_to="none",
    )
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Q{i}?"}] for i in range(PROMPTS)]})
    inputs = worker_inputs(
        config=config,  # its settings built as the trainer builds them
        model_name="fake",
        dataset=dataset,
        reward_funcs=[noisy_reward],
        processing_class=tokenizer,
        eos_token_ids=[tokenizer.eos_token_id],
        dataset_start_index=resume[0],
        skip_stream_indices=frozenset(resume[1]),
    )
    return RolloutWorkerPool(AsyncRolloutLoop, inputs, WORKERS, initial_allowance=1e15, worker_timeout=60)


def train_on(pool: RolloutWorkerPool, ledger: PromptLedger, done) -> list[tuple[int, int]]:
    """Take groups as the trainer does, marking each sample trained, until `done(taken)`; the
    (stream index, group id) of each."""
    taken: list[tuple[int, int]] = []
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not done(taken):
        assert time.monotonic() < deadline, f"stuck after {len(taken)} groups"
        result = pool.next_result(timeout=1.0)
        if result is None:
            continue
        assert result.samples, "every group has distinct rewards, so samples to train"
        ledger.add_group(result.stream_index, len(result.samples))
        for _ in result.samples:
            ledger.sample_done(result.stream_index, trained=True)
        taken.append((result.stream_index, result.group_id))
    return taken


@pytest.mark.slow
def test_two_workers_killed_and_resumed_train_every_prompt_once(instant_servers):
    ledger = PromptLedger()
    pool = make_pool(instant_servers, resume=(0, []))
    pool.start(ready_timeout=READY_TIMEOUT_S)
    try:
        before = train_on(pool, ledger, lambda taken: len(taken) >= TAKEN_BEFORE_THE_KILL)
        # The instant server lets the workers run far ahead: groups generated but never trained die
        # with them, and must come again after the resume.
        for process in pool.processes:
            os.kill(process.pid, signal.SIGKILL)
        for process in pool.processes:
            process.join(30)
    finally:
        pool.stop()
    assert not any(process.is_alive() for process in pool.processes)
    trained_before = [index for index, _ in before]
    assert len(set(trained_before)) == len(trained_before), "a prompt was generated twice"
    watermark, consumed_after = ledger.state()
    assert watermark == min(set(range(PROMPTS)) - set(trained_before))

    resumed_ledger = PromptLedger(watermark, consumed_after)
    pool = make_pool(instant_servers, resume=(watermark, consumed_after))
    pool.start(ready_timeout=READY_TIMEOUT_S)
    try:
        # Until every prompt up to the last one trained before the kill is trained (the gaps the kill
        # left are filled), as many groups again, and groups from both workers.
        after = train_on(
            pool,
            resumed_ledger,
            lambda taken: (
                resumed_ledger.watermark > max(trained_before)
                and len(taken) >= TAKEN_BEFORE_THE_KILL
                and {index % WORKERS for index, _ in taken} == set(range(WORKERS))
            ),
        )
    finally:
        pool.stop()
    trained_after = [index for index, _ in after]
    assert not set(trained_before) & set(trained_after), "a trained prompt was generated again"
    assert len(set(trained_after)) == len(trained_after), "a prompt was generated twice"
    gaps = set(range(max(trained_before))) - set(trained_before)
    assert gaps <= set(trained_after), "the prompts lost in the kill all came again"
    # Each worker keeps its share of the prompts and numbers its groups the same way.
    for index, group_id in before + after:
        assert group_id % WORKERS == index % WORKERS
