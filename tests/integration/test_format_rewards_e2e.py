"""TRL's documented format and reference rewards (examples 2 and 3) against a real vLLM server, run
from the example config examples/reference_answers.yaml by the rollout worker: a model that writes
`<think>...</think><answer>...</answer>` scores 1.0 on the format with default settings, and the
`\\boxed{}` value it writes is scored against the dataset's `ground_truth` column, which reaches the
reward function as a keyword argument.

The tiny model starts from random weights, so a short supervised warm start (the demo's,
asyncgrpo/cli/demo.py; a fixed seed, seconds on the CPU) first teaches it one answer per prompt of the
config's dataset: the documentation's completions, in the format. The last is wrong on purpose, as
in the documentation (`\\boxed{6}` against the ground truth 5).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "datasets", reason="datasets is not installed (a GPU host may lack the non-torch dependencies)"
)
pytest.importorskip(
    "msgspec", reason="msgspec is not installed (a GPU host may lack the non-torch dependencies)"
)

from reward_examples import boxed_reward_func, format_reward_func  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from worker_side import RecordingLoop, question  # noqa: E402 (what the rollout worker imports: tests/support/worker_side.py says why)

from asyncgrpo.cli.demo import answer_probability, supervised_steps  # noqa: E402
from asyncgrpo.cli.run_config import build_run_config, load_training_dataset, read_config  # noqa: E402
from asyncgrpo.cli.tiny_model import build_model, build_tokenizer  # noqa: E402
from asyncgrpo.generation.client import VLLMClient, policy_label  # noqa: E402
from asyncgrpo.records.metrics import MetricsWindow  # noqa: E402
from asyncgrpo.rollout.chat import render_prompt_ids  # noqa: E402
from asyncgrpo.rollout.worker import RolloutWorker, worker_inputs  # noqa: E402

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "reference_answers.yaml"
# What the warm-started model answers to each question of the example's dataset.
ANSWERS = {
    "What is the result of (1 + 2) * 4?": "<think>The sum of 1 and 2 is 3, which we multiply by 4 to get 12."
    "</think><answer>(1 + 2) * 4 = \\boxed{12}</answer>",
    "What is the result of (3 + 1) * 2?": "<think>The sum of 3 and 1 is 4, which we multiply by 2 to get 8."
    "</think><answer>(3 + 1) * 2 = \\boxed{8}</answer>",
    "Solve the equation $2x + 3 = 7$.": "<think>Subtract 3 from both sides and divide by 2.</think>"
    "<answer>The solution is \\boxed{2}.</answer>",
    "Solve the equation $3x - 5 = 10$.": "<think>Add 5 to both sides and divide by 3.</think>"
    "<answer>The solution is \\boxed{6}.</answer>",
}
WRONG_ON_PURPOSE = "Solve the equation $3x - 5 = 10$."  # its ground truth is 5
# The warm start stops once the model samples its answer (all of it, at temperature 1) this often; it
# took 100 steps at seed 0.
TAUGHT_PROBABILITY, WARM_START_MAX_STEPS, STEPS_PER_CHECK = 0.95, 400, 25
MIN_GROUPS, RESULTS_TIMEOUT_S = 8, 300


@pytest.fixture(scope="module")
def format_model_dir(tmp_path_factory) -> Path:
    """The tiny model warm-started on ANSWERS for the example dataset's prompts, rendered as the
    rollout worker renders them."""
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = build_model(tokenizer)
    dataset = [json.loads(line) for line in (REPO / "examples/data/equations.jsonl").read_text().splitlines()]
    examples = [
        (
            render_prompt_ids(tokenizer, row["prompt"]),
            tokenizer.encode(ANSWERS[question(row["prompt"])], add_special_tokens=False)
            + [tokenizer.eos_token_id],
        )
        for row in dataset
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the vLLM server's CPU engine holds the other core
    try:
        steps, taught = 0, answer_probability(model, examples)
        while taught < TAUGHT_PROBABILITY and steps < WARM_START_MAX_STEPS:
            supervised_steps(model, lambda: examples, STEPS_PER_CHECK)
            steps, taught = steps + STEPS_PER_CHECK, answer_probability(model, examples)
    finally:
        torch.set_num_threads(threads)
    assert taught >= TAUGHT_PROBABILITY, (
        f"after {steps} warm-start steps the model samples its answer {taught:.2f}"
    )
    out = tmp_path_factory.mktemp("format-model")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def serve_weights(url: str, model_dir: Path) -> None:
    """Load `model_dir`'s weights into the server, labelled as policy version 0 (what a trainer
    does before its worker starts)."""

    async def run():
        async with VLLMClient(url, timeout=60) as client:
            await client.reload_weights(str(model_dir), version=policy_label(0))
            await client.reset_prefix_cache()

    asyncio.run(run())


def results_covering_every_row(worker, rows: int) -> list:
    """Group results until every row of the dataset has been scored and MIN_GROUPS have come."""
    results, deadline = [], time.monotonic() + RESULTS_TIMEOUT_S
    while len(results) < MIN_GROUPS or len({result.row_index for result in results}) < rows:
        assert time.monotonic() < deadline, f"{len(results)} groups in {RESULTS_TIMEOUT_S} s"
        result = worker.next_result(timeout=deadline - time.monotonic())
        if result is not None:
            results.append(result)
    return results


def reward_metrics(worker, rollouts: int) -> dict[str, float]:
    """The worker's metric windows merged, once the reward metrics of `rollouts` rollouts are in
    (each scored group sends its window before its result, through another queue)."""
    window, deadline = MetricsWindow(), time.monotonic() + 60
    while True:
        for stats in worker.drain_metrics():
            window.merge(stats)
        stat = window.stats().get("rewards/format_reward_func/mean")
        if stat is not None and stat.weight >= rollouts:
            return window.summarize()
        assert time.monotonic() < deadline, "the scored groups' metrics did not arrive"
        time.sleep(0.2)


def test_format_and_reference_rewards_score_what_the_model_wrote(
    vllm_server, tiny_model_dir, format_model_dir, tmp_path, monkeypatch
):
    monkeypatch.chdir(REPO)  # the config names its data file relative to the repository
    run = build_run_config(
        read_config(
            EXAMPLE,
            ["--model", str(format_model_dir), "--output_dir", str(tmp_path),
             "--vllm_server_base_url", vllm_server.url, "--num_generations", "4",
             "--max_completion_length", "64", "--vllm_server_timeout", "60", "--report_to", "none"],
        )
    )  # fmt: skip
    assert run.args.parse_reasoning is False  # the default: what this test is about
    dataset = load_training_dataset(run.dataset)
    tokenizer = AutoTokenizer.from_pretrained(format_model_dir)
    worker = RolloutWorker(
        RecordingLoop,
        worker_inputs(
            config=run.args,  # its settings built as the trainer builds them
            model_name=str(tiny_model_dir),  # the name the shared server serves its model under
            dataset=dataset,
            reward_funcs=run.reward_funcs,
            processing_class=tokenizer,
            eos_token_ids=[tokenizer.eos_token_id],
        ),
        initial_allowance=1e9,
        worker_timeout=60,
    )
    serve_weights(vllm_server.url, format_model_dir)
    try:
        worker.start(ready_timeout=120)
        results = results_covering_every_row(worker, len(dataset))
        metrics = reward_metrics(worker, len(results) * run.args.num_generations)
    finally:
        worker.stop()
        serve_weights(vllm_server.url, tiny_model_dir)

    # The logged per-function rewards: the model writes the format, so the format reward is ~1.
    assert metrics["rewards/format_reward_func/mean"] > 0.8, metrics
    ground_truths = {question(row["prompt"]): row["ground_truth"] for row in dataset}
    groups = [json.loads(line) for line in (tmp_path / "groups.jsonl").read_text().splitlines()]
    assert {group["question"] for group in groups} == set(ANSWERS)
    taught = 0
    for group in groups:
        # The row's ground_truth column, one value per rollout: what boxed_reward_func was called with.
        assert group["ground_truth"] == [ground_truths[group["question"]]] * len(group["rewards"])
        for ids, reward, ground_truth in zip(
            group["completion_ids"], group["rewards"], group["ground_truth"]
        ):
            text = tokenizer.decode(ids, skip_special_tokens=True)
            # Each rollout is scored as the documentation's functions score the text as generated.
            generated = [[{"role": "assistant", "content": text}]]
            expected = format_reward_func(generated)[0] + boxed_reward_func(generated, [ground_truth])[0]
            assert reward == expected, (text, ground_truth, reward)
            if text == ANSWERS[group["question"]]:
                taught += 1
                # 1.0 for the format, plus 1.0 for a right \boxed{} value, 0.0 for the wrong one.
                assert reward == (1.0 if group["question"] == WRONG_ON_PURPOSE else 2.0), (text, reward)
    rollouts = sum(len(group["rewards"]) for group in groups)
    print(
        f"format reward {metrics['rewards/format_reward_func/mean']:.3f}, boxed reward "
        f"{metrics['rewards/boxed_reward_func/mean']:.3f}, {taught} of {rollouts} rollouts as taught"
    )
    assert taught > 0.8 * rollouts, f"only {taught} of {rollouts} rollouts wrote the answer taught"
