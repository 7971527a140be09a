"""What the agent sandbox costs (docs/harness.md, "The sandbox"): the start of a sandboxed agent, and
the latency the bridge to the capture proxy adds to each model request.

- Start: a `ProcessSessionFactory` session of a trivial agent (`python -c pass`), create() through its
  exit, sandboxed and not (`agent_sandbox="none"`), alternating; and `asyncgrpo.sandbox.run` of the
  same program against `subprocess.run`. The difference is the sandbox's own start: bubblewrap's
  namespaces and mounts, its first process (a Python without site packages), the cgroup as root.
  Target: under 0.25 s added per agent ("well under a second").
- Bridge: an agent that sends chat-completions requests on one kept-alive connection (http.client)
  to the real capture proxy (its sampling stubbed: a fixed 3-token reply), timing each round trip;
  once in the sandbox (127.0.0.1 inside -> the sandbox's bridge -> the proxy's Unix socket) and once
  without (straight to the proxy's TCP port). Requests of a chat turn (2 KB) and of a long history
  (100 KB; the proxy tokenizes it, which is most of its time). Target: under 2 ms added per 2 KB
  request (the median), against a sampled turn's tens of milliseconds to seconds. The bridge is one
  more process on the request's way: on a loaded machine, its wait for a core is most of what it adds.

- Disk: how far past `disk_bytes` (64 MiB here) a program writing 4 MiB files gets before the sandbox
  ends it (its folders are measured every 0.1 s from outside), with one writer and with 17 (forked),
  measured just before the sandbox's folder is removed. No target: the figure for docs/harness.md.

Run: `.venv/bin/python bench/sandbox.py` (about a minute).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from asyncgrpo import sandbox
from asyncgrpo.cli.tiny_model import build_tokenizer
from asyncgrpo.harness import ProcessSessionFactory
from asyncgrpo.harness.capture import CaptureProxy
from asyncgrpo.rollout.types import TurnRecord
from asyncgrpo.sandbox import runner
from asyncgrpo.sandbox.files import disk_usage

STARTS = 15
REQUESTS = {2_000: 100, 100_000: 15}  # body bytes -> requests timed per round
ROUNDS = 4  # sandboxed and direct clients alternate: a change of the machine's load hits both
START_TARGET_S, BRIDGE_TARGET_MS = 0.25, 2.0
PROMPT = [{"role": "user", "content": "hi"}]

CLIENT = """
import http.client, json, os, pathlib, time, urllib.parse
url = urllib.parse.urlsplit(os.environ["OPENAI_BASE_URL"])
headers = {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"}
connection = http.client.HTTPConnection(url.hostname, url.port)
timings = {}
for size, count in json.loads(os.environ["BENCH_REQUESTS"]).items():
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x" * int(size)}]})
    times = []
    for index in range(count + 3):  # the first three warm the connection and the proxy
        started = time.perf_counter()
        connection.request("POST", url.path + "/chat/completions", body, headers)
        reply = connection.getresponse()
        reply.read()
        assert reply.status == 200, reply.status
        if index >= 3:
            times.append(time.perf_counter() - started)
    timings[size] = times
pathlib.Path("timings.json").write_text(json.dumps(timings))
"""


def stub_sampler(tokenizer):
    async def sample_turn(prompt_ids):
        output = tokenizer.encode("Hi.", add_special_tokens=False)
        return TurnRecord(list(prompt_ids), output, [-0.5] * len(output), finish_reason="stop")

    return sample_turn


def session_seconds(factory: ProcessSessionFactory) -> float:
    started = time.perf_counter()
    session = factory.create({"prompt": PROMPT})
    assert session.wait_for_completion() == 0, session.output_tail()
    session.close()
    return time.perf_counter() - started


def agent_starts(capture) -> dict[str, float]:
    agent = [sys.executable, "-c", "pass"]
    factories = {
        mode: ProcessSessionFactory(agent, lambda w, t: 1.0, capture=capture, agent_sandbox=mode)
        for mode in ("bubblewrap", "none")
    }
    times: dict[str, list[float]] = {mode: [] for mode in factories}
    runs: dict[str, list[float]] = {"sandbox.run": [], "subprocess.run": []}
    for _ in range(STARTS):
        for mode, factory in factories.items():
            times[mode].append(session_seconds(factory))
        started = time.perf_counter()
        assert sandbox.run(agent).ok
        runs["sandbox.run"].append(time.perf_counter() - started)
        started = time.perf_counter()
        subprocess.run(agent, check=True)
        runs["subprocess.run"].append(time.perf_counter() - started)
    for factory in factories.values():
        factory.close()
    return {name: statistics.median(values) for name, values in {**times, **runs}.items()}


def bridge_latencies(tokenizer) -> dict[str, dict[int, list[float]]]:
    async def scenario():
        proxy = CaptureProxy(tokenizer, stub_sampler(tokenizer), "tiny", None, False, 16 * 2**20)
        endpoint = await proxy.start()
        environment = {"BENCH_REQUESTS": json.dumps(REQUESTS)}
        found: dict[str, dict[str, list[float]]] = {"bubblewrap": {}, "none": {}}
        try:
            for mode in ("bubblewrap", "none") * ROUNDS:
                factory = ProcessSessionFactory(
                    [sys.executable, "-c", CLIENT],
                    lambda w, t: 1.0,
                    timeout_s=600,
                    env=environment,
                    capture=endpoint,
                    agent_sandbox=mode,
                )
                session = await asyncio.to_thread(factory.create, {"prompt": PROMPT})
                code = await asyncio.to_thread(session.wait_for_completion)
                assert code == 0, session.output_tail()
                for size, times in json.loads((session.workdir / "timings.json").read_text()).items():
                    found[mode].setdefault(size, []).extend(times)
                await asyncio.to_thread(session.close)
                factory.close()
        finally:
            await proxy.stop()
        return found

    return asyncio.run(scenario())


FLOOD = "i = 0\nwhile True:\n    open(f'f{os.getpid()}-{i}', 'wb').write(b'x' * 2**22)\n    i += 1"
FORK_16 = "import os\nfor _ in range(16):\n    if os.fork() == 0:\n        break\n"  # 16 children
WRITERS = {"1": "import os\n" + FLOOD, "17": FORK_16 + FLOOD}


def disk_overshoot() -> dict[str, list[int]]:
    """Bytes past the disk bound at the end of flooding runs: the folder measured as run() removes it."""
    limits = sandbox.SandboxLimits(disk_bytes=64 * 2**20, file_bytes=16 * 2**20, processes=64)
    measured: list[int] = []
    remove_tree = runner.remove_tree

    def measure_then_remove(root):
        measured.append(disk_usage([root], 1 << 62))
        remove_tree(root)

    runner.remove_tree = measure_then_remove
    found: dict[str, list[int]] = {}
    try:
        for writers, program in WRITERS.items():
            for _ in range(3):
                assert sandbox.run([sys.executable, "-c", program], timeout_s=60, limits=limits).over_disk
                found.setdefault(writers, []).append(measured[-1] - limits.disk_bytes)
    finally:
        runner.remove_tree = remove_tree
    return found


def main() -> None:
    print(f"sandbox load_average_1min={os.getloadavg()[0]:.1f} cores={os.cpu_count()}")
    tokenizer = build_tokenizer()
    with tempfile.TemporaryDirectory() as folder:
        tempfile.tempdir = folder
        sandbox.check_available()

        class NoProxy:  # the start needs no proxy: the agent never calls it
            base_url, model, unix_socket = "http://127.0.0.1:9/v1", "tiny", None

            def open_session(self, episode_id):
                return "key"

            def close_session(self, key):
                pass

        starts = agent_starts(NoProxy())
        added_start = starts["bubblewrap"] - starts["none"]
        print(
            f"sandbox agent_start_s={starts['bubblewrap']:.3f} unsandboxed_s={starts['none']:.3f} "
            f"added_s={added_start:.3f} target<{START_TARGET_S}"
        )
        print(
            f"sandbox run_s={starts['sandbox.run']:.3f} subprocess_run_s={starts['subprocess.run']:.3f} "
            f"added_s={starts['sandbox.run'] - starts['subprocess.run']:.3f}"
        )
        latencies = bridge_latencies(tokenizer)
        for writers, overshoots in disk_overshoot().items():
            print(f"sandbox disk writers={writers} past_bound_mib={[round(b / 2**20) for b in overshoots]}")
        tempfile.tempdir = None
    for size in REQUESTS:
        medians = {mode: statistics.median(latencies[mode][str(size)]) * 1000 for mode in latencies}
        p90 = {mode: statistics.quantiles(latencies[mode][str(size)], n=10)[-1] * 1000 for mode in latencies}
        added = medians["bubblewrap"] - medians["none"]
        target = f" target<{BRIDGE_TARGET_MS}" if size == min(REQUESTS) else ""
        print(
            f"sandbox bridge body_bytes={size} median_ms={medians['bubblewrap']:.3f} "
            f"direct_median_ms={medians['none']:.3f} added_ms={added:.3f} p90_ms={p90['bubblewrap']:.3f} "
            f"direct_p90_ms={p90['none']:.3f}{target}"
        )


if __name__ == "__main__":
    main()
