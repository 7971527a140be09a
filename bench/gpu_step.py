"""The whole optimizer step at the trainer's default settings on one GPU: MFU, profile, memory.

The step is built by `AsyncGRPOTrainer` itself (its defaults, its model preparation, its
`_forward_backward` and `_optimizer_step`: `row_loss` per row, then clipping + AdamW), on random weights
of the Qwen3-1.7B shape held in fp32 (the trainer's `dtype` default) with no vLLM server: only the
samples are synthetic. Phases (one call, device time is scarce; a short table is printed last):
  1. the card's bf16 matmul peak (8192^3), the ceiling MFU is measured against;
  2. MFU of the full step (2 micro-batches = 2 rows of `--budget` tokens) on DeepMath-like rows
     (200-token prompt, 8 completions of 300-1,500 tokens), for the defaults and the variants;
  3. a torch.profiler breakdown of one default step by kernel family;
  4. tree vs plain padding-free packing of shared-prefix groups (packing ratio ~3.4) in the same
     full step: speedup against the FLOP ratio;
  5. peak memory of the default step vs token_budget, up to the first OOM.
Model FLOPs: 6 x decoder params x forwarded tokens + 6 x head params x trained tokens + attention
(asyncgrpo.modeling.perf); recomputation by checkpointing is not counted.

Run (GPU machine): `python bench/gpu_step.py --out $OUT`; `--smoke` runs tiny shapes on CPU.
Prints `gpu_step mfu=X target=0.67` last (issue 59: the default step against the peak of the same call).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from gpu_training import QWEN3, QWEN3_COMMON, matmul_peak, require_cuda  # noqa: E402
from workloads import plain_row  # noqa: E402

import asyncgrpo.losses.token_logprobs as logprobs_module  # noqa: E402
from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer  # noqa: E402
from asyncgrpo.cli.tiny_model import build_tokenizer  # noqa: E402
from asyncgrpo.modeling.perf import flop_model  # noqa: E402
from asyncgrpo.packing.planner import MicroBatchPlan, TokenBudgetBatcher  # noqa: E402
from asyncgrpo.packing.tree_attention import BLOCK_SIZE  # noqa: E402
from asyncgrpo.packing.trie import pack_row  # noqa: E402
from asyncgrpo.records.sample import Sample  # noqa: E402
from asyncgrpo.trainer.activation_memory import RowMemoryPlan  # noqa: E402
from asyncgrpo.trainer.intake import StepBatch  # noqa: E402
from asyncgrpo.trainer.optimizer_step import takes_device_decisions, torch_optimizer  # noqa: E402

TARGET = 0.67  # issue 59: the default step's MFU against the matmul peak measured in the same call
# Name fragments of fla-core's gated delta rule kernels (Gated DeltaNet hybrids, gpu_step_qwen3_5.py).
FLA_KERNELS = ("delta_rule", "chunk_", "l2norm", "solve_tril", "recompute_w_u", "wy_", "16x16")
TOP_N = 8
# name -> (AsyncGRPOConfig overrides, fused head); the first is what the trainer does by default.
VARIANTS = {
    "defaults": ({}, True),
    "recomputed-head-logits": ({}, True),  # the fused head never keeps its logits (see measure_variant)
    "full-ckpt": ({"gradient_checkpointing_to_fit": False}, True),
    "unfused-head": ({}, False),
    "previous-defaults": (  # eager layers, every layer checkpointed, unfused head
        {"torch_compile": False, "gradient_checkpointing_to_fit": False},
        False,
    ),
    "coordinate-descent": ({}, True),  # the defaults, inductor tuning its kernels' launch settings
    "flex-attention": ({}, True),  # the defaults with flex attention instead of asyncgrpo's kernels
}
# Environment a variant runs under (read at every row, asyncgrpo.packing.kernel_choice).
VARIANT_ENVIRONMENT = {"flex-attention": {"ASYNCGRPO_TREE_ATTENTION": "flex"}}
# Inductor settings a variant compiles its layers with (torch._inductor.config; the compiled-graph
# cache keys on them, so the variant compiles its own layers): coordinate descent times neighbouring
# block sizes and warp counts of each generated norm, rotary and activation kernel once, at compile
# time, where the defaults take inductor's heuristics.
INDUCTOR_SETTINGS = {"coordinate-descent": {"coordinate_descent_tuning": True}}
# Parts of the defaults variant's report that `--skip` may leave out of a short device call.
DIAGNOSES = ("probe", "idle_gaps", "tree_vs_plain")


def log(message: str) -> None:
    print(message, flush=True)


class _Prompts:
    """A one-row conversational dataset: the trainer checks its format; no rollout reads it here."""

    column_names = ["prompt"]

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index):
        return {"prompt": [{"role": "user", "content": "2+2?"}]}

    def __iter__(self):
        return iter([self[0]])


def build_model(smoke: bool) -> Qwen3ForCausalLM:
    values = dict(QWEN3_COMMON, **QWEN3["1.7B"])
    if smoke:
        values.update(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=1024)  # fmt: skip
    config = Qwen3Config(**values, dtype="float32")
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu"):
        return Qwen3ForCausalLM(config)  # fp32: AsyncGRPOConfig.dtype's default


def make_trainer(overrides: dict, smoke: bool, output_dir: str, model=None) -> AsyncGRPOTrainer:
    """The trainer around `model` (default: the Qwen3-1.7B shape), prepared as `train()` would."""
    args = AsyncGRPOConfig(output_dir=output_dir, gradient_accumulation_steps=2, report_to="none",
                           use_cpu=smoke, **overrides)  # fmt: skip
    model = build_model(smoke) if model is None else model
    trainer = AsyncGRPOTrainer(model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                               args=args, train_dataset=_Prompts(),
                               processing_class=build_tokenizer())  # fmt: skip
    if args.gradient_checkpointing:  # what Trainer.train does before the training loop
        trainer.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs
        )
    trainer._model = trainer._begin_run(args, None, None)  # train()'s set-up; no server is reached
    return trainer


def sample(rng, prompt: np.ndarray, completion_len: int, vocab: int, group: int) -> Sample:
    tokens = np.concatenate([prompt, rng.integers(0, vocab, completion_len)])
    trained = np.arange(len(tokens)) >= len(prompt)
    top_ids = rng.integers(0, vocab, (completion_len, TOP_N))
    top_logprobs = np.sort(np.log(rng.dirichlet(np.ones(TOP_N * 4), completion_len)[:, :TOP_N]), -1)[:, ::-1]
    return Sample(tokens, trained, rng.normal(-2.0, 0.5, completion_len).astype(np.float32),
                  float(rng.normal()), group, top_ids=top_ids,
                  top_logprobs=np.ascontiguousarray(top_logprobs, dtype=np.float32))  # fmt: skip


def deepmath_plans(rng, budget: int, rows: int, vocab: int, smoke: bool) -> list[MicroBatchPlan]:
    """Rows the trainer's planner fills to `budget` with groups of a 200-token prompt and 8
    completions of 300-1,500 tokens (packing ratio ~1.2)."""
    batcher = TokenBudgetBatcher(budget, 1, min_shared_tokens=BLOCK_SIZE)
    plans, group = [], 0
    scale = 16 if smoke else 1
    while len(plans) < rows:
        prompt = rng.integers(0, vocab, 200 // scale)
        for _ in range(8):
            candidate = sample(rng, prompt, int(rng.integers(300, 1500)) // scale, vocab, group)
            if batcher.offer(candidate).name != "PLACED":
                plans.append(batcher.close())
                batcher.offer(candidate)
        group += 1
    return plans[:rows]


def shared_prefix_samples(rng, groups: int, vocab: int, smoke: bool) -> list[Sample]:
    """Groups of a 1,068-token prompt + 8 x 256-token completions: packing ratio ~3.4."""
    scale = 16 if smoke else 1
    out = []
    for group in range(groups):
        prompt = rng.integers(0, vocab, 1068 // scale)
        out += [sample(rng, prompt, 256 // scale, vocab, group) for _ in range(8)]
    return out


class FixedPlan:
    """A micro-batch plan whose rows are given (plain padding-free packing for the comparison)."""

    def __init__(self, rows):
        self.rows = rows

    def pack(self):
        return self.rows


def with_top(row, tree):
    """plain_row's layout with the sampler's top-N of the same entries (same entry order)."""
    row.top_ids, row.top_logprobs = tree.top_ids, tree.top_logprobs
    return row


def step(trainer: AsyncGRPOTrainer, plans) -> None:
    """What `AsyncGRPOTrainer._train_step` runs on the GPU: forward/backward of every micro-batch,
    then clipping + AdamW (queued on the device with the trainer's fused AdamW)."""
    queued = trainer._forward_backward(trainer._model, StepBatch(plans=list(plans)))
    trainer._optimizer_step(trainer._model, queued)


# Every timed step of the process: its label, seconds and what the card and allocator did meanwhile
# (gpu_step_qwen3_5 reports the median of all rounds of its default step, and why rounds differ).
ROUND_LOG: list[dict] = []


def card_state() -> dict:
    """The SM clock, power, temperature and clock-limit reasons (NVML bit mask) now, where NVML is
    importable; {} elsewhere."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return {"sm_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                "power_w": pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3,
                "temp_c": pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU),
                "limits": pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)}  # fmt: skip
    except Exception:  # noqa: BLE001 (no NVML: the rounds are still timed)
        return {}


def timed_steps(trainer, plans, repeats: int, warmup: int, label: str = "") -> float:
    """Median seconds of `repeats` steps after `warmup` untimed ones; each timed step is logged in
    ROUND_LOG with the allocator's retries (cudaMalloc failures it recovered from by freeing its
    cache: memory at the card's edge), the memory reserved and the card's state after it."""
    for _ in range(warmup):
        step(trainer, plans)
    times = []
    for _ in range(repeats):
        retries = 0
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        started = time.perf_counter()
        step(trainer, plans)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        record = {"label": label, "seconds": times[-1]}
        if torch.cuda.is_available():
            record.update(alloc_retries=torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries,
                          reserved_gb=torch.cuda.memory_reserved() / 1e9, **card_state())  # fmt: skip
        ROUND_LOG.append(record)
    return statistics.median(times)


def memory_plan(trainer) -> dict:
    """What the row memory plans chose since the last call (a mean over rows; None off CUDA)."""
    window = trainer._run.metrics.window.summarize()
    return {
        "checkpointed_layers": window.get("perf/checkpointed_layers"),
        "head_logits_kept": window.get("perf/head_logits_kept"),
    }


def activation_probe(trainer, plans) -> dict:
    """Activation memory of `plans`' step with no layer checkpointed and the head's logits recomputed,
    measured (peak allocated above the memory held between steps, less the gradients, which the
    planner counts apart) against the planner's estimate for its largest row
    (trainer/activation_memory.py; the estimate includes its safety factor)."""
    fit = trainer._run.rows.fit_checkpointing
    if fit is None or not torch.cuda.is_available():
        return {}

    def nothing_checkpointed(num_tokens: int, num_entries: int) -> RowMemoryPlan:
        for layer in fit.layers:
            layer.gradient_checkpointing = False
        return RowMemoryPlan(checkpointed_layers=0, keep_logits=False)

    planned = fit.before_row
    fit.before_row = nothing_checkpointed
    try:
        step(trainer, plans)  # compiled, gradients and optimizer states built
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(trainer, plans)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    finally:
        fit.before_row = planned
    grads = sum(p.numel() * p.element_size() for p in fit.params)
    tokens = max(row.num_tokens for plan in plans for row in plan.pack())
    measured, estimated = peak - held - grads, tokens * sum(fit.kept_per_token)
    result = {"row_tokens": tokens, "measured_gb": measured / 1e9, "estimated_gb": estimated / 1e9,
              "measured_over_estimated": measured / estimated}  # fmt: skip
    log(f"activation probe {result}")
    return result


def plan_flops(flops, rows) -> float:
    return sum(flops.step_flops(r.num_tokens, r.num_entries, r.attention_cost) for r in rows)


@functools.cache
def _unfused_token_logprobs():
    return functools.partial(logprobs_module.token_logprobs, fused=False)


def set_fused(fused: bool, original=logprobs_module.token_logprobs) -> None:
    logprobs_module.token_logprobs = original if fused else _unfused_token_logprobs()


def measure_variant(name, overrides, fused, args, peak, out_dir) -> dict:
    import torch._inductor.config

    environment = VARIANT_ENVIRONMENT.get(name, {})
    saved = {key: os.environ.get(key) for key in environment}
    os.environ.update(environment)
    try:
        with torch._inductor.config.patch(**INDUCTOR_SETTINGS.get(name, {})):
            return _measure_variant(name, overrides, fused, args, peak, out_dir)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _measure_variant(name, overrides, fused, args, peak, out_dir) -> dict:
    set_fused(fused)
    trainer = make_trainer(overrides, args.smoke, out_dir)
    if name == "recomputed-head-logits" and trainer._run.rows.fit_checkpointing is not None:
        plan_row = trainer._run.rows.fit_checkpointing.before_row
        trainer._run.rows.fit_checkpointing.before_row = lambda *row: dataclasses.replace(
            plan_row(*row), keep_logits=False
        )
    vocab = trainer._model.config.vocab_size
    plans = deepmath_plans(np.random.default_rng(7), args.budget, 2, vocab, args.smoke)
    rows = [row for plan in plans for row in plan.pack()]
    flops = flop_model(trainer._model)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    seconds = timed_steps(trainer, plans, args.repeats, args.warmup)
    model_flops = plan_flops(flops, rows)
    unpacked = sum(r.num_unpacked_tokens for r in rows)
    result = {
        "variant": name, "seconds": seconds, "mfu": model_flops / seconds / peak,
        "tflops": model_flops / seconds / 1e12,
        "row_tokens": [r.num_tokens for r in rows], "unpacked_tok_s": unpacked / seconds,
        "packing_ratio": unpacked / sum(r.num_tokens for r in rows),
        **memory_plan(trainer), "optimizer_on_device": takes_device_decisions(trainer.optimizer),
        "optimizer": type(torch_optimizer(trainer.optimizer)).__name__,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else 0.0,
    }  # fmt: skip
    log(f"variant {result}")
    if name in ("defaults", *INDUCTOR_SETTINGS):
        result["profile"] = profile(trainer, plans, f"{name} step")
    if name == "defaults":
        skipped = args.skip.split(",")
        if "probe" not in skipped:
            result["activation_probe"] = activation_probe(trainer, plans)
        if "idle_gaps" not in skipped:
            result["idle_gaps"] = diagnose_idle_gaps(trainer, plans, "default step")
            result["host_lead"] = [host_lead(trainer, plans, "default step") for _ in range(3)]
        if "tree_vs_plain" not in skipped:
            result["tree_vs_plain"] = tree_vs_plain(trainer, flops, args)
    set_fused(True)
    return result


def kernel_family(name: str) -> str:
    lowered = name.lower()
    if "_tree_attention_" in lowered:
        return "tree attention (asyncgrpo kernels)"
    if "flex" in lowered or "triton_tem" in lowered:
        return "flex attention"
    if any(k in lowered for k in ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "matmul")):
        return "matmuls (cuBLAS)"
    if any(k in lowered for k in FLA_KERNELS):
        return "fla gated delta rule"
    if "adam" in lowered or "multi_tensor" in lowered or "foreach" in lowered:
        return "optimizer + clipping"
    if lowered.startswith("triton_"):
        return "compiled fused kernels (norms, rotary, SiLU, head passes)"
    if "softmax" in lowered:
        return "softmax"
    if "copy" in lowered or "cast" in lowered:
        return "copies / casts"
    if "elementwise" in lowered or "vectorized" in lowered or "reduce" in lowered:
        return "eager elementwise / reductions"
    return "other"


def profile(trainer, plans, label: str) -> dict:
    """One step under torch.profiler: CUDA time by kernel family, the top kernels, and the wall time
    (wall well above the CUDA time means the GPU waited on the host)."""
    if not torch.cuda.is_available():
        return {}
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    started = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(trainer, plans)
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - started) * 1e3
    families: dict[str, float] = {}
    kernels = []
    for event in prof.key_averages():
        cuda_us = getattr(event, "self_device_time_total", 0.0) or 0.0
        if cuda_us <= 0:
            continue
        families[kernel_family(event.key)] = families.get(kernel_family(event.key), 0.0) + cuda_us / 1e3
        kernels.append((cuda_us / 1e3, event.count, event.key[:90]))
    kernels.sort(reverse=True)
    total = sum(families.values())
    log(f"profile of {label}: {total:.0f} ms of CUDA time in one step, {wall_ms:.0f} ms wall (profiled)")
    for family, ms in sorted(families.items(), key=lambda kv: -kv[1]):
        log(f"  {family}: {ms:.0f} ms ({ms / total:.0%})")
    for ms, count, key in kernels[:25]:
        log(f"  {ms:8.1f} ms x{count:5d} {key}")
    return {"total_ms": total, "wall_ms": wall_ms, "families_ms": families, "top_kernels": kernels[:40]}


def idle_gaps(trainer, plans, label: str, min_gap_ms: float = 0.3) -> dict:
    """Where the GPU waits on the host in one step: gaps between consecutive kernels longer than
    `min_gap_ms`, each put down to what the host was doing when the GPU ran dry (a CUDA call that
    waits for the device, with the Python frames of asyncgrpo/bench that made it, or else the frames
    running mid-gap). Summed by cause, largest first."""
    if not torch.cuda.is_available():
        return {}
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        step(trainer, plans)
        torch.cuda.synchronize()
    trace = Path(tempfile.mkdtemp(prefix="gpu_step-trace-")) / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    trace.unlink()
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    frames = [
        e
        for e in events
        if e.get("cat") == "python_function" and ("asyncgrpo" in e["name"] or "bench/" in e["name"])
    ]

    def ours(at: float) -> str:
        spanning = sorted((f for f in frames if f["ts"] <= at <= f["ts"] + f["dur"]), key=lambda f: f["ts"])
        return " > ".join(f["name"].split("/")[-1] for f in spanning[-3:]) or "?"

    causes: dict[str, list[float]] = {}
    for before, after in zip(kernels, kernels[1:]):
        start, gap = before["ts"] + before["dur"], after["ts"] - (before["ts"] + before["dur"])
        if gap < min_gap_ms * 1e3:
            continue
        waits = [r for r in runtime if ("ynchronize" in r["name"] or "Memcpy" in r["name"])
                 and r["ts"] <= start + 50 and r["ts"] + r["dur"] >= start - 50]  # fmt: skip
        cause = (
            f"wait {waits[0]['name']} at {ours(waits[0]['ts'])}" if waits else f"host {ours(start + gap / 2)}"
        )
        causes.setdefault(cause, []).append(gap / 1e3)
    total = sum(sum(v) for v in causes.values())
    kernel_ms = sum(k["dur"] for k in kernels) / 1e3
    log(
        f"idle gaps of {label} over {min_gap_ms} ms: {total:.1f} ms in one step "
        f"({kernel_ms:.0f} ms of kernels)"
    )
    ranked = sorted(causes.items(), key=lambda kv: -sum(kv[1]))
    for cause, gaps in ranked[:15]:
        log(f"  {sum(gaps):7.1f} ms in {len(gaps):3d} gaps: {cause[:160]}")
    return {"idle_ms": total, "kernel_ms": kernel_ms, "causes": [(c, sum(g), len(g)) for c, g in ranked[:30]]}


def sync_points(trainer, plans, label: str) -> list[str]:
    """Where one step makes the host wait for the GPU, by torch's CUDA sync debug mode: each synchronizing
    call with the Python frames of asyncgrpo/bench that made it. The step is meant to have one, the read
    of its values after the last row; any other one lets the GPU run dry while the host catches up."""
    if not torch.cuda.is_available():
        return []
    import traceback
    import warnings

    found: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [
            f for f in traceback.extract_stack()[:-1] if "asyncgrpo" in f.filename or "bench" in f.filename
        ]
        where = " > ".join(f"{Path(f.filename).name}({f.lineno})" for f in frames[-4:])
        if "synchronizing" in str(message):  # not the mode's own notice that it is a prototype
            found.append(f"{str(message).splitlines()[0][:42]} at {where}")

    torch.cuda.synchronize()
    original = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(trainer, plans)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = original
    counts = {where: found.count(where) for where in dict.fromkeys(found)}
    log(f"synchronizing calls in one step of {label}: {len(found)}")
    for where, count in counts.items():
        log(f"  {count:3d} x {where[:220]}")
    return found


def host_lead(trainer, plans, label: str) -> dict:
    """How far the host runs ahead of the GPU through one step, without a profiler (which slows the
    host): at each of the trainer's device marks (each row's start, forward queued, backward queued;
    the optimizer step's start and end), the time the GPU reached the mark minus the time the host
    queued it. Near 0: the GPU was waiting for the host there. `tail_ms`: host time after the GPU
    finished the step (reading values, callbacks, the schedule)."""
    if not torch.cuda.is_available():
        return {}
    from asyncgrpo.trainer import device_clock

    original = device_clock.DeviceClock.mark
    queued = []

    def mark(self):
        event = original(self)
        queued.append((time.perf_counter(), event))
        return event

    torch.cuda.synchronize()
    origin = torch.cuda.Event(enable_timing=True)
    origin_host = time.perf_counter()
    origin.record()  # the GPU is idle: it reaches this event as the host records it
    device_clock.DeviceClock.mark = mark
    try:
        step(trainer, plans)
    finally:
        device_clock.DeviceClock.mark = original
    step_ms = (time.perf_counter() - origin_host) * 1e3
    torch.cuda.synchronize()
    host_ms = [(host - origin_host) * 1e3 for host, _ in queued]
    device_ms = [origin.elapsed_time(event) for _, event in queued]
    leads = [device - host for host, device in zip(host_ms, device_ms)]
    result = {"step_ms": step_ms, "host_ms": host_ms, "device_ms": device_ms, "lead_ms": leads,
              "tail_ms": step_ms - device_ms[-1]}  # fmt: skip
    lead_text = " ".join(f"{x:.1f}" for x in leads)
    log(f"host lead of {label}: step {step_ms:.1f} ms, GPU done at {device_ms[-1]:.1f} ms, host after it "
        f"{result['tail_ms']:.1f} ms; lead at each mark (ms): {lead_text}")  # fmt: skip
    return result


def diagnose_idle_gaps(trainer, plans, label: str) -> dict:
    try:  # a diagnosis: its failure must not cost the measurements after it
        return idle_gaps(trainer, plans, label)
    except Exception as error:  # noqa: BLE001
        log(f"idle gap diagnosis of {label} failed: {error!r}")
        return {}


def plain_rows_within_budget(samples: list[Sample], budget: int) -> list:
    """Plain padding-free packing as the trainer would lay it out at the same token_budget: samples
    in order, a new row whenever the next one would pass the budget."""
    rows, current = [], []
    for s in samples:
        if current and sum(c.num_tokens for c in current) + s.num_tokens > budget:
            rows.append(current)
            current = []
        current.append(s)
    rows.append(current)
    return [with_top(plain_row(r), pack_row(r)) for r in rows]


def tree_vs_plain(trainer, flops, args) -> dict:
    """The same shared-prefix groups in one optimizer step, tree-packed (2 rows of ~budget tokens)
    and plain padding-free: (a) at the same token_budget (what a user of plain packing gets: more
    rows, each row's fixed costs paid more often), (b) as 2 rows of ~3.4 x budget (the earlier
    measurement: the plain rows then pay checkpointing to fit, the tree rows do not)."""
    rng = np.random.default_rng(9)
    vocab = trainer._model.config.vocab_size
    per_row = max(1, args.budget // (1068 + 8 * 256) // 1) if not args.smoke else 1
    tree_plans, wide_plain_plans, step_samples = [], [], []
    for _ in range(2):
        samples = shared_prefix_samples(rng, per_row, vocab, args.smoke)
        step_samples += samples
        batcher = TokenBudgetBatcher(10**9, 1, min_shared_tokens=BLOCK_SIZE)
        for s in samples:
            batcher.offer(s)
        plan = batcher.close()
        tree_row = plan.pack()[0]
        tree_plans.append(FixedPlan([tree_row]))
        wide_plain_plans.append(FixedPlan([with_top(plain_row(samples), tree_row)]))
    budget_plain_plans = [FixedPlan([row]) for row in plain_rows_within_budget(step_samples, args.budget)]
    tree_rows = [p.rows[0] for p in tree_plans]
    layouts = {"tree": tree_plans, "budget": budget_plain_plans, "wide": wide_plain_plans}
    for plans in layouts.values():
        for _ in range(args.warmup):
            step(trainer, plans)
    # In rotation (tree, budget, wide, tree, ...): a drift of the card's clocks during the measurement
    # falls on the three alike, and each round gives its own ratio (their spread is printed).
    seconds = {name: [] for name in layouts}
    for _ in range(args.rounds):
        for name, plans in layouts.items():
            seconds[name].append(timed_steps(trainer, plans, 1, 0))
    tree_s = statistics.median(seconds["tree"])
    result = {
        "packing_ratio": sum(r.num_unpacked_tokens for r in tree_rows) / sum(r.num_tokens for r in tree_rows),
        "tree_tokens": [r.num_tokens for r in tree_rows], "tree_s": tree_s, "tree_seconds": seconds["tree"],
        "tree_profile": profile(trainer, tree_plans, "tree rows"),
        "tree_idle_gaps": diagnose_idle_gaps(trainer, tree_plans, "tree rows"),
        "tree_sync_points": sync_points(trainer, tree_plans, "tree rows"),
        "host_lead": {name: [host_lead(trainer, layouts[name], f"{name} rows") for _ in range(3)]
                      for name in ("tree", "budget")},
    }  # fmt: skip
    for name in ("budget", "wide"):
        rows = [p.rows[0] for p in layouts[name]]
        flop_ratio = plan_flops(flops, rows) / plan_flops(flops, tree_rows)
        per_round = [plain / tree / flop_ratio for plain, tree in zip(seconds[name], seconds["tree"])]
        result[name] = {
            "plain_tokens": [r.num_tokens for r in rows], "plain_s": statistics.median(seconds[name]),
            "plain_seconds": seconds[name], "flop_ratio": flop_ratio,
            "speedup": statistics.median(seconds[name]) / tree_s,
            "speedup_over_flop_ratio": statistics.median(per_round),
            "speedup_over_flop_ratio_range": (min(per_round), max(per_round)),
            **memory_plan(trainer),
            "profile": profile(trainer, layouts[name], f"plain rows ({name})"),
        }  # fmt: skip
    log(f"tree vs plain {json.dumps(result, default=str)[:3000]}")
    return result


def memory_sweep(args, out_dir, deadline: float) -> list[dict]:
    """Peak memory of the default step (fp32 weights, grads and AdamW states) vs token_budget."""
    trainer = make_trainer({}, args.smoke, out_dir)
    vocab = trainer._model.config.vocab_size
    results = []
    budget = args.budget
    while time.perf_counter() < deadline:
        plans = deepmath_plans(np.random.default_rng(budget), budget, 1, vocab, args.smoke)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        trainer._run.metrics.window.summarize()  # start with an empty window
        try:
            started = time.perf_counter()
            step(trainer, plans)
            entry = {
                "token_budget": budget,
                "row_tokens": plans[0].pack()[0].num_tokens,
                "fits": True,
                "seconds": time.perf_counter() - started,
                **memory_plan(trainer),
                "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9
                if torch.cuda.is_available()
                else 0.0,
            }
        except torch.OutOfMemoryError:
            entry = {"token_budget": budget, "fits": False}
            trainer._model.zero_grad(set_to_none=True)
        results.append(entry)
        log(f"memory {entry}")
        if not entry["fits"] or args.smoke and budget >= 4 * args.budget:
            break
        budget *= 2
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, on CPU: checks the script runs")
    parser.add_argument("--budget", type=int, default=16384, help="token_budget of each of the 2 rows")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7, help="rounds of tree / plain steps in rotation")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated names; '' for the memory sweep alone"
    )
    parser.add_argument("--memory-seconds", type=float, default=120.0)
    parser.add_argument(
        "--skip",
        default="",
        help=f"comma-separated parts of the defaults' report to leave out: {', '.join(DIAGNOSES)}",
    )
    args = parser.parse_args()
    require_cuda(args.smoke)
    if args.smoke:
        args.budget = min(args.budget, 2048)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    report: dict = {"torch": torch.__version__, "device": device_name, "budget": args.budget}
    log(f"{report}")
    report["matmul_peak_tflops"] = matmul_peak(device) / 1e12
    peak = report["matmul_peak_tflops"] * 1e12
    log(f"bf16 matmul peak {report['matmul_peak_tflops']:.1f} TFLOP/s")
    out_dir = tempfile.mkdtemp(prefix="gpu_step-")
    report["variants"] = []
    for name in [n.strip() for n in args.variants.split(",") if n.strip()]:
        overrides, fused = VARIANTS[name]
        report["variants"].append(measure_variant(name, overrides, fused, args, peak, out_dir))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.memory_seconds > 0:
        report["memory"] = memory_sweep(args, out_dir, time.perf_counter() + args.memory_seconds)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_step.json").write_text(json.dumps(report, indent=1, default=str))
    print_table(report)


def print_table(report: dict) -> None:
    log(
        f"\n{report['device']} torch {report['torch']}: bf16 matmul peak {report['matmul_peak_tflops']:.0f} "
        "TFLOP/s"
    )
    log(
        "| variant | step s | MFU | unpacked tok/s | ckpt layers | head logits kept | optimizer on device "
        "| peak GB |"
    )
    log("|---|---|---|---|---|---|---|---|")
    for v in report["variants"]:
        log(f"| {v['variant']} | {v['seconds']:.3f} | {v['mfu']:.1%} | {v['unpacked_tok_s']:,.0f} "
            f"| {v['checkpointed_layers']} | {v['head_logits_kept']} | {v['optimizer_on_device']} "
            f"| {v['peak_memory_gb']:.1f} |")  # fmt: skip
    for m in report.get("memory", []):
        log(f"memory budget {m['token_budget']}: fits={m['fits']} peak "
            f"{m.get('peak_memory_gb', float('nan')):.1f} GB ckpt layers "
            f"{m.get('checkpointed_layers')} head logits kept {m.get('head_logits_kept')}")  # fmt: skip
    if not report["variants"]:  # --variants '': the memory sweep alone
        return
    default = report["variants"][0]
    if "tree_vs_plain" in default:
        t = default["tree_vs_plain"]
        for name in ("budget", "wide"):
            c = t[name]
            log(
                f"tree vs plain ({name} rows {c['plain_tokens'][:3]}...) at ratio {t['packing_ratio']:.2f}: "
                f"speedup {c['speedup']:.2f}, FLOP ratio {c['flop_ratio']:.2f}, speedup / FLOP ratio "
                f"{c['speedup_over_flop_ratio']:.3f} (median of {len(c['plain_seconds'])} rounds, %.3f-%.3f; "
                "target 0.97)" % c["speedup_over_flop_ratio_range"]
            )
    log(f"gpu_step mfu={default['mfu']:.3f} target={TARGET}")


if __name__ == "__main__":
    main()
