"""attnlab.serve: a live attention explorer in the browser (``attnlab serve``).

Type a sentence and watch all-MiniLM-L6-v2's attention recomputed under the seed's experiments: score
scale (1/√d_k, 1, 1/d_k), temperature, softmax or none, dot or cosine similarity, any registered
mechanism or pattern; see the weights, entropy, max weight and the sentence embedding's similarity to
the unmodified model change, and step through the trace (X → Q, K, V → scores → scaled → mask →
softmax → output) with the formula of each step. Local only (127.0.0.1 by default), no network.

    >>> from attnlab.serve import create_app
    >>> app = create_app()                      # a Starlette ASGI app; run it with uvicorn

JSON API: GET /api/info, POST /api/attention, POST /api/trace (bodies: :class:`Settings` fields). Bad
requests get a 4xx with {"error": message}; text above ``max_tokens`` tokens gets 413.
"""
from __future__ import annotations

import ipaddress
import socket

from .engine import MAX_TOKENS, Explorer, ExplorerError, Settings, Variant, parse_settings

__all__ = ["create_app", "serve_forever", "Explorer", "ExplorerError", "Settings", "Variant", "parse_settings",
           "MAX_TOKENS", "bind", "is_loopback"]


def create_app(explorer: Explorer | None = None, *, allowed_hosts=None, **kwargs):
    """The Starlette app around ``explorer`` (default: ``Explorer(**kwargs)``, which loads MiniLM).

    allowed_hosts: Host header names answered (``attnlab.serve.app.LOOPBACK_HOSTS`` when bound to
    loopback); None answers any."""
    from .app import create_app as _create  # defers starlette until an app is built

    return _create(explorer if explorer is not None else Explorer(**kwargs), allowed_hosts=allowed_hosts)


def serve_forever(app, sock) -> None:
    """Serve ``app`` on the bound socket ``sock`` with uvicorn until SIGINT/SIGTERM (then KeyboardInterrupt
    propagates after a graceful shutdown, as uvicorn re-raises the signal)."""
    from .app import serve_forever as _serve  # defers starlette and uvicorn until a server runs

    _serve(app, sock)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); ValueError naming the address if it cannot be bound."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"--port must be in 0..65535 (0 = a free port), got {port!r}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} is not an address this machine can listen on: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror} (try --port 0 for a free port)") from None
    return sock


def is_loopback(host: str) -> bool:
    """Whether ``host`` ("localhost", "127.0.0.1", "::1", ...) is reachable only from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
