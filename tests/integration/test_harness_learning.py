"""HarnessAsyncGRPOTrainer learns, end to end: a real agent program (tests/support/harness_letter_agent.py,
the `openai` package) run through ProcessSessionFactory against the real vLLM CPU server, rewarded
only by `verify` reading the file the agent wrote.

The task: pick one of four letters; `verify` rewards the letter RIGHT. A short supervised warm start
teaches the tiny random model the answer's form (one letter, then end of turn) with the letters
equally likely, so the first rollouts score about 1/4 and GRPO has the rest to learn.
"""

from __future__ import annotations

import functools
import math
import random
import sys
from pathlib import Path

import pytest
from support_paths import SUPPORT

pytest.importorskip(
    "datasets", reason="datasets is not installed (a GPU host may lack the non-torch dependencies)"
)
import torch
from conftest import make_config
from datasets import Dataset
from test_trainer_e2e import restore_server
from worker_side import (  # what the rollout worker imports: tests/support/worker_side.py says why
    RIGHT_LETTER,
    pick_the_right_letter,
)

from asyncgrpo import HarnessAsyncGRPOTrainer
from asyncgrpo.cli.demo import answer_probability, supervised_steps
from asyncgrpo.cli.tiny_model import build_model, build_tokenizer
from asyncgrpo.harness import ProcessSessionFactory
from asyncgrpo.rollout.chat import render_prompt_ids

pytestmark = pytest.mark.vllm

AGENT = SUPPORT / "harness_letter_agent.py"
NO_THINKING = {"enable_thinking": False}
LETTERS, RIGHT = "ABCD", RIGHT_LETTER
PROMPTS = [
    "Pick one letter: A, B, C or D.",
    "Answer with a single letter, A to D.",
    "Choose A, B, C or D.",
    "One letter please: A, B, C, D.",
]


def prompt_ids(tokenizer, text: str) -> list[int]:
    """The prompt as the capture proxy renders the agent's request (no tools, no thinking block)."""
    return render_prompt_ids(tokenizer, [{"role": "user", "content": text}], None, NO_THINKING)


def right_letter_probability(model, tokenizer) -> float:
    """The model's probability of answering RIGHT among the four letters (renormalized over them),
    averaged over the prompts: exact, where a step's reward averages one group of samples."""
    letters = [tokenizer.encode(letter, add_special_tokens=False)[0] for letter in LETTERS]
    total = 0.0
    with torch.no_grad():
        for text in PROMPTS:
            logits = model(input_ids=torch.tensor([prompt_ids(tokenizer, text)])).logits[0, -1]
            total += float(torch.softmax(logits[letters], -1)[LETTERS.index(RIGHT)])
    return total / len(PROMPTS)


# The warm start: the prompts with letters drawn uniformly, so the model learns the form (a letter,
# then <|im_end|>) and no strong preference. It is deterministic (seeded draws, one thread): these
# steps at the demo's rate leave the form at 0.97 and the right letter at 0.15 (the test prints both).
WARM_STEPS, WARM_BATCH = 15, 8


def letter_warm_start(out_dir: Path, seed: int = 0) -> tuple[Path, float, float]:
    """(the warm-started model's directory, its probability of answering RIGHT among the letters, of
    answering in the form at all: any one letter, then end of turn)."""
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = build_model(tokenizer)
    rng = random.Random(seed)
    answers = {
        letter: tokenizer.encode(letter, add_special_tokens=False) + [tokenizer.eos_token_id]
        for letter in LETTERS
    }

    def draw():
        return [
            (prompt_ids(tokenizer, rng.choice(PROMPTS)), answers[rng.choice(LETTERS)])
            for _ in range(WARM_BATCH)
        ]

    supervised_steps(model, draw, WARM_STEPS)
    well_formed = len(LETTERS) * answer_probability(
        model, [(prompt_ids(tokenizer, text), answers[letter]) for text in PROMPTS for letter in LETTERS]
    )
    right = right_letter_probability(model, tokenizer)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir, right, well_formed


@pytest.fixture(autouse=True)
def shared_server_weights_restored(request, tiny_model_dir):
    """The run syncs its weights into the shared server: put the originals back."""
    yield
    if "vllm_server" in request.fixturenames:
        restore_server(request.getfixturevalue("vllm_server").url, tiny_model_dir)


# One group of GROUP rollouts per step: with the right letter at ~1/4, a group scores all 0 with
# probability 0.75^8 = 0.1 (dropped: no signal), so most steps train on a group of both rewards.
GROUP, GRPO_STEPS, GRPO_LR = 8, 6, 3e-4
# The curve's two ends: the first steps' samples come from the warm start or a policy one small step
# from it; the last ones from the trained policy.
FIRST_STEPS, LAST_STEPS = 2, 2
REWARD_GAIN, RIGHT_GAIN = 0.2, 0.2


@pytest.mark.timeout(600)
def test_agent_reward_from_verify_rises_after_a_warm_start(vllm_server, tmp_path):
    torch.set_num_threads(1)  # the server's CPU engine holds the other core
    warm_dir, right, well_formed = letter_warm_start(tmp_path / "warm")
    print(f"warm start: P(right letter) {right:.3f}, P(well-formed answer) {well_formed:.3f}")
    assert well_formed > 0.9, "the warm start must teach the answer's form"
    assert right < 0.5, "the warm start must leave room for GRPO"
    restore_server(vllm_server.url, warm_dir)  # the first rollouts already come from the warm start
    args = make_config(
        vllm_server,
        tmp_path / "run",
        num_generations=GROUP,
        per_device_train_batch_size=GROUP,
        token_budget=0,
        max_completion_length=8,
        max_steps=GRPO_STEPS,
        learning_rate=GRPO_LR,
        max_staleness=1,
        max_concurrent_rollouts=GROUP,
        chat_template_kwargs=NO_THINKING,
    )
    factory = functools.partial(
        ProcessSessionFactory, command=[sys.executable, str(AGENT)], verify=pick_the_right_letter
    )
    trainer = HarnessAsyncGRPOTrainer(
        model=str(warm_dir),
        args=args,
        train_dataset=Dataset.from_list(
            [{"prompt": [{"role": "user", "content": text}]} for text in PROMPTS]
        ),
        harness_session_factory=factory,
    )
    trainer.train()
    # A step that scored no new group logs no reward (NaN): it is not a point of the curve.
    rewards = [
        round(entry["reward"], 3)
        for entry in trainer.state.log_history
        if math.isfinite(entry.get("reward", math.nan))
    ]
    first = sum(rewards[:FIRST_STEPS]) / FIRST_STEPS
    last = sum(rewards[-LAST_STEPS:]) / LAST_STEPS
    trained_right = right_letter_probability(trainer.model.eval(), build_tokenizer())
    print(f"harness reward by step: {rewards}")
    print(f"harness reward: first {FIRST_STEPS} steps {first:.3f}, last {LAST_STEPS} {last:.3f}")
    print(f"harness P(right letter): warm start {right:.3f}, after GRPO {trained_right:.3f}")
    assert trained_right > right + RIGHT_GAIN, (right, trained_right)
    assert last > first + REWARD_GAIN, rewards
