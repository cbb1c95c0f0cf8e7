"""attnlab serve: the live attention explorer in the browser (a local web app; Ctrl-C stops it).

Bad arguments raise ValueError (``main`` prints it as one line, exit 2).
"""
from __future__ import annotations

import argparse
import sys

__all__ = ["build_parser", "run"]


def build_parser(p: argparse.ArgumentParser) -> None:
    """serve's options: the address and port to listen on, the longest input accepted."""
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; anything but a loopback address exposes the explorer to your network")
    p.add_argument("--port", type=int, default=8000, help="TCP port; 0 picks a free one (the URL is printed)")
    p.add_argument("--max-tokens", type=int, default=128, dest="max_tokens",
                   help="longest input accepted (tokens, 2..512); longer text is refused with a message")


def run(args: argparse.Namespace) -> dict:
    """Load MiniLM, listen, print the URL and serve until Ctrl-C (which ``main`` turns into exit 130)."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ValueError(f"attnlab serve needs Starlette and uvicorn ({e.name} is missing): "
                         "pip install starlette uvicorn") from None
    if not 2 <= args.max_tokens <= 512:
        raise ValueError(f"--max-tokens must be in 2..512 (MiniLM has 512 positions), got {args.max_tokens}")
    # defers starlette and uvicorn to `attnlab serve`
    from ..serve import Explorer, bind, create_app, is_loopback, serve_forever

    sock = bind(args.host, args.port)
    try:
        print("attnlab serve: loading all-MiniLM-L6-v2 …", file=sys.stderr, flush=True)
        explorer = Explorer(max_tokens=args.max_tokens)
        if not explorer.available:
            print(f"attnlab serve: warning: {explorer.message}; the page will say so", file=sys.stderr, flush=True)
        if not is_loopback(args.host):
            print(f"attnlab serve: warning: listening on {args.host}, reachable from other machines", file=sys.stderr)
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        url = f"http://{shown}:{port}/"
        print(f"attnlab serve: {url}  (Ctrl-C stops)", flush=True)
        # Ctrl-C: uvicorn shuts down gracefully, then re-raises SIGINT; main turns the KeyboardInterrupt into
        # one stderr line and exit code 130 (Note [One error boundary] in cli/main.py)
        from ..serve.app import LOOPBACK_HOSTS

        hosts = LOOPBACK_HOSTS if is_loopback(args.host) else None
        serve_forever(create_app(explorer, allowed_hosts=hosts), sock)
    finally:
        sock.close()
    return {"exit_code": 0}
