"""The model and tokenizer the trainer trains, made ready before the base Trainer sees them.

The model: loaded from an id in the configured dtype, its vision tower frozen, the MoE load-balancing
coefficient resolved against it, wrapped with PEFT when asked, tree attention enabled, MoE experts
switched to grouped GEMMs. The tokenizer:
loaded from the model id when none is given, with a pad token and, when rollouts use tools or
environments, a prefix-preserving training chat template and a tool-call format the tool loop reads.
"""

from __future__ import annotations

import logging

import torch
from transformers import AutoTokenizer, PreTrainedModel

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.kernels.moe_experts import use_grouped_experts
from asyncgrpo.modeling.models import freeze_outside_language_model, load_model, router_aux_loss_coef
from asyncgrpo.modeling.peft_adapters import wrap_with_peft
from asyncgrpo.packing.gated_deltanet import log_gated_delta_rule_path
from asyncgrpo.packing.tree_attention import enable_tree_attention
from asyncgrpo.rollout.tool_calls import require_call_format
from asyncgrpo.rollout.training_templates import use_training_template

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def load_policy_model(model_id: str, args: AsyncGRPOConfig) -> PreTrainedModel:
    kwargs = dict(args.model_init_kwargs or {})
    kwargs.setdefault("dtype", _DTYPES[args.dtype])
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    return load_model(model_id, **kwargs)


def prepare_policy_model(model: PreTrainedModel, args: AsyncGRPOConfig, peft_config) -> PreTrainedModel:
    """The model to train; sets `args.router_aux_loss_coef` to the model's value when None."""
    # Before PEFT wraps it: the frozen vision tower's names are the checkpoint's, and the adapter skips
    # it.
    frozen = freeze_outside_language_model(model)  # a vision tower: text-only training never uses it
    if frozen:
        logger.info("froze %d parameters outside the language model (vision tower)", len(frozen))
    args.router_aux_loss_coef = router_aux_loss_coef(model.config, args.router_aux_loss_coef)
    if peft_config is not None:
        model = wrap_with_peft(model, peft_config, args.gradient_checkpointing)
    enable_tree_attention(model)  # refuses attention sinks and layers it cannot pack
    if use_grouped_experts(model):  # MoE: grouped GEMMs under autocast (docs/gpu-performance.md)
        logger.info("MoE experts run as grouped GEMMs (asyncgrpo.kernels.moe_experts)")
    log_gated_delta_rule_path(model, args.device)  # Gated DeltaNet models: which rule runs, and why
    return model


def prepare_tokenizer(
    processing_class, model_id: str, args: AsyncGRPOConfig, agentic: bool, reads_tool_calls: bool
):
    """The tokenizer to train with; `agentic`: rollouts use tools or an environment; `reads_tool_calls`:
    asyncgrpo's tool loop reads the model's calls (not a loop_cls whose generate_one does)."""
    if processing_class is None:
        revision = (args.model_init_kwargs or {}).get("revision")  # the tokenizer's too, as in TRL
        processing_class = AutoTokenizer.from_pretrained(
            model_id, revision=revision, trust_remote_code=args.trust_remote_code, padding_side="left"
        )
    if processing_class.pad_token is None:
        processing_class.pad_token = processing_class.eos_token
    if agentic:
        use_training_template(processing_class)  # known families only; unknown ones are watched for forks
        if reads_tool_calls:  # never a run whose calls are never read, each rollout ending after a turn
            require_call_format(processing_class.chat_template, model_id)
    return processing_class
