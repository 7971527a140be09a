"""PEFT adapters on the trained model: wrapping, what is refused, and what vLLM can serve as an adapter.

The model is wrapped with `peft.get_peft_model`, so only adapter parameters require gradients (the
optimizer holds state for those alone) and checkpoints hold the adapter. Weight sync then has two
modes (docs/peft.md): the merged weights through the ordinary backend, or the adapter alone when
the servers run with `--enable-lora`. Adapters vLLM cannot load fall back to the merged mode;
`adapter_unservable_reason` says why.
"""

from __future__ import annotations

import copy
import logging
import re

import torch

from asyncgrpo.errors import ConfigurationError
from asyncgrpo.modeling.models import NOT_SERVED_ATTR

logger = logging.getLogger(__name__)


def is_peft_model(model: torch.nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def check_peft_config(peft_config) -> None:
    """What is refused from the config alone: the trainer calls it before loading the model."""
    try:
        import peft  # noqa: F401
    except ImportError as error:
        raise ImportError("peft_config needs the peft library: pip install 'asyncgrpo[peft]'") from error
    if getattr(peft_config, "is_prompt_learning", False):
        raise ConfigurationError(
            f"{type(peft_config).__name__} is a prompt-learning method: its virtual tokens cannot be merged "
            "into the weights vLLM serves. Use a LoraConfig (or another adapter that merges into the linear "
            "layers)."
        )
    if getattr(peft_config, "target_parameters", None):
        raise ConfigurationError(
            "peft_config.target_parameters (LoRA on raw parameters, e.g. MoE experts) is not supported: "
            "target modules instead"
        )


def wrap_with_peft(model: torch.nn.Module, peft_config, gradient_checkpointing: bool) -> torch.nn.Module:
    """`model` with a fresh trainable adapter of `peft_config`; the base weights are frozen."""
    check_peft_config(peft_config)
    from peft import get_peft_model

    peft_config = _outside_language_model_excluded(model, peft_config)
    head = model.get_output_embeddings()
    embedding = model.get_input_embeddings()
    tied = head is not None and embedding is not None and head.weight is embedding.weight
    if gradient_checkpointing:
        # The frozen embedding's output needs grad, or checkpointed layers pass none to the adapters.
        model.enable_input_require_grads()
    wrapped = get_peft_model(model, peft_config)
    _refuse_output_head(wrapped, head)
    if tied:
        _refuse_tied_embedding(wrapped, embedding)
    _refuse_frozen_modules(wrapped, model)
    return wrapped


def _frozen_roots(model: torch.nn.Module) -> list[str]:
    """The outermost modules holding what `freeze_outside_language_model` froze (e.g. `model.visual`)."""
    prefixes = sorted({name.rsplit(".", 1)[0] for name in getattr(model, NOT_SERVED_ATTR, ())})
    return [p for p in prefixes if not any(p.startswith(q + ".") for q in prefixes)]


def _outside_language_model_excluded(model: torch.nn.Module, peft_config):
    """A copy of `peft_config` that keeps adapters off the frozen vision tower, which
    `target_modules="all-linear"` would otherwise reach. A config that sets `exclude_modules`
    itself is kept as is (and checked after wrapping)."""
    roots = _frozen_roots(model)
    if not roots or getattr(peft_config, "exclude_modules", None) is not None:
        return peft_config
    peft_config = copy.copy(peft_config)
    peft_config.exclude_modules = "|".join(rf"{re.escape(root)}(\..*)?" for root in roots)
    return peft_config


def _refuse_frozen_modules(peft_model, model: torch.nn.Module) -> None:
    from peft.tuners.tuners_utils import BaseTunerLayer

    roots = _frozen_roots(model)
    for name, module in peft_model.get_base_model().named_modules():
        if isinstance(module, BaseTunerLayer) and any(name == r or name.startswith(r + ".") for r in roots):
            raise ConfigurationError(
                f"the adapter wraps {name}, outside the language model (a vision tower, frozen for text-only "
                "training and not served from the trainer): keep target_modules / exclude_modules to the "
                "language model"
            )


def _refuse_output_head(peft_model, head: torch.nn.Module | None) -> None:
    name = _wrapping(peft_model, head) if head is not None else None
    if name is not None:
        raise ConfigurationError(
            f"the adapter wraps the output head ({name}): PEFT on lm_head is not supported (the loss "
            "reads the head's weight directly, and vLLM cannot serve it as an adapter). Remove lm_head "
            "from target_modules / modules_to_save."
        )


def _refuse_tied_embedding(peft_model, embedding: torch.nn.Module) -> None:
    """The output head shares the input embedding's weight (`tie_word_embeddings`): merging an
    adapter into that weight for the servers would change their head as well, while the trainer's
    head stays the base one, so the served policy would not be the trained one."""
    name = _wrapping(peft_model, embedding)
    if name is not None:
        raise ConfigurationError(
            f"the adapter wraps the input embedding ({name}) of a model whose output "
            "head shares its weight (tie_word_embeddings): merged into the served weights it would change "
            "lm_head too, and PEFT on lm_head is not supported. Remove the embedding from target_modules / "
            "modules_to_save."
        )


def _wrapping(peft_model, module: torch.nn.Module) -> str | None:
    """The name of the PEFT layer (LoRA or modules_to_save) around `module`, if any."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    for name, candidate in peft_model.named_modules():
        if (isinstance(candidate, BaseTunerLayer) and candidate.get_base_layer() is module) or (
            isinstance(candidate, ModulesToSaveWrapper) and candidate.original_module is module
        ):
            return name
    return None


def active_config(peft_model):
    return peft_model.peft_config[peft_model.active_adapter]


def adapter_rank(peft_model) -> int:
    """The largest LoRA rank of the active adapter (rank_pattern included): what the servers'
    `--max-lora-rank` must cover."""
    config = active_config(peft_model)
    return max([int(config.r), *(int(rank) for rank in (config.rank_pattern or {}).values())])


# init_lora_weights values that only set the adapter's first weights and leave the base model as
# loaded (the others rewrite the base weights at wrapping time). True/False are LoRA's own inits.
_INITS_LEAVING_THE_BASE = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")
# LoraConfig options vLLM 0.32 refuses when it loads an adapter.
_UNSERVED_LORA_OPTIONS = ("alora_invocation_tokens", "layer_replication", "use_bdlora", "use_qalora")


def adapter_unservable_reason(peft_model) -> str | None:
    """Why vLLM cannot load the active adapter as a runtime LoRA adapter; None when it can."""
    from peft import LoraConfig
    from peft.tuners.lora import Embedding as LoraEmbedding

    config = active_config(peft_model)
    if not isinstance(config, LoraConfig):
        return f"it is a {type(config).__name__}, and vLLM serves LoRA adapters only"
    if config.use_dora:
        return "it uses DoRA (use_dora=True), which vLLM does not serve"
    if config.modules_to_save:
        modules = list(config.modules_to_save)
        return f"it trains whole modules (modules_to_save={modules}), which vLLM does not serve"
    if config.bias != "none" or getattr(config, "lora_bias", False):
        return "it trains biases (bias / lora_bias), which vLLM does not serve"
    init = config.init_lora_weights
    if isinstance(init, str) and init.lower() not in _INITS_LEAVING_THE_BASE:
        # PiSSA, OLoRA, CorDA, LoftQ: the trained base is not the one the servers hold.
        return f"init_lora_weights={init!r} changes the base weights, which the servers do not have"
    unserved = [name for name in _UNSERVED_LORA_OPTIONS if getattr(config, name, None)]
    if unserved:
        return f"it sets {unserved[0]}, which vLLM does not serve"
    embedded = [name for name, module in peft_model.named_modules() if isinstance(module, LoraEmbedding)]
    if embedded:
        return f"it targets embeddings ({embedded[0]}), which vLLM does not serve as LoRA"
    if len(peft_model.peft_config) > 1:
        return "the model holds several adapters"
    return None


def adapter_tensors(peft_model) -> list[tuple[str, torch.Tensor]]:
    """The adapter's weights (names as in the PEFT model's state dict, adapter name included), in a
    fixed order. Under FSDP2 they are sharded: gather each with `full_tensor`, every process in this
    order."""
    return [
        (name, parameter.detach()) for name, parameter in peft_model.named_parameters() if "lora_" in name
    ]
