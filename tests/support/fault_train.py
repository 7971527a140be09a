"""A training run for the fault tests to kill (tests/integration/test_faults.py), in its own process.

argv: server URL, model dir, output dir, max_steps, mode. A checkpoint every step. The run writes
`<output_dir>/at-step-<N>` when step N ends; mode `hold-at-2` then blocks in step 3's wait for
samples (training, worker and all alive), mode `wait-at-2` blocks there until `<output_dir>/release`
exists and then trains on to the end, mode `slow-save-at-3` blocks while checkpoint 3 is being
written (after its model and optimizer files), so the test can kill it there.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/conftest.py's helpers

from worker_side import prompts, token_parity_reward  # noqa: E402

# The rollout worker, a spawned process, runs this file's top level again (as `__mp_main__`): what it
# needs comes from tests/support/worker_side.py, and the trainer's imports wait in main().


def marker(output: Path, mode: str):
    """The callback that marks each step's end and holds the run as `mode` says."""
    from transformers import TrainerCallback

    class MarkSteps(TrainerCallback):
        def __init__(self, output_dir: Path, mode: str):
            self.output_dir, self.mode = output_dir, mode

        def on_step_end(self, args, state, control, **kwargs):
            (self.output_dir / f"at-step-{state.global_step}").touch()
            if self.mode == "hold-at-2" and state.global_step == 2:
                while True:  # alive and holding everything it started, as a long step would
                    time.sleep(1)
            if self.mode == "wait-at-2" and state.global_step == 2:
                while not (self.output_dir / "release").exists():
                    time.sleep(0.2)

    return MarkSteps(output, mode)


def main() -> None:
    from conftest import make_config

    import asyncgrpo.trainer.checkpoint as checkpoint_module
    from asyncgrpo import AsyncGRPOTrainer

    url, model_dir, output_dir, max_steps, mode = sys.argv[1:6]
    output = Path(output_dir)
    config = make_config(
        SimpleNamespace(url=url), output_dir, max_steps=int(max_steps), save_strategy="steps", save_steps=1,
        learning_rate=1e-3, vllm_server_timeout=120,
    )  # fmt: skip
    trainer = AsyncGRPOTrainer(
        model_dir, token_parity_reward, config, train_dataset=prompts(60), callbacks=[marker(output, mode)]
    )
    if mode == "slow-save-at-3":
        write_resume_point = checkpoint_module.save_resume_point

        def slow(directory, resume):
            if trainer.state.global_step == 3:
                (output / "saving-3").touch()
                time.sleep(3600)
            write_resume_point(directory, resume)

        checkpoint_module.save_resume_point = slow
    trainer.train()


if __name__ == "__main__":
    main()
