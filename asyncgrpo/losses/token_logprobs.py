"""Trainer log-probabilities of the trained tokens of a packed row.

The head runs only on the hidden states of the E trained entries (`PackedRow.predict_index`), a
chunk at a time with each chunk's logits recomputed in backward, so the (E, V) fp32 logits never
exist at once. The distribution is the sampler's: softmax(logits / temperature), restricted and
renormalized to the entry's top-k / top-p candidate set (an empty set = full vocabulary), so that
the importance ratio compares like with like. On CUDA the same function runs fused
(`fused_head.FusedHeadLogprobs`, docs/gpu-performance.md); elsewhere the plain chunked path below.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from asyncgrpo.errors import ConfigurationError
from asyncgrpo.kernels.fused_head import FusedHeadLogprobs, candidate_mask
from asyncgrpo.modeling.models import load_balancing_loss
from asyncgrpo.packing.row import PackedRow
from asyncgrpo.packing.tree_attention import TREE_ATTENTION, padded_length, tree_attention_masks

CHUNK_SIZE = 1024  # entries per head chunk on the plain path
FUSED_CHUNK_SIZE = 4096  # on the fused path


@dataclass
class TokenLogprobs:
    logprobs: torch.Tensor  # (E,) log p(target)
    entropy: torch.Tensor  # (E,) entropy of the (renormalized) distribution
    top_logprobs: torch.Tensor | None  # (E, N) log p_v at the sampler's top-N ids; -inf where id is -1
    aux_loss: torch.Tensor | None = None  # 0-d MoE load-balancing loss of the row, when asked for


@dataclass(frozen=True)
class OutputHead:
    """The model's hidden -> logits map: `softcap(scale * (hidden @ weight.T + bias))`."""

    weight: torch.Tensor  # (V, H)
    bias: torch.Tensor | None = None  # (V,)
    scale: float = 1.0  # Cohere's logit_scale, Granite's 1 / logits_scaling
    softcap: float | None = None  # Gemma-2's final_logit_softcapping

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (C, H) -> logits (C, V) in fp32 at least (a bf16 log-softmax is too coarse)."""
        logits = torch.nn.functional.linear(hidden, self.weight, self.bias)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def output_head(model) -> OutputHead:
    """The output head of a HF causal LM, with the logit transforms its forward applies."""
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise ConfigurationError(
            f"{type(model).__name__} has no linear output head (get_output_embeddings())"
        )
    config = model.config.get_text_config()
    scale = float(getattr(model, "logit_scale", None) or getattr(config, "logit_scale", None) or 1.0)
    if getattr(config, "logits_scaling", None):
        scale /= float(config.logits_scaling)
    return OutputHead(
        head.weight, getattr(head, "bias", None), scale, getattr(config, "final_logit_softcapping", None)
    )


def _chunk_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    top_ids: torch.Tensor | None,
    candidates: tuple[torch.Tensor, torch.Tensor] | None,
    head: OutputHead,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk: hidden (C, H), targets (C,), top_ids (C, N), candidates (set sizes (C,), ids)
    -> (C,), (C,), (C, N). Everything (C, V) is built here, so checkpointing frees it."""
    logits = head.logits(hidden) / temperature  # (C, V)
    if candidates is not None:
        logits = logits.masked_fill(~candidate_mask(*candidates, logits.shape[-1]), float("-inf"))
    logp = torch.log_softmax(logits, dim=-1)  # (C, V)
    target_logp = logp.gather(1, targets[:, None])[:, 0]
    # Outside the set p = 0 and logp = -inf: 0 * -inf would be NaN in forward or in backward.
    entropy = -(logp.exp() * logp.masked_fill(logp == float("-inf"), 0.0)).sum(-1)
    top_logp = None
    if top_ids is not None:
        valid = top_ids >= 0
        top_logp = logp.gather(1, top_ids.clamp(min=0)).masked_fill(~valid, float("-inf"))
    return target_logp, entropy, top_logp


def token_logprobs(
    hidden: torch.Tensor,
    head: OutputHead | torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    top_ids: torch.Tensor | None = None,
    candidate_offsets: torch.Tensor | None = None,
    candidate_ids: torch.Tensor | None = None,
    chunk_size: int | None = None,
    fused: bool | None = None,
    keep_logits: bool = False,
) -> TokenLogprobs:
    """Log p(target), entropy and log p at the sampler's top-N ids, per entry.

    hidden: (E, H) hidden states that predict the entries; head: an OutputHead or an lm_head weight
    (V, H); targets: (E,) int64; top_ids: (E, N) int64, -1 padded; candidate_offsets (E + 1,) /
    candidate_ids: ragged candidate sets as in `PackedRow`. Entries are processed `chunk_size` at a
    time and each chunk's logits are recomputed in backward: peak memory is a few (chunk_size, V)
    fp32 tensors (about 4 x 1024 x 150k x 4 bytes = 2.5 GB at the default and a 150k vocabulary).
    fused: None = on CUDA (see the module doc). chunk_size: None = 1024 unfused, 4096 fused (the
    fused path keeps no (C, V) tensor between chunks, and fewer chunks mean fewer passes of the fp32
    weight-gradient accumulation). keep_logits (fused path, no candidate sets): one chunk, whose
    (E, V) head output is kept for backward instead of recomputed (see `fused_head`).
    """
    if fused is None:
        fused = hidden.device.type == "cuda"
    if chunk_size is None:
        chunk_size = FUSED_CHUNK_SIZE if fused else CHUNK_SIZE
    _check_inputs(hidden, targets, temperature, top_ids, candidate_offsets, candidate_ids, chunk_size)
    if not isinstance(head, OutputHead):
        head = OutputHead(head)
    keep_logits = keep_logits and fused and candidate_offsets is None
    if keep_logits:
        chunk_size = max(hidden.shape[0], 1)
    chunks = _chunks(hidden.shape[0], chunk_size, candidate_offsets, candidate_ids)
    grad_wanted = torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad)
    if fused and chunks:
        inputs = (hidden, head.weight, head.bias)
        if not grad_wanted:
            inputs = tuple(None if t is None else t.detach() for t in inputs)
        logprobs, entropy, top = FusedHeadLogprobs.apply(
            *inputs,
            targets,
            top_ids,
            chunks,
            head.scale,
            head.softcap,
            temperature,
            keep_logits and grad_wanted,
        )
        return TokenLogprobs(logprobs, entropy, top)
    return _chunked_logprobs(hidden, head, targets, temperature, top_ids, chunks, grad_wanted)


def _check_inputs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    top_ids: torch.Tensor | None,
    candidate_offsets: torch.Tensor | None,
    candidate_ids: torch.Tensor | None,
    chunk_size: int,
) -> None:
    """Raise ValueError naming the first argument of `token_logprobs` that does not fit the others."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to compute log-probs, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if (candidate_offsets is None) != (candidate_ids is None):
        raise ValueError("pass both candidate_offsets and candidate_ids, or neither")
    num_entries = hidden.shape[0]
    if candidate_offsets is not None and candidate_offsets.shape != (num_entries + 1,):
        raise ValueError(
            f"candidate_offsets must have E + 1 = {num_entries + 1} entries, "
            f"got {tuple(candidate_offsets.shape)}"
        )
    if targets.shape != (num_entries,) or (top_ids is not None and top_ids.shape[0] != num_entries):
        raise ValueError(f"hidden has {num_entries} entries; targets and top_ids must have as many rows")


def _chunks(
    num_entries: int,
    chunk_size: int,
    candidate_offsets: torch.Tensor | None,
    candidate_ids: torch.Tensor | None,
) -> list[tuple[int, int, tuple[torch.Tensor, torch.Tensor] | None]]:
    """(start, stop, candidates) of each chunk of entries; candidates = (set sizes (C,), ids) or None."""
    if candidate_offsets is not None:
        offsets = candidate_offsets.tolist()  # (E + 1,): slicing bounds, read once
        sizes = candidate_offsets[1:] - candidate_offsets[:-1]  # (E,)
    chunks = []
    for start in range(0, num_entries, chunk_size):
        stop = min(start + chunk_size, num_entries)
        candidates = None
        if candidate_offsets is not None:
            candidates = (sizes[start:stop], candidate_ids[offsets[start] : offsets[stop]])
        chunks.append((start, stop, candidates))
    return chunks


def _chunked_logprobs(
    hidden: torch.Tensor,
    head: OutputHead,
    targets: torch.Tensor,
    temperature: float,
    top_ids: torch.Tensor | None,
    chunks: list,
    grad_wanted: bool,
) -> TokenLogprobs:
    """The unfused path: each chunk's logits materialized, and recomputed in backward."""
    parts = []
    for start, stop, candidates in chunks:
        chunk_top = None if top_ids is None else top_ids[start:stop]
        args = (hidden[start:stop], targets[start:stop], chunk_top, candidates, head, temperature)
        if grad_wanted:
            parts.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(*args))
    if not parts:  # no trained token in this row: empty (0,) outputs that still reach the graph
        empty = hidden.float().sum(-1)
        top = None if top_ids is None else empty[:, None].expand(0, top_ids.shape[1])
        return TokenLogprobs(empty, empty, top)
    return TokenLogprobs(
        torch.cat([p[0] for p in parts]),
        torch.cat([p[1] for p in parts]),
        None if top_ids is None else torch.cat([p[2] for p in parts]),
    )


def to_device(array: np.ndarray | None, device: torch.device) -> torch.Tensor | None:
    """A row's host array on `device`. To a GPU through pinned memory and without waiting: a plain
    copy from pageable memory synchronizes the stream, so the GPU would drain the previous row's
    backward and idle while this row's masks are built and its first kernels launched."""
    if array is None:
        return None
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


# Under FSDP2 the packed forward is registered as a forward method of the root module (see
# `trainer/distributed.py`), so the root's parameters (embeddings, final norm, head), which this
# forward reads directly, are gathered around it and their gradients reduced after backward.
PACKED_FORWARD_METHOD = "asyncgrpo_packed_forward"


def row_logprobs(
    model,
    row: PackedRow,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    router_aux_loss: bool = False,
    keep_logits: bool = False,
) -> TokenLogprobs:
    """Forward one packed row through `model` (switched with `enable_tree_attention`) and return the
    log-probs of its E loss entries, in entry order; with `router_aux_loss`, also the MoE
    load-balancing loss over the row's tokens, each counted once per sample that contains it."""
    config = model.config.get_text_config()
    if config._attn_implementation != TREE_ATTENTION:
        raise ConfigurationError(
            f"model uses attn_implementation={config._attn_implementation!r}: call "
            "asyncgrpo.packing.tree_attention.enable_tree_attention(model) before packing rows"
        )
    device = model.get_input_embeddings().weight.device
    head_device = model.get_output_embeddings().weight.device
    num_tokens = row.num_tokens
    length = padded_length(num_tokens)
    # Padding: token 0 at position 0; it attends only to itself and no entry reads it.
    input_ids = torch.zeros(length, dtype=torch.int64, device=device)
    position_ids = torch.zeros(length, dtype=torch.int64, device=device)
    input_ids[:num_tokens] = to_device(row.input_ids, device)
    position_ids[:num_tokens] = to_device(row.position_ids, device)
    masks = tree_attention_masks(
        config,
        to_device(row.subtree_end, device),
        position_ids[:num_tokens],
        to_device(row.segment_ids, device),
        host_subtree_end=row.subtree_end,
    )
    token_weights = None
    if router_aux_loss:
        token_weights = torch.zeros(length, dtype=torch.float32, device=device)  # padding weighs 0
        token_weights[:num_tokens] = to_device(row.token_multiplicity, device).float()
    forward = getattr(model, PACKED_FORWARD_METHOD, None) or (lambda *args: packed_forward(model, *args))
    logprobs, entropy, top_logprobs, aux_loss = forward(
        input_ids,
        position_ids,
        masks,
        to_device(row.predict_index, device),
        to_device(row.target_ids, head_device),
        temperature,
        to_device(row.top_ids, head_device),
        to_device(row.candidate_offsets, head_device),
        to_device(row.candidate_ids, head_device),
        chunk_size,
        token_weights,
        keep_logits,
    )
    return TokenLogprobs(logprobs, entropy, top_logprobs, aux_loss)


def packed_forward(
    model,
    input_ids: torch.Tensor,  # (L,) padded row
    position_ids: torch.Tensor,  # (L,) trie depths
    masks,  # tree_attention_masks(...)
    predict_index: torch.Tensor,  # (E,) packed index predicting each entry
    targets: torch.Tensor,  # (E,)
    temperature: float,
    top_ids: torch.Tensor | None,
    candidate_offsets: torch.Tensor | None,
    candidate_ids: torch.Tensor | None,
    chunk_size: int | None,
    router_token_weights: torch.Tensor | None = None,  # (L,): ask for the MoE load-balancing loss
    keep_logits: bool = False,  # token_logprobs: keep the head output for backward
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The decoder on the packed row, then the head on the E predicting positions only. Returns a
    tuple of tensors (what FSDP2's forward hooks can track): logprobs, entropy, top_logprobs and
    the load-balancing loss (None unless `router_token_weights` is given)."""
    router = {} if router_token_weights is None else {"output_router_logits": True}
    out = model.get_decoder()(
        input_ids=input_ids[None],
        position_ids=position_ids[None],
        attention_mask=masks,
        use_cache=False,
        **router,
    )
    aux_loss = None
    if router_token_weights is not None:
        config = model.config.get_text_config()
        aux_loss = load_balancing_loss(out.router_logits, config.num_experts_per_tok, router_token_weights)
    hidden = out.last_hidden_state[0]  # (L, H)
    head = output_head(model)
    result = token_logprobs(
        hidden[predict_index.to(hidden.device)].to(head.weight.device),
        head,
        targets,
        temperature,
        top_ids=top_ids,
        candidate_offsets=candidate_offsets,
        candidate_ids=candidate_ids,
        chunk_size=chunk_size,
        keep_logits=keep_logits,
    )
    return result.logprobs, result.entropy, result.top_logprobs, aux_loss
