"""An app served by uvicorn on a free 127.0.0.1 port in a thread, for the server tests."""
from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

HOST = "127.0.0.1"


@contextlib.contextmanager
def running(app, timeout: float = 120.0):
    """Yields the base URL; on exit the server and the app's engine thread are gone (asserted). A server
    that does not start or stop within ``timeout`` s fails saying so."""
    import uvicorn

    sock = socket.socket()
    sock.bind((HOST, 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=10))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        assert thread.is_alive(), "uvicorn stopped while starting"
        assert time.monotonic() < deadline, f"hung: uvicorn starting (not within {timeout:.0f} s)"
        time.sleep(0.02)
    try:
        yield f"http://{HOST}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()
        assert not thread.is_alive(), "uvicorn did not stop"
        assert not app.state.worker.alive, "the engine thread was left behind"


def sse(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of each named server-sent event (Anthropic's and OpenAI Responses' streams)."""
    events = []
    for block in filter(None, text.split("\n\n")):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append((lines["event"], json.loads(lines["data"])))
    return events
