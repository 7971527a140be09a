"""Tiny causal LMs of the Qwen3 families and a byte-level BPE tokenizer, built offline.

Nothing can be downloaded on the machines this project is tested on, so tests, the demo and the
benchmarks build their own model: deterministic (same bytes for the same arguments), in seconds,
with the same chat conventions as Qwen3 (ChatML, `<tool_call>{json}</tool_call>`,
`<tool_response>`, `<|im_end|>` as EOS) so that the tool loop and the chat-template code paths
run exactly as they would on a real Qwen3 checkpoint.

Architectures (`ARCHES`): `qwen3` (dense attention), `qwen3_5` (Gated DeltaNet hybrid, text only),
`qwen3_5_vl` (the same language model inside Qwen3.5's image-text-to-text checkpoint, with a tiny
vision tower: the form Qwen3.5 checkpoints are published in) and `qwen3_moe` (routed experts).
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from asyncgrpo.errors import ConfigurationError
from asyncgrpo.rollout.training_templates import QWEN3_TRAINING_TEMPLATE

# The placeholders of Qwen3.5's image-text-to-text config; text-only training never emits them.
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
ARCHES = ("qwen3", "qwen3_5", "qwen3_5_vl", "qwen3_moe")


@dataclass(frozen=True)
class ChatTokens:
    """What a chat family writes its conversations with: the chat template, the tokens it marks up
    turns with (`special` ones are dropped when a turn is decoded with skip_special_tokens, `markup`
    ones are kept), and its end-of-turn, padding and beginning-of-text tokens."""

    chat_template: str
    special: tuple[str, ...]
    markup: tuple[str, ...]
    eos: str
    pad: str
    bos: str | None = None


# Qwen3's chat conventions without its rewriting of earlier assistant turns' reasoning: the template
# is prefix-preserving (appending a message never changes how earlier ones render), which is what a
# multi-turn tool loop needs to extend one training sample instead of forking. Qwen3 registers the
# markup as added (not special) tokens: they survive skip_special_tokens=True.
QWEN3_CHAT = ChatTokens(
    chat_template=QWEN3_TRAINING_TEMPLATE,
    special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    markup=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"),
    eos="<|im_end|>",
    pad="<|endoftext|>",
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny model. The defaults generate fast enough on a 2-core CPU in vLLM for the tests
    and the demo (bench/RESULTS.md, "overlap", has its generation rate)."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    # vLLM's CPU attention backend only takes head sizes from 32 up.
    head_dim: int = 32
    vocab_size: int = 1024
    max_position_embeddings: int = 4096
    seed: int = 0


def _tokenizer_corpus() -> list[str]:
    """Text the BPE merges are learned from: chat markup, arithmetic, JSON and plain English."""
    words = (
        "the a an of to in is and you that it for on are with as be this was at by not or have "
        "from one what all can there which do their if will how up out so about more then them "
        "answer question number result sum product add multiply subtract count reverse word letter "
        "user assistant system tool function name arguments content role call response value "
        "yes no true false hello world think step first second final correct compute calculate"
    ).split()
    lines = []
    for i in range(200):
        a, b = (i * 7919) % 97, (i * 104729) % 89
        lines.append(f"What is {a} + {b}? The answer is {a + b}. {a} * {b} = {a * b}.")
        lines.append(" ".join(words[(i * k) % len(words)] for k in range(1, 13)))
        lines.append(json.dumps({"name": words[i % len(words)], "arguments": {"a": a, "b": b}}))
    lines.append("# Tools\n\nYou may call one or more functions to assist with the user query.")
    lines.append("<tools></tools> XML tags <function-name> <args-json-object> \\boxed{42}")
    return lines


def build_tokenizer(
    vocab_size: int = TinyModelSpec.vocab_size, vision: bool = False, chat: ChatTokens = QWEN3_CHAT
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (every string encodes; no unknown token) of at most `vocab_size`
    ids, written with `chat`'s conventions (Qwen3's ChatML unless told); `vision` adds the
    image/video placeholders an image-text-to-text config points to."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(chat.special) - len(chat.markup),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    named = {chat.eos, chat.pad, chat.bos}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=chat.eos,
        pad_token=chat.pad,
        bos_token=chat.bos,
        additional_special_tokens=[token for token in chat.special if token not in named],
        padding_side="left",
        model_max_length=TinyModelSpec.max_position_embeddings,
    )
    fast.add_tokens(list(chat.markup))
    if vision:
        fast.add_tokens(VISION_TOKENS, special_tokens=True)
    fast.chat_template = chat.chat_template
    return fast


def _common_text_config(tokenizer: PreTrainedTokenizerFast, spec: TinyModelSpec) -> dict:
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=eos_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def _qwen3_5_text_config(common: dict, spec: TinyModelSpec) -> dict:
    """Gated DeltaNet layers then full attention (Qwen3.5's 3:1 pattern, shortened). vLLM-CPU's GDN
    kernel takes equal key/value head dims of 64 or 128 only; the rotary part of a head (a quarter,
    as in Qwen3.5) is split over Qwen3.5's three M-RoPE sections."""
    layers = max(spec.num_hidden_layers, 3)
    rotary_half = int(spec.head_dim * 0.25) // 2
    return dict(
        common,
        num_hidden_layers=layers,
        layer_types=["linear_attention"] * (layers - 1) + ["full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [rotary_half - 2 * (rotary_half // 3), rotary_half // 3, rotary_half // 3],
            "mrope_interleaved": True,
        },
    )


def build_model(
    tokenizer: PreTrainedTokenizerFast, spec: TinyModelSpec = TinyModelSpec(), arch: str = "qwen3"
) -> PreTrainedModel:
    """Random weights of architecture `arch` (one of ARCHES) from a fixed seed.
    `tie_word_embeddings=False`: vLLM's CPU reload leaves a tied `lm_head` stale."""
    common = _common_text_config(tokenizer, spec)
    if arch == "qwen3":
        model_class, config = Qwen3ForCausalLM, Qwen3Config(**common)
    elif arch == "qwen3_moe":
        config = Qwen3MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=spec.intermediate_size // 2
        )
        model_class = Qwen3MoeForCausalLM
    elif arch == "qwen3_5":
        model_class, config = Qwen3_5ForCausalLM, Qwen3_5TextConfig(**_qwen3_5_text_config(common, spec))
    elif arch == "qwen3_5_vl":
        vision_ids = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
        config = Qwen3_5Config(
            text_config=_qwen3_5_text_config(common, spec),
            vision_config=dict(
                depth=1,
                hidden_size=32,
                intermediate_size=64,
                num_heads=2,
                out_hidden_size=spec.hidden_size,
                num_position_embeddings=64,
            ),
            vision_start_token_id=vision_ids[0],
            vision_end_token_id=vision_ids[1],
            image_token_id=vision_ids[2],
            video_token_id=vision_ids[3],
            tie_word_embeddings=False,
            dtype="float32",
        )
        model_class = Qwen3_5ForConditionalGeneration
    else:
        raise ConfigurationError(f"unknown tiny-model arch {arch!r}: pick one of {', '.join(ARCHES)}")
    torch.manual_seed(spec.seed)
    model = model_class(config)
    # The default init (std 0.02) makes every next-token distribution nearly uniform; a larger
    # output scale gives the sampler a peaked, position-dependent distribution, like a real LM.
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0.0, 0.5 / spec.hidden_size**0.5 * 4)
    model.generation_config = GenerationConfig(
        eos_token_id=common["eos_token_id"], pad_token_id=tokenizer.pad_token_id
    )
    return model


def save_tiny_model(
    out_dir: str | pathlib.Path, spec: TinyModelSpec = TinyModelSpec(), arch: str = "qwen3"
) -> pathlib.Path:
    """Build and save the tokenizer and model to `out_dir` (a directory `vllm serve` can load)."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab_size, vision=arch == "qwen3_5_vl")
    model = build_model(tokenizer, spec, arch)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out, safe_serialization=True)
    return out
