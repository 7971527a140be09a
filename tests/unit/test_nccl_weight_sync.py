"""The NCCL weight-sync backend: vLLM's packed format, the rendezvous payloads, and the whole
protocol end to end against a test double of the server (another process), including faults and a
model sharded with FSDP2 over two processes.

On CPU the double's receiver and the trainer's data plane speak gloo (`GlooTransport`); everything
else (HTTP calls and their order, bucket cuts, gathers, deadlines) is the production code. The NCCL
data plane itself is covered by the `gpu` tests at the end.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager

import pytest
from support_paths import SUPPORT

pytest.importorskip(
    "msgspec", reason="msgspec is not installed (a GPU host may lack the non-torch dependencies)"
)

import requests  # noqa: E402
import torch  # noqa: E402
from conftest import free_port  # noqa: E402
from weight_transfer_double import GlooTransport, checksum, running_double, start_double, unpack  # noqa: E402

from asyncgrpo.cli.tiny_model import TinyModelSpec, build_model, build_tokenizer  # noqa: E402
from asyncgrpo.generation.background import BackgroundLoop  # noqa: E402
from asyncgrpo.generation.client import VLLMClient, policy_label  # noqa: E402
from asyncgrpo.weight_sync.base import serving_tensors  # noqa: E402
from asyncgrpo.weight_sync.buckets import pack, plan_buckets  # noqa: E402
from asyncgrpo.weight_sync.nccl import NcclWeightSync, WeightTransferError  # noqa: E402
from asyncgrpo.weight_sync.transport import NcclTransport  # noqa: E402


def received(url: str) -> dict:
    return requests.get(url + "/received", timeout=10).json()


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(build_tokenizer(), TinyModelSpec())


def expected_checksums(model) -> dict[str, str]:
    return {name: checksum(tensor) for name, tensor in serving_tensors(model)}


# -- the packed format ---------------------------------------------------------------------------


def test_buckets_close_on_the_tensor_that_crosses_the_budget():
    assert plan_buckets([4, 4, 4, 4], bucket_bytes=8) == [range(0, 3), range(3, 4)]
    assert plan_buckets([9, 1, 1], bucket_bytes=8) == [range(0, 1), range(1, 3)]
    assert plan_buckets([8, 8], bucket_bytes=8) == [range(0, 2)]
    assert plan_buckets([], bucket_bytes=8) == []


def test_bucket_cuts_match_vllms_packed_producer():
    packed_tensor = pytest.importorskip("vllm.distributed.weight_transfer.packed_tensor")
    torch.manual_seed(0)
    tensors = [(f"t{i}", torch.randn(int(torch.randint(1, 50, ())))) for i in range(40)]
    sizes = [tensor.numel() * 4 for _, tensor in tensors]
    ours = [[tensors[i][0] for i in bucket] for bucket in plan_buckets(sizes, bucket_bytes=300)]
    iterator, theirs = iter(tensors), []
    while (chunk := packed_tensor.pack_tensors(iterator, lambda item: item[1], 300)) is not None:
        theirs.append(chunk.names)
    assert ours == theirs


def test_pack_then_unpack_gives_the_tensors_back():
    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.int64), torch.randn(2, 2).to(torch.bfloat16)]
    buffer = pack(tensors)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 60 + 56 + 8
    back = unpack(buffer, [t.shape for t in tensors], [t.dtype for t in tensors])
    for original, copy in zip(tensors, back):
        assert torch.equal(original, copy) and copy.dtype == original.dtype


# -- the protocol against the double ----------------------------------------------------------


@contextmanager
def against_doubles(
    count: int = 1, fault: str = "none", receiver: str = "gloo", device: str = "cpu", transport=GlooTransport
):
    """`count` doubles of a server, each in its own process, and a factory of senders to all of them."""
    loop = BackgroundLoop()
    with ExitStack() as stack:
        urls = [
            stack.enter_context(running_double(fault=fault, receiver=receiver, device=device))
            for _ in range(count)
        ]
        client = VLLMClient(urls, timeout=60)

        def sender(timeout_s: float = 30, **options) -> NcclWeightSync:
            return NcclWeightSync(client, loop, transport(), timeout_s=timeout_s, **options)

        try:
            yield urls, sender
        finally:
            loop.run(client.close())
    loop.close()


@pytest.mark.slow
def test_weights_arrive_exactly_with_the_protocol_in_order():
    model = tiny_model()
    with against_doubles() as ([url], sender):
        backend = sender(bucket_bytes=64 * 1024)
        backend.sync(model, version=1)
        first = received(url)
        assert first["version"] == policy_label(1)
        assert first["checksums"] == expected_checksums(model)
        assert "lm_head.weight" in first["checksums"]  # untied: its own tensor
        assert first["log"] == [
            "/init_weight_transfer_engine",
            "/pause",
            "/start_weight_update",
            "/update_weights",
            "/finish_weight_update",
            "/resume",
        ]
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.01)
        backend.sync(model, version=2)
        second = received(url)
        assert second["version"] == policy_label(2) and second["checksums"] == expected_checksums(model)
        assert second["checksums"] != first["checksums"]
        backend.close()
        assert received(url)["log"][-1] == "/shutdown_weight_transfer_engine"


@pytest.mark.slow
def test_two_servers_join_one_group_at_their_rank_offsets():
    """Trainer rank 0, server A's worker rank 1, server B's rank 2: both receive every weight."""
    model = tiny_model()
    with against_doubles(count=2) as (urls, sender):
        backend = sender(bucket_bytes=64 * 1024)
        backend.sync(model, version=1)
        for url in urls:
            answer = received(url)
            assert answer["version"] == policy_label(1) and answer["checksums"] == expected_checksums(model)
        backend.close()


@pytest.mark.slow
def test_a_rejected_update_fails_at_once_and_generation_resumes():
    with against_doubles(fault="reject_update") as ([url], sender):
        backend = sender()
        started = time.monotonic()
        with pytest.raises(WeightTransferError, match="unknown parameter 'bogus'"):
            backend.sync(tiny_model(), version=1)
        assert time.monotonic() - started < 10  # not the 30 s collective timeout
        log = received(url)["log"]
        assert log[-2:] == ["/finish_weight_update", "/resume"]  # best-effort finish, then resume
        with pytest.raises(WeightTransferError, match="earlier failure"):
            backend.sync(tiny_model(), version=2)


@pytest.mark.slow
def test_a_server_that_never_joins_times_out_with_a_clear_error():
    with against_doubles(fault="never_join") as (_, sender):
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="joining"):
            sender(timeout_s=3)
        assert time.monotonic() - started < 15


@pytest.mark.slow
def test_a_server_that_stops_receiving_cannot_hang_the_trainer():
    with against_doubles(fault="stall_receive") as ([url], sender):
        backend = sender(timeout_s=4)
        started = time.monotonic()
        with pytest.raises(WeightTransferError, match="weight sync v1 failed"):
            backend.sync(tiny_model(), version=1)
        assert time.monotonic() - started < 30
        assert received(url)["log"][-1] == "/resume"


@pytest.mark.slow
def test_fsdp2_sharded_weights_sync_from_two_processes(tmp_path):
    """Two CPU processes shard the model with FSDP2; both gather, rank 0 sends. Then the same with a
    LoRA adapter for adapter-only sync: both gather the adapter, rank 0 writes it as vLLM loads it."""
    model = tiny_model()
    with running_double() as url:
        port = free_port()
        workers = [
            subprocess.Popen(
                [sys.executable, str(SUPPORT / "fsdp_sync_worker.py"), url, str(tmp_path)],
                env={
                    **os.environ,
                    "RANK": str(rank),
                    "WORLD_SIZE": "2",
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "CUDA_VISIBLE_DEVICES": "",
                },
            )
            for rank in range(2)
        ]
        # 300 s: a bound against a hang, not a speed target (on a loaded 2-core machine a run took 118 s)
        assert [worker.wait(timeout=300) for worker in workers] == [0, 0]
        answer = received(url)
        assert answer["version"] == policy_label(1)
        assert answer["checksums"] == expected_checksums(model)
    from fsdp_sync_worker import lora_model
    from peft import PeftModel

    reference = lora_model()
    written = PeftModel.from_pretrained(tiny_model(), tmp_path / "v1")
    adapter = {name: p for name, p in written.named_parameters() if "lora_" in name}
    assert adapter.keys() == {name for name, _ in reference.named_parameters() if "lora_" in name}
    assert all(torch.equal(p, adapter[name]) for name, p in reference.named_parameters() if "lora_" in name)


# -- the NCCL data plane (GPU) -----------------------------------------------------------------


@pytest.mark.gpu
def test_nccl_library_mints_ids_and_runs_collectives_on_one_gpu():
    from asyncgrpo.weight_sync.nccl_library import NcclCommunicator, NcclLibrary

    library = NcclLibrary()
    assert library.version().startswith("2.")
    unique_id = library.new_unique_id()
    assert len(unique_id) == 128 and unique_id != library.new_unique_id()
    device = torch.device("cuda", 0)
    communicator = NcclCommunicator(library, unique_id, 0, 1, device, timeout_s=30)
    total = torch.full((4,), 3.0, device=device)
    communicator.all_reduce_sum(total, timeout_s=30)
    assert total.tolist() == [3.0] * 4
    payload = torch.arange(1000, dtype=torch.uint8, device=device)
    communicator.broadcast(payload, root=0, timeout_s=30)
    assert torch.equal(payload, torch.arange(1000, dtype=torch.uint8, device=device))
    communicator.close()


def model_on_last_gpu(gpus: int, layout: str) -> torch.nn.Module:
    """The tiny model in bfloat16 on GPU `gpus - 1`, the trainer's; skipped without `gpus` GPUs."""
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs: {layout}")
    torch.cuda.set_device(gpus - 1)
    return tiny_model().to(f"cuda:{gpus - 1}", torch.bfloat16)


@pytest.mark.gpu
def test_nccl_weights_arrive_bit_exact_on_a_second_gpu():
    model = model_on_last_gpu(2, "the receiver double on GPU 0, the trainer on GPU 1")
    with against_doubles(receiver="nccl", device="cuda:0", transport=NcclTransport) as ([url], sender):
        backend = sender(timeout_s=60, bucket_bytes=1 << 20)
        backend.sync(model, version=1)
        answer = received(url)
        assert answer["version"] == policy_label(1) and answer["checksums"] == expected_checksums(model)
        backend.close()


@pytest.mark.slow
def test_reconnect_forms_a_new_group_and_weights_arrive_through_it():
    """What the trainer does after a server restart (which leaves the old group): shut the engine down
    everywhere, join a new group, send the weights again."""
    model = tiny_model()
    with against_doubles() as ([url], sender):
        backend = sender()
        backend.sync(model, version=1)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.02)
        backend.reconnect()
        backend.sync(model, version=1)
        answer = received(url)
        assert answer["checksums"] == expected_checksums(model)
        log = answer["log"]
        assert log.count("/init_weight_transfer_engine") == 2
        assert log.index("/shutdown_weight_transfer_engine") < len(log) - 1 - log[::-1].index(
            "/init_weight_transfer_engine"
        )
        backend.close()


def lost_receiver_rejoins(model, transport, receiver: str, devices: tuple[str, str]) -> None:
    """Two servers in one group; one is killed between syncs. The next sync cannot reach it: it tears
    the group down on the other and forms it anew without the dead receiver, and the survivor gets the
    weights exactly. A server back at the dead one's URL then gets a new group with the survivor (the
    trainer's full sync for a server that joins under NCCL), and both receive the next version."""
    loop = BackgroundLoop()
    (first, url_a), (second, url_b) = (start_double(receiver=receiver, device=device) for device in devices)
    processes = [first, second]
    client = VLLMClient([url_a, url_b], timeout=60)
    try:
        backend = NcclWeightSync(client, loop, transport(), timeout_s=60)
        assert backend.sync(model, version=1).missed == []
        second.kill()
        second.wait(10)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.01)
        assert backend.sync(model, version=2).missed == [url_b]
        survivor = received(url_a)
        assert survivor["version"] == policy_label(2) and survivor["checksums"] == expected_checksums(model)
        assert survivor["log"][-7:] == [
            "/pause",
            "/shutdown_weight_transfer_engine",  # the group that held the dead receiver, torn down
            "/init_weight_transfer_engine",  # and formed anew without it
            "/start_weight_update",
            "/update_weights",
            "/finish_weight_update",
            "/resume",
        ]
        assert backend.members == [url_a]
        back, _ = start_double(receiver=receiver, device=devices[1], port=int(url_b.rsplit(":", 1)[1]))
        processes.append(back)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.01)
        backend.reconnect()
        assert backend.sync(model, version=3, urls=[url_a, url_b]).missed == []
        for url in (url_a, url_b):
            answer = received(url)
            assert answer["version"] == policy_label(3) and answer["checksums"] == expected_checksums(model)
        assert backend.members == [url_a, url_b]
        backend.close()
    finally:
        loop.run(client.close())
        loop.close()
        for process in processes:
            process.kill()
            process.wait(10)


@pytest.mark.slow
def test_a_lost_receiver_is_dropped_from_the_group_and_a_server_back_joins_a_new_one():
    lost_receiver_rejoins(tiny_model(), GlooTransport, "gloo", ("cpu", "cpu"))


@pytest.mark.gpu
def test_a_lost_nccl_receiver_is_dropped_from_the_group_and_a_server_back_joins_a_new_one():
    model = model_on_last_gpu(3, "two receiver doubles on GPUs 0 and 1, the trainer on GPU 2")
    lost_receiver_rejoins(model, NcclTransport, "nccl", ("cuda:0", "cuda:1"))


@pytest.mark.slow
def test_a_receiver_lost_during_a_broadcast_leaves_the_others_paused_until_a_new_group():
    """One receiver dies as it is asked to receive. The sync does not fail the run: the group is
    aborted, the dead server and the one that may hold part of the weights are both reported missed,
    and the survivor stays paused (it must not generate with half the weights) until the next sync
    forms a group without the dead one and gives it every tensor."""
    model = tiny_model()
    loop = BackgroundLoop()
    (first, url_a), (second, url_b) = start_double(), start_double(fault="die_on_update")
    client = VLLMClient([url_a, url_b], timeout=60)
    try:
        backend = NcclWeightSync(client, loop, GlooTransport(), timeout_s=20)
        assert sorted(backend.sync(model, version=1).missed) == sorted([url_a, url_b])
        assert received(url_a)["log"][-1] == "/finish_weight_update", "not resumed: it stays paused"
        assert backend.members == []
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.01)
        assert backend.sync(model, version=2, urls=[url_a]).missed == []
        answer = received(url_a)
        assert answer["version"] == policy_label(2) and answer["checksums"] == expected_checksums(model)
        assert answer["log"][-1] == "/resume" and backend.members == [url_a]
        backend.close()
    finally:
        loop.run(client.close())
        loop.close()
        for process in (first, second):
            process.kill()
            process.wait(10)


def test_server_engine_and_version_detection():
    from asyncgrpo.generation.server_info import parse_server_info
    from asyncgrpo.weight_sync.nccl import vllm_at_least

    assert (
        parse_server_info({"vllm_config": {"weight_transfer_config": {"backend": "nccl"}}}).transfer_backend
        == "nccl"
    )
    assert parse_server_info({"vllm_config": {"weight_transfer_config": None}}).transfer_backend is None
    assert parse_server_info(None) is None
    assert vllm_at_least("0.32.0+cpu", (0, 30)) and vllm_at_least("1.0.0", (0, 30))
    assert not vllm_at_least("0.11.1rc2.dev3", (0, 30)) and not vllm_at_least("unknown", (0, 30))


def test_an_nccl_sync_to_a_server_older_than_vllm_0_30_is_refused():
    # Such a server would join through a TCP store the trainer hosts, unauthenticated, holding a pickle
    # the server unpickles: not offered (docs/security.md). Refused before any GPU or store is touched.
    from asyncgrpo.weight_sync import make_weight_sync

    class OldServer:
        async def version(self) -> str:
            return "0.29.2"

    loop = BackgroundLoop()
    try:
        with pytest.raises(ValueError, match=r"needs vLLM >= 0\.30 .* runs vLLM 0\.29\.2.*'filesystem'"):
            make_weight_sync("nccl", OldServer(), loop)
    finally:
        loop.close()


@pytest.mark.gpu
def test_an_nccl_peer_that_never_joins_times_out():
    from asyncgrpo.weight_sync.nccl_library import NcclCommunicator, NcclLibrary

    library = NcclLibrary()
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="not every one of the 2 ranks joined within 3 s"):
        NcclCommunicator(library, library.new_unique_id(), 0, 2, torch.device("cuda", 0), timeout_s=3)
    assert time.monotonic() - started < 10
