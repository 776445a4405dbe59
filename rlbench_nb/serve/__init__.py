"""The Tinker API over a live Session: the `tinker` SDK and tinker-cookbook recipes drive the session's own workers.

    srv = sess.serve_tinker()            # or: rlbench-nb serve CONFIG
    srv.env                              # {"TINKER_BASE_URL": ..., "TINKER_API_KEY": ...} for the client
    srv.samples[-1]                      # the last batch a client sampled (sess.inspect(srv.samples[-1]))
    srv.close()

Rooms: app.py (the HTTP routes), backend.py (what each call does to the session), futures.py (requests in
order on one thread), samples.py (sample requests' rows in, sequences out), wire.py (the SDK's protobuf).
docs/tinker.md lists every endpoint and what it maps to.
"""
from __future__ import annotations

import secrets
import threading
import time

from ..errors import UsageError, is_count
from .backend import TinkerBackend
from .futures import Futures


class TinkerServer:
    """A running server (uvicorn on a thread of this process): `url`, `api_key`, `samples`, `close()`."""

    def __init__(self, sess, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None):
        import uvicorn

        from .app import make_app
        if api_key is not None and not api_key.startswith("tml-"):
            raise ValueError("the tinker SDK only sends keys that start with 'tml-': pass api_key='tml-...' or none "
                             "(one is generated)")
        if not is_count(port, 0, 65535):
            raise UsageError(f"port={port!r}: a TCP port, 1-65535 (0: a free one)")  # uvicorn wraps 99999999 to 57599
        self.api_key = api_key or f"tml-{secrets.token_urlsafe(24)}"
        self.backend = TinkerBackend(sess)
        self.futures = Futures()
        app = make_app(self.backend, self.futures, self.api_key)
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                     timeout_keep_alive=75))
        self._thread = threading.Thread(target=self._server.run, name="tinker-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.futures.close()
                raise OSError(f"the Tinker server did not start on {host}:{port} (is the port taken? pass port=0 for "
                              "a free one)")
            time.sleep(0.02)
        bound = self._server.servers[0].sockets[0].getsockname()
        self.host, self.port = bound[0], bound[1]
        self.url = f"http://{self.host}:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """What a client process needs: `TINKER_BASE_URL` and `TINKER_API_KEY`."""
        return {"TINKER_BASE_URL": self.url, "TINKER_API_KEY": self.api_key}

    @property
    def samples(self):
        """The batches clients sampled, newest last (the last 50): `sess.inspect(srv.samples[-1])`."""
        return list(self.backend.samples)

    def drop_gradients(self) -> None:
        """Drop the gradients a training client accumulated and did not apply (it went away mid-step): the other
        clients may train again. In the request queue's order, after what was already sent."""
        state, value = self.futures.wait(self.futures.submit(self.backend.drop_gradients), timeout=600) or ("", None)
        if state == "error":
            raise value

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self.futures.close()

    def __enter__(self) -> TinkerServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Tinker API at {self.url} (key {self.api_key[:8]}…): in the client, "
                f"tinker.ServiceClient(base_url='{self.url}') with TINKER_API_KEY=srv.api_key")


def serve_tinker(sess, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None) -> TinkerServer:
    """Serve `sess` over the Tinker API on `host:port` (127.0.0.1 and a free port by default; bind 0.0.0.0 only on
    a network you trust: the API key is the one lock)."""
    return TinkerServer(sess, host, port, api_key)
