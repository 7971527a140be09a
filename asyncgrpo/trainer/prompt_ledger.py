"""Which prompts the trainer is done with: the resume position and the epoch count.

A prompt is *resolved* when every sample of its group has been trained or dropped, or at once when it
carried none. Groups finish out of order, so the resume position is the first unresolved stream index
(the watermark) plus the resolved indices after it: a resumed worker starts at the watermark and
skips those, so no prompt is trained twice or skipped. The epoch count (`epoch_prompts`) counts the
prompts a pass has covered, leaving out those whose samples were all dropped as stale or oversize.
The rules and why: docs/architecture.md#stopping-checkpoints-and-resume and
docs/configuration.md#epochs-counted-in-prompts.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from asyncgrpo.errors import ConfigurationError
from asyncgrpo.rollout.prompts import PromptOrder
from asyncgrpo.run.durable_files import write_atomically

ROLLOUT_STATE_NAME = "rollout_state.json"


@dataclass
class RolloutState:
    """What `rollout_state.json` holds."""

    first_untrained_index: int = 0
    consumed_after: list[int] = field(default_factory=list)
    epoch_prompts: int = 0  # prompts counted toward num_train_epochs (see the module doc)
    model_version: int = 0
    num_tokens: int = 0
    # The order whose stream indices the positions above count; None in checkpoints older than this
    # field, which are resumed in the config's order unchecked.
    prompt_order: PromptOrder | None = None

    def check_prompt_order(self, order: PromptOrder, checkpoint: str | os.PathLike) -> None:
        """A resume replays the stream from the saved positions: in another prompt order they would
        name other prompts (some trained twice, others never), so a different order is refused."""
        saved = self.prompt_order
        if saved is None or saved == order:
            return
        settings = (
            "train_sampling_strategy='sequential'"
            if saved.seed is None
            else f"data_seed={saved.seed} (train_sampling_strategy='random')"
        )
        raise ConfigurationError(
            f"{checkpoint} drew its prompts {saved.describe()}, this config {order.describe()}: the resume "
            "position counts prompts in the checkpoint's order, so another order would train some "
            f"prompts twice and skip others. Resume with {settings}."
        )

    def save(self, directory: str | os.PathLike) -> None:
        """Write atomically and durably: a crash of the process or the host leaves the old file or
        the new one, never half of one."""
        fields = dataclasses.asdict(self)  # prompt_order too, as a dict
        write_atomically(Path(directory) / ROLLOUT_STATE_NAME, json.dumps(fields, indent=2))

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "RolloutState | None":
        path = Path(directory) / ROLLOUT_STATE_NAME
        if not path.exists():
            return None
        fields = json.loads(path.read_text())
        if "prompt_index" in fields:  # a TRL checkpoint: {"prompt_index", "model_version"}
            return cls(
                first_untrained_index=int(fields["prompt_index"]),
                model_version=int(fields.get("model_version", 0)),
                prompt_order=PromptOrder(None),  # TRL's worker reads the dataset in order
            )
        known = {name: value for name, value in fields.items() if name in cls.__dataclass_fields__}
        if known.get("prompt_order") is not None:
            known["prompt_order"] = PromptOrder(**known["prompt_order"])
        return cls(**known)


class PromptLedger:
    def __init__(self, start_index: int = 0, consumed_after: list[int] | None = None, epoch_prompts: int = 0):
        self.watermark = start_index
        self._consumed_ahead: set[int] = set(consumed_after or ())
        self._pending: dict[int, int] = {}  # stream index -> samples not yet trained or dropped
        self._trained: set[int] = set()  # pending stream indices with at least one trained sample
        self.epoch_prompts = epoch_prompts
        # Prompts in a row, in stream order, whose groups brought nothing to train (filtered, or equal
        # rewards). Groups finish out of order: a prompt counts once every earlier one has arrived, so a
        # slow group that brings samples breaks the streak it belongs in (trainer/intake.py stops a
        # run at a whole pass of them). `_arrival_watermark`: the first prompt whose group has not
        # arrived; `_arrived_ahead`: arrived after it, with whether each brought samples. A prompt
        # resolved before a resume counts as one that brought samples: the streak starts anew.
        self.prompts_without_samples_streak = 0
        self._arrival_watermark = start_index
        self._arrived_ahead: dict[int, bool] = dict.fromkeys(consumed_after or (), True)
        self._advance()
        self._advance_arrivals()

    def add_group(self, stream_index: int, num_samples: int) -> None:
        """A group result arrived with `num_samples` samples for training."""
        self._arrived_ahead[stream_index] = num_samples > 0
        self._advance_arrivals()
        if num_samples == 0:
            self.epoch_prompts += 1
            self._consume(stream_index)
        else:
            self._pending[stream_index] = num_samples

    def sample_done(self, stream_index: int, trained: bool) -> None:
        """One of the group's samples was trained (`trained`) or dropped."""
        if trained:
            self._trained.add(stream_index)
        remaining = self._pending[stream_index] - 1
        if remaining:
            self._pending[stream_index] = remaining
            return
        del self._pending[stream_index]
        if stream_index in self._trained:
            self._trained.discard(stream_index)
            self.epoch_prompts += 1
        self._consume(stream_index)

    def _consume(self, stream_index: int) -> None:
        """The prompt is resolved: nothing of it is left to train."""
        self._consumed_ahead.add(stream_index)
        self._advance()

    def _advance(self) -> None:
        while self.watermark in self._consumed_ahead:
            self._consumed_ahead.discard(self.watermark)
            self.watermark += 1

    def _advance_arrivals(self) -> None:
        while self._arrival_watermark in self._arrived_ahead:
            brought_samples = self._arrived_ahead.pop(self._arrival_watermark)
            self.prompts_without_samples_streak = (
                0 if brought_samples else self.prompts_without_samples_streak + 1
            )
            self._arrival_watermark += 1

    def state(self) -> tuple[int, list[int]]:
        """(first unresolved stream index, resolved indices after it)."""
        return self.watermark, sorted(self._consumed_ahead)
