"""The reference policy of the KL term (`beta > 0`): whose log-probs of the trained tokens it scores, and
how `sync_ref_model` moves it.

With a PEFT adapter the reference is the base model: the policy's own forward with the adapter off, so no
second model exists anywhere. Otherwise it is a frozen copy of the model as the trainer was built (the
initial weights, also when a run resumes), on the training device and sharded as the policy is. Scored in
the trainer rather than on a vLLM server: a server's prompt log-probs skip the sampling processors, so
they are the untempered distribution while the KL needs the one the trainer trains (softmax(logits / T),
on the candidate set); docs/algorithm.md, "KL to a reference", gives the measured costs of both.
"""

from __future__ import annotations

import copy
import logging

import torch

from asyncgrpo.errors import ConfigurationError
from asyncgrpo.losses.token_logprobs import row_logprobs
from asyncgrpo.modeling.peft_adapters import is_peft_model
from asyncgrpo.packing.row import PackedRow
from asyncgrpo.trainer.compile import compile_decoder_layers
from asyncgrpo.trainer.distributed import shard_model

logger = logging.getLogger(__name__)


class ReferenceModel:
    """The reference's log-probs of a packed row's trained tokens, and its TR-DPO updates."""

    def __init__(self, copy_of_model: torch.nn.Module | None):
        self.model = copy_of_model  # None: the policy with its adapter off

    @classmethod
    def for_policy(cls, model: torch.nn.Module, args) -> ReferenceModel | None:
        """The reference of `model` (unwrapped, before training) for `args`; None when beta == 0."""
        if args.beta == 0.0:
            return None
        if is_peft_model(model):
            if args.sync_ref_model:
                raise ConfigurationError(
                    "sync_ref_model=True with a PEFT adapter: the reference is the base model (the adapter "
                    "off), so there is no reference copy to move toward the policy (TRL refuses it too). Use "
                    "sync_ref_model=False, or train without peft_config to keep a reference copy."
                )
            return cls(None)
        reference = copy.deepcopy(model)
        reference.requires_grad_(False)
        reference.eval()
        return cls(reference)

    @property
    def is_copy(self) -> bool:
        return self.model is not None

    def prepare(
        self, device: torch.device, sharded: bool, reshard: bool, compile_options: dict | None
    ) -> None:
        """The copy on the training device, sharded and compiled as the policy is."""
        if self.model is None:
            return
        self.model.to(device)
        if sharded:
            shard_model(self.model, reshard)
        if compile_options is not None:
            compile_decoder_layers(self.model, **compile_options)

    @torch.no_grad()
    def row_logprobs(self, policy: torch.nn.Module, row: PackedRow, temperature: float) -> torch.Tensor:
        """(E,) log p_ref of the row's trained tokens, under the distribution the trainer trains."""
        if self.model is not None:
            return row_logprobs(self.model, row, temperature=temperature).logprobs
        with policy.disable_adapter():
            return row_logprobs(policy, row, temperature=temperature).logprobs

    @torch.no_grad()
    def sync(self, policy: torch.nn.Module, alpha: float) -> None:
        """TR-DPO: ref <- alpha x policy + (1 - alpha) x ref, parameter by parameter (the shards of a
        sharded pair, which share one layout)."""
        for reference, current in zip(self.model.parameters(), policy.parameters(), strict=True):
            reference.mul_(1.0 - alpha).add_(current.detach(), alpha=alpha)
