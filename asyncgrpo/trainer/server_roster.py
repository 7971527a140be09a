"""The run's servers, kept by rank 0: which are live, which were lost, which join (docs/reliability.md,
"Elastic servers"; docs/scaling.md, "Servers that come and go").

Live servers run the trainer's current weights and take work; a weight sync goes to them alone. In
the background (on the trainer's HTTP loop) every known server is asked which weights it runs every
PROBE_INTERVAL_S, and the server list file (`vllm_server_urls_file`) is read again. Between steps,
and every few seconds while the trainer waits for samples, `refresh` acts on what was seen:

- a live server that failed LOST_AFTER_FAILED_PROBES probes in a row, or that a sync could not
  reach, is lost; one that reports weights the trainer did not push restarted, and is lost too. It
  leaves the live set at once: the rollout workers send its requests to the others;
- a lost server that answers again, or one the file names for the first time, is checked against the
  run's first server (model, context length, flags), given the weights the others run, and joins;
- a server taken out of the file leaves (not counted as lost).

Every change reaches the rollout workers (each its share) and the trainer's own client. The run stops
when no server has been live for `vllm_server_timeout`, or when more than `max_lost_server_fraction`
of the servers are lost at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from asyncgrpo.generation.background import BackgroundLoop
from asyncgrpo.generation.client import (
    ServerLostError,
    VLLMClient,
    VLLMError,
    VLLMRequestError,
    parse_policy_label,
)
from asyncgrpo.generation.server_info import ServerInfo, server_differences
from asyncgrpo.generation.server_list import read_server_list
from asyncgrpo.records.metrics import MetricsWindow, Reduce
from asyncgrpo.run import timeline

logger = logging.getLogger(__name__)

# How often every server is asked which weights it runs (and the list file read again): a lost server
# is noticed within a few seconds, at the cost of one small request per server each time.
PROBE_INTERVAL_S = 2.0
# One probe's deadline: a server that is busy still answers this route at once; one on a dead node
# (no refusal, no answer) would otherwise hold the probe until the connection times out.
PROBE_TIMEOUT_S = 10.0
# Probes in a row a live server must fail to count as lost: one dropped connection is not a loss.
LOST_AFTER_FAILED_PROBES = 2
# Bound on checking a server that joins (a few HTTP calls): one that stops answering meanwhile is
# tried again later rather than holding the training loop.
JOIN_CHECK_TIMEOUT_S = 60.0

LIVE, LOST, JOINING, REFUSED, LEFT = "live", "lost", "joining", "refused", "left"


# The name this error had before there was one lost-server type (docs/reliability.md names it).
ServerLossError = ServerLostError


@dataclass
class Probe:
    """What the latest probe of a server saw."""

    started: float  # time.monotonic() when it was sent
    label: str | None = None  # the weight label it reported ("" for an error answer); None: no answer
    failures: int = 0  # probes in a row without an answer
    error: str = ""


class ServerProbe:
    """Asks every server which weights it runs, in the background, and reads the list file."""

    def __init__(self, client: VLLMClient, urls_file: str | None):
        self.client = client
        self.urls_file = urls_file
        self.urls: list[str] = []  # what to probe, set by the roster
        self.results: dict[str, Probe] = {}
        self.listed: list[str] | None = None  # the list file's URLs (None: no file)
        self.lock = threading.Lock()

    async def run(self) -> None:
        while True:
            started = time.monotonic()
            listed = read_server_list(self.urls_file) if self.urls_file else None
            with self.lock:
                self.listed = listed
                urls = list(dict.fromkeys([*self.urls, *(listed or [])]))
            answers = await asyncio.gather(*(self._ask(url) for url in urls))
            with self.lock:
                for url, (label, error) in zip(urls, answers):
                    failures = 0 if error is None else self.results.get(url, Probe(0.0)).failures + 1
                    self.results[url] = Probe(started, label, failures, error or "")
            await asyncio.sleep(PROBE_INTERVAL_S)

    async def _ask(self, url: str) -> tuple[str | None, str | None]:
        try:
            return await self.client.probe(url, PROBE_TIMEOUT_S), None
        except VLLMRequestError:
            return "", None  # it answered: not with our weights
        except VLLMError as error:
            return None, str(error)


@dataclass
class Server:
    url: str
    status: str
    admission: int = 0  # each admission into the live set counts one (generation/server_set.py)
    changed_at: float = 0.0  # time.monotonic() of the last change of status
    weights_at: float | None = None  # when the trainer's weights last reached it (None: not yet)
    bar_from_us: int = 0  # the timeline's current "serving" bar starts here
    refusal: str = ""
    restarted: bool = False  # it came back from a restart, running its own checkpoint


class ServerRoster:
    def __init__(
        self,
        client: VLLMClient,
        http: BackgroundLoop,
        weight_sync,
        reference: ServerInfo | None,
        served_name: str,
        max_model_len: int,
        args,
        publish: Callable[[list[str], dict[str, int]], None],
        window: MetricsWindow,
    ):
        self.client = client
        self.http = http
        self.weight_sync = weight_sync
        self.reference = reference  # the run's first server: a server joining must match it
        self.served_name = served_name
        self.max_model_len = max_model_len
        self.configured = set(args.vllm_server_urls)  # never leave by the list file
        self.timeout_s = args.vllm_server_timeout
        self.max_lost_fraction = args.max_lost_server_fraction
        self.publish = publish
        self.window = window
        self.token_route = False  # whether the run's servers offer the token route (set by `start`)
        self.servers: dict[str, Server] = {}
        self.probe = ServerProbe(client, args.vllm_server_urls_file)
        self._probing = None
        self._none_live_since: float | None = None

    # -- the live set ---------------------------------------------------------------------------

    def start(self, urls: list[str]) -> None:
        """The run starts with `urls` live (they passed the start-up checks); probing begins."""
        now, now_us = time.monotonic(), timeline.now_us()
        self.token_route = self.http.run(self.client.supports_token_generate(urls))
        for url in urls:
            self.servers[url] = Server(url, LIVE, admission=1, changed_at=now, bar_from_us=now_us)
        self.probe.urls = list(urls)
        self._probing = self.http.submit(self.probe.run())
        self._publish()

    def live(self) -> list[str]:
        return [server.url for server in self.servers.values() if server.status == LIVE]

    def after_sync(self, targets: list[str], missed: list[str], joining: list[str] = ()) -> None:
        """A sync to `targets` ended: the servers it `missed` are lost; those `joining` that it reached
        join."""
        now = time.monotonic()
        changed = False
        for url in targets:
            server = self.servers[url]
            if url in missed:
                if server.status == LIVE:
                    self._lose(server, now, "the weight sync could not reach it")
                    changed = True
            else:
                server.weights_at = now
                if url in joining and server.status != LIVE:
                    self._admit(server, now)
                    changed = True
        if changed:
            self._publish()

    def refresh(self, version: int) -> list[str]:
        """Act on what the probes saw (see the module's docstring). Servers that can be given the
        served version without the model join here; the others (NCCL) are returned, for a full sync
        with every process. Raises ServerLostError when the run has lost more than it may."""
        with self.probe.lock:
            results, listed = dict(self.probe.results), self.probe.listed
        now = time.monotonic()
        changed = self._follow_list(listed, now)
        for server in list(self.servers.values()):
            probe = results.get(server.url)
            if server.status != LIVE or probe is None or probe.started < server.changed_at:
                continue
            if probe.failures >= LOST_AFTER_FAILED_PROBES:
                self._lose(server, now, f"it stopped answering ({probe.error})")
                changed = True
            elif (
                probe.label is not None
                and server.weights_at is not None
                and probe.started > server.weights_at
                and parse_policy_label(probe.label) is None
            ):
                self._lose(server, now, f"it restarted: it runs weights labelled {probe.label!r}")
                changed = True
        joining = [
            server
            for server in self.servers.values()
            if server.status in (LOST, JOINING, REFUSED)
            and (probe := results.get(server.url)) is not None
            and probe.label is not None
            and (probe.started >= server.changed_at or server.status == JOINING)  # back since it was lost
        ]
        full_sync = []
        for server in joining:
            if not self._passes_checks(server):
                continue
            if server.status == LOST and parse_policy_label(results[server.url].label) is None:
                server.restarted = True  # back from its own checkpoint: counted once it has the weights
            if not self.weight_sync.can_resend:
                full_sync.append(server.url)
                continue
            try:
                missed = self.weight_sync.resend(version, [server.url])
            except VLLMRequestError as error:  # it answered, and refused the weights
                self._refuse(server, f"it could not load the weights ({error})")
                continue
            if not missed:
                server.weights_at = time.monotonic()
                self._admit(server, time.monotonic())
                changed = True
        if changed:
            self._publish()
        self._check_losses(now)
        self.window.record("rollout/servers_live", len(self.live()))
        return full_sync

    def mark_timeline(self) -> None:
        """Each live server's lane gets its bar up to now (so every step holds its part)."""
        now_us = timeline.now_us()
        for server in self.servers.values():
            if server.status == LIVE:
                self._close_bar(server, now_us)

    def close(self) -> None:
        if self._probing is not None:
            self._probing.cancel()
            self._probing = None
        self.mark_timeline()

    # -- transitions ------------------------------------------------------------------------------

    def _follow_list(self, listed: list[str] | None, now: float) -> bool:
        """New URLs in the list file join (once checked); URLs taken out of it leave."""
        if listed is None:
            return False
        changed = False
        for url in listed:
            if url not in self.servers:
                self.servers[url] = Server(url, JOINING, changed_at=now)
                logger.info("vLLM server %s is in the server list: it joins once it answers", url)
            elif self.servers[url].status == LEFT:
                self._set(self.servers[url], JOINING, now)
        for server in self.servers.values():
            if server.url not in listed and server.url not in self.configured and server.status != LEFT:
                if server.status == LIVE:
                    self._close_bar(server, timeline.now_us())
                    changed = True
                logger.info("vLLM server %s left the server list: it leaves the run", server.url)
                self._set(server, LEFT, now)
        with self.probe.lock:
            self.probe.urls = [url for url, server in self.servers.items() if server.status != LEFT]
        return changed

    def _lose(self, server: Server, now: float, why: str) -> None:
        logger.warning(
            "vLLM server %s is lost: %s. Its requests go to the other servers; it rejoins with the "
            "current weights when it answers again",
            server.url,
            why,
        )
        now_us = timeline.now_us()
        self._close_bar(server, now_us)
        timeline.interval("lost", now_us, now_us, lane=_lane(server.url), process=timeline.SERVERS, why=why)
        self.window.record("rollout/servers_lost_count", 1, Reduce.SUM)
        self._set(server, LOST, now)

    def _admit(self, server: Server, now: float) -> None:
        logger.info("vLLM server %s joins the run with the current weights", server.url)
        server.admission += 1
        server.bar_from_us = timeline.now_us()
        self.window.record("rollout/servers_joined_count", 1, Reduce.SUM)
        if server.restarted:
            self.window.record("rollout/server_restarts", 1, Reduce.SUM)
            server.restarted = False
        self._set(server, LIVE, now)

    @staticmethod
    def _set(server: Server, status: str, now: float) -> None:
        server.status, server.changed_at = status, now

    def _close_bar(self, server: Server, now_us: int) -> None:
        timeline.interval(
            "serving", server.bar_from_us, now_us, lane=_lane(server.url), process=timeline.SERVERS
        )
        server.bar_from_us = now_us

    def _publish(self) -> None:
        live = self.live()
        admissions = {url: server.admission for url, server in self.servers.items()}

        async def on_the_loop() -> None:  # the client's requests run there (an evaluation's)
            self.client.set_servers(live, admissions)

        self.http.run(on_the_loop())
        self.publish(live, admissions)

    # -- checks ----------------------------------------------------------------------------------

    def _passes_checks(self, server: Server) -> bool:
        """Whether a server that answers may join: it serves the run's model, with room for the run's
        requests, started like the run's first server. A refusal is logged once per reason."""
        try:
            problems = self.http.run(self._problems(server.url), timeout=JOIN_CHECK_TIMEOUT_S)
        except (VLLMError, TimeoutError) as error:
            logger.info("vLLM server %s answers but could not be checked yet: %s", server.url, error)
            return False
        if problems:
            self._refuse(server, "; ".join(problems))
            return False
        return True

    def _refuse(self, server: Server, refusal: str) -> None:
        """Keep a server out (it is checked again at every refresh); said once per reason."""
        if refusal != server.refusal:
            logger.warning(
                "vLLM server %s is not taken into the run: %s. Restart it like the run's first server "
                "(`asyncgrpo serve --for CONFIG` prints the flags)",
                server.url,
                refusal,
            )
        server.refusal = refusal
        if server.status != REFUSED:
            self._set(server, REFUSED, time.monotonic())

    async def _problems(self, url: str) -> list[str]:
        model = (await self.client.models(url))[0]
        problems = []
        if model["id"] != self.served_name:
            problems.append(f"it serves {model['id']!r}, not {self.served_name!r}")
        if int(model.get("max_model_len") or 0) < self.max_model_len:
            problems.append(
                f"--max-model-len {model.get('max_model_len')}, below the run's {self.max_model_len}"
            )
        problems += server_differences(self.reference, await self.client.server_info(url))
        if self.token_route and not await self.client.supports_token_generate([url]):
            problems.append("no token route (--enable-scale-out)")
        return problems

    def _check_losses(self, now: float) -> None:
        """Raise when the run has lost more than it may: every server for vllm_server_timeout, or
        more than max_lost_server_fraction of them at once."""
        lost = [server.url for server in self.servers.values() if server.status == LOST]
        live = self.live()
        if live:
            self._none_live_since = None
        else:
            self._none_live_since = self._none_live_since or now
            if now - self._none_live_since > self.timeout_s:
                raise ServerLostError(
                    f"no vLLM server has been live for {now - self._none_live_since:.0f} s "
                    f"(vllm_server_timeout={self.timeout_s:g}); lost: {', '.join(lost) or 'none'}. "
                    "Restart them (on the same URLs), or list new ones in vllm_server_urls_file",
                    run_can_go_on=False,
                    lost=tuple(lost),
                )
        if lost and len(lost) / (len(lost) + len(live)) > self.max_lost_fraction:
            raise ServerLostError(
                f"{len(lost)} of {len(lost) + len(live)} vLLM servers are lost ({', '.join(lost)}): more "
                f"than max_lost_server_fraction={self.max_lost_fraction:g} of them",
                run_can_go_on=False,
                lost=tuple(lost),
            )


def _lane(url: str) -> str:
    return f"server {url}"
