"""One replica served: the engine's loop in the main thread, uvicorn serving the replica's
``Server`` in a second one, started once the engine has warmed up; SIGINT/SIGTERM finish the
requests in flight; then the run directory and ``trace.json``, the requests as served."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from schedlab.errors import SchedlabError

from .bridge import Bridge
from .http import APIError, listening, server_config
from .server import Server


def exit_with_front() -> None:
    """A replica a front started (``SCHEDLAB_FRONT_PID``) ends when the front is gone, whatever it
    is doing: Linux kills it then (PR_SET_PDEATHSIG); elsewhere (macOS) a thread watches."""
    front = os.environ.get("SCHEDLAB_FRONT_PID")
    if not front or sys.platform.startswith("linux"):
        return

    def watch() -> None:
        while os.getppid() == int(front):
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="front-watch", daemon=True).start()


def check_address(host: str, port: int) -> None:
    """Fail at once when ``host:port`` cannot be listened on (a port in use, an address not of this
    machine), before the model loads; uvicorn's own bind, later, still reports a port taken since."""
    import socket

    if port == 0:
        return
    message = f"cannot listen on {host}:{port} (in use, or not an address of this machine?)"
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError):
        raise SchedlabError(message) from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError:
            raise SchedlabError(message) from None


def serve_replica(
    eng,
    pol,
    host: str,
    port: int,
    name: str,
    max_tokens: int,
    out: Path | None,
    log,
    max_waiting: int | None = None,
    kv_dir: Path | None = None,
):
    """Serve ``pol`` on the loaded engine ``eng`` until SIGINT/SIGTERM: (the run, an error or None)."""
    import uvicorn

    from schedlab.sim import LiveSource, WallClock

    info = eng.info
    # a light warm-up (on a GPU: every kind of pass once at small shapes; on the CPU none), so
    # that the server is ready seconds sooner; larger passes' allocations come with the first
    # requests that need them
    backend = eng.make_backend(warmup="light")
    clock = WallClock()
    bridge = Bridge(backend, eng.kv_tokens, info.tokenizer, frozenset(info.eos_token_ids or ()))
    http: dict[str, Any] = {}

    def start_http() -> None:  # the clock runs: from now on arrivals are the run's
        policy = getattr(pol, "name", type(pol).__name__)
        srv = Server(info, source, bridge, name, max_tokens, max_waiting=max_waiting, kv_dir=kv_dir, policy=policy)
        config = server_config(srv.app, host, port)
        hs = uvicorn.Server(config)
        t = threading.Thread(target=hs.run, name="schedlab-http", daemon=True)
        t.start()
        while not hs.started and t.is_alive():
            time.sleep(0.01)
        http.update(server=hs, thread=t)
        where = listening(hs) if hs.started else None
        if where is None:
            http["error"] = f"cannot listen on {host}:{port} (in use, or not an address of this machine?)"
            source.close()
            return
        prof = Path(str(eng.cost_model.source.get("profile"))).name
        elsewhere = any(n.startswith("no cost profile for model") for n in eng.notes)
        print(
            f"serve: listening on http://{where[0]}:{where[1]} (policy {getattr(pol, 'name', type(pol).__name__)}, "
            f"model {name}, KV {eng.kv_tokens} tokens, profile {prof}"
            f"{' (bundled: not measured on this model and machine; --calibrate measures one)' if elsewhere else ''})",
            file=sys.stderr,
            flush=True,
        )

    source = LiveSource(clock, on_ready=start_http, on_finish=bridge.on_finish)
    bridge.on_cancel = source.cancel
    stopping = {"n": 0}

    def stop(signum, frame) -> None:
        stopping["n"] += 1
        if stopping["n"] > 1:
            raise KeyboardInterrupt
        source.close()
        log("progress", f"shutting down: finishing {bridge.in_flight()} request(s) in flight")

    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    run = None
    try:
        run = eng.run(pol, source, trace_name="served", clock=clock, backend=backend)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        why = (run.error if run is not None else None) or "the replica stopped"
        bridge.fail_all(APIError(500, f"the server could not finish this request: {why}", kind="server_error"))
        hs = http.get("server")
        if hs is not None:
            hs.should_exit = True
            http["thread"].join(timeout=10)
    if http.get("error"):
        return None, http["error"]
    if out is not None:
        run.save(out)
        write_replica_trace(Path(out) / "trace.json", run, source.received, pol, name, source.cancelled)
    return run, run.error


def write_replica_trace(path: Path, run, received, pol, name: str, cancelled_at: dict[str, float]) -> None:
    """trace.json: the requests as served, for simulate/validate to replay. A request that
    stopped at EOS has the tokens it generated as its output (what a replay must generate); one
    refused keeps its max_tokens (refused again), as does one whose client went away, with its
    ``cancel_after_s`` (cancelled again at that time); times from the first arrival (a replay on the
    real engine need not sit idle first)."""
    from dataclasses import replace

    from schedlab.traces.schema import Trace

    req = run.requests
    done = req[req["status"] == "finished"]
    made = {str(i): int(n) for i, n in zip(done["id"], done["output_tokens"])}
    status = {str(i): s for i, s in zip(req["id"], req["status"])}
    t0 = received[0].arrival_s if received else 0.0

    def served(r):
        at = round(r.arrival_s - t0, 6)
        if status.get(r.id) == "cancelled":  # keeps its max_tokens; its client left this long after
            left = max(cancelled_at.get(r.id, r.arrival_s) - r.arrival_s, 0.0)
            return replace(r, arrival_s=at, cancel_after_s=round(left, 6))
        return replace(r, arrival_s=at, output_tokens=made.get(r.id, r.output_tokens))

    trace = Trace(
        name="served",
        description=f"requests served by schedlab serve (policy "
        f"{getattr(pol, 'name', type(pol).__name__)}, model {name}); "
        f"arrival_s from the first arrival ({t0:.3f} s into the run); "
        f"output_tokens: the tokens each generated",
        requests=[served(r) for r in received],
    )
    path.write_text(json.dumps(trace.to_json(), ensure_ascii=False, indent=1) + "\n")
