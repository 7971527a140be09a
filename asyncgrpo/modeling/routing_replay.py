"""MoE routing replay: the trainer's forward routes chosen tokens to the experts the sampler used.

A mixture-of-experts router picks each token's top-k experts by its logits; the sampler's kernels
and precision move those logits a little, and a token near a tie goes to other experts on the two
sides, a log-prob mismatch no importance weight can undo. Replay takes the sampler's choice of
experts as given for the tokens it generated and keeps the trainer's own router probabilities as
their weights (softmax over all experts, gathered at the recorded ids, renormalized over them when
the model normalizes its top-k), so the router still learns.

Works on the Hugging Face Qwen3-MoE router (`Qwen3MoeTopKRouter`: forward(hidden) -> (logits,
scores, indices)) through forward hooks, one per MoE layer; `recorded` holds the experts of every
forwarded token of a row (packed positions: a token shared in the trie has one routing).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from asyncgrpo.errors import ConfigurationError


def replayed_routing(
    router_logits: torch.Tensor,
    recorded: torch.Tensor,
    replay: torch.Tensor,
    top_k: int,
    normalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores (T, k), indices (T, k)): the router's top-k, except that a token with `replay` True
    takes the experts `recorded` (T, k) and the router's probabilities of those experts as scores."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    _, own = torch.topk(probs, top_k, dim=-1)
    indices = torch.where(replay[:, None], recorded.to(own.dtype), own)
    scores = probs.gather(1, indices)
    if normalize:
        scores = scores / scores.sum(dim=-1, keepdim=True)
    return scores.to(router_logits.dtype), indices


def moe_routers(model) -> list[torch.nn.Module]:
    """The model's top-k routers in layer order (modules with `top_k` and `num_experts` returning
    (logits, scores, indices))."""
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    if not routers:
        raise ConfigurationError(
            f"{type(model).__name__} has no top-k MoE router (Qwen3-MoE's Qwen3MoeTopKRouter): routing "
            "replay applies to mixture-of-experts models only"
        )
    return routers


@contextmanager
def replay_routing(model, recorded: torch.Tensor, replay: torch.Tensor):
    """Within the block, every forward of `model` routes the tokens where `replay` (P,) is True to
    `recorded` (num_moe_layers, P, k) experts. P is the packed row's token count; a forward padded
    past it leaves the padding to the router."""
    routers = moe_routers(model)
    if recorded.shape[0] != len(routers):
        raise ValueError(
            f"recorded routing has {recorded.shape[0]} layers, the model {len(routers)} MoE layers: the "
            "routing must come from a server running this model"
        )
    handles = []
    for layer, router in enumerate(routers):

        def hook(module, inputs, output, layer=layer):
            logits = output[0]
            padding = logits.shape[0] - replay.shape[0]  # the packed forward pads its row at the end
            if padding < 0:
                raise ValueError(
                    f"routing replay got a forward of {logits.shape[0]} tokens for a routing of "
                    f"{replay.shape[0]}: replay one packed row per forward"
                )
            forced = torch.nn.functional.pad(replay.to(logits.device), (0, padding), value=False)
            experts = torch.nn.functional.pad(recorded[layer].to(logits.device), (0, 0, 0, padding))
            scores, indices = replayed_routing(logits, experts, forced, module.top_k, module.norm_topk_prob)
            return logits, scores, indices

        handles.append(router.register_forward_hook(hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
