"""Tree packing of Gated DeltaNet layers against each sample alone, at the precision it trains in.

1. The rule alone (`tree_gated_delta_rule`): on CUDA the path the library picks (fla's varlen kernel
   level by level; transformers' torch rule, padded, where fla is missing or refuses to train, see
   `fla_refusal`), fp32 and bf16 inputs; on CPU the padded torch rule (fp32). Against the recurrence
   run token by token in fp64 along every root-to-leaf path (each sample alone). The tolerance is
   the kernel's own round-off: the same kernel, same dtype, on the samples laid out one after
   another with nothing shared (plain packing). A deliberately broken layout (parents dropped) must
   miss it by far.
2. The Qwen3.5-2B shape (public config, random weights) on CUDA as the trainer runs it: fp32 weights
   under bf16 autocast. Log-probs and every parameter's gradient of a packed multi-level trie,
   against the fp32 forward of each sample alone (transformers' torch rule, no autocast, no TF32):
   packing must not be further from fp32 than the model's own unpacked bf16 forward is.
3. Whether fla's varlen kernel trains on this GPU at all (skipped, with the reason, where it cannot).
"""

import copy
import inspect
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_logprobs import TEMPERATURE, completion_sample, random_trie_samples
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5

from asyncgrpo.losses.token_logprobs import row_logprobs
from asyncgrpo.packing import gated_deltanet, kernel_choice, tree_attention
from asyncgrpo.packing.gated_deltanet import tree_gated_delta_rule
from asyncgrpo.packing.path_conv import path_conv_and_activate, tree_causal_conv1d
from asyncgrpo.packing.recurrent_layout import recurrent_layout, to_layer_order, to_packed_order
from asyncgrpo.packing.tree_attention import enable_tree_attention
from asyncgrpo.packing.trie import pack_row

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from gpu_training import QWEN3_5_2B  # noqa: E402  (the shape the GPU benchmarks use)

VOCAB = QWEN3_5_2B["vocab_size"]


def random_tree(rng, num_segments: int, max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """(parents, lengths) of a random trie of segments in depth-first order; parent -1 = a root."""
    parents, path = [], []
    for segment in range(num_segments):
        path = path[: int(rng.integers(0, len(path) + 1))]
        parents.append(path[-1] if path else -1)
        path.append(segment)
    return np.array(parents), rng.integers(1, max_length + 1, num_segments)


def row_arrays(parents: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """segment_ids and subtree_end per token of the depth-first layout, as a PackedRow has them."""
    starts = np.cumsum(lengths) - lengths
    ends = starts + lengths
    for segment in range(len(parents) - 1, -1, -1):  # children come after their parent
        if parents[segment] >= 0:
            ends[parents[segment]] = max(ends[parents[segment]], ends[segment])
    return np.repeat(np.arange(len(parents)), lengths), np.repeat(ends, lengths)


def sample_paths(parents: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    """Packed token indices of each root-to-leaf path: the samples of the trie."""
    starts = np.cumsum(lengths) - lengths
    paths = []
    for leaf in sorted(set(range(len(parents))) - set(parents.tolist())):
        chain, segment = [], leaf
        while segment >= 0:
            chain.append(segment)
            segment = parents[segment]
        paths.append(np.concatenate([np.arange(starts[s], starts[s] + lengths[s]) for s in chain[::-1]]))
    return paths


def recurrence_fp64(q, k, v, g, beta) -> torch.Tensor:
    """The gated delta rule of one sequence, token by token in fp64: (T, H, Dk/Dv) -> (T, H, Dv)."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    state = q.new_zeros(q.shape[1], q.shape[2], v.shape[2])
    out = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        delta = (v[t] - (state * k[t][:, :, None]).sum(1)) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out.append((state * q[t][:, :, None]).sum(1))
    return torch.stack(out)


def gdn_path(device) -> str:
    """Which rule `tree_gated_delta_rule` runs on `device`."""
    if device == "cpu":
        return "torch-padded"
    return "fla-varlen" if gated_deltanet._fla_chunk_rule(torch.device(device)) else "torch-padded"


def own_segment_end(segment_ids: np.ndarray) -> np.ndarray:
    """subtree_end as if every segment were a root: its own end, per token."""
    starts = np.flatnonzero(np.diff(segment_ids, prepend=-1))
    ends = np.append(starts[1:], len(segment_ids))
    return np.repeat(ends, ends - starts)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def packed_tree_rule(inputs, layout, chunk_rule) -> torch.Tensor:
    """`tree_gated_delta_rule` on packed-order inputs, its output in packed order (as a layer runs it)."""
    out = tree_gated_delta_rule(*(to_layer_order(t, layout) for t in inputs), layout, chunk_rule)
    return to_packed_order(out, layout, layout.num_tokens)


def rule_errors(inputs, cotangent, layout, truth, chunk_rule) -> list[float]:
    """Relative errors of the output and of the 5 input gradients of one `tree_gated_delta_rule`."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = packed_tree_rule(leaves, layout, chunk_rule)
    grads = torch.autograd.grad((out.float() * cotangent).sum(), leaves)
    return [relative(out, truth[0])] + [relative(g, w) for g, w in zip(grads, truth[1:])]


RULE_CASES = [
    pytest.param("cpu", torch.float32, "random", id="cpu-fp32"),
    # Tries whose levels are single segments (a slice each, no padding) or one level of roots (the
    # packed order itself): the paths that skip the gathers.
    pytest.param("cpu", torch.float32, "chain", id="cpu-fp32-chain"),
    pytest.param("cpu", torch.float32, "roots", id="cpu-fp32-roots"),
    pytest.param("cuda", torch.float32, "random", id="cuda-fp32", marks=pytest.mark.gpu),
    pytest.param("cuda", torch.bfloat16, "random", id="cuda-bf16", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize(("device", "dtype", "shape"), RULE_CASES)
def test_tree_rule_equals_each_sample_alone(device, dtype, shape):
    """A random trie of 24 segments (up to 150 tokens: across the 64-token chunks), several roots;
    on CPU also a chain of segments and a row of roots."""
    rng = np.random.default_rng(11)
    heads, dim = (4, 128) if device == "cuda" else (2, 32)
    parents, lengths = random_tree(rng, 24 if device == "cuda" else 12, 150 if device == "cuda" else 80)
    if shape != "random":
        parents = np.arange(-1, 4) if shape == "chain" else np.full(5, -1)
        lengths = lengths[:5]
    segment_ids, subtree_end = row_arrays(parents, lengths)
    num_tokens = len(segment_ids)
    torch.manual_seed(0)
    q, k, v = (torch.randn(num_tokens, heads, dim, device=device) for _ in range(3))
    g = F.logsigmoid(2 * torch.randn(num_tokens, heads, device=device) + 5)  # decays near 1: state carries
    beta = torch.rand(num_tokens, heads, device=device)
    cotangent = torch.randn(num_tokens, heads, dim, device=device)
    inputs = [t.to(dtype) for t in (q, k, v)] + [g, beta.to(dtype)]

    # Truth: each sample alone in fp64; a token in several samples has one output, counted once in
    # the loss, so each sample's share of a token's cotangent is 1 / (samples containing it). The
    # loss's gradient is the sum of each sample's, taken one sample at a time: the token-by-token
    # graph keeps about two fp64 states (0.5 MB each at the GPU case's shape) per step: by count ~3 GB for
    # all 16 samples at once against 0.5 GB for the longest alone, which matters where parallel
    # workers share the GPU (tests/support/gpu_limits.py).
    paths = sample_paths(parents, lengths)
    multiplicity = np.bincount(np.concatenate(paths), minlength=num_tokens)
    leaves = [t.double().requires_grad_() for t in inputs]
    truth_out = torch.zeros(num_tokens, heads, dim, dtype=torch.float64, device=device)
    truth_grads = [torch.zeros_like(leaf) for leaf in leaves]
    for path in paths:
        index = torch.from_numpy(path).to(device)
        out = recurrence_fp64(*(t[index] for t in leaves))
        truth_out[index] = out.detach()
        share = cotangent[index].double() / torch.from_numpy(multiplicity[path]).to(device)[:, None, None]
        for total, grad in zip(truth_grads, torch.autograd.grad((out * share).sum(), leaves)):
            total += grad
    truth = [truth_out, *truth_grads]

    chunk_rule = inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)  # the padded path's rule
    tree = rule_errors(
        inputs, cotangent, recurrent_layout(segment_ids, subtree_end, 4, device), truth, chunk_rule
    )

    # The kernel's own round-off: the samples one after another, nothing shared (one level of roots).
    unrolled = np.concatenate(paths)
    flat_ids = np.repeat(np.arange(len(paths)), [len(p) for p in paths])
    flat_end = np.repeat(np.cumsum([len(p) for p in paths]), [len(p) for p in paths])
    index = torch.from_numpy(unrolled).to(device)
    alone_leaves = [t.detach().requires_grad_() for t in inputs]
    out = packed_tree_rule([t[index] for t in alone_leaves], recurrent_layout(flat_ids, flat_end, 4, device),
                           chunk_rule)  # fmt: skip
    share = cotangent[index] / torch.from_numpy(multiplicity[unrolled]).to(device)[:, None, None]
    grads = torch.autograd.grad((out.float() * share).sum(), alone_leaves)
    alone = [relative(out, truth_out[index])] + [relative(gr, w) for gr, w in zip(grads, truth[1:])]

    # A broken layout (every segment a root: parents' states and convolution inputs dropped).
    broken_layout = recurrent_layout(segment_ids, own_segment_end(segment_ids), 4, device)
    broken = rule_errors(inputs, cotangent, broken_layout, truth, chunk_rule)

    names = ["out", "dq", "dk", "dv", "dg", "dbeta"]
    print("GDN_RULE", json.dumps({"case": f"{device}-{dtype}-{shape}-{gdn_path(device)}",
          "tokens": num_tokens, "paths": len(paths), "tree": dict(zip(names, tree)),
          "alone": dict(zip(names, alone)), "broken": dict(zip(names, broken))}))  # fmt: skip
    tolerance = [max(2 * own, 1e-5) for own in alone]
    for name, got, bound in zip(names, tree, tolerance):
        assert got <= bound, (name, got, bound)
    if shape != "roots":  # a row of roots has no parent to drop
        assert broken[0] > 5 * tolerance[0]  # the check can fail


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", ["triton", "fla", "conv1d"])
def test_path_conv_on_this_gpu(monkeypatch, path, dtype):
    """The layers' path convolution on CUDA (asyncgrpo's Triton kernel, the default; fla's varlen
    kernel; F.conv1d with the segment starts fixed up: `ASYNCGRPO_PATH_CONV`), output and gradients
    against the per-tap definition in fp64: a random trie at the Qwen3.5-2B channel count, split into
    q, k and v as the layer splits it, its segments shorter and longer than the kernel and than the
    Triton kernel's tiles, a dozen of them read by several children."""
    if path == "fla":
        pytest.importorskip("fla", reason="fla-core is not installed: pip install 'asyncgrpo[gpu]'")
    monkeypatch.setenv(kernel_choice.PATH_CONV_ENV, path)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    rng = np.random.default_rng(12)
    parents, lengths = random_tree(rng, 40, 150)
    lengths[::7] = rng.integers(1, 3, len(lengths[::7]))  # some segments shorter than K - 1
    layout = recurrent_layout(*row_arrays(parents, lengths), 4, "cuda")
    key_dim = QWEN3_5_2B["linear_num_key_heads"] * QWEN3_5_2B["linear_key_head_dim"]
    widths = (key_dim, key_dim, QWEN3_5_2B["linear_num_value_heads"] * QWEN3_5_2B["linear_value_head_dim"])
    channels = sum(widths)
    torch.manual_seed(0)
    wide = torch.randn(layout.num_tokens, channels + 2 * widths[2], device="cuda").to(dtype)
    weight = torch.randn(channels, 4, device="cuda") / 2
    cotangent = torch.randn(layout.num_tokens, channels, device="cuda")
    leaves = [wide[:, :channels].double().requires_grad_(), weight.double().requires_grad_()]
    want = F.silu(tree_causal_conv1d(*leaves[:1], leaves[1], None, layout.conv_index))
    want_grads = torch.autograd.grad((want * cotangent).sum(), leaves)
    got_leaves = [wide.requires_grad_(), weight.requires_grad_()]
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):  # as in training
        outs = path_conv_and_activate(
            got_leaves[0][:, :channels], got_leaves[1], None, layout, "silu", widths
        )
    got = torch.cat(outs, dim=1)
    got_grads = list(torch.autograd.grad((got.float() * cotangent).sum(), got_leaves))
    assert got_grads[0][:, channels:].abs().max() == 0  # the rest of the projections' output
    got_grads[0] = got_grads[0][:, :channels]
    errors = [relative(got, want)] + [relative(g, w) for g, w in zip(got_grads, want_grads)]
    print("GDN_CONV", json.dumps({"dtype": str(dtype), "path": path, "tokens": layout.num_tokens,
                                  "remote_reads": len(layout.conv_remote_entries),
                                  "out_dmixed_dweight": errors}))  # fmt: skip
    assert got.dtype == dtype and [o.shape[1] for o in outs] == list(widths)
    # fp32: fp32 round-off (TF32 off); bf16: the rounding of the bf16 output and input gradient.
    bound = 1e-5 if dtype == torch.float32 else 1e-2
    for error in errors:
        assert error <= bound, errors


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gated_norm_on_this_gpu(dtype):
    """The fused gated RMS norm compiled, against its definition in fp64 (tests/support/gated_norm_check.py):
    16k (token, head) rows of Qwen3.5-2B's 128-value heads and a small odd shape, the gate read
    through its strides."""
    from gated_norm_check import check_case

    heads, dim = QWEN3_5_2B["linear_num_value_heads"], QWEN3_5_2B["linear_value_head_dim"]
    for shape in ((1021, heads, dim), (9, 2, 48)):
        errors = check_case(shape, dtype, device="cuda")
        print("GDN_NORM", json.dumps({"dtype": str(dtype), "shape": shape, "out_dx_dz_dweight": errors}))


def qwen3_5_2b_samples(rng) -> list:
    """A GRPO group with a 300-token prompt (6 completions, 2 with a later turn) and a short-prompt
    multi-level trie: ~1.5k packed tokens, segments across the 64-token chunks."""
    prompt = rng.integers(0, VOCAB, 300)
    samples = []
    for i in range(6):
        completion = rng.integers(0, VOCAB, int(rng.integers(20, 150)))
        samples.append(completion_sample(rng, prompt, completion))
        if i < 2:
            context = np.concatenate([prompt, completion, rng.integers(0, VOCAB, 7)])
            samples.append(completion_sample(rng, context, rng.integers(0, VOCAB, int(rng.integers(20, 90)))))
    return samples + random_trie_samples(rng, vocab=VOCAB)


def alone_logprobs_and_grads(model, samples, weights) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each sample forwarded alone: log p of its trained tokens (sampler distribution) and the
    parameter gradients of sum(weights * log p)."""
    model.zero_grad()
    device = model.device
    logps, offset = [], 0
    for s in samples:
        logits = (
            model(input_ids=torch.from_numpy(s.token_ids)[None].to(device)).logits[0].float() / TEMPERATURE
        )
        positions = np.flatnonzero(s.trained)
        allowed = torch.ones(len(positions), logits.shape[-1], dtype=torch.bool, device=device)
        for j, candidates in enumerate(s.candidate_sets or []):
            if len(candidates):
                allowed[j] = False
                allowed[j, torch.from_numpy(candidates).to(device)] = True
        logp = torch.log_softmax(logits[positions - 1].masked_fill(~allowed, float("-inf")), -1)
        target = logp.gather(1, torch.from_numpy(s.token_ids[positions]).to(device)[:, None])[:, 0]
        (target.double() * weights[offset : offset + len(positions)]).sum().backward()
        logps.append(target.detach())
        offset += len(positions)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return torch.cat(logps), grads


def rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).pow(2).mean().sqrt().item()


@pytest.mark.gpu
def test_qwen3_5_2b_packed_bf16_equals_alone(monkeypatch):
    device = torch.device("cuda")
    rule = gated_deltanet._fla_chunk_rule(device)
    calls = []
    if rule is not None:  # count the varlen calls: the packed forward must reach them
        counting = lambda *a, **kw: calls.append(1) or rule(*a, **kw)  # noqa: E731
        monkeypatch.setattr(gated_deltanet, "_fla_chunk_rule", lambda _device: counting)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        plain = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**QWEN3_5_2B, dtype="float32"))
    tree = enable_tree_attention(copy.deepcopy(plain))
    rng = np.random.default_rng(5)
    samples = qwen3_5_2b_samples(rng)
    row = pack_row(samples)
    weights = torch.from_numpy(rng.normal(size=row.num_entries)).cuda()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16)

    def packed_logprobs_and_grads():
        tree.zero_grad()
        with autocast:
            logprobs = row_logprobs(tree, row, TEMPERATURE).logprobs
            (logprobs.double() * weights).sum().backward()
        return logprobs.detach(), {
            name: p.grad.clone() for name, p in tree.named_parameters() if p.grad is not None
        }

    packed, packed_grads = packed_logprobs_and_grads()
    _, rerun_grads = packed_logprobs_and_grads()  # the same computation again: the kernels' own noise
    assert bool(calls) == (rule is not None), "the packed forward did not take the path it should"
    # The model's own rule: fla's when it trains here (transformers dispatches to it), else torch's.
    torch_rule = inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)
    if rule is None:
        monkeypatch.setattr(modeling_qwen3_5, "torch_chunk_gated_delta_rule", torch_rule)
    with autocast:
        alone, alone_grads = alone_logprobs_and_grads(plain, samples, weights)
    # fp32 reference: transformers' own torch rule (fla's kernels use TF32 dots in fp32).
    monkeypatch.setattr(modeling_qwen3_5, "torch_chunk_gated_delta_rule", torch_rule)
    reference, reference_grads = alone_logprobs_and_grads(plain, samples, weights)
    # Negative control: the GDN layers see every segment as a root (attention layers unchanged).
    monkeypatch.setattr(
        tree_attention,
        "recurrent_layout",
        lambda ids, _end, k, device: recurrent_layout(ids, own_segment_end(ids), k, device),
    )
    with torch.no_grad(), autocast:
        broken = row_logprobs(tree, row, TEMPERATURE).logprobs

    packed_err, alone_err, broken_err = (rms(x, reference) for x in (packed, alone, broken))
    grad_err = {
        n: (relative(packed_grads[n], w), relative(alone_grads[n], w)) for n, w in reference_grads.items()
    }
    norm = sum(w.double().norm() ** 2 for w in reference_grads.values()).sqrt()
    total = tuple(
        (
            sum((g[n].double() - w.double()).norm() ** 2 for n, w in reference_grads.items()).sqrt() / norm
        ).item()
        for g in (packed_grads, alone_grads)
    )  # relative error of all gradients as one vector
    worst = sorted(grad_err.items(), key=lambda kv: -kv[1][0] / max(kv[1][1], 1e-30))[:8]
    decay = [n for n in reference_grads if n.endswith(("A_log", "dt_bias"))]
    decay_norm = sum(reference_grads[n].double().norm() ** 2 for n in decay).sqrt()
    decay_total = tuple(
        (
            sum((g[n].double() - reference_grads[n].double()).norm() ** 2 for n in decay).sqrt() / decay_norm
        ).item()
        for g in (packed_grads, alone_grads)
    )  # the decay path's gradients (A_log, dt_bias of every GDN layer) as one vector
    rerun = sorted(((relative(rerun_grads[n], packed_grads[n]), n) for n in packed_grads), reverse=True)[:4]
    print("GDN_MODEL", json.dumps({
        "path": gdn_path("cuda"),
        "tokens": row.num_tokens, "unpacked_tokens": row.num_unpacked_tokens, "entries": row.num_entries,
        "logprob_rms_vs_fp32": {
            "packed_bf16": packed_err, "alone_bf16": alone_err, "broken_bf16": broken_err,
        },
        "logprob_max_abs_packed_vs_alone_bf16": (packed - alone).abs().max().item(),
        "grad_rel_vs_fp32_total": {"packed_bf16": total[0], "alone_bf16": total[1]},
        "grad_rel_vs_fp32_worst_ratio": worst,
        "decay_path_grad_rel_vs_fp32": {"packed_bf16": decay_total[0], "alone_bf16": decay_total[1]},
        "packed_rerun_grad_rel_worst": rerun,
    }))  # fmt: skip
    assert row.packing_ratio > 2
    assert packed_err <= 1.5 * alone_err, (packed_err, alone_err)
    assert broken_err > 5 * alone_err  # the check can fail
    assert total[0] <= 1.5 * total[1], total
    # The decay path's gradients (A_log, dt_bias) sum terms of both signs over each 64-token chunk of
    # the recurrence, and packing moves where chunks start: a single one of them is ill-conditioned.
    # On an H200 with these inputs a change of rounding alone (the same math in another kernel) moved
    # the worst single ratio across the old 3x bound while the decay path as one vector stayed where
    # the unpacked forward is (bench/RESULTS.md, issue 33). So the decay path is bound as one vector,
    # like the whole gradient, and each of its tensors more loosely.
    assert decay_total[0] <= 1.5 * decay_total[1], decay_total
    for name, (got, own) in grad_err.items():
        assert got <= (4 if name in decay else 3) * own, (name, got, own)


@pytest.mark.gpu
def test_fla_varlen_trains_on_this_gpu():
    """The fast path: fla-core installed (extra `gpu`) and able to train here."""
    pytest.importorskip("fla", reason="fla-core is not installed: pip install 'asyncgrpo[gpu]'")
    reason = gated_deltanet.fla_refusal(torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)
    assert gdn_path("cuda") == "fla-varlen"
