"""Model families beyond a plain causal LM: image-text-to-text checkpoints trained on text, and MoE
models' router load-balancing loss.

A checkpoint with a vision tower loads with the image-text-to-text auto class (its weights keep the
checkpoint's and the server's names) and everything outside its language model is frozen. For MoE
models the Switch-Transformer load-balancing loss is computed as transformers does, with each packed
token weighted by the samples that contain it, so tree packing gives the loss of the same samples
unpacked. What and why: docs/models.md.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, PreTrainedModel

from asyncgrpo.errors import ConfigurationError

# Set on a model by `freeze_outside_language_model`: the parameter/buffer names weight sync skips.
NOT_SERVED_ATTR = "_asyncgrpo_not_served"


def declares_vision_tower(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def load_model(model_id: str, **kwargs) -> PreTrainedModel:
    """A causal LM, or the image-text-to-text model when the config declares a vision tower."""
    config = AutoConfig.from_pretrained(model_id, trust_remote_code=kwargs.get("trust_remote_code", False))
    auto_class = AutoModelForImageTextToText if declares_vision_tower(config) else AutoModelForCausalLM
    return auto_class.from_pretrained(model_id, **kwargs)


def language_model_names(model: torch.nn.Module) -> set[str]:
    """Names (parameters and buffers) of the decoder and the output head."""
    modules = [model.get_decoder(), model.get_output_embeddings()]
    ids = {id(t) for m in modules if m is not None for t in (*m.parameters(), *m.buffers())}
    tensors = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    return {name for name, tensor in tensors.items() if id(tensor) in ids}


def freeze_outside_language_model(model: PreTrainedModel) -> list[str]:
    """Freeze what is outside the language model of a checkpoint with a vision tower and mark it as
    not served; returns the frozen parameter names (empty for a plain causal LM)."""
    if not declares_vision_tower(model.config):
        return []
    keep = language_model_names(model)
    frozen = []
    for name, parameter in model.named_parameters():
        if name not in keep:
            parameter.requires_grad_(False)
            frozen.append(name)
    not_served = {name for name in model.state_dict() if name not in keep}
    setattr(model, NOT_SERVED_ATTR, frozenset(not_served))
    return frozen


def is_served(model: torch.nn.Module, name: str) -> bool:
    """Whether weight sync sends the state-dict entry `name` of `model`."""
    return name not in getattr(model, NOT_SERVED_ATTR, ())


def is_moe(config) -> bool:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "num_experts", 0) or getattr(text, "num_local_experts", 0))


def router_aux_loss_coef(config, requested: float | None) -> float:
    """The coefficient to train with: `requested`, or the model config's for an MoE model (0 when
    it has none); a coefficient on a model without routed experts is a ValueError."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not is_moe(config):
        if requested:
            raise ConfigurationError(
                f"router_aux_loss_coef={requested} but {getattr(text, 'model_type', 'the model')} has no "
                "routed experts (no num_experts in its config): leave router_aux_loss_coef unset for dense "
                "models"
            )
        return 0.0
    if requested is not None:  # >= 0: AsyncGRPOConfig checks it
        return float(requested)
    return float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0)


def load_balancing_loss(
    router_logits: tuple[torch.Tensor, ...], top_k: int, token_weights: torch.Tensor
) -> torch.Tensor:
    """Switch-Transformer load-balancing loss over all MoE layers.

    router_logits: per layer (T, E) logits of the T forwarded tokens; token_weights: (T,) how many
    times each token counts (0 for padding). Returns E * sum_e f_e * P_e, a 0-d fp32 tensor: top_k
    for perfectly balanced routing, up to E when one expert takes everything.
    """
    num_experts = router_logits[0].shape[-1]
    weights = token_weights.float()
    assigned = torch.zeros(num_experts, device=weights.device)
    probability = torch.zeros(num_experts, device=weights.device)
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)  # (T, E)
        chosen = torch.topk(probs, top_k, dim=-1).indices  # (T, k)
        one_hot = torch.zeros_like(probs).scatter_(1, chosen, 1.0)  # (T, E)
        assigned = assigned + weights @ one_hot
        probability = probability + weights @ probs
    total = weights.sum() * len(router_logits)
    return num_experts * ((assigned / total) * (probability / total)).sum()
