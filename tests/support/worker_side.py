"""What the integration tests hand the rollout worker: reward functions, rollout loops, datasets.

The worker is a spawned process, and it imports the module that defines each object it is sent. A test
module imports the trainer (transformers' Trainer, accelerate and more) and the config (transformers'
TrainingArguments): seconds of CPU added to every worker's start, on the way to the run's first step,
and the suite starts a worker for nearly every run. Defined here, they cost the worker no more than it
imports anyway (the rollout loop, datasets, numpy). So this module imports nothing else of asyncgrpo or
transformers (tests/unit/test_rollout_units.py checks it), and the test modules import these from here.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import multiprocessing
import os
import random
import threading
import time
import uuid
from pathlib import Path

import numpy as np
from datasets import Dataset

from asyncgrpo.harness import HarnessRolloutResult, Tool, ToolResult, ToolTraceEntry, VerifyResult
from asyncgrpo.rollout.loop import AsyncRolloutLoop


def token_parity_reward(completion_ids, **kwargs):
    return [sum(1 for token in ids if token % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


def prompts(n: int = 40) -> Dataset:
    return Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"Say something about {i}."}] for i in range(n)]}
    )


# -- TRL's documented CurriculumRolloutLoop (tests/integration/test_trainer_e2e.py) --------------------------


class CurriculumRolloutLoop(AsyncRolloutLoop):
    def filter_prompt(self, row_index, row, epoch):
        return self.pass_rates.get(row_index, 0.0) < self.config.pass_rate_cap

    async def setup(self):
        self.pass_rates = {}

    def compute_advantages(self, group):
        scored = group.rewards[~np.isnan(group.rewards)]
        if len(scored):
            self.pass_rates[group.row_index] = float(np.mean(scored > 0))
        return super().compute_advantages(group)


def only_flagged_rows_vary(completions, varies, **kwargs):
    """0, 1, 2... in the groups of the rows whose `varies` column is true (they bring samples), 0.0 in
    every other group (equal rewards: dropped, no sample)."""
    return [float(index) if flag else 0.0 for index, flag in enumerate(varies)]


_ROWS_SCORED: set[int] = set()  # per process: the rows whose group the rollout worker has scored


def saturating_reward(completions, row, varies_first, **kwargs):
    """A policy that has learnt what it can: the first group of a row whose `varies_first` is set gets
    0, 1, 0, 1... (samples to train on); every other group gets the same reward on every rollout, 1.0
    for an even row (always solved), 0.0 for an odd one (never solved)."""
    if varies_first[0] and row[0] not in _ROWS_SCORED:
        _ROWS_SCORED.add(row[0])
        return [float(index % 2) for index in range(len(completions))]
    return [1.0 if row[0] % 2 == 0 else 0.0] * len(completions)


def no_session_reward(outcome) -> float:
    """A harness run's rollout_reward_fn that leaves the reward to reward_funcs."""
    return 0.0


def saturating_prompts(n: int = 8, varying: int = 4) -> Dataset:
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"Say something about {i}."}] for i in range(n)],
            "row": list(range(n)),
            "varies_first": [i < varying for i in range(n)],
        }
    )


def positive_if_even_start(completion_ids, **kwargs):
    return [1.0 if ids and ids[0] % 2 == 0 else 0.0 for ids in completion_ids]


# -- the evaluation tests' rewards (tests/integration/test_evaluation.py) ------------------------------------


def first_token_reward(completion_ids, split, **kwargs):
    """The first generated token's id: with greedy decoding, a function of the weights alone. Raises in
    the rollout worker (a child process) if an eval prompt ever reaches it."""
    if multiprocessing.parent_process() is not None and "eval" in split:
        raise AssertionError("an eval prompt reached the rollout worker")
    return [float(ids[0]) if ids else 0.0 for ids in completion_ids]


def parity_or_listed_passes(completion_ids, passes=None, **kwargs):
    """Training rows: token_parity_reward, a signal to train on. Eval rows (their `passes` column): 1.0
    for the prompt's first `passes` rollouts, 0.0 for the rest (tests/support/multi_process_train.py)."""
    if passes is None:
        return token_parity_reward(completion_ids)
    return [1.0 if index < passes[0] else 0.0 for index in range(len(completion_ids))]


def listed_passes(completions, passes, **kwargs):
    """1.0 for the first `passes` rollouts of a prompt, 0.0 for the rest: a known count per prompt."""
    return [1.0 if index < passes[0] else 0.0 for index in range(len(completions))]


# -- the fault tests' rewards, rollout loop and dataset (tests/integration/test_faults.py) -------------------


def hanging_reward(completions, **kwargs):
    Path(os.environ["ASYNCGRPO_TEST_HANG_MARK"]).write_text(str(time.time()))  # when the call began
    time.sleep(3600)


def inf_reward(completions, **kwargs):
    return [math.inf] + [0.0] * (len(completions) - 1)


_JUDGE_CALLS = itertools.count()  # per process: the rollout worker's own count


def flaky_judge(completions, completion_ids, **kwargs):
    """A remote judge that answers 503 on two calls in 25 (8%), the rest scored."""
    if next(_JUDGE_CALLS) % 25 in (1, 3):
        raise ConnectionError("the judge answered 503 Service Unavailable")
    return token_parity_reward(completion_ids)


def broken_judge(completions, **kwargs):
    raise ValueError("the judge's API key was revoked")


class StuckThreadThenFail:
    """A rollout loop's inputs whose settings, read as the rollout process starts its scheduler, start
    a non-daemon thread that never ends, then fail."""

    @property
    def settings(self):
        threading.Thread(target=time.sleep, args=(3600,)).start()
        raise RuntimeError("boom after starting a thread that never ends")


class MixedRows:
    """A map-style dataset whose rows do not share one schema (Arrow cannot hold a bad row)."""

    def __init__(self, rows):
        self.rows = rows
        self.column_names = ["prompt"]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return {"prompt": [row["prompt"] for row in self.rows[index]]}
        return self.rows[index]

    def __iter__(self):
        return iter(self.rows)


# -- the rollout worker's tests (tests/integration/test_rollout_worker.py, tests/unit/test_worker_pool_resume.


def even_token_reward(completion_ids, **kwargs):
    """A deterministic reward the test can recompute: the fraction of even token ids."""
    return [sum(1 for token in ids if token % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


def constant_reward(completions, **kwargs):
    """The same reward for every completion: no group advantage, so a teacher's term is the only signal."""
    return [1.0] * len(completions)


def nobody_scores(completions, **kwargs):
    return [None] * len(completions)


def exploding_reward(completions, **kwargs):
    raise ZeroDivisionError("the judge divided by zero on purpose")


def counting_prompts(n: int = 16) -> Dataset:
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"Count to {i}."}] for i in range(n)],
            "target": list(range(n)),
        }
    )


class FastPollLoop(AsyncRolloutLoop):
    """Polls /metrics every second instead of every 5 s, so the test sees several adjustments."""

    load_poll_interval_s = 1.0


def noisy_reward(completion_ids, **kwargs):
    """Distinct rewards within a group, so every group has samples to train."""
    return [random.random() for _ in completion_ids]


# -- the format rewards' recording loop (tests/integration/test_format_rewards_e2e.py) -----------------------


def question(prompt: list[dict]) -> str:
    return prompt[-1]["content"]


class RecordingLoop(AsyncRolloutLoop):
    """Writes each scored group (question, ground truths, sampled token ids, summed rewards) to
    output_dir/groups.jsonl, before its result is sent."""

    def compute_advantages(self, group):
        record = {
            "question": question(group.prompts[0]),
            "ground_truth": group.reward_kwargs["ground_truth"],
            "completion_ids": group.completions_ids,
            "rewards": group.rewards.tolist(),
        }
        with (Path(self.config.output_dir) / "groups.jsonl").open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        return super().compute_advantages(group)


# -- rewards of longer runs (tests/integration/test_timeline_e2e.py, tests/integration/test_elastic_servers.py


SLOW_REWARD_S = 1.5  # a group's scoring: longer than a training step (tests/integration/test_timeline_e2e.py)


def slow_reward(completion_ids, **kwargs):
    time.sleep(SLOW_REWARD_S)
    return token_parity_reward(completion_ids)


def noise_reward(completions, **kwargs):
    """Rewards that never saturate: the run must outlast the servers' restarts, and a policy that
    solves the task ends training (docs/reliability.md)."""
    return [random.random() for _ in completions]


# -- the harness tests' verify functions, sessions and adapters (tests/integration/test_harness_e2e.py) ------

EXAMPLE_FUNCTIONS = Path(__file__).resolve().parents[2] / "examples" / "harness" / "functions.py"


def written_length(workdir: Path, transcript) -> float:
    """The reward: the length of what the agent wrote into files, modulo 5: it varies between the
    rollouts of a random tiny model, so groups bring samples."""
    files = [path for path in workdir.iterdir() if path.name != "task.json"]
    return float(sum(len(path.read_text(errors="replace")) for path in files) % 5)


def example_verify():
    spec = importlib.util.spec_from_file_location("harness_example_functions", EXAMPLE_FUNCTIONS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.answer_file_is_right


def judged_like_the_example(record_dir: str, workdir: Path, transcript, row):
    """The example's verify, its verdict recorded per rollout; "escape" rollouts get a random reward: a
    group whose rewards differ brings the step."""
    reward = example_verify()(workdir, transcript, row)
    Path(record_dir, f"{uuid.uuid4().hex}.json").write_text(
        json.dumps({"mode": row["mode"], "reward": reward})
    )
    return random.random() if row["mode"] == "escape" else reward


class NoteSession:
    def __init__(self, task):
        self.task = task
        self.notes: list[str] = []

    def initial_messages(self):
        return list(self.task)

    def list_tools(self):
        schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
        return [Tool(name="write_note", description="Keep a note.", input_schema=schema)]

    def call_tool(self, name, arguments):
        self.notes.append(str(arguments.get("text", "")))
        return ToolResult(data="ok")

    def verify(self, transcript, final_state=None):
        text = "".join(self.notes) + "".join(
            str(m.get("content") or "") for m in transcript if m["role"] == "assistant"
        )
        return VerifyResult(env_reward=min(len(text), 60) / 10, done=True)

    def close(self):
        self.notes = []


class NoteSessionFactory:
    def create(self, task, seed=None, episode_id=None):
        return NoteSession(task)


class NoteAdapter:
    """A user's white-box harness: model turn, its tool calls, until a turn calls none."""

    def run_white_box(self, model_step, session, limits=None):
        messages, trace = session.initial_messages(), []
        tools = session.list_tools()
        for _ in range(limits.max_turns):
            step = model_step(messages, tools, limits.sampling)
            messages.append(step.response.to_message_dict())
            if not step.response.tool_calls:
                break
            for call in step.response.tool_calls:
                result = session.call_tool(call.name, call.args)
                trace.append(ToolTraceEntry(call.name, call.args, result))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result.data)})
        return HarnessRolloutResult(messages=messages, tool_trace=trace)

    def run_black_box(self, session, limits=None):
        raise NotImplementedError("this harness is trained white-box only")


class ModeNoteSession(NoteSession):
    """A NoteSession of a dataset row, with a random reward: in mode "hang-verify" its verify never
    returns, in "hang-tool" its tool never returns."""

    def __init__(self, row):
        super().__init__(row["prompt"])
        self.mode = row["mode"]

    def call_tool(self, name, arguments):
        if self.mode == "hang-tool":
            threading.Event().wait()
        return super().call_tool(name, arguments)

    def verify(self, transcript, final_state=None):
        if self.mode == "hang-verify":
            threading.Event().wait()
        return VerifyResult(env_reward=random.random(), done=True)  # rewards that differ: the group trains


class ModeNoteSessionFactory:
    takes_dataset_row = True

    def create(self, task, seed=None, episode_id=None):
        return ModeNoteSession(task)


class NoteFirstAdapter:
    """A harness that samples one turn and keeps it as a note through the session's tool, whatever the
    model wrote (as a harness's own bookkeeping step would); in mode "hang-adapter" it never returns."""

    def run_white_box(self, model_step, session, limits=None):
        if session.mode == "hang-adapter":
            threading.Event().wait()
        messages = session.initial_messages()
        step = model_step(messages, session.list_tools(), limits.sampling)
        messages.append(step.response.to_message_dict())
        arguments = {"text": step.response.content or ""}
        result = session.call_tool("write_note", arguments)
        return HarnessRolloutResult(
            messages=messages, tool_trace=[ToolTraceEntry("write_note", arguments, result)]
        )

    def run_black_box(self, session, limits=None):
        raise NotImplementedError("this harness is trained white-box only")


def noise_verdict(workdir: Path, transcript) -> float:
    """A reward that differs between any two rollouts, so no group is dropped for equal rewards: this
    run is about which version sampled each turn, not about learning."""
    return random.random()


VERIFIED_HERE: list[str] = []  # sessions verified in this process: the trainer's, so evaluation's only


def counted_written_length(workdir: Path, transcript) -> float:
    VERIFIED_HERE.append(workdir.name)
    return written_length(workdir, transcript)


# -- the harness learning test's reward (tests/integration/test_harness_learning.py) -------------------------

RIGHT_LETTER = "C"


def pick_the_right_letter(workdir: Path, transcript) -> float:
    """The reward: 1 when the agent's answer.txt holds the right letter (surrounding spaces ignored)."""
    answer = workdir / "answer.txt"
    return float(answer.is_file() and answer.read_text().strip() == RIGHT_LETTER)


# Model-written code at its worst: it forks as far as it may, and every process floods the disk.
HOSTILE_CODE = (
    "```python\nimport os\nfor _ in range(64):\n"
    "    try:\n        os.fork()\n    except OSError:\n        break\n"
    "i = 0\nwhile True:\n    open(f'f{os.getpid()}-{i}', 'wb').write(b'x' * 2**22)\n    i += 1\n```"
)


def hostile_code_reward(completions, **kwargs):
    """code_execution_reward fed hostile code for every completion: each run ends at the sandbox's disk
    bound and scores 0.0, and the rollout worker goes on."""
    from asyncgrpo.rewards.code_execution import code_execution_reward

    return code_execution_reward([HOSTILE_CODE] * len(completions), [["assert True"]] * len(completions))
