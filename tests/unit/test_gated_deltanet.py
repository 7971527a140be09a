"""Tree packing of Gated DeltaNet hybrids (Qwen3.5, Qwen3-Next): a packed row gives each sample
exactly what forwarding it alone gives, log-probs and gradients, and the layout's pieces (path
convolution, segment parents, levels) are what a hand-drawn trie says."""

import copy
import functools
import importlib.util
import logging
import os
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gated_norm_check import GATED_NORM_CASES, gated_norm_definition
from interpreted import run_interpreted
from test_gated_deltanet_gpu import random_tree, row_arrays
from test_logprobs import TEMPERATURE, check_packed_equals_unpacked, completion_sample, random_trie_samples
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
from tree_conv_check import TREE_CONV_CASES

from asyncgrpo.cli.tiny_model import build_model, build_tokenizer
from asyncgrpo.losses.token_logprobs import row_logprobs
from asyncgrpo.packing import gated_deltanet, kernel_choice
from asyncgrpo.packing.gated_deltanet import fla_refusal
from asyncgrpo.packing.path_conv import path_conv_and_activate, tree_causal_conv1d
from asyncgrpo.packing.recurrent_layout import recurrent_layout, to_layer_order, to_packed_order
from asyncgrpo.packing.tree_attention import enable_tree_attention
from asyncgrpo.packing.trie import pack_row

VOCAB = 900


def _qwen3_next():
    tokenizer = build_tokenizer()
    config = Qwen3NextConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        layer_types=["linear_attention", "linear_attention", "full_attention"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=64, dtype="float32",
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3NextForCausalLM(config)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def models(request):
    """(plain model, tree-packed copy with the same weights) of each GDN family."""
    plain = _qwen3_next() if request.param == "qwen3_next" else build_model(build_tokenizer(), arch="qwen3_5")
    return plain, enable_tree_attention(copy.deepcopy(plain))


def test_layout_of_a_hand_drawn_trie():
    """Prompt p0 p1 p2 (segment 0), completions a0 a1 (segment 1) and b0 b1 b2 (segment 2), and a
    later turn under a: a0 a1 c0 (segment 3, its parent segment 1)."""
    segment_ids = np.array([0, 0, 0, 1, 1, 3, 2, 2, 2])
    subtree_end = np.array([9, 9, 9, 6, 6, 6, 9, 9, 9])
    layout = recurrent_layout(segment_ids, subtree_end, kernel_size=3)
    # Layer order: the prompt, then a and b (depth 1), then c.
    assert layout.order.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 5]
    assert layout.inverse.tolist() == [0, 1, 2, 3, 4, 8, 5, 6, 7]
    none = 9
    packed_conv = np.append(layout.order.numpy(), none)[layout.conv_index.numpy()][layout.inverse.numpy()]
    assert packed_conv.tolist() == [
        [none, none, 0], [none, 0, 1], [0, 1, 2],  # the prompt
        [1, 2, 3], [2, 3, 4],  # a0 a1 read the prompt's tail
        [3, 4, 5],  # c0 reads a0 a1
        [1, 2, 6], [2, 6, 7], [6, 7, 8],  # b0 b1 b2 read the prompt's tail, not a's
    ]  # fmt: skip
    # In layer order b0, b1 (rows 5, 6) and c0 (row 8) do not read the rows just before them.
    assert layout.conv_fix_rows.tolist() == [5, 6, 8]
    # Remote reads (across a segment start, not the rows just before): b0 b1 (rows 5, 6) read the
    # prompt's tail (rows 1, 2), c0 (row 8) reads a0 a1 (rows 3, 4); a's rows read the prompt's
    # tail too, but as the rows just before them.
    assert layout.conv_reader_rows.tolist() == [5, 6, 8]
    assert layout.conv_read_slot.tolist() == [-1, -1, -1, -1, -1, 0, 1, -1, 2]
    assert layout.conv_remote_tokens.tolist() == [1, 2, 3, 4]
    assert layout.conv_remote_slot.tolist() == [-1, 0, 1, 2, 3, -1, -1, -1, -1]
    entries = np.split(layout.conv_remote_entries.numpy(), layout.conv_remote_offsets.numpy()[1:-1])
    # (reader slot, tap) of each remote token: 1 <- b0 tap 0; 2 <- b0 tap 1, b1 tap 0; 3, 4 <- c0
    assert [[divmod(int(e), 3) for e in group] for group in entries] == [
        [(0, 0)], [(0, 1), (1, 0)], [(2, 0)], [(2, 1)]
    ]  # fmt: skip
    assert [(level.start, level.stop) for level in layout.levels] == [(0, 3), (3, 8), (8, 9)]
    assert [level.parent_rows.tolist() for level in layout.levels] == [[-1], [0, 0], [0]]
    assert [level.cu_seqlens.tolist() for level in layout.levels] == [[0, 3], [0, 2, 5], [0, 1]]
    assert layout.levels[1].gather.tolist() == [[3, 4, 3], [5, 6, 7]]
    assert layout.levels[1].padding.tolist() == [[False, False, True], [False, False, False]]
    assert layout.levels[1].unpad.tolist() == [0, 1, 3, 4, 5]


def test_layouts_needing_no_gather():
    """Samples that share nothing are all roots (one level), and one GRPO group is its prompt then
    its completions (two levels) in packed order already: neither gathers its rows."""
    roots = recurrent_layout(np.repeat([0, 1, 2], [5, 3, 4]), np.repeat([5, 8, 12], [5, 3, 4]), 4)
    assert roots.order is None and len(roots.levels) == 1
    assert roots.conv_fix_rows.tolist() == [5, 6, 7, 8, 9, 10]  # each root's start reads zeros
    group = recurrent_layout(np.repeat([0, 1, 2], [5, 3, 4]), np.repeat([12, 8, 12], [5, 3, 4]), 4)
    assert group.order is None and len(group.levels) == 2
    assert group.conv_fix_rows.tolist() == [8, 9, 10]  # the second completion reads the prompt's tail


INDEXING_OPS = {"index_select", "gather", "index", "index_put", "index_put_", "index_copy", "index_copy_",
                "index_add", "index_add_", "scatter", "scatter_add", "take"}  # fmt: skip


class IndexingCounter(TorchDispatchMode):
    """Counts the aten indexing ops (gathers, scatters) that run under it, forward and backward."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in INDEXING_OPS:
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("shape", ["whole_row", "scattered"])
def test_gathers_only_where_the_trie_needs_them(shape):
    """A GDN layer's forward and backward over a row that is one segment (the whole row one level)
    runs no gather or scatter at all; the counter does see them on a scattered multi-level trie."""
    model = build_model(build_tokenizer(), arch="qwen3_5")
    module = next(m for m in model.modules() if gated_deltanet.is_gated_deltanet(m))
    if shape == "whole_row":
        parents, lengths = np.array([-1]), np.array([40])
    else:
        parents, lengths = random_tree(np.random.default_rng(2), 9, 8)
    layout = recurrent_layout(*row_arrays(parents, lengths), module.conv1d.weight.shape[-1])
    hidden = torch.randn(1, layout.num_tokens, model.config.hidden_size, requires_grad=True)
    with IndexingCounter() as counter:
        out = gated_deltanet.tree_gdn_forward(module, hidden, layout)
        out.square().sum().backward()
    if shape == "whole_row":
        assert counter.counts == {}
    else:
        assert layout.order is not None and counter.counts.get("index_select", 0) > 0, counter.counts


def test_row_permutation_and_its_gradient():
    """to_layer_order / to_packed_order are inverse gathers (with the padded tail dropped and zeroed)
    and their gradient is plain indexing's."""
    rng = np.random.default_rng(0)
    parents, lengths = random_tree(rng, 10, 6)
    layout = recurrent_layout(*row_arrays(parents, lengths), 4)
    num_tokens = layout.num_tokens
    packed = torch.randn(num_tokens + 3, 5, dtype=torch.float64, requires_grad=True)  # 3 padding rows
    rows = to_layer_order(packed, layout)
    torch.testing.assert_close(rows, packed[layout.order], rtol=0, atol=0)
    back = to_packed_order(rows * 2, layout, num_tokens + 3)
    torch.testing.assert_close(back[:num_tokens], 2 * packed[:num_tokens], rtol=0, atol=0)
    assert back[num_tokens:].abs().max() == 0
    cotangent = torch.randn_like(back)
    (grad,) = torch.autograd.grad((back * cotangent).sum(), packed)
    want = torch.cat([2 * cotangent[:num_tokens], torch.zeros(3, 5, dtype=torch.float64)])
    torch.testing.assert_close(grad, want, rtol=0, atol=0)


def test_tree_conv_equals_conv1d_on_a_path():
    """On a single chain the path convolution is F.conv1d with left padding K - 1."""
    torch.manual_seed(0)
    x, weight, bias = torch.randn(10, 6), torch.randn(6, 4), torch.randn(6)
    layout = recurrent_layout(np.zeros(10, dtype=np.int64), np.full(10, 10), kernel_size=4)
    want = F.conv1d(x.T[None], weight[:, None], bias, padding=3, groups=6)[0, :, :10].T
    torch.testing.assert_close(tree_causal_conv1d(x, weight, bias, layout.conv_index), want)


@pytest.mark.parametrize("shape", ["random", "roots", "chain"])
def test_path_conv_equals_its_definition(shape):
    """The layers' convolution off CUDA (F.conv1d with the segment starts fixed up) equals the
    per-tap definition on every row, with its gradients, in fp64."""
    rng = np.random.default_rng(1)
    parents, lengths = {
        "random": random_tree(rng, 16, 7),  # segments shorter and longer than K - 1
        "roots": (np.full(4, -1), np.array([5, 1, 3, 6])),
        "chain": (np.arange(-1, 3), np.array([5, 1, 3, 6])),
    }[shape]
    layout = recurrent_layout(*row_arrays(parents, lengths), 4)
    mixed = torch.randn(layout.num_tokens, 6, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    got = torch.cat(path_conv_and_activate(mixed, weight, None, layout, "silu", (2, 4)), dim=1)
    want = F.silu(tree_causal_conv1d(mixed, weight, None, layout.conv_index))
    torch.testing.assert_close(got, want)
    cotangent = torch.randn_like(got)
    got_grads = torch.autograd.grad((got * cotangent).sum(), (mixed, weight))
    want_grads = torch.autograd.grad((want * cotangent).sum(), (mixed, weight))
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)


@pytest.mark.slow
def test_tree_conv_kernel_interpreted():
    """The Triton path convolution (the CUDA path) against the per-tap definition, values and
    gradients, on several trie shapes, at two tile sizes, through Triton's interpreter
    (tests/support/tree_conv_check.py)."""
    lines = run_interpreted("tree_conv_check.py").splitlines()
    assert len([line for line in lines if line.startswith("ok ")]) == 3 * len(TREE_CONV_CASES), lines


@pytest.mark.slow
def test_gated_norm_kernel_interpreted():
    """The fused gated RMS norm (the CUDA path) against its definition in fp64, values and gradients,
    through Triton's interpreter (tests/support/gated_norm_check.py)."""
    lines = run_interpreted("gated_norm_check.py").splitlines()
    assert len([line for line in lines if line.startswith("ok ")]) == 2 * len(GATED_NORM_CASES), lines


@pytest.mark.slow
def test_gdn_kernels_compile_for_hopper():
    """The path convolution's and the gated norm's kernels through Triton's compiler down to sm_90
    machine code, with no GPU: the interpreter skips the compiler's passes
    (tests/support/tree_conv_compile_check.py). No variant may spill registers to the stack."""
    lines = run_interpreted("tree_conv_compile_check.py", interpret=False).splitlines()
    compiled = [line for line in lines if line.startswith("compiled ")]
    assert len(compiled) == 3 * 4 + 2 * 2, lines
    assert all(" stack=0 " in line for line in compiled), compiled


@pytest.mark.parametrize("norm_class", gated_deltanet.GATED_RMS_NORMS)
def test_models_gated_norms_are_the_fused_kernels_function(norm_class):
    """Each model norm the fused kernel may replace computes the function the kernel is held to
    (tests/support/gated_norm_check.py), in fp32; the layers call it on (P, Hv, Dv) core and gate tensors."""
    module = {
        "Qwen3_5RMSNormGated": "qwen3_5", "Qwen3_5MoeRMSNormGated": "qwen3_5_moe",
        "Qwen3NextRMSNormGated": "qwen3_next",
    }[norm_class]  # fmt: skip
    cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), norm_class)
    norm = cls(48, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(48) / 4)
    x, z = torch.randn(2, 5, 3, 48, dtype=torch.float64)
    want = gated_norm_definition(x, z, norm.weight.double(), 1e-5)
    got = gated_deltanet.gated_norm(norm, x.float(), z.float())  # CPU: the module itself
    torch.testing.assert_close(got.view(5, 3, 48).double(), want, rtol=1e-5, atol=1e-5)


def test_kernel_choice_by_environment(monkeypatch):
    """Off CUDA the layers run F.conv1d and the model's norm whatever the variables say; on CUDA the
    Triton kernels by default, another choice when asked, and an error naming the fix for an unknown
    choice or one whose package is missing."""
    monkeypatch.setattr(kernel_choice, "installed", lambda package: package == "triton")
    for variable in (kernel_choice.PATH_CONV_ENV, kernel_choice.GATED_NORM_ENV):
        monkeypatch.delenv(variable, raising=False)
    assert (
        kernel_choice.path_conv_choice("cuda") == "triton"
        and kernel_choice.gated_norm_choice("cuda") == "triton"
    )
    monkeypatch.setenv(kernel_choice.PATH_CONV_ENV, "conv1d")
    monkeypatch.setenv(kernel_choice.GATED_NORM_ENV, "Model")
    assert (
        kernel_choice.path_conv_choice("cuda") == "conv1d"
        and kernel_choice.gated_norm_choice("cuda") == "model"
    )
    assert (
        kernel_choice.path_conv_choice("cpu") == "conv1d"
        and kernel_choice.gated_norm_choice("cpu") == "model"
    )
    monkeypatch.setenv(kernel_choice.PATH_CONV_ENV, "fla")
    with pytest.raises(ValueError, match="fla is not installed"):
        kernel_choice.path_conv_choice("cuda")
    monkeypatch.setenv(kernel_choice.PATH_CONV_ENV, "cudnn")
    with pytest.raises(ValueError, match="choose one of triton, fla, conv1d"):
        kernel_choice.path_conv_choice("cuda")
    monkeypatch.setattr(kernel_choice, "installed", lambda package: False)
    monkeypatch.delenv(kernel_choice.PATH_CONV_ENV)
    monkeypatch.delenv(kernel_choice.GATED_NORM_ENV)
    assert (
        kernel_choice.path_conv_choice("cuda") == "conv1d"
        and kernel_choice.gated_norm_choice("cuda") == "model"
    )


def test_group_sharing(models):
    """A GRPO group with a long prompt: the prompt's state is computed once for 6 completions."""
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, VOCAB, 70)  # longer than one 64-token chunk of the recurrence
    samples = [
        completion_sample(rng, prompt, rng.integers(0, VOCAB, int(rng.integers(3, 20)))) for _ in range(6)
    ]
    row = check_packed_equals_unpacked(*models, samples)
    assert row.packing_ratio > 3


@pytest.mark.parametrize("shape", ["roots", "group"])
def test_rows_in_packed_order(models, shape):
    """Rows whose layers need no gather (`test_layouts_needing_no_gather`): samples that share
    nothing, and one GRPO group; each sample still gets what it gets alone."""
    rng = np.random.default_rng(4)
    if shape == "roots":
        samples = [
            completion_sample(rng, [first, *rng.integers(0, VOCAB, 30)], rng.integers(0, VOCAB, 20))
            for first in (1, 2, 3)
        ]
    else:
        prompt = rng.integers(0, VOCAB, 70)
        samples = [completion_sample(rng, prompt, rng.integers(0, VOCAB, 12 + i)) for i in range(3)]
    row = check_packed_equals_unpacked(*models, samples)
    layout = recurrent_layout(row.segment_ids, row.subtree_end, 4)
    assert layout.order is None and len(layout.levels) == (1 if shape == "roots" else 2)


@pytest.mark.parametrize("seed", [3])
def test_random_tries(models, seed):
    """Multi-level tries: several groups, forks, multi-turn continuations, a sample that is a
    prefix of another."""
    rng = np.random.default_rng(seed)
    row = check_packed_equals_unpacked(*models, random_trie_samples(rng))
    assert len(set(row.segment_ids.tolist())) > 8


def test_vision_checkpoint_packs():
    """The language model inside the image-text-to-text checkpoint packs like the text-only one."""
    plain = build_model(build_tokenizer(vision=True), arch="qwen3_5_vl")
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, VOCAB, 70)
    samples = [
        completion_sample(rng, prompt, rng.integers(0, VOCAB, int(rng.integers(3, 20)))) for _ in range(4)
    ]
    row = check_packed_equals_unpacked(plain, enable_tree_attention(copy.deepcopy(plain)), samples)
    assert row.packing_ratio > 2.5


def _unpacked_gradients(model, samples, weights) -> dict[str, torch.Tensor]:
    """Parameter gradients of sum(weights * log p(entry)) over the samples forwarded one by one."""
    model.zero_grad()
    offset = 0
    for s in samples:
        logits = model(input_ids=torch.from_numpy(s.token_ids)[None]).logits[0] / TEMPERATURE
        positions = np.flatnonzero(s.trained)
        allowed = torch.ones(len(positions), logits.shape[-1], dtype=torch.bool)
        for j, candidates in enumerate(s.candidate_sets or []):
            if len(candidates):
                allowed[j] = False
                allowed[j, torch.from_numpy(candidates)] = True
        logp = torch.log_softmax(logits[positions - 1].masked_fill(~allowed, float("-inf")), -1)
        target = logp.gather(1, torch.from_numpy(s.token_ids[positions])[:, None])[:, 0]
        (target.double() * weights[offset : offset + len(positions)]).sum().backward()
        offset += len(positions)
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _relative_errors(got: dict, want: dict) -> dict[str, float]:
    return {name: ((got[name] - w).norm() / w.norm().clamp(min=1e-30)).item() for name, w in want.items()}


def test_packed_gradient_equals_unpacked(models, monkeypatch):
    """fp32, every parameter (A_log, dt_bias and the convolution weights included): the packed row's
    gradient is within 1e-5 of the per-sample forwards' (norm of the difference over the norm),
    except where the model's own fp32 arithmetic is less precise than that.

    That is the decay path (A_log, dt_bias, in_proj_a): its gradients sum terms of both signs over
    each chunk of the recurrence, and a packed row's chunks start at segment starts instead of sample
    starts, so their round-off differs. The same model forwarding the same samples alone with its
    recurrence chunked by 32 or 16 instead of 64 moves them as much (measured: qwen3_5 A_log 1.0e-4
    by packing, 1.1e-4 by re-chunking; Qwen3-Next 2.3e-4 and 2.2e-4 on another trie), so the bound
    there is twice the larger re-chunking difference, the size of the model's own fp32 round-off.
    transformers' torch chunked rule runs in fp32 whatever the model's dtype, so there is no fp64
    reference to compare with instead."""
    plain, tree = models
    rng = np.random.default_rng(6)
    samples = random_trie_samples(rng)
    row = pack_row(samples)
    weights = torch.from_numpy(rng.normal(size=row.num_entries))
    tree.zero_grad()
    (row_logprobs(tree, row, TEMPERATURE).logprobs.double() * weights).sum().backward()
    packed = {name: p.grad for name, p in tree.named_parameters() if p.grad is not None}
    alone = _unpacked_gradients(plain, samples, weights)
    modeling = sys.modules[type(plain).__module__]
    rule = modeling.torch_chunk_gated_delta_rule
    own_round_off = dict.fromkeys(alone, 0.0)
    for chunk_size in (32, 16):
        monkeypatch.setattr(
            modeling, "torch_chunk_gated_delta_rule", functools.partial(rule, chunk_size=chunk_size)
        )
        rechunked = _relative_errors(_unpacked_gradients(plain, samples, weights), alone)
        own_round_off = {name: max(own_round_off[name], rechunked[name]) for name in alone}
    assert packed.keys() == alone.keys()
    errors = _relative_errors(packed, alone)
    for name, error in errors.items():
        assert error <= max(1e-5, 2 * own_round_off[name]), (name, error, own_round_off[name])
    decay_path = ("A_log", "dt_bias", "in_proj_a.weight", "in_proj_ba.weight")
    assert max(error for name, error in errors.items() if not name.endswith(decay_path)) <= 1e-5


@pytest.mark.parametrize(
    ("capability", "triton_version", "tilelang", "nvcc", "refused"),
    [
        ((9, 0), "3.6.0", False, True, True),  # the H200 image of bench/RESULTS.md
        ((9, 0), "3.4.0", False, True, True),
        ((9, 0), "3.7.1", False, True, False),
        ((9, 0), "3.3.1", False, True, False),
        ((9, 0), "3.6.0", True, True, False),  # fla runs the kernel through tilelang
        ((9, 0), "3.6.0", True, False, True),  # tilelang without an nvcc to compile with: fla skips it
        ((8, 0), "3.6.0", False, True, False),  # not Hopper
    ],
)
def test_fla_refusal(monkeypatch, capability, triton_version, tilelang, nvcc, refused):
    """fla-core 0.6 raises in the gated delta rule's backward on Hopper with Triton in [3.4, 3.7.1)
    unless tilelang and an nvcc are found: the tree path must know beforehand and run the torch rule."""
    find_spec = importlib.util.find_spec
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__=triton_version))
    monkeypatch.setitem(sys.modules, "fla.utils", types.SimpleNamespace(has_usable_nvcc=lambda: nvcc))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "tilelang" and tilelang else find_spec(name, *a),
    )
    reason = fla_refusal(torch.device("cuda"))
    assert (reason is not None) == refused
    if refused:
        assert triton_version in reason and "tilelang" in reason


class FakeGatedDeltaNet(torch.nn.Module):
    """Has what `is_gated_deltanet` looks for, nothing more."""

    def __init__(self):
        super().__init__()
        self.in_proj_qkv = self.conv1d = self.norm = torch.nn.Identity()
        self.A_log = self.dt_bias = torch.nn.Parameter(torch.zeros(2))


@pytest.mark.parametrize("case", ["cpu", "no_fla", "refused"])
def test_start_up_line_says_which_rule_runs_and_why(monkeypatch, caplog, tmp_path, case):
    """The trainer's start-up line for a Gated DeltaNet model on the torch fallback: the reason, and
    on a GPU what to install (a warning there) and where kernel autotuning is kept; a model without
    such layers logs nothing."""
    for name, value in (("TRITON_CACHE_DIR", "unused"), ("FLA_CACHE_RESULTS", "1")):
        monkeypatch.setenv(name, value)  # restored after the test
    find_spec = importlib.util.find_spec
    if case != "cpu":  # a CUDA device (never run here): fla-core absent, or present but refusing
        found = {"triton": None, "fla": object() if case == "refused" else None}
        monkeypatch.setattr(
            importlib.util,
            "find_spec",
            lambda name, *a: found[name] if name in found else find_spec(name, *a),
        )
        monkeypatch.setattr(gated_deltanet, "fla_refusal", lambda device: "Triton 3.6.0 on Hopper: X")
        kernel_choice.installed.cache_clear()
    device = torch.device("cpu" if case == "cpu" else "cuda")
    model = torch.nn.Sequential(FakeGatedDeltaNet())
    with caplog.at_level(logging.INFO, logger=gated_deltanet.__name__):
        line = gated_deltanet.log_gated_delta_rule_path(model, device, tmp_path / "kernels")
        assert (
            gated_deltanet.log_gated_delta_rule_path(torch.nn.Sequential(torch.nn.Linear(2, 2)), device)
            is None
        )
    kernel_choice.installed.cache_clear()
    assert [record.getMessage() for record in caplog.records] == [line]
    assert line.startswith("Gated DeltaNet layers run transformers' torch gated delta rule")
    assert "path convolution: F.conv1d with segment starts fixed up; gated norm: the model's module" in line
    expected = {
        "cpu": ("fla-core's kernels run on CUDA GPUs only (this device is cpu)", logging.INFO),
        "no_fla": ("fla-core is not installed: `pip install 'asyncgrpo[gpu]'` brings the fast path",
                   logging.WARNING),
        "refused": ("Triton 3.6.0 on Hopper: X", logging.WARNING),
    }[case]  # fmt: skip
    assert expected[0] in line and caplog.records[0].levelno == expected[1]
    if case == "cpu":  # nothing compiles for a GPU there: Triton's cache is left alone
        assert "autotuning" not in line and os.environ["TRITON_CACHE_DIR"] == "unused"
    else:
        assert line.endswith(f"; kernel autotuning kept in {tmp_path / 'kernels'}")
        assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "kernels") and (tmp_path / "kernels").is_dir()
