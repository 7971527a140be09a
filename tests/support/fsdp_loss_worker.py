"""One process of `test_fsdp2_loss_and_gradients_match_one_process`: rank r trains on row r of a
micro-batch with the trainer's own `row_loss`, FSDP2-sharded over gloo (CPU); every rank checks
that the summed loss and the gathered gradients equal one unsharded process doing both rows. Twice:
with the default (score-centered) loss, and with a TRL loss type carrying the KL to a sharded reference
copy and the high-entropy mask, whose threshold is found over both ranks' rows (trainer/loss_menu.py).
Run with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set; exits non-zero on a mismatch."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # the test module it reads

from loss_args import loss_args  # noqa: E402
from test_trie_packing import random_samples  # noqa: E402

from asyncgrpo.cli.tiny_model import TinyModelSpec, build_model, build_tokenizer  # noqa: E402
from asyncgrpo.losses.regularizers import entropy_threshold  # noqa: E402
from asyncgrpo.losses.token_logprobs import row_logprobs  # noqa: E402
from asyncgrpo.packing.planner import TokenBudgetBatcher  # noqa: E402
from asyncgrpo.packing.tree_attention import enable_tree_attention  # noqa: E402
from asyncgrpo.trainer.algorithm_state import AlgorithmState  # noqa: E402
from asyncgrpo.trainer.distributed import Processes, shard_model  # noqa: E402
from asyncgrpo.trainer.loss_menu import LossMenu  # noqa: E402
from asyncgrpo.trainer.row_loss import StepLoss, algorithm_settings, row_loss  # noqa: E402

TOP_N = 4
ARGS = loss_args(
    temperature=0.9, vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=2.0,
    epsilon=0.2, epsilon_high=0.28, gradient_accumulation_steps=1, router_aux_loss_coef=None,
)  # fmt: skip
MENU_ARGS = SimpleNamespace(
    **{
        **vars(ARGS),
        "loss_type": "dapo",
        "score_centering": False,
        "beta": 0.05,
        "top_entropy_quantile": 0.5,
    },
    device=torch.device("cpu"),
)


def samples_with_top(vocab: int):
    rng = np.random.default_rng(7)
    samples = random_samples(rng, 12, vocab=24)
    for index, sample in enumerate(samples):
        sample.advantage = float(rng.normal())
        sample.group_id = index % 3
        sample.top_ids = rng.integers(0, vocab, (sample.num_trained, TOP_N))
        sample.top_logprobs = np.full((sample.num_trained, TOP_N), -1.5, dtype=np.float32)
    return samples


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    built = build_model(build_tokenizer(), TinyModelSpec()).float()
    enable_tree_attention(built)
    return built


def with_reference(args, processes: Processes, sharded: bool) -> tuple[torch.nn.Module, LossMenu]:
    """A policy and its loss menu, whose reference copy differs from it (head x 1.3), sharded alike."""
    policy = model()
    menu = LossMenu(policy, args)
    with torch.no_grad():
        menu.reference.model.lm_head.weight.mul_(1.3)
    if sharded:
        shard_model(policy)
    menu.prepare(processes, sharded, True, None, AlgorithmState())
    return policy, menu


def check(name: str, rank: int, world: int, rows, args, step_of) -> None:
    """`step_of(policy, menu, sharded)`: the StepLoss the rows use (None: row_loss's own)."""
    entries = float(sum(row.num_entries for row in rows))
    reference, menu = with_reference(args, Processes(1, 0), sharded=False) if args.beta else (model(), None)
    reference_loss = 0.0
    for row in rows:  # one process, both rows
        loss, _ = row_loss(reference, row, entries, args, step_of(reference, menu, rows))
        loss.backward()
        reference_loss += float(loss)

    if args.beta:
        sharded, menu = with_reference(args, Processes(world, rank), sharded=True)
    else:
        sharded = model()
        shard_model(sharded)
    loss, _ = row_loss(sharded, rows[rank], entries, args, step_of(sharded, menu, None))
    (loss * world).backward()  # FSDP2 averages gradients over ranks
    total = torch.tensor([float(loss)], dtype=torch.float64)
    dist.all_reduce(total)
    assert abs(float(total) - reference_loss) < 1e-6, (float(total), reference_loss)
    expected = dict(reference.named_parameters())
    worst = 0.0
    for name_, parameter in sharded.named_parameters():
        gradient = parameter.grad.full_tensor()
        worst = max(worst, float((gradient - expected[name_].grad).abs().max()))
    print(
        f"rank {rank} {name}: loss {float(total):.6f} vs {reference_loss:.6f}, max grad diff {worst:.2e}",
        flush=True,
    )
    assert worst < 1e-5, worst


def menu_step(world: int, entries: float, samples: float):
    """The TRL-loss step: on one process the micro-batch's entropy threshold comes from both rows'
    entropies, computed first; sharded, each rank brings its own row's (LossMenu.for_row, a gather)."""

    def step_of(policy, menu, rows):
        settings = algorithm_settings(MENU_ARGS)
        step = StepLoss(settings, entries, samples, rows=world, reference=menu.reference)
        if rows is None:
            return menu.for_row(step, counted=True)
        with torch.no_grad():
            entropies = torch.cat([row_logprobs(policy, row, MENU_ARGS.temperature).entropy for row in rows])
        threshold = entropy_threshold(entropies, MENU_ARGS.top_entropy_quantile)
        return dataclasses.replace(step, micro_batch_entropy_threshold=lambda _: threshold)

    return step_of


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = model()
    batcher = TokenBudgetBatcher(token_budget=10_000, num_rows=world)
    for sample in samples_with_top(reference.config.vocab_size):
        batcher.offer(sample)
    rows = batcher.close().pack()
    assert all(row.num_entries for row in rows), "each rank needs a row for this check"
    entries = float(sum(row.num_entries for row in rows))
    check("score-centered", rank, world, rows, ARGS, lambda *_: None)
    samples = float(sum(row.num_samples for row in rows))
    check("dapo, KL, entropy mask", rank, world, rows, MENU_ARGS, menu_step(world, entries, samples))
    # Both ranks past their last collective before either tears gloo down: a rank that exits first
    # closes its sockets under the other's gloo threads, which then abort (seen once in CI).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
