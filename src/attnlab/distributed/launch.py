"""Run a function in N local processes joined by a torch.distributed group (tests and benchmarks).

``run_local(fn, world_size)`` starts fresh processes (spawn), joins them on 127.0.0.1 through a
TCPStore that the parent opens on a free port (port 0, so no port can be taken between choosing
and using it), calls ``fn(rank, world_size, *args)`` in each and returns one ``RankResult`` per rank.
A rank that raises, dies or outlives ``timeout`` is reported, never waited on forever. For real jobs
use torchrun (docs/distributed.md); this is the in-process equivalent for a single machine.
"""
from __future__ import annotations

import datetime
import os
import queue as queue_mod
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_local", "RankResult", "LocalRunError"]


@dataclass
class RankResult:
    """What one rank of :func:`run_local` returned: ``ok`` with ``fn``'s return ``value``, or the
    exception's type name, message and traceback (``error_type`` "ProcessDied" or "Timeout" when the
    process ended without a result); the process's exit code and seconds from start to result."""
    rank: int
    ok: bool
    value: Any = None
    error_type: str | None = None
    error: str | None = None
    traceback: str | None = None
    exitcode: int | None = None
    seconds: float | None = None  # from process start to result


class LocalRunError(RuntimeError):
    """At least one rank failed; ``results`` holds every rank's RankResult."""

    def __init__(self, message: str, results: list[RankResult]):
        super().__init__(message)
        self.results = results


def _worker(fn, rank, world_size, port, backend, timeout_s, args, env, out_q):
    t0 = time.perf_counter()
    for k_, v_ in (env or {}).items():
        os.environ[k_] = v_
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size=None, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            value = fn(rank, world_size, *args)
        finally:
            try:
                dist.destroy_process_group()
            except Exception:  # a broken group cannot always be torn down cleanly; the process ends anyway
                pass
        out_q.put((rank, True, value, None, None, None, time.perf_counter() - t0))
    except BaseException as e:  # report everything, including KeyboardInterrupt-free SystemExit
        out_q.put((rank, False, None, type(e).__name__, str(e), traceback.format_exc(), time.perf_counter() - t0))


def run_local(fn: Callable[..., Any], world_size: int, *, args: tuple = (), backend: str = "gloo",
              timeout: float = 60.0, group_timeout: float | None = None, env: dict[str, str] | None = None,
              check: bool = True) -> list[RankResult]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes on one process group.

    ``fn`` must be importable (a module-level function) and return something picklable. ``timeout``
    bounds the whole run (ranks still running after it are killed); ``group_timeout`` is the
    process group's own timeout (default: ``timeout``), after which a blocked collective raises.
    ``env`` is set in each child before the group starts. With ``check`` a failed rank raises
    ``LocalRunError`` naming each failure; otherwise inspect ``RankResult.ok``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    group_timeout = timeout if group_timeout is None else group_timeout
    env = dict(env or {})
    env.setdefault("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=max(timeout, 1.0)))
    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    procs = []
    # Ctrl-C reaches every process of the terminal's group: the ranks start with SIGINT ignored (a
    # disposition a new Python keeps) so that only this process reacts, stops them and reports once
    main_thread = threading.current_thread() is threading.main_thread()
    prev = signal.signal(signal.SIGINT, signal.SIG_IGN) if main_thread else None
    try:
        for rank in range(world_size):
            p = ctx.Process(target=_worker, args=(fn, rank, world_size, store.port, backend, group_timeout, args,
                                                  env, out_q), daemon=True)
            p.start()
            procs.append(p)
    finally:
        if prev is not None:
            signal.signal(signal.SIGINT, prev)
    results: dict[int, RankResult] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size and time.monotonic() < deadline:
            try:
                rank, ok, value, etype, err, tb, secs = out_q.get(timeout=0.2)
                results[rank] = RankResult(rank, ok, value, etype, err, tb, None, secs)
            except queue_mod.Empty:
                # a process that ended without reporting has died (os._exit, signal, OOM killer)
                for r, p in enumerate(procs):
                    if r not in results and not p.is_alive() and p.exitcode is not None:
                        try:  # it may still have reported just before exiting
                            rank, ok, value, etype, err, tb, secs = out_q.get(timeout=0.5)
                            results[rank] = RankResult(rank, ok, value, etype, err, tb, None, secs)
                        except queue_mod.Empty:
                            results[r] = RankResult(r, False, error_type="ProcessDied",
                                                    error=f"process exited with code {p.exitcode} without a result")
    except KeyboardInterrupt:
        deadline = time.monotonic()  # the ranks ignore Ctrl-C: stop them now, not after their timeout
        raise
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        out_q.close()
        del store
    for r, p in enumerate(procs):
        if r not in results:
            results[r] = RankResult(r, False, error_type="Timeout",
                                    error=f"no result within {timeout:g} s (killed)")
        results[r].exitcode = p.exitcode
    ordered = [results[r] for r in range(world_size)]
    if check and not all(x.ok for x in ordered):
        lines = [f"rank {x.rank}: {x.error_type}: {x.error}" for x in ordered if not x.ok]
        tbs = [x.traceback for x in ordered if x.traceback and not x.ok]
        raise LocalRunError("run_local: " + "; ".join(lines) + ("\n" + tbs[0] if tbs else ""), ordered)
    return ordered
