"""Which process of a run held which core when: CPU counters for the run's timeline (docs/timeline.md).

A daemon thread of the trainer reads `/proc/<pid>/stat` of the run's processes (the trainer and each
rollout worker, each with the processes it started, and the vLLM servers that run on this machine
with their child processes) every
`SAMPLE_INTERVAL_S` and records, per process, the cores it kept busy over the interval (user and
system time over wall time: 0 to the number of cores) and the core it last ran on, as Chrome trace
counter events ('C') on the timeline's clock. Linux only: elsewhere there is no /proc and the
sampler is off.

A vLLM server is found by its URL: a loopback or this host's name, and the process listening on the
URL's port (read from /proc/net/tcp and the processes' open sockets); its child processes (the engine
core, which does the generating) count with it. A server of another user, or on another machine, is
not seen.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable
from urllib.parse import urlsplit

from asyncgrpo.run import timeline

logger = logging.getLogger(__name__)

# Four samples a second: enough to tell the phases of a step of a second or more apart, while reading
# a handful of small files a tick costs well under 1% of a core.
SAMPLE_INTERVAL_S = 0.25
# The run's own processes count with the processes they start (the compiler's workers, a reward's
# subprocesses), looked up again this often: the lookup reads every process's stat. A process started
# and ended between two lookups is still counted, in its parent's count of ended children.
DESCENDANT_LOOKUP_INTERVAL_S = 1.0
# Servers are looked up again this often (and whenever one of their processes ended), so a server
# restarted during a run is followed; the lookup reads every process's open files, too much per tick.
SERVER_LOOKUP_INTERVAL_S = 30.0
BUSY_COUNTER = "cores busy"  # one per process lane; its series (one per process) stack to the lane's
CORE_PREFIX = "core: "  # one per process: the core it last ran on
_PROC = Path("/proc")
_LISTEN = "0A"  # the LISTEN state in /proc/net/tcp
_LOOPBACK = {"localhost", "127.0.0.1", "::1", "0.0.0.0", "[::1]"}


@dataclass(frozen=True)
class ProcStat:
    """What a tick needs of one process's /proc/<pid>/stat."""

    pid: int
    name: str  # the executable's name (field 2, `comm`)
    parent: int  # field 4, ppid
    cpu_ticks: int  # user + system time in clock ticks (fields 14 and 15), all threads
    core: int  # field 39, `processor`: the core it last ran on
    children_ticks: int = 0  # fields 16 and 17: the same of its children that ended and were waited for


def parse_stat(text: str) -> ProcStat:
    """One /proc/<pid>/stat line. `comm` is in parentheses and may hold spaces and parentheses itself,
    so the fields after it are counted from the last ')'."""
    head, _, tail = text.rpartition(")")
    pid, _, name = head.partition(" (")
    fields = tail.split()  # fields[0] is field 3 (the state)
    return ProcStat(
        pid=int(pid),
        name=name,
        parent=int(fields[4 - 3]),
        cpu_ticks=int(fields[14 - 3]) + int(fields[15 - 3]),
        core=int(fields[39 - 3]),
        children_ticks=int(fields[16 - 3]) + int(fields[17 - 3]),
    )


def read_stat(pid: int) -> ProcStat | None:
    """The process's stat, or None when it has ended (or never was)."""
    try:
        return parse_stat((_PROC / str(pid) / "stat").read_text())
    except (OSError, ValueError, IndexError):
        return None


def cores_busy(ticks_before: int, ticks_after: int, seconds: float, ticks_per_s: float) -> float:
    """Cores kept busy over an interval: CPU seconds used over wall seconds (2.0: two cores all along)."""
    return max(0, ticks_after - ticks_before) / ticks_per_s / seconds if seconds > 0 else 0.0


def within_the_machine(busy: dict[str, dict[str, float]], cores: int) -> dict[str, dict[str, float]]:
    """One tick's figures, every process of every lane, scaled down together when they add up to more
    than the machine's cores. They can, though no set of processes can use more: a process's CPU time
    advances in whole clock ticks (one tick over a sampling interval is 0.04 cores at 100 ticks a second
    and four samples a second, for each process), and the reads follow the clock reading by a moment that
    a busy machine stretches."""
    total = sum(value for series in busy.values() for value in series.values())
    if total <= cores:
        return busy
    scale = cores / total
    return {
        process: {name: value * scale for name, value in series.items()} for process, series in busy.items()
    }


def local_ports(urls: Iterable[str]) -> list[int]:
    """The ports of the URLs that name this machine."""
    here = {socket.gethostname().lower()}
    ports = []
    for url in urls:
        parts = urlsplit(url)
        host = (parts.hostname or "").lower()
        if host in _LOOPBACK or host in here:
            ports.append(parts.port or (443 if parts.scheme == "https" else 80))
    return ports


def listening_inodes(tables: Iterable[str], port: int) -> set[str]:
    """The socket inodes listening on `port`, from the text of /proc/net/tcp and tcp6 (a header line,
    then `sl local_address rem_address st ... uid timeout inode`, addresses as HEXIP:HEXPORT)."""
    inodes = set()
    for table in tables:
        for line in table.splitlines()[1:]:
            fields = line.split()
            if len(fields) > 9 and fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def all_pids() -> list[int]:
    return [int(entry.name) for entry in _PROC.iterdir() if entry.name.isdigit()]


def socket_owners(inodes: set[str]) -> set[int]:
    """The processes holding one of the sockets (those of other users cannot be read: left out)."""
    wanted = {f"socket:[{inode}]" for inode in inodes}
    owners = set()
    for pid in all_pids():
        try:
            for fd in (_PROC / str(pid) / "fd").iterdir():
                if os.readlink(fd) in wanted:
                    owners.add(pid)
                    break
        except OSError:
            continue
    return owners


def with_descendants(roots: set[int], stats: Iterable[ProcStat], apart: set[int] = frozenset()) -> list[int]:
    """`roots` and every process below them, by parent pid, but for the processes in `apart` and
    those below them (counted on their own)."""
    children: dict[int, list[int]] = {}
    for stat in stats:
        children.setdefault(stat.parent, []).append(stat.pid)
    found, frontier = set(roots), list(roots)
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child not in found and child not in apart:
                found.add(child)
                frontier.append(child)
    return sorted(found)


def server_pids(urls: Iterable[str]) -> list[int]:
    """The processes of the vLLM servers among `urls` that run on this machine, children included."""
    inodes: set[str] = set()
    for port in local_ports(urls):
        tables = [
            (_PROC / "net" / name).read_text() for name in ("tcp", "tcp6") if (_PROC / "net" / name).exists()
        ]
        inodes |= listening_inodes(tables, port)
    if not inodes:
        return []
    owners = socket_owners(inodes)
    stats = [stat for stat in map(read_stat, all_pids()) if stat is not None]
    return with_descendants(owners, stats)


def counter(name: str, ts_us: int, process: str, series: dict[str, float]) -> dict:
    """One counter event, before the file's numbering of processes (`timeline.event`'s counterpart)."""
    return {"name": name, "ph": "C", "ts": int(ts_us), "process": process, "args": series}


Tracked = tuple[str, str, int]  # (process lane in the timeline, series label, pid)


class CpuSampler:
    """The thread: `tracked()` names the run's own processes at each tick (workers come and go), the
    servers are looked up from `server_urls`; each tick's counters go to `add`."""

    def __init__(
        self,
        add: Callable[[dict], None],
        tracked: Callable[[], list[Tracked]],
        server_urls: list[str],
        interval_s: float = SAMPLE_INTERVAL_S,
    ):
        self.add, self.tracked, self.server_urls, self.interval_s = add, tracked, server_urls, interval_s
        self.ticks_per_s = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._servers: list[int] = []
        self._servers_found_us: int | None = None
        self._last: dict[int, int] = {}  # pid -> cpu ticks at the previous tick
        self._members: dict[int, list[int]] = {}  # own process -> the processes below it
        self._members_found_us: int | None = None
        self._family_seen: dict[int, list[int]] = {}  # own process -> its descendants read last tick
        self._last_us: int | None = None  # the previous tick's time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def available() -> bool:
        return (_PROC / "self" / "stat").exists()

    def start(self) -> None:
        if not self.available():
            logger.info("CPU counters are off: they read /proc, which only Linux has")
            return
        self._thread = threading.Thread(target=self._run, name="asyncgrpo-cpu-use", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception:  # never let the counters take the run down; say so once and stop
                logger.exception("CPU counters stopped")
                return

    def _server_processes(self, now_us: int) -> list[Tracked]:
        due = (
            self._servers_found_us is None
            or now_us - self._servers_found_us >= SERVER_LOOKUP_INTERVAL_S * 1e6
        )
        if due or any(read_stat(pid) is None for pid in self._servers):
            self._servers, self._servers_found_us = server_pids(self.server_urls), now_us
        return [(timeline.SERVERS, "", pid) for pid in self._servers]

    def _own_families(self, own: list[Tracked], servers: list[Tracked], now_us: int) -> dict[int, list[int]]:
        """Each own process's descendants (not another tracked process's), looked up when due."""
        due = (
            self._members_found_us is None
            or now_us - self._members_found_us >= DESCENDANT_LOOKUP_INTERVAL_S * 1e6
        )
        if due:
            stats = [stat for stat in map(read_stat, all_pids()) if stat is not None]
            tracked = {pid for _, _, pid in [*own, *servers]}
            self._members = {
                pid: [member for member in with_descendants({pid}, stats, tracked - {pid}) if member != pid]
                for _, _, pid in own
            }
            self._members_found_us = now_us
        return self._members

    def sample(self) -> None:
        """One tick: read every process; those read at the previous tick too get their counters, timed
        at the previous tick (a counter holds its value until the next one: the interval it measured).
        An own process's count holds its descendants: their CPU time, their ended children's included,
        since the previous tick (all of it for one found since)."""
        looked_up_us = timeline.now_us()
        own, servers = self.tracked(), self._server_processes(looked_up_us)
        families = self._own_families(own, servers, looked_up_us)
        now_us = timeline.now_us()  # after the lookups, which may take a while: the reads follow it
        busy: dict[str, dict[str, float]] = {}
        seen: dict[int, int] = {}
        stats = {pid: read_stat(pid) for _, _, pid in [*own, *servers]}
        # An own process that ended was waited for by its parent, whose count of ended children then
        # holds all of its time, counted already: that parent's count is left out for this tick.
        ended = any(stats[pid] is None and pid in self._last for _, _, pid in own)
        for process, label, pid in [*own, *servers]:
            stat = stats[pid]
            if stat is None:
                continue
            label = label or f"{stat.name} {pid}"
            seen[pid] = stat.cpu_ticks
            used = stat.cpu_ticks - self._last.get(pid, stat.cpu_ticks)
            if pid in families:  # an own process: its ended children count with it
                seen[-pid] = stat.children_ticks  # (negative keys: the count of ended children)
                if not ended:
                    used += stat.children_ticks - self._last.get(-pid, stat.children_ticks)
            for member in families.get(pid, []):
                member_stat = read_stat(member)
                if member_stat is not None:
                    seen[member] = member_stat.cpu_ticks + member_stat.children_ticks
                    used += seen[member] - self._last.get(member, 0)
            # A descendant that ended moved all of its time into its parent's count of ended children,
            # counted just now: what was counted of it before is taken back.
            used -= sum(
                self._last.get(member, 0) for member in self._family_seen.get(pid, ()) if member not in seen
            )
            self._family_seen[pid] = [member for member in families.get(pid, []) if member in seen]
            if pid in self._last and self._last_us is not None:
                seconds = (now_us - self._last_us) / 1e6
                busy.setdefault(process, {})[label] = cores_busy(0, used, seconds, self.ticks_per_s)
                self.add(counter(CORE_PREFIX + label, self._last_us, process, {"core": stat.core}))
        for process, series in within_the_machine(busy, os.cpu_count() or 1).items():
            self.add(counter(BUSY_COUNTER, self._last_us, process, series))
        self._last, self._last_us = seen, now_us
