"""Elastic rollout servers against real vLLM CPU servers, in one run (each server start costs about
45 s and 3 GB): a server is SIGKILLed for good, the run trains on with the other, the killed one is
started again on its port and rejoins with the current weights, and a third server started mid-run
and added to the server list file joins, takes work and receives every later weight version
(docs/reliability.md, "Elastic servers"). The decisions themselves: tests/unit/test_server_roster.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import urllib.request

import pytest

pytest.importorskip(
    "datasets", reason="datasets is not installed (a GPU host may lack the non-torch dependencies)"
)

from conftest import MAX_MODEL_LEN, free_port, make_config  # noqa: E402
from test_faults import record_trained  # noqa: E402
from test_trainer_e2e import PROBE, hf_greedy, prompts, restore_server, server_greedy  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from worker_side import noise_reward  # noqa: E402 (what the rollout worker imports: tests/support/worker_side.py says why)

from asyncgrpo import AsyncGRPOTrainer  # noqa: E402
from asyncgrpo.generation.client import SamplingParams, VLLMClient, policy_label  # noqa: E402
from asyncgrpo.generation.server import ServerOptions, VLLMServer  # noqa: E402
from asyncgrpo.run import timeline  # noqa: E402
from asyncgrpo.weight_sync.filesystem import FilesystemWeightSync  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.many_servers]

# Bound on the servers' coming back and joining: starts of two servers side by side on a loaded
# machine, plus the checks and the weights; a run that never grows fails here instead of hanging.
JOIN_DEADLINE_S = 900
# Steps the run trains with the one server left before it waits for the others to start.
TRAINED_ALONE_STEPS = 3


def sampled(url: str) -> tuple[str, list[int], list[float]]:
    """A server's weight label and what it samples (tokens and their log-probs) for one seeded
    request: equal on two servers only when they run the same weights."""

    async def run():
        async with VLLMClient(url, timeout=60) as client:
            completion = await client.complete(PROBE, SamplingParams(max_tokens=8), seed=0)
            return (
                (await client.weight_labels())[0],
                completion.token_ids.tolist(),
                completion.logprobs.tolist(),
            )

    return asyncio.run(run())


def last_refusal(server: VLLMServer) -> float:
    """When a starting server last refused a connection, polled until it answers or its process
    ends (its `wait_ready` then raises): no request can have reached it before that moment."""
    refused_at = time.time()
    while server.process.poll() is None:
        attempt = time.time()
        try:
            urllib.request.urlopen(server.url + "/health", timeout=5).close()
            break
        except OSError:
            refused_at = attempt
            time.sleep(0.2)
    return refused_at


def requests_served(url: str) -> float:
    """Requests the server finished, from its Prometheus counter."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total")
    )


def server_lane(trace: dict, url: str) -> tuple[list[tuple[int, int]], list[int]]:
    """(the `serving` intervals on `url`'s lane of the timeline, sorted; when it was marked lost)."""
    lanes = {
        (item["pid"], item["tid"])
        for item in trace["traceEvents"]
        if item["ph"] == "M" and item["name"] == "thread_name" and item["args"]["name"] == f"server {url}"
    }
    events = [
        item for item in trace["traceEvents"] if item["ph"] == "X" and (item["pid"], item["tid"]) in lanes
    ]
    bars = sorted((item["ts"], item["ts"] + item["dur"]) for item in events if item["name"] == "serving")
    return bars, sorted(item["ts"] for item in events if item["name"] == "lost")


class EveryStepKept(timeline.TimelineRecorder):
    """The run's timeline with every step (the file keeps a sample of a long run's middle steps)."""

    def __init__(self, path):
        super().__init__(path, first_steps=1_000_000)


def test_a_run_loses_a_server_takes_it_back_and_grows_by_one_listed_mid_run(
    vllm_server, tiny_model_dir, tmp_path, monkeypatch
):
    def server(name: str, port: int) -> VLLMServer:
        options = ServerOptions(
            model=str(tiny_model_dir), port=port, max_model_len=MAX_MODEL_LEN, dtype="float32", cpu=True
        )
        return VLLMServer(options, log_path=tmp_path / f"{name}.log")

    # B, the server that stays, is the session's: one start fewer. Its weights are put back at the end.
    first, third = server("a", free_port()), server("c", free_port())
    url_a, url_b, url_c = first.url, vllm_server.url, third.url
    server_list = tmp_path / "servers.txt"
    server_list.write_text("# servers that join while the run goes on\n")
    synced: list[tuple[int, list[str], list[str]]] = []  # (version, servers, those it missed)
    apply = FilesystemWeightSync.apply

    def recording_apply(self, prepared, version, urls):
        missed = apply(self, prepared, version, urls)
        synced.append((version, list(urls), list(missed)))
        return missed

    monkeypatch.setattr(FilesystemWeightSync, "apply", recording_apply)
    monkeypatch.setattr(timeline, "TimelineRecorder", EveryStepKept)
    trained = record_trained(monkeypatch)
    back = threading.Event()
    restart_failures: list[BaseException] = []
    not_answering: list[float] = []  # a moment the restarted server was still refusing connections

    def bring_back() -> None:
        """The killed server again on its port, and a new one, started side by side; the new one is
        listed once it answers, as a SLURM job or a pod's readiness hook would. A start that fails
        is kept for the run's next step to raise (with the server's log), not left to the deadline."""
        try:
            first.launch()
            third.launch()
            not_answering.append(last_refusal(first))
            first.wait_ready()
            third.wait_ready()
        except BaseException as error:
            restart_failures.append(error)
            raise
        server_list.write_text(server_list.read_text() + f"{url_c}\n")
        back.set()

    class LoseRejoinGrow(TrainerCallback):
        killed_at = grown_at_step = stop_at_step = None

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2 and self.killed_at is None:
                os.killpg(first.process.pid, signal.SIGKILL)  # the server's whole process group, for good
                first.process.wait()
                self.killed_at = time.time()
                threading.Thread(target=bring_back, daemon=True).start()
            if restart_failures:
                raise AssertionError("the servers could not be started again") from restart_failures[0]
            if self.killed_at and state.global_step >= 2 + TRAINED_ALONE_STEPS:
                # The run has trained on with one server; now it waits for the two starts. Here all
                # share two cores, and a run at full speed (its server generating flat out, the
                # trainer stepping) starved the starts past their timeout in the full suite, or made
                # them take minutes. On a cluster a server starts on a machine of its own.
                while (
                    not (back.is_set() or restart_failures) and time.time() - self.killed_at < JOIN_DEADLINE_S
                ):
                    back.wait(1.0)
            if self.killed_at and self.stop_at_step is None:
                assert time.time() - self.killed_at < JOIN_DEADLINE_S, (
                    f"the servers never joined the run, or the new one never generated (joined at step "
                    f"{self.grown_at_step}; server list: {server_list.read_text()!r}); last lines of the "
                    f"restarted server's log:\n{first.log_tail()}\n"
                    f"and of the new server's:\n{third.log_tail()}"
                )
            # Once the new server has generated (the samples queued before it joined come first), three
            # more weight versions with all three.
            if self.grown_at_step is not None and self.stop_at_step is None and requests_served(url_c) > 0:
                self.stop_at_step = args.max_steps = state.global_step + 3

        def on_log(self, args, state, control, logs=None, **kwargs):
            if back.is_set() and self.grown_at_step is None and (logs or {}).get("rollout/servers_live") == 3:
                self.grown_at_step = state.global_step

    callback = LoseRejoinGrow()
    try:
        first.launch()
        first.wait_ready()
        original = sampled(url_a)
        args = make_config(
            first, tmp_path / "out", vllm_server_base_url=f"{url_a},{url_b}", num_rollout_workers=2,
            vllm_server_urls_file=str(server_list), max_steps=10_000, learning_rate=1e-3,
            vllm_server_timeout=240,
        )  # fmt: skip
        trainer = AsyncGRPOTrainer(
            str(tiny_model_dir), noise_reward, args, train_dataset=prompts(), callbacks=[callback]
        )
        trainer.train()

        assert callback.stop_at_step is not None and trainer.state.global_step == callback.stop_at_step
        rollout_ids = [rollout for _, rollout in trained]
        assert len(set(rollout_ids)) == len(rollout_ids), "a sample was trained twice"
        history = trainer.state.log_history
        assert sum(entry.get("rollout/servers_lost_count", 0) for entry in history) >= 1, "the loss counted"
        alone = [entry for entry in history if entry.get("rollout/servers_live") == 1]
        assert len(alone) >= TRAINED_ALONE_STEPS - 1, "the run trained on with the server left"
        assert sum(entry.get("rollout/servers_joined_count", 0) for entry in history) >= 2, "A back, C new"
        # Whether a request was in flight on A when it died is timing; that it is logged is not.
        assert any("rollout/server_lost_regenerated_count" in entry for entry in history)

        # The third server took work and received every weight version after it joined.
        joined = next(index for index, (_, urls, _) in enumerate(synced) if url_c in urls)
        later = [(version, urls, missed) for version, urls, missed in synced[joined + 1 :]]
        assert len({version for version, _, _ in later}) >= 3
        assert all(url_c in urls and url_c not in missed for _, urls, missed in later)
        assert requests_served(url_c) > 0, "the server that joined generated"
        # Every server runs the trained weights: the one back from the kill, the one that stayed, the new one.
        label, *samples = sampled(url_b)
        assert label == policy_label(trainer.model_version) and samples != list(original[1:])
        assert sampled(url_a) == sampled(url_c) == (label, *samples)
        assert server_greedy(url_a) == hf_greedy(trainer.model.eval())

        # The timeline: the lost server's lane has a gap from its loss to its return, the new one's
        # lane starts when it joined.
        trace = json.loads((tmp_path / "out" / "timeline.json").read_text())
        bars_a, lost_at = server_lane(trace, url_a)
        assert len(lost_at) == 1
        down = (lost_at[0], not_answering[0] * 1e6)  # no request can have gone to A in between
        assert all(end <= down[0] or start >= down[1] for start, end in bars_a), "no bar while A was down"
        assert any(end <= down[0] for _, end in bars_a) and any(start >= down[1] for start, _ in bars_a)
        bars_c, _ = server_lane(trace, url_c)
        assert bars_c and bars_c[0][0] > callback.killed_at * 1e6
    finally:
        for each in (first, third):
            each.stop()
        restore_server(url_b, tiny_model_dir)
