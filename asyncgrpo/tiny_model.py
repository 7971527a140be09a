"""A tiny Qwen3-architecture causal LM and a byte-level BPE tokenizer, built offline.

Nothing can be downloaded on the machines this project is tested on, so tests, the demo and the
benchmarks build their own model: deterministic (same bytes for the same arguments), in seconds,
with the same chat conventions as Qwen3 (ChatML, `<tool_call>{json}</tool_call>`,
`<tool_response>`, `<|im_end|>` as EOS) so that the tool loop and the chat-template code paths
run exactly as they would on a real Qwen3 checkpoint.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from asyncgrpo.rollout.chat import QWEN3_TRAINING_TEMPLATE

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen3 registers these as added (not special) tokens: they survive skip_special_tokens=True.
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

# Qwen3's chat conventions without its rewriting of earlier assistant turns' reasoning: the template
# is prefix-preserving (appending a message never changes how earlier ones render), which is what a
# multi-turn tool loop needs to extend one training sample instead of forking.
CHAT_TEMPLATE = QWEN3_TRAINING_TEMPLATE


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny model. The defaults run ~2-3k generated tokens/s on a 2-core CPU in vLLM."""

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


def build_tokenizer(vocab_size: int = TinyModelSpec.vocab_size) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (every string encodes; no unknown token) with ChatML specials."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS) - len(MARKUP_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        padding_side="left",
        model_max_length=TinyModelSpec.max_position_embeddings,
    )
    fast.add_tokens(MARKUP_TOKENS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(
    tokenizer: PreTrainedTokenizerFast, spec: TinyModelSpec = TinyModelSpec()
) -> Qwen3ForCausalLM:
    """Random Qwen3 weights from a fixed seed. `tie_word_embeddings=False`: vLLM's CPU reload
    leaves a tied `lm_head` stale."""
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen3Config(
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
    torch.manual_seed(spec.seed)
    model = Qwen3ForCausalLM(config)
    # The default init (std 0.02) makes every next-token distribution nearly uniform; a larger
    # output scale gives the sampler a peaked, position-dependent distribution, like a real LM.
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5 / spec.hidden_size**0.5 * 4)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=tokenizer.pad_token_id)
    return model


def save_tiny_model(out_dir: str | pathlib.Path, spec: TinyModelSpec = TinyModelSpec()) -> pathlib.Path:
    """Build and save the tokenizer and model to `out_dir` (a directory `vllm serve` can load)."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab_size)
    model = build_model(tokenizer, spec)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out, safe_serialization=True)
    return out
