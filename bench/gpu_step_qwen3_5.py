"""The whole optimizer step for the Qwen3.5-2B shape (Gated DeltaNet hybrid) on one GPU (issue 15).

The same step as bench/gpu_step.py: `AsyncGRPOTrainer` built with its defaults around random fp32
weights of Qwen/Qwen3.5-2B's text shape (bench/gpu_training.QWEN3_5_2B), prepared as `train()` does
(compiled layers, checkpoint only to fit, fused head, bf16 autocast), then `_forward_backward` and
`_optimizer_step` (forward/backward, clipping + AdamW) on 2 micro-batches of one row each; no vLLM
server, only the samples are synthetic.
The Gated DeltaNet layers run tree-packed through fla-core's varlen kernel (extra `gpu`).
Phases (one device call; a short table is printed last):
  1. the card's bf16 matmul peak (8192^3), the ceiling MFU is measured against;
  2. tree vs plain padding-free packing of the same samples in the same step, at one token_budget,
     for groups of 8 completions whose packing ratio is ~3.4, ~1 and ~2 (gpu_training's
     SPEED_WORKLOADS): tree rows as the trainer's planner fills them (2 rows), plain rows as a plain
     packer would (a new row when the next sample would pass the budget);
  3. (`memory`) the activations of one row of token_budget / 2 with no layer checkpointed, measured
     against the checkpoint-to-fit planner's estimate;
  4. the default step on DeepMath-like rows (200-token prompt, 8 completions of 300-1,500 tokens,
     packing ratio ~1.2): MFU, tokens/s, peak memory and a profile by kernel family.
`--kernels` names the Gated DeltaNet kernels the default step is timed with, in rotation in one
process (`KERNEL_VARIANTS`: asyncgrpo's convolution and norm, fla's convolution, the model's norm,
and both of the others: issue 33's code), each profiled.
`--phases start` measures what a user waits for, seconds from a process's start to the end of its
first default step (imports, the model, compiling, fla's autotuning): it runs this script twice in
child processes that share one set of fresh kernel caches (Triton's, which holds fla's autotuning
results, inductor's and tilelang's, `START_CACHES`): the first is a cold start, the second a warm
one, which then runs `--warm-phases` (with fla's kernels tuned, where the other phases' device
calls cut autotuning to one config). It prints `gpu_step_qwen3_5 start cold_s=A warm_s=B` and where
each start's seconds went.
The report names the Gated DeltaNet path that ran (`gdn_path`): fla's varlen kernel, or transformers'
torch rule where fla-core is missing or refuses to train (asyncgrpo.packing.gated_deltanet.fla_refusal).
Model FLOPs: asyncgrpo.modeling.perf (matmul weights of every layer, the full-attention layers' pairs, the
recurrence's state products); recomputation by checkpointing is not counted.

Every timed step of the process is logged with the allocator's retries, the memory reserved and the
card's clock, power and clock-limit reasons (`gpu_step.ROUND_LOG`): issue 59 saw the same step take
0.87 s in one phase and 0.97-0.99 s in the next. The process runs with the allocator's expandable
segments (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` unless set): on an 80 GB H100 the default
step runs at the card's edge (80.0 GB), and without them its first step ran out of memory with 7.35
GiB reserved but unallocated (bench/RESULTS.md, issue 59).

Run (GPU machine): `python bench/gpu_step_qwen3_5.py --out $OUT`; `--smoke` runs tiny shapes on CPU.
The last line is `gpu_step_qwen3_5 median_mfu=X target=0.58`: the MFU of the median of every timed
round of the default step in the process (the `defaults` phase and the first of `--kernels` in the
rotation), not of its best phase (issue 59's target on an H200; 0.52 on an H100).
"""

from __future__ import annotations

import os

# Before torch initializes CUDA's allocator (see the module doc).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from gpu_step import (  # noqa: E402
    ROUND_LOG,
    FixedPlan,
    activation_probe,
    deepmath_plans,
    log,
    make_trainer,
    plain_rows_within_budget,
    plan_flops,
    profile,
    sample,
    timed_steps,
)
from gpu_training import QWEN3_5_2B, SPEED_WORKLOADS, matmul_peak, require_cuda  # noqa: E402

from asyncgrpo.modeling.perf import flop_model  # noqa: E402
from asyncgrpo.packing import gated_deltanet, kernel_choice  # noqa: E402
from asyncgrpo.packing.planner import TokenBudgetBatcher  # noqa: E402
from asyncgrpo.packing.tree_attention import BLOCK_SIZE  # noqa: E402

TARGET_MFU = 0.58  # issue 59: median over the process's default-step rounds, on an H200 (0.52 on an H100)
# name -> (ASYNCGRPO_PATH_CONV, ASYNCGRPO_GATED_NORM) of the Gated DeltaNet kernels a default step runs
KERNEL_VARIANTS = {
    "asyncgrpo": ("triton", "triton"),
    "fla-conv": ("fla", "triton"),
    "model-norm": ("triton", "model"),
    "issue33": ("fla", "model"),
}
# The caches a start reads (kernel_cache, docs/models.md): one fresh folder each for the cold start,
# the same ones for the warm start.
START_CACHES = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TILELANG_CACHE_DIR")

SMOKE_SHAPE = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
    linear_value_head_dim=32, vocab_size=1024, layer_types=["linear_attention"] * 3 + ["full_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
)  # fmt: skip


def build_model(smoke: bool) -> Qwen3_5ForCausalLM:
    config = Qwen3_5TextConfig(**dict(QWEN3_5_2B, **(SMOKE_SHAPE if smoke else {})), dtype="float32")
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu"):
        return Qwen3_5ForCausalLM(config)  # fp32: AsyncGRPOConfig.dtype's default


def gdn_path(device: torch.device) -> str:
    """The Gated DeltaNet rule and convolution tree packing runs on `device`."""
    conv = f"conv: {gated_deltanet.path_conv_name(device.type)}"
    if device.type != "cuda":
        return f"torch rule, {conv}"
    if gated_deltanet._fla_chunk_rule(device):
        return f"fla varlen, {conv}"
    if importlib.util.find_spec("fla") is None:
        return f"torch rule (fla-core is not installed), {conv}"
    return f"torch rule ({gated_deltanet.fla_refusal(device)}), {conv}"


def seconds_since_process_start() -> float:
    """Wall seconds since this process started (Linux: its start time in /proc, so the interpreter's
    start and every import count, as they do for a user's training script)."""
    ticks = os.sysconf("SC_CLK_TCK")
    started = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
    return float(Path("/proc/uptime").read_text().split()[0]) - started


def peak_memory_gb() -> float:
    return torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else 0.0


def measure(trainer, plans, flops, peak: float, args, warmup: int, label: str) -> dict:
    """Median step time of `plans` (one optimizer step), its MFU and tokens/s."""
    rows = [row for plan in plans for row in plan.pack()]
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    seconds = timed_steps(trainer, plans, args.repeats, warmup, label)
    unpacked = sum(r.num_unpacked_tokens for r in rows)
    forwarded = sum(r.num_tokens for r in rows)
    return {
        "rows": len(rows), "row_tokens": [r.num_tokens for r in rows], "seconds": seconds,
        "mfu": plan_flops(flops, rows) / seconds / peak, "model_flops": plan_flops(flops, rows),
        "unpacked_tok_s": unpacked / seconds, "forwarded_tok_s": forwarded / seconds,
        "packing_ratio": unpacked / forwarded, "peak_memory_gb": peak_memory_gb(),
        "checkpointed_layers": trainer._run.metrics.window.summarize().get("perf/checkpointed_layers"),
    }  # fmt: skip


def workload_plans(rng, prompt_len: int, completion_len: int, budget: int, vocab: int, smoke: bool):
    """(tree plans, plain plans) of the same samples: 2 rows the trainer's planner fills to `budget`
    with groups of a prompt and 8 completions, and the same samples packed plainly at `budget`."""
    scale = 16 if smoke else 1
    batcher = TokenBudgetBatcher(budget, 1, min_shared_tokens=BLOCK_SIZE)
    plans, group = [], 0
    while len(plans) < 2:
        prompt = rng.integers(0, vocab, max(2, prompt_len // scale))
        for _ in range(8):
            candidate = sample(rng, prompt, max(2, completion_len // scale), vocab, group)
            if batcher.offer(candidate).name != "PLACED":
                plans.append(batcher.close())
                batcher.offer(candidate)
        group += 1
    plans = plans[:2]
    samples = [s for plan in plans for row in plan.rows for s in row]
    return plans, [FixedPlan([row]) for row in plain_rows_within_budget(samples, budget)]


def use_kernels(name: str) -> None:
    """Run the Gated DeltaNet kernels of `KERNEL_VARIANTS[name]` from the next layer call on."""
    conv, norm = KERNEL_VARIANTS[name]
    os.environ[kernel_choice.PATH_CONV_ENV], os.environ[kernel_choice.GATED_NORM_ENV] = conv, norm


def kernel_variants(trainer, plans, flops, peak: float, names: list[str], rounds: int) -> dict:
    """The default step with each kernel variant, timed in rotation (one step of each per round, so
    a drift of the card's clocks falls on all alike), after a warm-up step of each; the median, its
    MFU and a profile of each."""
    rows = [row for plan in plans for row in plan.pack()]
    for name in names:
        use_kernels(name)
        timed_steps(trainer, plans, repeats=1, warmup=1, label=f"warm-up kernels {name}")
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            use_kernels(name)
            seconds[name].append(timed_steps(trainer, plans, repeats=1, warmup=0, label=f"kernels {name}"))
    results = {}
    for name in names:
        use_kernels(name)
        median = statistics.median(seconds[name])
        results[name] = {"kernels": KERNEL_VARIANTS[name], "seconds": median, "all_seconds": seconds[name],
                         "mfu": plan_flops(flops, rows) / median / peak,
                         "profile": profile(trainer, plans, f"default step, kernels {name}")}  # fmt: skip
        log(f"kernels {name} {KERNEL_VARIANTS[name]}: {median:.3f} s ({results[name]['mfu']:.1%} MFU), "
            f"rounds {' '.join(f'{x:.3f}' for x in seconds[name])}")  # fmt: skip
    use_kernels(names[0])
    return results


def measure_start(args, out: Path) -> dict:
    """Cold then warm start: this script twice (`--start-child`), sharing fresh kernel caches. Each
    child's log goes to `out`/start_{cold,warm}.log; returns their reports and the sum of the
    autotuning time Triton printed in each."""
    root = Path(tempfile.mkdtemp(prefix="gpu_step_qwen3_5-caches-"))
    env = {**os.environ, **{name: str(root / name.lower()) for name in START_CACHES},
           "TRITON_PRINT_AUTOTUNING": "1", "PYTHONUNBUFFERED": "1"}  # fmt: skip
    # A user's start: every Triton autotuner tuned, never the one-config shortcut of short device calls.
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and "one_config_autotune" not in p
    )
    env.pop("ONE_CONFIG_AUTOTUNE_EXCEPT", None)
    results: dict = {"caches": str(root)}
    for label in ("cold", "warm"):
        phases = ["start"] + ([args.warm_phases] if label == "warm" and args.warm_phases else [])
        command = [sys.executable, __file__, "--start-child", "--out", str(out / label), "--budget",
                   str(args.budget), "--phases", ",".join(phases), "--kernels", args.kernels,
                   "--rounds", str(args.rounds)] + (["--smoke"] if args.smoke else [])  # fmt: skip
        started = time.perf_counter()
        limit = args.start_timeout if label == "cold" else args.warm_timeout
        try:
            done = subprocess.run(command, env=env, timeout=limit, capture_output=True, text=True)
            text, code = done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired as expired:
            text = (expired.stdout or b"").decode(errors="replace") + (expired.stderr or b"").decode(
                errors="replace"
            )
            code = "timeout"
        (out / f"start_{label}.log").write_text(text)
        found = re.findall(r"^start_report (.*)$", text, flags=re.MULTILINE)
        report = json.loads(found[-1]) if found else {}
        report.update(exit=code, wall_s=time.perf_counter() - started,
                      autotune_s=sum(map(float, re.findall(r"finished after ([0-9.]+)s", text))),
                      autotuned_kernels=len(re.findall(r"finished after", text)))  # fmt: skip
        results[label] = report
        log(f"start {label}: {json.dumps(report)}")
        for line in text.splitlines():  # what the warm child measured next, into this log too
            if line.startswith(("kernels ", "gpu_step_qwen3_5 mfu", "profile of")) or re.match(
                r"  \S.*: \d+ ms \(", line
            ):
                log(line)
        if code == "timeout":
            log(f"start {label}: still running after {limit:.0f} s, stopped")
    cold, warm = (results[x].get("start_to_first_step_s", float("nan")) for x in ("cold", "warm"))
    log(f"gpu_step_qwen3_5 start cold_s={cold:.1f} warm_s={warm:.1f}")
    return results


def start_child(output_dir: str, args, report: dict, save):
    """In a `--start-child` process: seconds from the process's start to the end of each stage up to
    the first default step, then the second step's seconds, as one `start_report` line."""
    marks = {"imports_s": seconds_since_process_start()}
    model = build_model(args.smoke)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    marks["model_s"] = seconds_since_process_start()
    trainer = make_trainer({}, args.smoke, output_dir, model)
    marks["trainer_s"] = seconds_since_process_start()
    plans = deepmath_plans(
        np.random.default_rng(7), args.budget, 2, trainer._model.config.vocab_size, args.smoke
    )
    timed_steps(trainer, plans, repeats=1, warmup=0)
    marks["start_to_first_step_s"] = seconds_since_process_start()
    marks["second_step_s"] = timed_steps(trainer, plans, repeats=1, warmup=0)
    from torch._dynamo.utils import compile_times

    log(compile_times(repr="str"))  # where torch.compile's seconds went, by phase
    report["start"] = marks
    save()
    log("start_report " + json.dumps(marks))
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, on CPU: checks the script runs")
    parser.add_argument("--budget", type=int, default=16384, help="token_budget of each row")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=480.0, help="skip phases that start after this")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the kernel variants in rotation")
    parser.add_argument(
        "--kernels",
        default="asyncgrpo",
        help=f"comma-separated kernel variants of the default step: {', '.join(KERNEL_VARIANTS)}",
    )
    parser.add_argument("--start-timeout", type=float, default=330.0, help="seconds the cold start may take")
    parser.add_argument("--warm-timeout", type=float, default=150.0, help="seconds the warm child may take")
    parser.add_argument("--warm-phases", default="defaults", help="what the warm start child runs next")
    parser.add_argument("--start-child", action="store_true", help=argparse.SUPPRESS)  # measure_start's child
    parser.add_argument(
        "--phases", default="3.4,1,2,defaults",
        help="comma-separated: packing ratios of the tree-vs-plain workloads (3.4, 1, 2), 'memory' (the "
        "activations of one unchecked row against the planner's estimate) and/or 'defaults'; "
        "lets a short device call run part of the measurement; 'start' (measured first): a cold and "
        "a warm start in child processes",
    )  # fmt: skip
    args = parser.parse_args()
    require_cuda(args.smoke)
    started = time.perf_counter()
    if args.smoke:
        args.budget = min(args.budget, 2048)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    report: dict = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "budget": args.budget, "shape": "Qwen3.5-2B" if not args.smoke else "smoke",
    }  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every phase: a call cut short still returns what it measured
        (out / "gpu_step_qwen3_5.json").write_text(json.dumps(report, indent=1, default=str))

    report["gdn_path"] = gdn_path(device)
    phases = args.phases.split(",")
    kernels = args.kernels.split(",")
    if set(kernels) - set(KERNEL_VARIANTS):
        parser.error(f"--kernels: unknown {sorted(set(kernels) - set(KERNEL_VARIANTS))}")
    use_kernels(kernels[0])
    if "start" in phases and not args.start_child:  # children of their own, before this one takes the GPU
        report["start"] = measure_start(args, out)
        save()
        phases.remove("start")
        if not phases:
            return
    output_dir = tempfile.mkdtemp(prefix="gpu_step_qwen3_5-")
    if args.start_child:
        trainer = start_child(output_dir, args, report, save)
        phases.remove("start")
        if not phases:
            return
    else:
        trainer = make_trainer({}, args.smoke, output_dir, build_model(args.smoke))
    vocab = trainer._model.config.vocab_size
    peak = matmul_peak(device)
    report["matmul_peak_tflops"] = peak / 1e12
    log(f"{report}")
    flops = flop_model(trainer._model)
    # The comparison first (ratio 3.4, 1, 2): a call cut short by the device's time keeps the most.
    workloads = {"3.4": SPEED_WORKLOADS[2], "1": SPEED_WORKLOADS[0], "2": SPEED_WORKLOADS[1]}
    known = set(workloads) | {"defaults", "memory"}
    if set(phases) - known:
        parser.error(f"--phases: unknown {sorted(set(phases) - known)}")
    report["tree_vs_plain"] = []
    for prompt_len, completion_len, _ in (workloads[p] for p in phases if p in workloads):
        if time.perf_counter() - started > args.seconds:
            log(f"skipping workload ({prompt_len}, {completion_len}): out of time")
            continue
        rng = np.random.default_rng(prompt_len)
        tree_plans, plain_plans = workload_plans(
            rng, prompt_len, completion_len, args.budget, vocab, args.smoke
        )
        tree = measure(trainer, tree_plans, flops, peak, args, args.warmup, f"tree {prompt_len}")
        plain = measure(trainer, plain_plans, flops, peak, args, 1, f"plain {prompt_len}")
        entry = {
            "prompt": prompt_len, "completion": completion_len, "packing_ratio": tree["packing_ratio"],
            "tree": tree, "plain": plain, "speedup": plain["seconds"] / tree["seconds"],
            "flop_ratio": plain["model_flops"] / tree["model_flops"],
        }  # fmt: skip
        report["tree_vs_plain"].append(entry)
        log(f"tree vs plain {json.dumps(entry)}")
        save()
    if "memory" in phases:  # one row of half the budget: the torch rule's activations fit unchecked
        plans = deepmath_plans(np.random.default_rng(5), args.budget // 2, 1, vocab, args.smoke)
        report["activation_probe"] = activation_probe(trainer, plans)
        save()
    if "defaults" in phases and time.perf_counter() - started < args.seconds:
        plans = deepmath_plans(np.random.default_rng(7), args.budget, 2, vocab, args.smoke)
        report["defaults"] = measure(trainer, plans, flops, peak, args, 1, "defaults")
        log(f"defaults {report['defaults']}")
        save()
        report["kernel_variants"] = kernel_variants(trainer, plans, flops, peak, kernels, args.rounds)
        save()
        default_labels = ("defaults", f"kernels {kernels[0]}")
        rounds = [r["seconds"] for r in ROUND_LOG if r["label"] in default_labels]
        median = statistics.median(rounds)
        report["median"] = {"rounds": len(rounds), "seconds": median,
                            "mfu": report["defaults"]["model_flops"] / median / peak}  # fmt: skip
    report["round_log"] = ROUND_LOG
    save()
    print_table(report)


def print_table(report: dict) -> None:
    log(f"\n{report['device']} torch {report['torch']}, {report['shape']}, token_budget "
        f"{report['budget']}: bf16 matmul peak {report['matmul_peak_tflops']:.0f} TFLOP/s, "
        f"GDN: {report['gdn_path']}")  # fmt: skip
    d = report.get("defaults")
    if d:
        log(f"default step (DeepMath-like, ratio {d['packing_ratio']:.2f}): {d['seconds']:.3f} s, "
            f"MFU {d['mfu']:.1%}, {d['unpacked_tok_s']:,.0f} tok/s, peak {d['peak_memory_gb']:.1f} GB, "
            f"ckpt layers {d['checkpointed_layers']}")  # fmt: skip
        for name, v in report.get("kernel_variants", {}).items():
            log(f"  kernels {name} (conv {v['kernels'][0]}, norm {v['kernels'][1]}): {v['seconds']:.3f} s, "
                f"MFU {v['mfu']:.1%}")  # fmt: skip
    log("| workload (prompt + 8 x completion) | ratio | tree rows | tree s | tree MFU | tree tok/s "
        "| plain rows | plain s | plain MFU | plain tok/s | speedup | FLOP ratio |")  # fmt: skip
    log("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for e in report["tree_vs_plain"]:
        t, p = e["tree"], e["plain"]
        log(f"| {e['prompt']} + 8 x {e['completion']} | {e['packing_ratio']:.2f} | {t['rows']} "
            f"| {t['seconds']:.3f} | {t['mfu']:.1%} | {t['unpacked_tok_s']:,.0f} | {p['rows']} "
            f"| {p['seconds']:.3f} | {p['mfu']:.1%} | {p['unpacked_tok_s']:,.0f} | "
            f"{e['speedup']:.2f} | {e['flop_ratio']:.2f} |")  # fmt: skip
    if report.get("round_log"):
        log("| round | s | allocator retries | reserved GB | SM MHz | W | clock limits |")
        log("|---|---|---|---|---|---|---|")
        for r in report["round_log"]:
            log(f"| {r['label']} | {r['seconds']:.3f} | {r.get('alloc_retries')} "
                f"| {r.get('reserved_gb', 0):.1f} | {r.get('sm_mhz')} | {r.get('power_w', 0):.0f} "
                f"| {r.get('limits')} |")  # fmt: skip
    if d:
        m = report["median"]
        log(f"defaults phase alone: mfu={d['mfu']:.3f}")
        log(f"gpu_step_qwen3_5 median_mfu={m['mfu']:.3f} target={TARGET_MFU:.2f} rounds={m['rounds']} "
            f"median_s={m['seconds']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
