"""What several agent test modules share: an example tool (`multiply`) and environment (`Counter`),
excerpts of chat templates, a writer of Hermes tool calls (`call`), a scripted stand-in for the rollout
loop (`ScriptedLoop`), and the check that multi-turn training sequences train each generated token once."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np

from asyncgrpo import AsyncGRPOConfig
from asyncgrpo.records.metrics import MetricsWindow
from asyncgrpo.rollout.activity import ActivityBoard
from asyncgrpo.rollout.chat import render_prompt_ids
from asyncgrpo.rollout.settings import rollout_settings
from asyncgrpo.rollout.types import TurnRecord

# Excerpts of what each family's template declares (the parts the format and family are read by).
QWEN3_5_LIKE = (
    "{%- set ns = namespace(last_query_index=0) %}{{ reasoning_content }}"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>"
)
MISTRAL_LIKE = "{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}"
LLAMA3_LIKE = (
    '{{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and '
    "its value}.' }}"
)


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


class Counter:
    def reset(self, **kwargs):
        self.value = 0

    def get_reward(self) -> float:
        return float(self.value)

    def increment(self, step: int) -> int:
        """
        Increment the counter.

        Args:
            step: Value to add.
        """
        self.value += step
        return self.value

    def _private(self):
        return None


class ScriptedLoop:
    """Just what run_tool_loop uses of AsyncRolloutLoop, with turns read from a script: the model's
    replies are the input under test here, not the server."""

    def __init__(self, tokenizer, replies: dict[str, list[str]], **config):
        self.config = AsyncGRPOConfig(output_dir="unused", report_to="none", **config)
        self.settings = rollout_settings(self.config)
        self.tokenizer = tokenizer
        self.replies = replies
        self.metrics = MetricsWindow()
        # The parts of the hook context (rollout/context.py) the tool loop reads.
        self.context = SimpleNamespace(
            max_model_len=4096, tool_executor=ThreadPoolExecutor(4), activity=ActivityBoard()
        )

    def render_prompt(self, prompt, tools, group_id):
        return render_prompt_ids(self.tokenizer, prompt, tools)

    async def generate_one_turn(self, prompt_ids):
        await asyncio.sleep(0.01)
        key = self.tokenizer.decode(prompt_ids).split("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]
        reply = self.replies[key].pop(0)
        ids = self.tokenizer.encode(reply, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return TurnRecord(prompt_ids=list(prompt_ids), output_ids=ids, output_log_probs=[-1.0] * len(ids))


def call(name: str, **arguments) -> str:
    import json

    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def assert_each_generated_token_trained_once(turns, sequences):
    trained = [int(s.trained.sum()) for s in sequences]
    assert sum(trained) == sum(len(turn.output_ids) for turn in turns)
    # And the trained tokens are exactly the turns' outputs, in order.
    trained_ids = np.concatenate([s.token_ids[s.trained] for s in sequences]).tolist()
    assert trained_ids == [token for turn in turns for token in turn.output_ids]
