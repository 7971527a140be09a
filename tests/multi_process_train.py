"""One process of `test_two_processes_train_against_the_server`: AsyncGRPOTrainer launched with
torchrun on two CPU processes (FSDP2 over gloo) for a few steps against a real vLLM server.
argv: server URL, model dir, output dir. Rank 0 writes the logged history to output_dir/history.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from asyncgrpo import AsyncGRPOTrainer  # noqa: E402
from test_trainer_e2e import make_config, prompts, token_parity_reward  # noqa: E402


def main() -> None:
    url, model_dir, output_dir = sys.argv[1:4]
    config = make_config(SimpleNamespace(url=url), output_dir, max_steps=3, learning_rate=1e-3, use_cpu=True)
    trainer = AsyncGRPOTrainer(model_dir, token_parity_reward, config, train_dataset=prompts())
    assert trainer.accelerator.num_processes == 2, "the trainer must see both processes"
    trainer.train()
    if dist.get_rank() == 0:
        (Path(output_dir) / "history.json").write_text(json.dumps(trainer.state.log_history))


if __name__ == "__main__":
    main()
