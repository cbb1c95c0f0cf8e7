"""The explorer's HTTP side: a Starlette app (page + JSON API) and a uvicorn runner on a bound socket.

Every error is JSON ``{"error": message}`` with a 4xx (bad request, unknown route or method, too large)
or 500 (a bug: the message names the exception, never a traceback page). The page is one HTML document
with inline CSS/JS, served with a Content-Security-Policy that allows no network beyond this origin.
"""
from __future__ import annotations

import json

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse
from starlette.routing import Route

from .engine import Explorer, ExplorerError
from .page import PAGE

__all__ = ["create_app", "serve_forever", "MAX_BODY", "LOOPBACK_HOSTS"]

MAX_BODY = 64 * 1024  # bytes; a request is a sentence and a few switches
MAX_DEPTH = 16  # JSON nesting: a request is an object of scalars and one small params object
_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'")


def _error(message: str, status: int) -> JSONResponse:
    # a message quoting the request may carry a lone surrogate, which UTF-8 cannot: escaped, not a 500
    message = " ".join(message.encode("utf-8", "backslashreplace").decode("utf-8").split("\n"))
    return JSONResponse({"error": message}, status_code=status)


def _depth_over(value, limit: int) -> bool:
    """Whether ``value`` (decoded JSON) nests lists/objects more than ``limit`` deep (iteratively)."""
    stack = [(value, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, (list, dict)):
            if d > limit:
                return True
            stack.extend((y, d + 1) for y in (x.values() if isinstance(x, dict) else x))
    return False


async def _json_body(request: Request):
    if "application/json" not in request.headers.get("content-type", ""):
        raise ExplorerError("send the request body as JSON with Content-Type: application/json", 415)
    body = await request.body()
    if len(body) > MAX_BODY:
        raise ExplorerError(f"the request body is {len(body)} bytes; at most {MAX_BODY}", 413)
    try:
        value = json.loads(body.decode("utf-8"))
    except RecursionError:
        raise ExplorerError(f"the request body is nested too deeply to parse; at most {MAX_DEPTH} levels") from None
    except ValueError as e:  # UnicodeDecodeError, JSONDecodeError, an integer past Python's digit limit
        raise ExplorerError(f"the request body is not valid JSON: {e}") from None
    if _depth_over(value, MAX_DEPTH):
        deep = [k for k, v in value.items() if _depth_over(v, MAX_DEPTH - 1)] if isinstance(value, dict) else []
        subject = f"field {deep[0]!r}" if deep else "the request body"
        raise ExplorerError(f"{subject} nests lists/objects more than {MAX_DEPTH} levels deep; at most {MAX_DEPTH}")
    return value


class _HostCheck:
    """Answer 400 (JSON) to requests whose Host header is not one of ``hosts``: a page on another site that
    rebinds its DNS name to 127.0.0.1 then cannot use the explorer from the visitor's browser."""

    def __init__(self, app, hosts: set[str]):
        self.app, self.hosts = app, hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if name not in self.hosts:
                await _error(f"Host {host!r} is not served here (use {sorted(self.hosts)[0]})", 400)(scope, receive, send)
                return
        await self.app(scope, receive, send)


LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "[::1]"})


def create_app(explorer: Explorer, allowed_hosts=None) -> Starlette:
    """Routes: GET / (the page), GET /api/info, POST /api/attention, POST /api/trace.

    allowed_hosts: Host header names to answer (e.g. :data:`LOOPBACK_HOSTS` for a loopback bind); None
    answers any (tests, or a deliberate bind to another address).
    """

    async def page(request: Request) -> HTMLResponse:
        return HTMLResponse(PAGE, headers={"Content-Security-Policy": _CSP, "X-Content-Type-Options": "nosniff",
                                           "Cache-Control": "no-store"})

    async def info(request: Request) -> JSONResponse:
        return JSONResponse(explorer.info())

    def endpoint(fn):
        async def handler(request: Request) -> JSONResponse:
            body = await _json_body(request)
            return JSONResponse(await run_in_threadpool(fn, body))
        return handler

    async def explorer_error(request: Request, exc: ExplorerError) -> JSONResponse:
        return _error(str(exc), exc.status)

    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        msg = {404: f"no such page: {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        return _error(msg.get(exc.status_code, str(exc.detail)), exc.status_code)

    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        return _error(f"internal error ({type(exc).__name__}: {exc}); please report it", 500)

    routes = [
        Route("/", page, methods=["GET"]),
        Route("/api/info", info, methods=["GET"]),
        Route("/api/attention", endpoint(explorer.attention), methods=["POST"]),
        Route("/api/trace", endpoint(explorer.trace), methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={ExplorerError: explorer_error, HTTPException: http_error,
                                                       Exception: server_error})
    app.state.explorer = explorer
    if allowed_hosts is not None:
        app.add_middleware(_HostCheck, hosts=set(allowed_hosts))
    return app


def serve_forever(app, sock) -> None:
    """Run ``app`` with uvicorn on an already bound socket (so port 0 can be printed before serving).
    Ctrl-C raises KeyboardInterrupt here after uvicorn's graceful shutdown (Note [Ctrl-C under uvicorn])."""
    import signal

    import uvicorn

    # Note [Ctrl-C under uvicorn]: uvicorn catches SIGINT, shuts down, then re-raises it under the handler it found
    # at start. Under asyncio.run that handler is asyncio's own, which cancels the main task rather than raising,
    # and whether the cancel surfaces as KeyboardInterrupt depends on when Python runs the handler: once, in a fresh
    # clone's `make test`, run() returned normally and `attnlab serve` exited 0 instead of 130. So the signal is
    # recorded here and turned into KeyboardInterrupt whichever way run() ends.
    class _Server(uvicorn.Server):
        stopped_by: int | None = None

        def handle_exit(self, sig, frame):
            self.stopped_by = sig
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=2)
    server = _Server(config)
    server.run(sockets=[sock])
    if server.stopped_by == signal.SIGINT:
        raise KeyboardInterrupt
