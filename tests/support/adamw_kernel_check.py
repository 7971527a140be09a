"""The Triton AdamW (`asyncgrpo.kernels.adamw_kernel.TritonAdamW`) against torch's AdamW, on any device.
Used by tests/unit/test_optimizer_step.py twice: on a GPU (compiled kernel) and on CPU through Triton's
interpreter, where this file runs as a script in a process of its own with TRITON_INTERPRET=1 (Triton
reads it when the kernel is defined)."""

from __future__ import annotations

import copy

import torch

from asyncgrpo.trainer.optimizer_step import queue_clipped_step


def model(device: str) -> torch.nn.Module:
    """Sizes that are no multiple of the kernel's block, tiny and multi-block tensors."""
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(37, 301), torch.nn.LayerNorm(301), torch.nn.Linear(301, 5))
    return layers.to(device)


def groups(net: torch.nn.Module) -> list[dict]:
    """The Trainer's layout: weights with decay, biases and norms without; a second learning rate."""
    weights = [p for name, p in net.named_parameters() if name.endswith("weight") and p.ndim == 2]
    others = [p for name, p in net.named_parameters() if not (name.endswith("weight") and p.ndim == 2)]
    return [{"params": weights, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0, "lr": 3e-3}]


def gradients(net: torch.nn.Module, step: int, device: str, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(step)
    inputs = torch.randn(16, 37, generator=gen).to(device)
    loss = (net(inputs) ** 2).mean() * scale
    loss.backward()
    return loss.detach()


def check_triton_adamw(device: str) -> None:
    """Six steps through the trainer's queue_clipped_step (one clipped, one skipped for a non-finite
    loss) against clip_grad_norm_ + torch's AdamW: parameters, moments and step counts agree; then
    the state continues in torch's fused AdamW (the same next step) and loads back."""
    from asyncgrpo.kernels.adamw_kernel import TritonAdamW

    settings = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8)
    reference, candidate = model(device), model(device)
    torch_adamw = torch.optim.AdamW(groups(reference), foreach=False, **settings)
    triton_adamw = TritonAdamW(groups(candidate), **settings)
    steps_seen = []
    triton_adamw.register_step_post_hook(lambda optimizer, args, kwargs: steps_seen.append(1))
    for step in range(6):
        scale = 50.0 if step == 1 else 1.0  # step 1 is clipped
        gradients(reference, step, device, scale)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        if step != 3:  # step 3 has a non-finite loss: skipped
            torch_adamw.step()
        torch_adamw.zero_grad(set_to_none=True)
        loss = gradients(candidate, step, device, scale)
        if step == 3:
            loss = torch.tensor(float("nan"), device=device)
        assert all(triton_adamw._kernel_covers(group) for group in triton_adamw.param_groups)
        _, skipped = queue_clipped_step(triton_adamw, list(candidate.parameters()), 1.0, loss)
        assert bool(skipped) == (step == 3)
        triton_adamw.zero_grad(set_to_none=True)
    for (name, want), got in zip(reference.named_parameters(), candidate.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(triton_adamw.state[got][key], torch_adamw.state[want][key], msg=key)
        assert float(triton_adamw.state[got]["step"]) == float(torch_adamw.state[want]["step"]) == 5.0
    assert len(steps_seen) == 6  # step hooks run once a step
    # Checkpoints interchange: the Triton state continues as torch's fused AdamW (the same next step),
    # and loads back.
    resumed = copy.deepcopy(candidate)
    as_torch = torch.optim.AdamW(groups(resumed), fused=True, **settings)
    as_torch.load_state_dict(copy.deepcopy(triton_adamw.state_dict()))  # as a saved checkpoint: no aliasing
    for net, optimizer in ((candidate, triton_adamw), (resumed, as_torch)):
        queue_clipped_step(optimizer, list(net.parameters()), 1.0, gradients(net, 6, device))
    for (name, want), got in zip(resumed.named_parameters(), candidate.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"resumed {name}")
    back = TritonAdamW(groups(resumed), **settings)
    back.load_state_dict(as_torch.state_dict())
    assert back.state_dict()["state"].keys() == triton_adamw.state_dict()["state"].keys()
    print(f"ok {device}")


def check_uncovered_groups_take_torchs_update() -> None:
    """amsgrad is not in the kernel: that group gets torch's fused update, the same as torch's
    AdamW's, and the step hooks still run once."""
    from asyncgrpo.kernels.adamw_kernel import TritonAdamW

    settings = dict(lr=1e-2, amsgrad=True)
    reference, candidate = model("cpu"), model("cpu")
    torch_adamw = torch.optim.AdamW(reference.parameters(), **settings)
    triton_adamw = TritonAdamW(candidate.parameters(), **settings)
    assert not triton_adamw._kernel_covers(triton_adamw.param_groups[0])
    steps_seen = []
    triton_adamw.register_step_post_hook(lambda optimizer, args, kwargs: steps_seen.append(1))
    for step in range(3):
        for net, optimizer in ((reference, torch_adamw), (candidate, triton_adamw)):
            gradients(net, step, "cpu")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    for want, got in zip(reference.parameters(), candidate.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert len(steps_seen) == 3
    print("amsgrad: torch's update")


def check_sharded_parameters_take_torchs_step() -> None:
    """FSDP2's parameters are DTensor shards, which the kernel cannot address: torch's step runs."""
    import os
    import socket

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from asyncgrpo.kernels.adamw_kernel import TritonAdamW

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        param = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]))
        param.grad = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
        optimizer = TritonAdamW([param], lr=1e-2)
        assert not optimizer._kernel_covers(optimizer.param_groups[0])
        before = param.full_tensor().clone()
        optimizer.step()
        assert not torch.equal(param.full_tensor(), before)
    finally:
        dist.destroy_process_group()
    print("sharded: torch's step")


if __name__ == "__main__":
    from types import SimpleNamespace

    from asyncgrpo.kernels.adamw_kernel import TritonAdamW
    from asyncgrpo.trainer.optimizer_step import with_triton_update

    check_triton_adamw("cpu")
    check_uncovered_groups_take_torchs_update()
    check_sharded_parameters_take_torchs_step()
    on_cuda = SimpleNamespace(device=torch.device("cuda"), triton_adamw=True)
    assert with_triton_update(torch.optim.AdamW, {"fused": True}, on_cuda) is TritonAdamW
    print("picked on cuda")
