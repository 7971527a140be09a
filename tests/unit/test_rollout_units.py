"""Pure pieces of the rollout side: advantages, reward sums, the cap rules, the allowance, prompt
streams, turn reconciliation, the reward-function examples of TRL's AsyncGRPO documentation, and
what a subclass of the rollout loop inherits."""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from reward_examples import (
    MULTI_TASK_DATASET,
    coding_reward_func,
    format_reward_func,
    length_reward_func,
    math_reward_func,
)
from support_paths import SUPPORT

from asyncgrpo.generation.server_load import ServerLoad
from asyncgrpo.records.metrics import MetricsWindow, Reduce
from asyncgrpo.rollout.concurrency import TokenAllowance, initial_cap, next_cap
from asyncgrpo.rollout.prompts import prompt_stream
from asyncgrpo.rollout.scoring import (
    call_reward_functions,
    group_advantages,
    is_degenerate_group,
    reward_function_name,
    sum_rewards,
)
from asyncgrpo.rollout.sequences import build_training_sequences
from asyncgrpo.rollout.types import TurnRecord

# -- advantages -----------------------------------------------------------------------------------


def test_group_advantages_hand_values():
    # rewards 1, 0, 0, 1: mean 0.5, population std 0.5 -> +-1 (up to the 1e-4 guard)
    advantages = group_advantages(np.array([1.0, 0.0, 0.0, 1.0]))
    np.testing.assert_allclose(advantages, np.array([1, -1, -1, 1]) * 0.5 / (0.5 + 1e-4))


def test_unscored_rollouts_leave_mean_and_std_and_get_zero():
    # Scored: 3, 1 -> mean 2, std 1; the NaN rollout gets 0 and does not move mean or std.
    advantages = group_advantages(np.array([3.0, np.nan, 1.0]))
    np.testing.assert_allclose(advantages, [1 / (1 + 1e-4), 0.0, -1 / (1 + 1e-4)])


def test_degenerate_groups():
    assert is_degenerate_group(np.array([1.0, 1.0, 1.0]))
    assert is_degenerate_group(np.array([np.nan, 2.0, np.nan]))  # fewer than two scored
    assert is_degenerate_group(np.array([np.nan, np.nan]))
    assert is_degenerate_group(np.array([0.5, np.nan, 0.5]))  # scored ones all equal
    assert not is_degenerate_group(np.array([0.5, np.nan, 0.25]))


def test_sum_rewards_skips_none_and_marks_unscored_nan():
    total = sum_rewards([[1.0, None, None], [0.5, 2.0, None], [None, None, None]], 3)
    assert total[0] == 1.5 and total[1] == 2.0 and math.isnan(total[2])


# -- TRL's documented reward-function examples (tests/support/reward_examples.py), through the scoring path --


ASYNC_REWARDS_RUNNING = {"now": 0, "most": 0}


async def slow_async_reward(prompts, completions, **kwargs):
    """Example 5's shape, counting how many calls are awaiting at once."""
    ASYNC_REWARDS_RUNNING["now"] += 1
    ASYNC_REWARDS_RUNNING["most"] = max(ASYNC_REWARDS_RUNNING["most"], ASYNC_REWARDS_RUNNING["now"])
    await asyncio.sleep(0.2)
    ASYNC_REWARDS_RUNNING["now"] -= 1
    return [1.0 if completion else 0.0 for completion in completions]


def score(functions, prompts, completions, completion_ids, **columns):
    async def run():
        with ThreadPoolExecutor(4) as pool:
            return await call_reward_functions(functions, pool, prompts, completions, completion_ids, columns)

    return asyncio.run(run())


def test_documented_examples_length_and_format():
    prompts = [[{"role": "user", "content": "The sky is"}], [{"role": "user", "content": "The sun is"}]]
    completions = [
        [{"role": "assistant", "content": "<think>3 * 4 = 12.</think><answer>(1 + 2) * 4 = 12</answer>"}],
        [{"role": "assistant", "content": "So (3 + 1) * 2 = 8."}],
    ]
    rewards = score(
        [length_reward_func, format_reward_func], prompts, completions, [[6303, 13], [304, 279, 12884, 13]]
    )
    assert rewards == [[2.0, 4.0], [1.0, 0.0]]


def test_documented_multi_task_example_returns_none_for_other_tasks():
    rows = MULTI_TASK_DATASET[:2]
    completions = [
        [{"role": "assistant", "content": "2+2 = 4"}],
        [{"role": "assistant", "content": "```python\ndef add(a, b):\n    return a + b\n```"}],
    ]
    per_function = score(
        [math_reward_func, coding_reward_func],
        [row["prompt"] for row in rows],
        completions,
        [[1], [2]],
        task=[row["task"] for row in rows],
    )
    assert per_function == [[1.0, None], [None, 1.0]]
    assert sum_rewards(per_function, 2).tolist() == [1.0, 1.0]


def test_async_reward_functions_overlap():
    prompts = [[{"role": "user", "content": "x"}]] * 2
    completions = [[{"role": "assistant", "content": "a"}], [{"role": "assistant", "content": ""}]]
    ASYNC_REWARDS_RUNNING.update(now=0, most=0)
    rewards = score([slow_async_reward] * 5, prompts, completions, [[1], []])
    # Counted, not timed: all five were awaiting at once (run one after another, at most one would be).
    assert ASYNC_REWARDS_RUNNING["most"] == 5, "five async rewards must run together"
    assert rewards == [[1.0, 1.0]] * 5


def test_reward_function_must_return_one_float_per_completion():
    def bad(**kwargs):
        return [1.0]

    with pytest.raises(TypeError, match="reward function 'bad' must return a list of 2 floats"):
        score([bad], [[]] * 2, [[{"content": ""}]] * 2, [[], []])


def test_reward_function_names():
    import functools

    class Judge:
        def __call__(self, **kwargs):
            return []

    assert reward_function_name(length_reward_func) == "length_reward_func"
    assert reward_function_name(functools.partial(length_reward_func)) == "length_reward_func"
    assert reward_function_name(Judge()) == "Judge"


# -- metrics: the reduction is declared at record time ----------------------------------------------


def test_user_named_metric_is_averaged_whatever_its_name():
    window = MetricsWindow()
    window.record("rewards/max_score/mean", 1.0)
    window.record("rewards/max_score/mean", 3.0)
    window.record("sample/dropped_stale_count", 2, Reduce.SUM)
    window.record("sample/dropped_stale_count", 5, Reduce.SUM)
    window.record("completions/max_length", 7, Reduce.MAX)
    window.record("completions/max_length", 3, Reduce.MAX)
    window.record_rate("rollout/generated_tokens_per_s", 100, 2.0)
    window.record_rate("rollout/generated_tokens_per_s", 300, 2.0)
    assert window.summarize() == {
        "completions/max_length": 7,
        "rewards/max_score/mean": 2.0,
        "rollout/generated_tokens_per_s": 100.0,
        "sample/dropped_stale_count": 7,
    }


# -- the adaptive cap (docs/architecture.md, "Three limits on generation") ------------------------------


def load(usage: float, waiting: int = 0) -> ServerLoad:
    return ServerLoad(kv_cache_usage=usage, running=10, waiting=waiting, preemptions=0, kv_cache_tokens=0)


def test_initial_cap_is_kv_capacity_over_max_model_len():
    assert initial_cap(1_048_576, 1024, 512) == 512  # bounded by max_concurrent_rollouts
    assert initial_cap(40_960, 1024, 512) == 40
    assert initial_cap(640, 1024, 512) == 1  # never 0
    assert initial_cap(0, 1024, 64) == 64  # no /metrics: the user's bound


def test_cap_rules_hand_values():
    assert next_cap(40, load(0.85), 0, 512) == (28, False)  # > 80%: -30%
    assert next_cap(40, load(0.50), 40, 512) == (50, True)  # < 60%, none waiting, a cap's worth done: +25%
    assert next_cap(40, load(0.50), 39, 512) == (40, False)  # not yet a cap's worth of finished rollouts
    assert next_cap(40, load(0.50, waiting=3), 100, 512) == (40, False)  # requests waiting: hold
    assert next_cap(40, load(0.70), 100, 512) == (40, False)  # between 60% and 80%: hold
    assert next_cap(500, load(0.10), 1000, 512) == (512, True)  # bounded by max_concurrent_rollouts
    assert next_cap(1, load(0.95), 0, 512) == (1, False)  # never below 1
    assert next_cap(2, load(0.10), 5, 512) == (3, True)  # small caps still grow


def test_allowance_starts_one_group_at_a_time_then_uses_the_estimate():
    allowance = TokenAllowance(num_generations=4)
    assert allowance.may_start_group(1000)
    allowance.group_started()
    assert not allowance.may_start_group(1e9), "until a group finishes, one at a time"
    allowance.group_finished([100, 100, 100, 100], queued_tokens=400)
    # produced 400, estimate 400 per group: may start while 400 + 400 * in_flight < limit
    assert allowance.may_start_group(401)
    allowance.group_started()
    assert not allowance.may_start_group(800)
    assert allowance.may_start_group(801)
    allowance.group_finished([50, 50, 50, 50], queued_tokens=0)  # a dropped group queues nothing
    assert allowance.produced_tokens == 400 and allowance.tokens_per_group_estimate == 300


def test_rollouts_without_tokens_leave_the_estimate_alone():
    """Agents that fail before their first turn make no tokens: counted as rollouts of 0 tokens they
    would drive the estimate to 0, and groups (a process each rollout, for a harness) would start
    without limit."""
    allowance = TokenAllowance(num_generations=4)
    allowance.group_started()
    allowance.group_finished([0, 0, 0, 0], queued_tokens=0)
    assert allowance.tokens_per_group_estimate is None
    allowance.group_started()
    assert not allowance.may_start_group(1e9), "still one group at a time"
    allowance.group_finished([100, 0, 0, 100], queued_tokens=200)
    assert allowance.tokens_per_group_estimate == 400  # from the two rollouts that made tokens


# -- prompt streams ---------------------------------------------------------------------------------------


def rows(n):
    return [{"prompt": [{"role": "user", "content": str(i)}], "i": i} for i in range(n)]


def take(stream, n):
    return [next(stream) for _ in range(n)]


def test_epochs_are_shuffled_reproducibly_and_cover_every_prompt():
    first = take(prompt_stream(rows(10), seed=3), 30)
    again = take(prompt_stream(rows(10), seed=3), 30)
    assert [item.row_index for item in first] == [item.row_index for item in again]
    for epoch in range(3):
        epoch_items = first[epoch * 10 : (epoch + 1) * 10]
        assert sorted(item.row_index for item in epoch_items) == list(range(10))
        assert {item.epoch for item in epoch_items} == {epoch}
    assert [item.row_index for item in first[:10]] != [item.row_index for item in first[10:20]]
    assert [item.stream_index for item in first] == list(range(30))


def test_resume_starts_at_the_index_and_skips_trained_ones():
    full = take(prompt_stream(rows(10), seed=3), 20)
    resumed = take(prompt_stream(rows(10), seed=3, start_index=7, skip_stream_indices=frozenset({8, 12})), 5)
    assert [item.stream_index for item in resumed] == [7, 9, 10, 11, 13]
    assert [item.row_index for item in resumed] == [full[i].row_index for i in (7, 9, 10, 11, 13)]


def test_iterable_dataset_streams_and_restarts():
    from datasets import Dataset

    iterable = Dataset.from_list(rows(4)).to_iterable_dataset()
    items = take(prompt_stream(iterable, seed=0), 8)
    assert [item.stream_index for item in items] == list(range(8))
    assert sorted(item.row["i"] for item in items[:4]) == [0, 1, 2, 3]
    # A stream cannot seek: a resumed run starts it again from its first prompt (the trainer warns).
    assert take(prompt_stream(iterable, seed=0, start_index=5), 1)[0].stream_index == 0


# -- turns to training sequences -------------------------------------------------------------------------


def turn(prompt, output, version=0):
    return TurnRecord(
        prompt_ids=prompt, output_ids=output, output_log_probs=[-0.5] * len(output), model_version=version
    )


def test_single_turn_sequence():
    sequences, stats = build_training_sequences([turn([1, 2, 3], [4, 5])])
    (sequence,) = sequences
    assert sequence.token_ids.tolist() == [1, 2, 3, 4, 5]
    assert sequence.trained.tolist() == [False, False, False, True, True]
    assert sequence.sampler_logprobs.tolist() == [-0.5, -0.5] and stats.transitions == 0


def test_prefix_preserving_turns_extend_one_sequence():
    turns = [turn([1, 2], [3, 4], version=2), turn([1, 2, 3, 4, 9, 9], [5], version=1)]
    (sequence,), stats = build_training_sequences(turns)
    assert sequence.token_ids.tolist() == [1, 2, 3, 4, 9, 9, 5]
    assert sequence.trained.tolist() == [False, False, True, True, False, False, True]
    assert sequence.model_version == 1  # the oldest policy that produced any of it
    assert stats.forks == 0 and stats.drift_tokens == [0]


def test_a_re_rendered_history_forks_and_trains_each_token_once():
    # Turn 2's prompt rewrites token 3 (e.g. the template dropped earlier reasoning).
    turns = [turn([1, 2], [3, 4]), turn([1, 2, 7, 4, 9], [5, 6])]
    sequences, stats = build_training_sequences(turns)
    assert [s.token_ids.tolist() for s in sequences] == [[1, 2, 3, 4], [1, 2, 7, 4, 9, 5, 6]]
    assert [s.trained.tolist() for s in sequences] == [
        [False, False, True, True],
        [False, False, False, False, False, True, True],
    ]
    assert stats.forks == 1 and stats.transitions == 1 and stats.drift_tokens == [2]


def test_top_logprobs_follow_trained_tokens_and_masked_outputs_stay_context():
    first = turn([1], [2, 3])
    first.output_mask = [0, 1]
    first.output_top_ids = np.array([[2, 8], [3, 9]])
    first.output_top_logprobs = np.array([[-0.1, -2.0], [-0.2, -3.0]], dtype=np.float32)
    (sequence,), _ = build_training_sequences([first])
    assert sequence.trained.tolist() == [False, False, True]
    assert sequence.top_ids.tolist() == [[3, 9]]
    np.testing.assert_allclose(sequence.top_logprobs, [[-0.2, -3.0]])


def test_completions_table_prints_prompt_completion_and_reward(capsys):
    from asyncgrpo.cli.tiny_model import build_tokenizer
    from asyncgrpo.records.sample import Sample
    from asyncgrpo.trainer.completions_table import completion_rows, print_completions

    tokenizer = build_tokenizer()
    prompt = tokenizer.encode("What is 2 + 2?")
    answer = tokenizer.encode("4")
    tokens = np.array(prompt + answer)
    trained = np.arange(len(tokens)) >= len(prompt)
    sample = Sample(tokens, trained, np.zeros(len(answer), np.float32), 0.75, 0, reward=1.0)
    rows = completion_rows([sample], tokenizer, step=3)
    assert rows == [
        {"step": 3, "prompt": "What is 2 + 2?", "completion": "4", "reward": 1.0, "advantage": 0.75}
    ]
    print_completions(rows, step=3)
    out = capsys.readouterr().out
    assert "completions at step 3" in out and "What is 2 + 2?" in out and "1.000" in out and "+0.750" in out


# -- the loop's surface -----------------------------------------------------------------------------


def test_a_loop_subclass_inherits_only_the_documented_attributes():
    # docs/agents.md lists what a subclass may read; the scheduler's state (queues, cap, allowance,
    # tasks) must not land on the loop a user subclasses, nor private names a hook would reach into:
    # what exists only in the running process comes in the public hook context.
    from asyncgrpo import AsyncGRPOConfig, AsyncRolloutLoop
    from asyncgrpo.rollout.context import LoopInputs, hook_context

    config = AsyncGRPOConfig(output_dir="unused", report_to="none")
    inputs = LoopInputs.of(config, model_name="m", processing_class=None, eos_token_ids=[0])
    context = hook_context(inputs, client="client", sampler=None, max_model_len=64, tool_executor=None)
    loop = AsyncRolloutLoop(inputs, context)
    readable = {
        "settings",
        "config",
        "model_name",
        "dataset",
        "reward_funcs",
        "tokenizer",
        "eos_token_ids",
        "tools",
        "environment_factory",
        "lora_name",
        "metrics",
        "context",
    }
    assert set(vars(loop)) == readable
    assert (loop.client, loop.max_model_len) == ("client", 64), "read from the hook context"


def test_groups_without_reward_signal_are_counted_under_trl_grpos_name_too():
    """TRL's GRPOTrainer logs the share of groups whose rewards all agree as `frac_reward_zero_std`: a
    user coming from it finds the same figure under that name (beside `frac_zero_std_groups`)."""
    from asyncgrpo.rollout.rollout_metrics import record_group_metrics
    from asyncgrpo.rollout.types import RolloutGroup

    window = MetricsWindow()
    groups = (([1.0, 1.0], True), ([0.0, 1.0], False), ([0.5, 0.0], False), ([0.0, 0.0], True))
    for rewards, dropped in groups:
        group = RolloutGroup(
            prompts=[], reward_kwargs={}, completions=[], completions_ids=[], completions_sequences=[],
            tool_call_counts=[], tool_failure_counts=[], model_version=0, group_id=0, row_index=0,
            env_rewards=[], rollout_rewards=[], rewards=np.array(rewards),
        )  # fmt: skip
        record_group_metrics(window, group, [rewards], ["r"], dropped, num_samples=0 if dropped else 2)
    logged = window.summarize()
    assert logged["frac_reward_zero_std"] == logged["frac_zero_std_groups"] == 0.5


def test_the_rollout_process_gets_the_configs_values_without_transformers_training_arguments(tmp_path):
    import dataclasses
    import pickle
    import subprocess
    import sys
    from dataclasses import dataclass

    from asyncgrpo import AsyncGRPOConfig
    from asyncgrpo.rollout.settings import rollout_settings

    @dataclass
    class CurriculumConfig(AsyncGRPOConfig):
        pass_rate_cap: float = 0.9

    config = CurriculumConfig(
        output_dir=str(tmp_path),
        vllm_server_base_url="http://127.0.0.1:1,http://127.0.0.1:2",
        pass_rate_cap=0.25,
    )
    typed = rollout_settings(config)
    assert typed.scheduling.num_generations == config.num_generations and typed.sampling.seed == config.seed
    assert typed.servers.urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"], "a property"
    with pytest.raises(dataclasses.FrozenInstanceError):
        typed.sampling.temperature = 0.5
    settings = typed.config  # what hooks read as `self.config`
    assert settings.pass_rate_cap == 0.25, "a subclass's field"
    assert settings.num_generations == config.num_generations and settings.seed == config.seed
    assert settings.vllm_server_urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"], "a property"
    assert (
        settings.lr_scheduler_type == config.lr_scheduler_type.value
        and type(settings.lr_scheduler_type) is str
    )
    assert settings.save_strategy == config.save_strategy.value and type(settings.save_strategy) is str
    assert settings.accelerator_config.split_batches is False, "a nested dataclass: a plain object"
    # A fresh interpreter unpickles it without importing transformers (nor torch).
    unpickle = "import pickle, sys; pickle.loads(sys.stdin.buffer.read()); print(sorted(sys.modules))"
    loaded = subprocess.run(
        [sys.executable, "-c", unpickle], input=pickle.dumps(typed), capture_output=True, check=True
    ).stdout.decode()
    assert "'transformers'" not in loaded and "'torch'" not in loaded


def test_what_the_suite_hands_the_rollout_worker_imports_neither_torch_nor_the_trainer():
    """tests/support/worker_side.py holds the integration tests' rewards and loops so that a spawned rollout
    worker imports nothing it would not import anyway: a heavy import there costs every run's start."""
    import subprocess
    import sys

    heavy = ["torch", "transformers.training_args", "asyncgrpo.config", "asyncgrpo.trainer", "accelerate"]
    probe = f"import sys; import worker_side; print([name for name in {heavy!r} if name in sys.modules])"
    loaded = subprocess.run(
        [sys.executable, "-c", probe], cwd=SUPPORT, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert loaded == "[]", f"tests/support/worker_side.py imports {loaded}"
