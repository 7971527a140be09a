"""TrainingArguments settings that the base Trainer's training loop applies, applied by this trainer's.

AsyncGRPOTrainer runs its own loop, so a setting the base loop reads would otherwise do nothing:
- `torch_empty_cache_steps`: empty the device's caching allocator every N optimizer steps (rows of
  very different lengths can leave cached blocks that fragment memory), as the base loop does;
- `include_num_input_tokens_seen`: count the tokens the model was given, which the base Trainer's
  `log` then reports as `num_input_tokens_seen` (kept in `trainer_state.json`, so a resumed run
  continues the count). The model's input is the packed rows: "non_padding" counts the tokens
  forwarded (a shared prefix once), "all" the rows' padded lengths (the tree-attention kernel pads a
  row to whole blocks).
"""

from __future__ import annotations

from accelerate.utils.memory import clear_device_cache
from transformers import TrainerCallback


class EmptyDeviceCache(TrainerCallback):
    """`torch_empty_cache_steps`: after every N-th optimizer step, empty the device cache."""

    def on_step_end(self, args, state, control, **kwargs):
        every = args.torch_empty_cache_steps
        if every and state.global_step % every == 0:
            clear_device_cache()


def input_tokens_seen(args, forwarded_tokens: int, padded_tokens: int) -> int:
    """A step's contribution to `state.num_input_tokens_seen` under `include_num_input_tokens_seen`
    (transformers turns True into "all", False into "no")."""
    mode = args.include_num_input_tokens_seen
    if mode in ("no", False):
        return 0
    return forwarded_tokens if mode == "non_padding" else padded_tokens
