"""attnlab serve: the live attention explorer in the browser (a local web app; Ctrl-C stops it).

Bad arguments raise ValueError (``main`` prints it as one line, exit 2): the class, unlike ``UsageError``,
is the same object when ``attnlab.cli.main`` also runs as ``__main__`` (``python -m attnlab.cli.main``).
"""
from __future__ import annotations

import argparse
import ipaddress
import socket
import sys

__all__ = ["build_parser", "run", "bind"]


def build_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; anything but a loopback address exposes the explorer to your network")
    p.add_argument("--port", type=int, default=8000, help="TCP port; 0 picks a free one (the URL is printed)")
    p.add_argument("--max-tokens", type=int, default=128, dest="max_tokens",
                   help="longest input accepted (tokens, 2..512); longer text is refused with a message")


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


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args: argparse.Namespace) -> dict:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ValueError(f"attnlab serve needs Starlette and uvicorn ({e.name} is missing): "
                         "pip install starlette uvicorn") from None
    if not 2 <= args.max_tokens <= 512:
        raise ValueError(f"--max-tokens must be in 2..512 (MiniLM has 512 positions), got {args.max_tokens}")
    from ..serve import Explorer, create_app, serve_forever

    sock = bind(args.host, args.port)
    try:
        print("attnlab serve: loading all-MiniLM-L6-v2 …", file=sys.stderr, flush=True)
        explorer = Explorer(max_tokens=args.max_tokens)
        if not explorer.available:
            print(f"attnlab serve: warning: {explorer.message}; the page will say so", file=sys.stderr, flush=True)
        if not _is_loopback(args.host):
            print(f"attnlab serve: warning: listening on {args.host}, reachable from other machines", file=sys.stderr)
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        url = f"http://{shown}:{port}/"
        print(f"attnlab serve: {url}  (Ctrl-C stops)", flush=True)
        # Ctrl-C: uvicorn shuts down gracefully, then re-raises SIGINT; main turns the KeyboardInterrupt into
        # one stderr line and exit code 130 (Note [One error boundary] in cli/main.py)
        from ..serve.app import LOOPBACK_HOSTS

        hosts = LOOPBACK_HOSTS if _is_loopback(args.host) else None
        serve_forever(create_app(explorer, allowed_hosts=hosts), sock)
    finally:
        sock.close()
    return {"exit_code": 0}
