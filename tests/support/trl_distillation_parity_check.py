"""Our distillation loss against TRL 1.16's own (tests/unit/test_trl_distillation_parity.py runs this in a
process with the trl==1.16.0 wheel on its path).

TRL's `AsyncDistillationTrainer._compute_loss` narrows the teacher's reported support by `beta`
(`_narrow_top1_actual_support`), keeps the positions with teacher signal, and sums the generalized JSD
over them with `_chunked_jsd_loss`, which projects the student's hidden states through the output head a
chunk at a time. Both functions run here unchanged, on the same fp32 tensors as ours: the student's
hidden states and head weight, the realized tokens, and a teacher's top-k (plus the realized token when
it falls outside, as vLLM reports it). Ours: `teacher_support`, the student's log-probs at the support
from `token_logprobs` (the trainer's chunked head, asyncgrpo/losses/token_logprobs.py),
`distillation_divergence`. For beta in {0, 0.3, 0.5, 1} x tail bucket on/off x two teacher temperatures, the
loss, its gradient with respect to the hidden states and the head weight, and the metrics (jsd, entropy,
teacher_entropy, per token) must agree within 1e-6. Prints one line per case and "parity" when every case
holds.
"""

from __future__ import annotations

import itertools
import sys
import warnings

import torch

warnings.filterwarnings("ignore")  # TRL's vLLM-version notice
from trl.experimental.async_distillation.async_distillation_trainer import (  # noqa: E402
    _chunked_jsd_loss,
    _narrow_top1_actual_support,
)

from asyncgrpo.losses.distillation import distillation_divergence, teacher_support  # noqa: E402
from asyncgrpo.losses.token_logprobs import token_logprobs  # noqa: E402

TOLERANCE = 1e-6
ENTRIES, HIDDEN, VOCAB, TOP_K = 45, 16, 64, 6


def inputs(seed: int, teacher_temperature: float):
    """Student hidden states and head, realized tokens drawn from the student, and the teacher's report:
    its top-k ids in rank order with their log-probs at `teacher_temperature`, the realized token appended
    when outside the top-k, -1 / -inf padded; two entries carry no report at all."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ENTRIES, HIDDEN, generator=generator)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator) * 0.5
    targets = torch.multinomial(torch.softmax(hidden @ weight.T, -1), 1, generator=generator)[:, 0]
    teacher_logits = torch.randn(ENTRIES, VOCAB, generator=generator) * 2.0
    teacher = torch.log_softmax(teacher_logits / teacher_temperature, -1)
    top = teacher.topk(TOP_K, dim=-1)
    ids = torch.full((ENTRIES, TOP_K + 1), -1, dtype=torch.int64)
    logprobs = torch.full((ENTRIES, TOP_K + 1), -torch.inf)
    ids[:, :TOP_K], logprobs[:, :TOP_K] = top.indices, top.values
    outside = ~(top.indices == targets[:, None]).any(-1)
    ids[outside, TOP_K] = targets[outside]
    logprobs[outside, TOP_K] = teacher[outside, targets[outside]]
    ids[[3, 17]], logprobs[[3, 17]] = -1, -torch.inf  # positions the teacher did not score
    return hidden, weight, targets, ids, logprobs


def trls(hidden, weight, targets, ids, logprobs, beta, temperature, tail):
    """TRL's `_compute_loss` path from the teacher's report to the summed loss and metric sums."""
    mask = ids != -1
    if beta == 0.0:
        support_ids, support_logprobs, valid = ids, logprobs, mask
    else:
        support_ids, support_logprobs, valid = (
            t[0]
            for t in _narrow_top1_actual_support(ids[None], logprobs[None], targets[None], mask[None], beta)
        )
    scored = valid.any(-1)
    hidden = hidden.clone().requires_grad_(True)
    weight = weight.clone().requires_grad_(True)
    loss, jsd_sum, entropy_sum, teacher_entropy_sum, _ = _chunked_jsd_loss(
        hidden[scored], weight, None, 1.0, None, support_ids[scored], support_logprobs[scored], valid[scored],
        beta, temperature, tail, None, 1, 16,
    )  # fmt: skip
    loss.backward()
    count = scored.sum()
    metrics = [jsd_sum / count, entropy_sum / count, teacher_entropy_sum / count]
    return loss.detach(), hidden.grad, weight.grad, torch.stack(metrics).detach()


def ours(hidden, weight, targets, ids, logprobs, beta, temperature, tail):
    support_ids, support_logprobs, valid = teacher_support(ids, logprobs, targets, beta)
    hidden = hidden.clone().requires_grad_(True)
    weight = weight.clone().requires_grad_(True)
    student = token_logprobs(
        hidden, weight, targets, temperature, top_ids=support_ids, chunk_size=8, fused=False
    )
    divergence = distillation_divergence(student.top_logprobs, support_logprobs, valid, beta, tail)
    loss = divergence.jsd.sum()
    loss.backward()
    scored = divergence.scored
    count = scored.sum()
    metrics = [
        divergence.jsd[scored].sum() / count,
        student.entropy[scored].sum() / count,
        divergence.teacher_entropy[scored].sum() / count,
    ]
    return loss.detach(), hidden.grad, weight.grad, torch.stack(metrics).detach()


def main() -> int:
    failed = cases = 0
    for beta, tail, temperature in itertools.product((0.0, 0.3, 0.5, 1.0), (True, False), (1.0, 0.7)):
        cases += 1
        tensors = inputs(cases, temperature)
        theirs_, ours_ = trls(*tensors, beta, temperature, tail), ours(*tensors, beta, temperature, tail)
        entries = float(ENTRIES)
        gaps = {
            "loss/token": (theirs_[0] - ours_[0]).abs().item() / entries,
            "d hidden": (theirs_[1] - ours_[1]).abs().max().item(),
            "d weight": (theirs_[2] - ours_[2]).abs().max().item(),
            "metrics": (theirs_[3] - ours_[3]).abs().max().item(),
        }
        worst = max(gaps.values())
        # Reverse KL over the realized token alone, renormalized, is 0 on both sides (the config refuses it).
        degenerate = beta == 1.0 and not tail
        ok = worst <= TOLERANCE and (theirs_[0] > 0 or degenerate)
        failed += not ok
        detail = " ".join(f"{name}={gap:.2e}" for name, gap in gaps.items())
        print(
            f"beta={beta} tail={tail} T={temperature}: loss={ours_[0].item():.6f} {detail} "
            + ("ok" if ok else "FAIL")
        )
    print(f"{cases} cases, {failed} failed")
    if failed:
        return 1
    print("parity")
    return 0


if __name__ == "__main__":
    sys.exit(main())
