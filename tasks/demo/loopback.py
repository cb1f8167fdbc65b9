"""An aiohttp server's life on loopback: bind, serve from a thread or in the foreground, stop cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Self

from aiohttp import web


class LoopbackServer:
    """The lifecycle of one aiohttp application; subclasses give it with ``application()``.

    Args:
        host: address to listen on. Default ``127.0.0.1``.
        port: preferred port; 0 (the default) takes an ephemeral one. A nonzero port that is
            busy falls back to an ephemeral one, so check ``port`` / ``base_url`` after
            ``start()``.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.host = host
        self.preferred_port = port
        self.port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._streams: set[asyncio.Transport] = set()

    def application(self) -> web.Application:
        """The aiohttp application to serve."""
        raise NotImplementedError

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise RuntimeError(f"{type(self).__name__} is not listening; call start() first")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def url(self, path: str) -> str:
        """Absolute URL of a path on this server (``/img/a.jpg`` -> ``http://127.0.0.1:P/img/a.jpg``)."""
        return self.base_url + (path if path.startswith("/") else "/" + path)

    def start(self) -> Self:
        """Serve from a daemon thread with its own event loop; returns once listening."""
        if self._thread is not None:
            raise RuntimeError(f"{type(self).__name__} already started")
        self._ready.clear()
        self._start_error = None
        self._thread = threading.Thread(
            target=self._thread_main, name=f"{type(self).__name__}-{id(self):x}", daemon=True
        )
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self._thread.join()
            self._thread = None
            raise self._start_error
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving: streaming handlers end, connections close, the thread exits."""
        thread, loop = self._thread, self._loop
        if thread is None:
            return
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self.request_stop)
            except RuntimeError:
                pass  # the loop closed between the check and the call: already stopped
        thread.join(timeout)
        if thread.is_alive():
            raise RuntimeError(f"{type(self).__name__} on port {self.port} did not stop within {timeout} s")
        self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def serve_forever(self, on_ready: Callable[[Self], None] | None = None) -> None:
        """Serve in this thread until SIGTERM or SIGINT (the CLI)."""

        async def main() -> None:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop)
            await self._serve(lambda: on_ready(self) if on_ready else None)

        asyncio.run(main())

    def _thread_main(self) -> None:
        def ready() -> None:
            self._ready.set()

        try:
            asyncio.run(self._serve(ready))
        except BaseException as err:  # noqa: BLE001 - handed to start() in the caller's thread
            if not self._ready.is_set():
                self._start_error = err
                self._ready.set()
            else:
                raise

    def request_stop(self) -> None:
        if self._stop_event is not None:
            self._stop_event.set()

    def stopping(self) -> bool:
        """True once the server has been asked to stop."""
        return self._stop_event is not None and self._stop_event.is_set()

    async def stopping_within(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True as soon as the server is stopping."""
        if self._stop_event is None:
            return True
        try:
            await asyncio.wait_for(self._stop_event.wait(), seconds)
        except TimeoutError:
            return False
        return True

    @contextlib.contextmanager
    def streaming(self, request: web.Request) -> Iterator[None]:
        """Register a never-ending response's connection, for stop() to abort."""
        transport = request.transport
        if transport is not None:
            self._streams.add(transport)
        try:
            yield
        finally:
            if transport is not None:
                self._streams.discard(transport)

    async def _serve(self, ready: Callable[[], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        sock = self._bind()
        # No access log: formatting a line per request is a large share of a cheap request.
        runner = web.AppRunner(self.application(), access_log=None, handle_signals=False, shutdown_timeout=2.0)
        await runner.setup()
        try:
            site = web.SockSite(runner, sock)
            await site.start()
            self.port = sock.getsockname()[1]
            ready()
            await self._stop_event.wait()
        finally:
            # A stream whose client stopped reading waits forever for the socket to drain;
            # aborting its connection (close() would wait for that drain too) ends it now.
            for transport in list(self._streams):
                transport.abort()
            await runner.cleanup()
            sock.close()

    def _bind(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        # SO_REUSEADDR lets a rerun take the port back from TIME_WAIT; Linux still refuses it
        # while another socket listens there, which is when we fall back.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            try:
                sock.bind((self.host, self.preferred_port))
            except OSError as err:
                if self.preferred_port == 0 or err.errno not in (errno.EADDRINUSE, errno.EACCES):
                    raise
                sock.bind((self.host, 0))
            sock.listen(1024)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock
