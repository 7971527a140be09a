"""The weight sync through RAM (`shared_memory`): when it is chosen, the directory a run owns and
the clean-up of a dead run's, and on a real server that it serves exactly the trainer's weights, as
the filesystem sync does."""

from __future__ import annotations

import fcntl
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip(
    "msgspec", reason="msgspec is not installed (a GPU host may lack the non-torch dependencies)"
)

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from asyncgrpo.generation.client import VLLMRequestError  # noqa: E402
from asyncgrpo.weight_sync import choose_backend  # noqa: E402
from asyncgrpo.weight_sync.shared_memory import (  # noqa: E402
    DIRECTORY_PREFIX,
    OWNER_LOCK,
    ROOM_IN_MODEL_COPIES,
    SharedMemoryWeightSync,
    owned_directory,
    remove_orphans,
    servers_on_this_machine,
    why_not_shared_memory,
)


def test_only_servers_on_this_machine_count_as_local():
    assert servers_on_this_machine(["http://127.0.0.1:8000", "http://localhost:8001/"])
    assert not servers_on_this_machine(["http://127.0.0.1:8000", "http://192.0.2.7:8000"])  # TEST-NET-1
    assert not servers_on_this_machine(["http://no-such-host.invalid:8000"])
    assert not servers_on_this_machine([])


def test_why_not_names_the_missing_condition(tmp_path, monkeypatch):
    local = ["http://127.0.0.1:8000"]
    assert why_not_shared_memory(local, 1024, root=tmp_path) is None
    assert "not on this machine" in why_not_shared_memory(["http://192.0.2.7:1"], 1024, root=tmp_path)
    assert "not a directory" in why_not_shared_memory(local, 1024, root=tmp_path / "absent")
    monkeypatch.setattr("asyncgrpo.weight_sync.shared_memory.free_ram_bytes", lambda root: 4000)
    assert why_not_shared_memory(local, 4000 // ROOM_IN_MODEL_COPIES, root=tmp_path) is None
    assert "RAM free" in why_not_shared_memory(local, 4000 // ROOM_IN_MODEL_COPIES + 1, root=tmp_path)


def test_shared_memory_is_chosen_only_by_name_and_only_where_it_can_be_used():
    assert choose_backend("auto", None, trainer_on_gpu=False, shared_memory_refusal=None) == "filesystem"
    assert choose_backend("shared_memory", None, False, shared_memory_refusal=None) == "shared_memory"
    with pytest.raises(ValueError, match="cannot be used: a server is elsewhere"):
        choose_backend("shared_memory", None, False, shared_memory_refusal="a server is elsewhere")


def test_a_dead_runs_directory_is_removed_and_a_live_ones_kept(tmp_path):
    live, live_lock = owned_directory(tmp_path)
    dead, dead_lock = owned_directory(tmp_path)
    assert live.name.startswith(DIRECTORY_PREFIX) and (live / OWNER_LOCK).exists()
    dead_lock.abandon()  # what the kernel does when its process dies: the flock goes, the file stays
    stray = tmp_path / f"{DIRECTORY_PREFIX}no-lock"  # an owner part-way through removing it
    stray.mkdir()
    assert remove_orphans(tmp_path) == [dead]
    assert live.exists() and stray.exists() and not dead.exists()
    # A second open of the lock file is another open file description: it cannot take a held lock.
    with open(live / OWNER_LOCK) as other, pytest.raises(BlockingIOError):
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    live_lock.release()


class ReloadRecorder:
    """The client calls the filesystem sync makes, with what each reload found on disk."""

    base_urls = ["http://server"]

    def __init__(self, refuse: bool = False):
        self.refuse = refuse
        self.calls: list[str] = []
        self.reloaded: list[dict] = []

    async def pause(self, **kwargs):
        self.calls.append("pause")
        return []  # every server reached

    async def resume(self, **kwargs):
        self.calls.append("resume")
        return []

    async def reload_weights(self, path, version=None, timeout=None, urls=None):
        self.calls.append(
            f"reload {Path(path).name}" + (f" on {' '.join(urls)}" if urls != self.base_urls else "")
        )
        if self.refuse:
            raise VLLMRequestError("http://server", 500, "No such file or directory")
        self.reloaded.append(load_file(Path(path) / "model.safetensors"))
        return []


class ImmediateLoop:
    def run(self, coroutine, timeout=None):
        import asyncio

        return asyncio.run(coroutine)


def test_a_sync_writes_under_the_owned_directory_and_close_removes_it(tmp_path):
    model = torch.nn.Linear(3, 2)
    client = ReloadRecorder()
    sync = SharedMemoryWeightSync(client, ImmediateLoop(), timeout_s=5.0, root=tmp_path)
    owned = sync.owned
    sync.sync(model, 1)
    with torch.no_grad():
        model.weight.add_(1.0)
    sync.sync(model, 2)
    assert client.calls == ["pause", "reload v1", "resume", "pause", "reload v2", "resume"]
    assert torch.equal(client.reloaded[-1]["weight"], model.weight) and not (owned / "versions/v1").exists()
    assert sorted(path.name for path in (owned / "versions").iterdir()) == ["v2"]
    sync.close()
    assert not owned.exists() and list(tmp_path.iterdir()) == []


def test_a_server_that_joins_reloads_the_version_the_others_run(tmp_path):
    """A server back after a loss, or new, is given the served version from what the sync kept,
    without the model: it alone is paused, reloads those files and is resumed."""
    model = torch.nn.Linear(3, 2)
    client = ReloadRecorder()
    sync = SharedMemoryWeightSync(client, ImmediateLoop(), timeout_s=5.0, root=tmp_path)
    sync.sync(model, 1)
    with torch.no_grad():
        model.weight.add_(1.0)
    sync.sync(model, 2)
    served = dict(client.reloaded[-1])
    with torch.no_grad():
        model.weight.add_(1.0)  # trained on since version 2: the server must get version 2 all the same
    assert sync.can_resend and sync.resend(2, ["http://back"]) == []
    assert client.calls[-3:] == ["pause", "reload v2 on http://back", "resume"]
    assert torch.equal(client.reloaded[-1]["weight"], served["weight"])
    sync.close()


def test_a_refused_reload_says_how_to_fall_back(tmp_path):
    sync = SharedMemoryWeightSync(ReloadRecorder(refuse=True), ImmediateLoop(), root=tmp_path)
    with pytest.raises(VLLMRequestError, match="weight_sync_backend='filesystem'"):
        sync.sync(torch.nn.Linear(3, 2), 1)
    sync.close()  # the reload failed part-way: the directory stays for the next run to reclaim
    assert remove_orphans(tmp_path) and list(tmp_path.iterdir()) == []


# -- against the real server ---------------------------------------------------------------------------


@pytest.mark.vllm
def test_shared_memory_and_filesystem_syncs_serve_exactly_the_trainers_weights(
    vllm_server, tiny_model_dir, tmp_path
):
    """The server's greedy tokens and log-probs after each sync are the trainer's own (the served
    model is float32), and both transports serve the same weights alike."""
    from test_vllm_weights import GREEDY, PROMPT, greedy_reference

    from asyncgrpo.generation.background import BackgroundLoop
    from asyncgrpo.generation.client import VLLMClient, policy_label
    from asyncgrpo.weight_sync import make_weight_sync

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    expected_tokens, expected_logprobs = greedy_reference(model, PROMPT, GREEDY.max_tokens)
    loop = BackgroundLoop(default_timeout_s=120)
    client = VLLMClient(vllm_server.url, timeout=60)
    served = {}
    try:
        for version, backend in enumerate(("shared_memory", "filesystem"), start=1):
            sync = make_weight_sync(backend, client, loop, tmp_path, timeout_s=60)
            sync.sync(model, version)
            completion = loop.run(client.complete(PROMPT, GREEDY, seed=0))
            served[backend] = completion.token_ids.tolist(), np.asarray(completion.logprobs)
            owned = getattr(sync, "owned", None)
            sync.close()
            assert owned is None or not owned.exists()
    finally:
        loop.run(client.reload_weights(str(tiny_model_dir), version=policy_label(0)))  # the session's server
        loop.run(client.reset_prefix_cache())  # unsalted requests: drop the synced weights' prefixes
        loop.run(client.close())
        loop.close()
    for tokens, logprobs in served.values():
        assert tokens == expected_tokens
        np.testing.assert_allclose(logprobs, expected_logprobs, atol=1e-4)
    np.testing.assert_array_equal(served["shared_memory"][1], served["filesystem"][1])
