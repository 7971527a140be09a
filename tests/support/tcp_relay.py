"""A TCP relay on a loopback port in front of a real server, that a test can cut and restore: while cut,
its port refuses connections and the connections it carried are closed, as when the server behind it
dies; restored, it listens on the same port again. It runs on an event loop of its own, in a thread."""

from __future__ import annotations

import asyncio
import socket
import threading
from urllib.parse import urlsplit


class TcpRelay:
    def __init__(self, target_url: str):
        target = urlsplit(target_url)
        self.target = (target.hostname, target.port)
        with socket.socket() as probe:  # a free port, kept for every restore
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="tcp-relay", daemon=True)
        self.thread.start()
        self.server: asyncio.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()

    def restore(self) -> None:
        asyncio.run_coroutine_threadsafe(self._listen(), self.loop).result(10)

    def cut(self) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self.loop).result(10)

    def close(self) -> None:
        self.cut()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _listen(self) -> None:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", self.port, reuse_address=True)

    async def _close(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.close()
        for writer in list(self.writers):
            writer.transport.abort()
        self.writers.clear()
        if server is not None:
            await server.wait_closed()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            target_reader, target_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self.writers.update((writer, target_writer))

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                sink.transport.abort()

        await asyncio.gather(pipe(reader, target_writer), pipe(target_reader, writer))
        self.writers.difference_update((writer, target_writer))
