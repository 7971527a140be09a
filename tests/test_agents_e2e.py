"""Agent training end to end against a real vLLM CPU server: the environment examples of TRL's
documentation with only the import changed, on the tiny model.

The IncrementEnv learning test (a warm-started tiny model raising its own environment reward) is not
here yet: it did not show learning in the runs made so far (docs/agents.md).
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
from datasets import Dataset

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer, AsyncRolloutLoop
from asyncgrpo.generation.client import VLLMClient

pytestmark = pytest.mark.vllm

NO_THINKING = {"enable_thinking": False}


# -- the documentation's examples (module level: the rollout worker is a spawned process) -------------------


class IncrementEnv:
    # Reserved methods
    def reset(self, **kwargs) -> str | None:  # required; called at the start of each rollout
        self.counter = 0
        self.target = random.randint(1, 6)  # self-sample the task
        return f"Increment the counter by {self.target}."  # returned string becomes the prompt

    def get_reward(self) -> float:  # optional: the environment scores itself from its own state
        return float(self.counter == self.target)

    # Public methods (exposed as tools)
    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


class CodingEnv:
    def reset(self, **kwargs) -> str:
        n = random.randint(1, 20)
        return f"Compute the {n}th Fibonacci number."

    def run_code(self, code: str) -> str:  # exposed as a tool only for "coding" examples
        """Run the given Python code and return its stdout.

        Args:
            code: The Python source to execute.

        Returns:
            The captured standard output.
        """
        ...


class GameEnv:
    def reset(self, **kwargs) -> str:
        return "Reach the goal tile."

    def move(self, action: str) -> str:  # exposed as a tool only for "game" examples
        """Apply an action to the game and return the new observation.

        Args:
            action: One of "up", "down", "left", "right".

        Returns:
            The observation after the move.
        """
        ...


def reward_func(completions, **kwargs):
    """The documentation leaves it to the reader: any signal that varies inside a group."""
    return [float(len(completion[-1]["content"]) % 3) for completion in completions]


# -- helpers -------------------------------------------------------------------------------------------------


def set_server_weights(url: str, model_dir) -> None:
    async def run():
        async with VLLMClient(url, timeout=60) as client:
            await client.reload_weights(str(model_dir), version="0")
            await client.reset_prefix_cache()

    asyncio.run(run())


@pytest.fixture(autouse=True)
def shared_server_weights_restored(request, tiny_model_dir):
    yield
    if "vllm_server" in request.fixturenames:
        set_server_weights(request.getfixturevalue("vllm_server").url, tiny_model_dir)


def make_args(server, output_dir, **overrides) -> AsyncGRPOConfig:
    options = dict(
        output_dir=str(output_dir),
        vllm_server_base_url=server.url,
        chat_template_kwargs=NO_THINKING,
        num_generations=8,
        max_completion_length=32,
        token_budget=2048,
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        vllm_server_timeout=60,
        seed=0,
    )
    options.update(overrides)
    return AsyncGRPOConfig(**options)


TOOL_METRICS = [
    "tools/call_frequency",
    "tools/failure_frequency",
    "tools/parallel_calls_mean",
    "tools/loop_exhausted_frac",
    "tools/latency_s",
    "tools/increment/latency_s",
    "tools/increment/call_count",
    "tools/increment/failure_count",
    "env/reset_s",
    "env/reward_s",
    "rewards/IncrementEnv/mean",
    "rollout/fork_frac",
    "rollout/drift_tokens_mean",
    "rollout/drift_tokens_max",
    "rollout/samples_per_rollout",
    "rollout/turns_mean",
    "rollout/turns_max",
]


class ToolsProbeLoop(AsyncRolloutLoop):
    """Records, per rollout, the tools it was offered and the rendered prompt's text."""

    async def generate_one(self, prompt, tools, group_id=0):
        text = self.tokenizer.decode(self.render_prompt(prompt, tools, group_id))
        probe = Path(self.config.output_dir) / "probe.jsonl"
        with probe.open("a") as handle:
            handle.write(
                json.dumps({"tools": sorted(tool.__name__ for tool in tools), "prompt": text}) + "\n"
            )
        return await super().generate_one(prompt, tools, group_id)


class ProbingTrainer(AsyncGRPOTrainer):
    loop_cls = ToolsProbeLoop


def test_multi_environment_routing_offers_only_the_rows_environment_tools(
    vllm_server, tiny_model_dir, tmp_path
):
    dataset = Dataset.from_dict({"environment": ["coding", "game"] * 500})
    args = make_args(vllm_server, tmp_path, max_steps=2, num_generations=4, learning_rate=1e-4)
    trainer = ProbingTrainer(
        model=str(tiny_model_dir),
        args=args,
        train_dataset=dataset,
        reward_funcs=reward_func,
        environment_factory={"coding": CodingEnv, "game": GameEnv},
    )
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "probe.jsonl").read_text().splitlines()]
    assert {tuple(record["tools"]) for record in records} == {("run_code",), ("move",)}
    for record in records:
        coding = record["tools"] == ["run_code"]
        assert ('"name": "run_code"' in record["prompt"]) == coding
        assert ('"name": "move"' in record["prompt"]) == (not coding)
        assert ("Fibonacci" in record["prompt"]) == coding and ("goal tile" in record["prompt"]) == (
            not coding
        )
