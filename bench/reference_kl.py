"""Where should the KL's reference be scored (`beta > 0`)? A reference copy in the trainer against a frozen
reference scored by a vLLM server (prompt log-probs of the sampled tokens, as a distillation teacher is
scored), measured on this machine with the tiny model (docs/algorithm.md, "KL to a reference").

For one optimizer step of the demo's shape (16 groups of 16 completions, prompts of ~20 tokens, rows of
256 tokens) and of the long task's (4 groups of 16 completions of 48-64 tokens, rows of 2,048):

- trainer copy: the copy's bytes; the step's policy forward+backward (what a step costs without a KL)
  against the reference forward the KL adds (no gradient), timed on the trainer's path (`row_logprobs`);
- server: its resident memory (the vLLM process tree), and the seconds to score the step's samples with
  `prompt_logprobs` on it, all requests at once (generation's side: it overlaps training, but delays
  each sample by that much, and takes the server's time from generation);
- exactness: the server's prompt log-probs against the trainer's at temperature 1 and 0.7. vLLM computes
  prompt log-probs before any sampling processor (its source says so), so at T != 1 they are the
  untempered distribution, not the one the policy samples and trains.

Prints one line per shape: `reference_kl shape=S copy_MB=.. copy_extra_step_frac=.. server_MB=..
server_score_s=.. step_s=..` and the exactness line. No target: it records what the choice rests on.
Run: `flock /work/heavy.lock .venv/bin/python bench/reference_kl.py` (it starts a vLLM server).
"""

from __future__ import annotations

import asyncio
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import numpy as np
import torch

from asyncgrpo.cli.tiny_model import save_tiny_model
from asyncgrpo.generation.server import ServerOptions, VLLMServer
from asyncgrpo.losses.token_logprobs import row_logprobs
from asyncgrpo.modeling.models import load_model
from asyncgrpo.packing.planner import Placement, TokenBudgetBatcher
from asyncgrpo.packing.tree_attention import enable_tree_attention
from asyncgrpo.records.sample import Sample
from asyncgrpo.run import cpu_use
from asyncgrpo.trainer.reference_model import ReferenceModel

SHAPES = {  # groups, group size, prompt tokens, completion tokens (low, high), row token budget
    "demo": (16, 16, 20, (2, 8), 256),
    "long": (4, 16, 20, (48, 64), 2048),
}
REPEATS = 5


def step_samples(shape: str, vocab: int, rng: np.random.Generator) -> list[Sample]:
    groups, size, prompt_tokens, (low, high), _ = SHAPES[shape]
    samples = []
    for group in range(groups):
        prompt = rng.integers(3, vocab, prompt_tokens)
        for _ in range(size):
            completion = rng.integers(3, vocab, int(rng.integers(low, high + 1)))
            ids = np.concatenate([prompt, completion])
            trained = np.arange(len(ids)) >= prompt_tokens
            samples.append(Sample(ids, trained, np.full(int(trained.sum()), -2.0, np.float32), 1.0, group))
    return samples


def rows_of(samples: list[Sample], budget: int):
    batcher, plans = TokenBudgetBatcher(token_budget=budget, num_rows=1), []
    for sample in samples:
        if batcher.offer(sample) is Placement.CLOSED:
            plans.append(batcher.close())
            batcher.offer(sample)
    plans.append(batcher.close())
    return [plan.pack()[0] for plan in plans]


def timed(function) -> float:
    seconds = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        function()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def trainer_side(model, rows) -> tuple[float, float, float]:
    """(copy MB, the step's policy forward+backward s, the reference forward s)."""
    reference = ReferenceModel.for_policy(model, SimpleNamespace(beta=0.1, sync_ref_model=False))
    copy_bytes = sum(p.numel() * p.element_size() for p in reference.model.parameters())

    def policy_step():
        for row in rows:
            row_logprobs(model, row).logprobs.sum().backward()
        model.zero_grad(set_to_none=True)

    def reference_forward():
        for row in rows:
            reference.row_logprobs(model, row, 1.0)

    return copy_bytes / 2**20, timed(policy_step), timed(reference_forward)


async def score(url: str, model_name: str, samples: list[Sample]) -> list[list[float]]:
    """Each sample's prompt log-probs of its trained tokens, every request at once."""

    async def one(session, sample):
        body = {
            "model": model_name,
            "prompt": sample.token_ids.tolist(),
            "max_tokens": 1,
            "prompt_logprobs": 0,
        }
        async with session.post(f"{url}/v1/completions", json=body) as answer:
            data = await answer.json()
        entries = data["choices"][0]["prompt_logprobs"]
        positions = np.flatnonzero(sample.trained)
        return [float(entries[p][str(sample.token_ids[p])]["logprob"]) for p in positions]

    async with aiohttp.ClientSession() as session:
        return await asyncio.gather(*(one(session, s) for s in samples))


def server_rss_mb(url: str) -> float:
    total = 0
    for pid in cpu_use.server_pids([url]):
        try:
            with open(f"/proc/{pid}/status") as status:
                total += next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))
        except (OSError, StopIteration):
            pass
    return total / 1024


def main() -> int:
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="reference-kl-"))
    model_dir = save_tiny_model(work / "model")
    model = enable_tree_attention(load_model(str(model_dir), dtype=torch.float32))
    rng = np.random.default_rng(0)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    options = ServerOptions(model=str(model_dir), port=port, max_model_len=1024, dtype="float32", cpu=True)
    with VLLMServer(options, log_path=work / "vllm.log") as server:
        url = server.options.url
        rss = server_rss_mb(url)
        for shape in SHAPES:
            samples = step_samples(shape, model.config.vocab_size, rng)
            rows = rows_of(samples, SHAPES[shape][4])
            copy_mb, step_s, reference_s = trainer_side(model, rows)
            asyncio.run(score(url, str(model_dir), samples[:4]))  # warm
            started = time.perf_counter()
            asyncio.run(score(url, str(model_dir), samples))
            server_s = time.perf_counter() - started
            print(
                f"reference_kl shape={shape} samples={len(samples)} rows={len(rows)} copy_MB={copy_mb:.1f} "
                f"step_fwd_bwd_s={step_s:.3f} copy_ref_forward_s={reference_s:.3f} "
                f"copy_extra_step_frac={reference_s / step_s:.2f} server_MB={rss:.0f} "
                f"server_score_s={server_s:.3f}",
                flush=True,
            )
        exactness(url, str(model_dir), model, rng)
    return 0


def exactness(url: str, model_name: str, model, rng) -> None:
    """Max |server prompt log-prob - trainer log-prob| over a few samples, at T = 1 and T = 0.7."""
    samples = step_samples("demo", model.config.vocab_size, rng)[:16]
    served = asyncio.run(score(url, model_name, samples))
    rows = [rows_of([s], 256)[0] for s in samples]
    line = []
    for temperature in (1.0, 0.7):
        with torch.no_grad():
            trainer = [row_logprobs(model, row, temperature).logprobs for row in rows]
        gap = max(float((torch.tensor(s) - t.double()).abs().max()) for s, t in zip(served, trainer))
        line.append(f"max_gap_T{temperature:g}={gap:.2e}")
    print("reference_kl exactness (server prompt log-probs vs the trainer's): " + " ".join(line), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
