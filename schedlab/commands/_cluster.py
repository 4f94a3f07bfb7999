"""``serve --replicas N``: N replica processes behind one front that routes every request with the
simulator's routers (``schedlab.routers``), on the replicas' live state.

- **Replicas.** Each is the single-replica ``serve`` (its own process, model, policy object, KV
  cache and wall clock) on ``127.0.0.1`` and a free port, pinned to its share of the cores
  (``os.sched_setaffinity``; ``OPENBLAS_NUM_THREADS``/``OMP_NUM_THREADS`` the share's size), with
  its own run directory ``OUT/replica-<i>``. It answers ``GET /state`` (the router's signals) and
  ``POST /prepare/...`` (a completion request checked and its prompt counted, not run).
- **The front** (this process) serves the OpenAI API on ``--host``/``--port`` (FastAPI/uvicorn in
  a thread; the main thread watches the replicas and the signals). Per request: a replica checks
  and counts it (``/prepare``), the front reads every up replica's ``/state`` at once, adds what it
  sent that a replica has not received yet, shows the router a ``ClusterView`` and forwards the
  request to the replica it names, always streamed (with usage), relaying the stream to a
  streaming client or gathering it into one answer.
- **Prefill and decode apart** (``serve --prefill P --decode D``): the first P replicas are the
  prefill pool, the others the decode pool, a router object each. A request goes to a prefill
  replica for its first token (``X-Schedlab-KV-Export``: the replica writes the prompt's KV to a
  file in a shared-memory folder the front made, ``engine.kvfile``, and its stream says where),
  then to a decode replica with that file (``X-Schedlab-KV-Import``) for the rest; the client sees
  one answer (``Front.pd_events``). Before serving the front measures the link (``probe_link``).
- **Faults.** A replica whose process exits, or that a connection to fails, is down at once (the
  process is polled every ``POLL_S``); the router is shown it with ``up=False``. A request it held
  that had sent its client no token yet (every non-streamed one) is routed again, once, among the
  replicas up; one that had is ended with an OpenAI-style error event. No replica up: 503.
- **Shutdown** (SIGINT/SIGTERM): new requests get 503, the replicas get SIGTERM (they finish what
  they hold and write their run directories), the front waits for its requests in flight and for
  the replicas to exit, then writes ``OUT/trace.json`` (the requests as they arrived at the front,
  each with its ``replica``) and ``OUT/cluster.json``, and prints the summary it measured.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request as HTTPRequest  # (module level: FastAPI resolves handler annotations here)

from ..errors import SchedlabError
from ._http import APIError, listening, models_body, openai_app, server_config

POLL_S = 0.05  # how often the main thread looks at the replica processes
PROBE_S = 0.5  # how often a replica down after a connection error (its process alive) is tried again
_LISTENING = re.compile(r"listening on (http://[^\s]+:\d+)")
_DONE = object()  # the end of an upstream stream ([DONE])
_RESTART = object()  # the request starts again on another replica (nothing reached its client)


def cpu_shares(n: int) -> list[list[int]]:
    """The cores this process may use, split into ``n`` contiguous shares (one core each, round
    the cores, when there are fewer cores than replicas)."""
    if hasattr(os, "sched_getaffinity"):
        cores = sorted(os.sched_getaffinity(0))
    else:  # pragma: no cover - macOS: no affinity; the shares only size the thread counts
        cores = list(range(os.cpu_count() or 1))
    k = len(cores)
    if k >= n:
        return [cores[i * k // n : (i + 1) * k // n] for i in range(n)]
    return [[cores[i % k]] for i in range(n)]


def _death_signal():
    """``prctl`` (Linux), for a replica's preexec_fn: killed when the front dies."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        prctl = None
    return prctl


_PRCTL = _death_signal()


class Replica:
    """One replica process as the front knows it."""

    def __init__(self, index: int, argv: list[str], cpus: list[int], pool: str | None = None):
        self.index = index
        self.pool = pool  # "prefill" or "decode" when prefill and decode run apart, else None
        self.argv = argv
        self.cpus = cpus
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.listening = threading.Event()
        self.up = False
        self.dead = False  # its process exited
        self.exit_status: int | None = None
        self.down_s: float | None = None  # when it went down (front time)
        self.down_reason: str | None = None
        self.failed = False  # it went down while the cluster served (not at its shutdown)
        self.routed = 0  # routing decisions that named it (a retry's included)
        self.in_flight = 0  # requests being relayed from it now
        self.sent = [0, 0, 0]  # requests, prompt tokens, output tokens forwarded to it (cumulative)
        self.last_state: dict[str, Any] | None = None
        self.lines: list[str] = []  # its stderr, but for the listening line
        self._reader: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, echo) -> None:
        cpus = self.cpus
        threads = str(len(cpus))
        env = dict(
            os.environ, OPENBLAS_NUM_THREADS=threads, OMP_NUM_THREADS=threads, SCHEDLAB_FRONT_PID=str(os.getpid())
        )

        def preexec() -> None:  # in the child, before exec: its cores; killed when the front dies
            if hasattr(os, "sched_setaffinity"):
                os.sched_setaffinity(0, cpus)
            if _PRCTL is not None and sys.platform.startswith("linux"):
                # PR_SET_PDEATHSIG: nobody is left to answer to, so nothing to finish (a SIGTERM
                # would let a replica that is still calibrating go on for minutes)
                _PRCTL(1, signal.SIGKILL)

        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,  # a Ctrl-C at a terminal reaches the front only; it tells the replicas
            preexec_fn=preexec,
        )
        self._reader = threading.Thread(target=self._read, args=(echo,), name=f"replica-{self.index}", daemon=True)
        self._reader.start()

    def _read(self, echo) -> None:
        for line in iter(self.proc.stderr.readline, ""):
            line = line.rstrip("\n")
            if self.url is None:
                m = _LISTENING.search(line)
                if m:
                    self.url = m.group(1)
                    self.listening.set()
                    continue
            self.lines.append(line)
            if self.url is None and re.match(r"(schedlab )?serve: error: ", line):
                continue  # (one that does not start: the front says why, in one line)
            echo(self.index, line)

    def last_line(self) -> str:
        if self._reader is not None:
            self._reader.join(timeout=2)
        lines = [x for x in self.lines if x.strip()]
        errors = [x for x in lines if "error" in x]
        text = (errors or lines or ["(nothing on stderr)"])[-1]
        return re.sub(r"^(schedlab )?serve: (error: )?", "", text)

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.send_signal(signum)
            except ProcessLookupError:  # pragma: no cover - it just exited
                pass

    def kill(self) -> None:
        """End it now, whatever it is doing, with anything it started (its own session)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # pragma: no cover - it just exited
                self.proc.kill()

    def describe(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "url": self.url,
            "pid": self.pid,
            "cpus": self.cpus,
            **({"pool": self.pool} if self.pool else {}),
            "up": self.up,
            "routed": self.routed,
            "in_flight": self.in_flight,
        }


@dataclass
class Record:
    """One request at the front: what arrived, where it went, what its client saw (front time)."""

    id: str
    chat: bool
    stream: bool
    include_usage: bool
    arrival: float
    prompt_tokens: int = 0
    max_tokens: int = 0
    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    arrival_index: int | None = None
    ticket: int | None = None  # its place in the order the front received requests (Front.ticket)
    replica: int | None = None
    replicas: list[int] = field(default_factory=list)  # every replica it was sent to, in order
    retried: bool = False
    failed: str | None = None
    cancelled: bool = False
    saw_tokens: bool = False  # its client has been sent text: it can no longer be retried
    times: list[float] = field(default_factory=list)  # when each piece of text came
    finish: float | None = None
    finish_reason: str | None = None
    completion_tokens: int | None = None
    # prefill and decode apart: the KV handed from its prefill replica to its decode replica (tokens,
    # bytes, export_s: the prefill engine writing it; at_s: when the front heard of it; notice_s: from
    # its first token to then; handoff_s: from then to the decode replica taking it, KV read;
    # exposed_s: their sum, as the simulator's exposed transfer)
    kv: dict[str, Any] | None = None

    def request(self, arrival_s: float, stage: str | None = None):
        """As a router sees it (``stage``: its part in a pool: "prefill" one token; "decode" the rest,
        from a prompt with its first token whose KV it brings)."""
        from schedlab.sim.disagg import TransferredRequest
        from schedlab.traces.schema import Request

        text = {"prompt": self.prompt, "messages": self.messages}
        if stage == "prefill":
            return Request(self.id, arrival_s, self.prompt_tokens, 1, **text)
        if stage == "decode":
            n = self.prompt_tokens
            return TransferredRequest(self.id, arrival_s, n + 1, self.max_tokens - 1, **text, kv_transferred=n)
        return Request(self.id, arrival_s, self.prompt_tokens, self.max_tokens, **text)


class _Lost(Exception):
    """The replica serving a request went away (a connection error, a stream cut short)."""


TURN_WAIT_S = 3.0  # how long a request waits for the requests that arrived before it to be routed


class Front:
    """The front's HTTP side: the OpenAI API over the replicas, ``/health`` and ``/metrics``."""

    def __init__(
        self,
        replicas: list[Replica],
        router,
        router_options: dict,
        model_name: str,
        policy: str,
        log,
        decode_router=None,
    ):
        self.replicas = replicas
        self.router = router
        # prefill and decode apart (replicas with a pool): a router per pool, each keeps its own state
        self.pools = any(r.pool for r in replicas)
        self.routers = {"prefill": router, "decode": decode_router} if self.pools else {None: router}
        self.router_name = getattr(router, "name", type(router).__name__)
        self.router_options = router_options
        self.model_name = model_name
        self.policy = policy
        self.log = log
        self.trace_name = "served"  # (run-real: the trace replayed)
        self.t0 = time.perf_counter()
        self.closing = False
        self.records: list[Record] = []
        self.retries = 0
        self.failures = 0
        self.route_errors = 0
        self.in_flight = 0
        self._ids = itertools.count()
        self._used: set[str] = set()
        self._arrivals = 0
        self._prepare_turn = itertools.count()
        self._lock: asyncio.Lock | None = None
        # requests are routed first in the order they arrived, whatever order their prompts'
        # counting (/prepare) ends in: each takes a ticket on arrival and waits for its turn
        self._tickets = itertools.count()
        self._turn = 0
        self._passed: set[int] = set()
        self._turn_events: dict[int, asyncio.Event] = {}
        self._client = None
        self._metrics = _Metrics(model_name, len(replicas))
        self.app = self._make_app()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    # ---------------------------------------------------------------- replicas up and down

    def mark_down(self, r: Replica, why: str) -> None:
        if r.up:
            r.up = False
            r.down_s = self.now()
            r.down_reason = why
            if not self.closing:
                r.failed = True
                self.log("warning", f"replica {r.index} (pid {r.pid}) is down: {why}")

    def client(self):
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(None, connect=5.0),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            )
        return self._client

    async def _state(self, r: Replica) -> dict[str, Any] | None:
        import httpx

        try:
            resp = await self.client().get(r.url + "/state", timeout=5.0)
            resp.raise_for_status()
            st = resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            self.mark_down(r, f"GET /state failed: {type(exc).__name__}")
            return None
        r.last_state = st
        return st

    # ---------------------------------------------------------------- routing

    def ticket(self) -> int:
        """A request's place in the arrival order (taken as it arrives, before its prompt is
        counted); its first routing waits until every earlier ticket has been routed or dropped
        (``pass_turn``)."""
        return next(self._tickets)

    async def wait_turn(self, ticket: int) -> None:
        """Until every ticket before ``ticket`` has passed. After ``TURN_WAIT_S`` those still being
        counted (not yet waiting here: a stopped replica's /prepare) lose their place, so that
        one hung request does not hold the ones after it."""
        loop = asyncio.get_running_loop()
        deadline: float | None = loop.time() + TURN_WAIT_S
        try:
            while self._turn < ticket:
                ev = self._turn_events.get(ticket)
                if ev is None:
                    ev = self._turn_events[ticket] = asyncio.Event()
                left = None if deadline is None else max(deadline - loop.time(), 0.0)
                try:
                    await asyncio.wait_for(ev.wait(), left)
                except asyncio.TimeoutError:
                    deadline = None
                    self._passed.update(t for t in range(self._turn, ticket) if t not in self._turn_events)
                    self._advance()
        finally:  # (its client may go while it waits)
            self._turn_events.pop(ticket, None)

    def pass_turn(self, ticket: int | None) -> None:
        """``ticket`` has been routed, or will never be (refused, failed, gone): the next may go.
        Idempotent."""
        if ticket is None or ticket < self._turn:
            return
        self._passed.add(ticket)
        self._advance()

    def _advance(self) -> None:
        while self._turn in self._passed:
            self._passed.discard(self._turn)
            self._turn += 1
        ev = self._turn_events.get(self._turn)
        if ev is not None:
            ev.set()

    async def route(self, rec: Record, pool: str | None = None):
        """The replica the router picks for ``rec`` among those up (an APIError if none, or if the
        router's answer is not a replica that is up); ``pool``: among that pool's replicas (the
        router sees them numbered from 0, and the request as that pool gets it). A request's first
        routing comes after every request that arrived before it (``ticket``)."""
        first = rec.arrival_index is None and rec.ticket is not None
        if first:
            await self.wait_turn(rec.ticket)
        try:
            return await self._route(rec, pool)
        finally:
            if first:
                self.pass_turn(rec.ticket)

    async def _route(self, rec: Record, pool: str | None):
        import operator

        from schedlab.routers import ClusterView, ReplicaSignals

        if self._lock is None:
            self._lock = asyncio.Lock()
        members = [r for r in self.replicas if r.pool == pool]
        where = f"in the {pool} pool " if pool else ""
        async with self._lock:  # one decision at a time, in arrival order (routers keep state)
            ups = [r for r in members if r.up]
            if not ups:
                raise APIError(503, f"no replica {where}is up", kind="server_error", code="no_replica")
            states = dict(zip((r.index for r in ups), await asyncio.gather(*(self._state(r) for r in ups))))
            signals = []
            for k, r in enumerate(members):
                st = states.get(r.index)
                if st is None or not r.up:
                    last = r.last_state or {}
                    signals.append(ReplicaSignals(k, kv_capacity=last.get("kv_capacity", 1), up=False))
                    continue
                got = st.get("received", {})
                # forwarded by the front, not yet received by the replica: in transit, waiting there
                tn = max(r.sent[0] - got.get("requests", 0), 0)
                tp = max(r.sent[1] - got.get("prompt_tokens", 0), 0)
                to = max(r.sent[2] - got.get("output_tokens", 0), 0)
                signals.append(
                    ReplicaSignals(
                        k,
                        waiting=st["waiting"] + tn,
                        running=st["running"],
                        prompt_tokens=st["prompt_tokens"] + tp,
                        output_tokens=st["output_tokens"] + to,
                        kv_used=st["kv_used"],
                        kv_capacity=st["kv_capacity"],
                        prefix_hit=0,
                        up=True,
                    )
                )
            if not any(s.up for s in signals):
                raise APIError(503, f"no replica {where}is up", kind="server_error", code="no_replica")
            if rec.arrival_index is None:
                rec.arrival_index = self._arrivals
                self._arrivals += 1
            now = self.now()
            request = rec.request(now, pool)
            view = ClusterView(now, request, rec.arrival_index, tuple(signals))
            n = len(members)

            def illegal(what: str) -> APIError:
                self.route_errors += 1
                return APIError(
                    500,
                    f"router '{self.router_name}' {where}request {rec.id}: {what}",
                    kind="server_error",
                    code="router_error",
                )

            try:
                j = self.routers[pool].route(view)
            except Exception as exc:  # the user's router code
                raise illegal(f"route() raised {type(exc).__name__}: {exc}") from None
            if isinstance(j, bool):
                raise illegal(f"returned {j!r}, not a replica index (0 to {n - 1})")
            try:
                j = operator.index(j)
            except TypeError:
                raise illegal(f"returned {j!r}, not a replica index (0 to {n - 1})") from None
            if not 0 <= j < n:
                raise illegal(f"returned replica {j}, but the cluster has replicas 0 to {n - 1}")
            if not signals[j].up:
                raise illegal(f"returned replica {j}, which is down")
            r = members[j]
            r.routed += 1
            self._sent(r, request, 1)
            self._metrics.routed(r.index)
            return r, request

    @staticmethod
    def _sent(r: Replica, request, sign: int) -> None:
        r.sent[0] += sign
        r.sent[1] += sign * request.prompt_tokens
        r.sent[2] += sign * request.output_tokens

    async def prepare(self, raw: bytes, chat: bool) -> dict[str, Any]:
        """A replica checks the request and counts its prompt (the replicas take turns)."""
        import httpx

        path = "/prepare/chat/completions" if chat else "/prepare/completions"
        tried: set[int] = set()
        while True:
            ups = [r for r in self.replicas if r.up and r.index not in tried]
            if not ups:
                raise APIError(503, "no replica is up", kind="server_error", code="no_replica")
            r = ups[next(self._prepare_turn) % len(ups)]
            try:
                resp = await self.client().post(r.url + path, content=raw, headers={"content-type": "application/json"})
            except httpx.TransportError as exc:
                self.mark_down(r, f"a connection to it failed ({type(exc).__name__})")
                tried.add(r.index)
                continue
            if resp.status_code != 200:
                raise _upstream_error(resp.status_code, resp.content)
            return resp.json()

    # ---------------------------------------------------------------- relaying

    async def _open(self, rec: Record, body: bytes, pool: str | None = None, headers: dict | None = None):
        """Route ``rec`` (in ``pool``) and open its stream at the replica chosen: (replica, response)."""
        import httpx

        r, request = await self.route(rec, pool)
        path = "/v1/chat/completions" if rec.chat else "/v1/completions"
        client = self.client()
        req = client.build_request(
            "POST",
            r.url + path,
            content=body,
            headers={"content-type": "application/json", "x-schedlab-request-id": rec.id, **(headers or {})},
        )
        try:
            resp = await client.send(req, stream=True)
        except httpx.TransportError as exc:
            self._sent(r, request, -1)
            self.mark_down(r, f"a connection to it failed ({type(exc).__name__})")
            raise _Lost(str(exc)) from None
        if resp.status_code != 200:
            data = await resp.aread()
            await resp.aclose()
            self._sent(r, request, -1)  # (not submitted there)
            raise _upstream_error(resp.status_code, data, resp.headers.get("retry-after"))
        if pool == "decode" and rec.kv is not None:  # (the decode replica has read its KV and taken it)
            rec.kv["handoff_s"] = self.now() - rec.kv["at_s"]
            rec.kv["exposed_s"] = rec.kv["notice_s"] + rec.kv["handoff_s"]
        rec.replica = r.index
        rec.replicas.append(r.index)
        return r, resp

    async def events(self, rec: Record, body: bytes, pool: str | None = None, headers: dict | None = None):
        """The request's upstream chunks (dicts) until its replica's ``[DONE]``, with ``_RESTART``
        where it starts again on another replica. Raises ``APIError`` when it cannot be served (before anything was
        relayed), ``_Lost`` when its replica went away after its client had text."""
        import httpx

        attempts = 0
        while True:
            attempts += 1
            try:
                r, resp = await self._open(rec, body, pool, headers)
            except _Lost as exc:
                if attempts > 1:
                    raise APIError(502, f"request {rec.id}: its replicas went away ({exc})", kind="server_error")
                self._retry(rec)
                continue
            lost = None
            r.in_flight += 1
            try:
                async for item in _sse(resp):
                    if item is _DONE:
                        return
                    err = item.get("error") if isinstance(item, dict) else None
                    if isinstance(err, dict) and err.get("type") == "server_error":
                        lost = f"replica {r.index}: {err.get('message')}"  # its loop stopped
                        break
                    yield item
                    if item is not None and isinstance(err, dict):
                        return  # an error event ends the stream
                else:
                    lost = f"replica {r.index} closed the stream before its end"
            except httpx.TransportError as exc:
                lost = f"replica {r.index} went away ({type(exc).__name__})"
            finally:
                r.in_flight -= 1
                await resp.aclose()
            self.mark_down(r, lost)
            if rec.saw_tokens or attempts > 1:
                raise _Lost(lost)
            self._retry(rec)
            yield _RESTART

    async def pd_events(self, rec: Record, body: dict):
        """``events`` when prefill and decode run apart: a prefill replica makes the first token and
        writes the prompt's KV (its stream then says where: ``schedlab_kv``); a decode replica reads
        it and makes the rest. The client sees one stream: the first token's text from the first,
        the rest (and the finish, and usage counting every token) from the second. A request that
        ends at its first token (EOS, a stop string, max_tokens 1) ends at the prefill replica.
        Once its first token is out, a decode replica lost is an error, as for any replica."""
        key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        if rec.max_tokens > 1 and not any(r.up for r in self.replicas if r.pool == "decode"):
            # (not prefilled for nothing: its first token would be all it got)
            raise APIError(503, "no replica in the decode pool is up", kind="server_error", code="no_replica")
        if rec.max_tokens == 1:
            async for item in self.events(rec, json.dumps(body).encode(), "prefill"):
                yield item
            return
        first = json.dumps({**body, key: 1}).encode()
        held: list = []  # the prefill replica's finish and usage: its client's only if it ends there
        kv = None
        async for item in self.events(rec, first, "prefill", {"x-schedlab-kv-export": "1"}):
            if item is _RESTART:
                held.clear()
                yield item
            elif isinstance(item, dict) and "schedlab_kv" in item:
                kv = item["schedlab_kv"]
                kv["at_s"] = self.now()
                kv["notice_s"] = kv["at_s"] - (rec.times[0] if rec.times else kv["at_s"])
            elif held or item.get("usage") is not None or (item.get("choices") or [{}])[0].get("finish_reason"):
                held.append(item)
            else:
                yield item
        if kv is None:  # it ended at its first token
            for item in held:
                yield item
            return
        rec.kv = kv
        rec.saw_tokens = True  # (its KV was read by the decode replica it went to: no second try)
        rest = json.dumps({**body, key: rec.max_tokens - 1}).encode()
        async for item in self.events(rec, rest, "decode", {"x-schedlab-kv-import": kv["path"]}):
            usage = item.get("usage") if isinstance(item, dict) else None
            if usage is not None:  # every token, the prompt as the client sent it
                done = int(usage.get("completion_tokens") or 0) + 1
                item = {**item, "usage": {**usage, "prompt_tokens": rec.prompt_tokens, "completion_tokens": done}}
                item["usage"]["total_tokens"] = rec.prompt_tokens + done
            yield item

    def _retry(self, rec: Record) -> None:
        self.retries += 1
        rec.retried = True
        rec.times.clear()
        self._metrics.retried()

    def _fail(self, rec: Record, why: str) -> None:
        rec.failed = why
        self.failures += 1
        self._metrics.failed()

    # ---------------------------------------------------------------- the app

    def _make_app(self):
        from fastapi.responses import Response, StreamingResponse

        app, error = openai_app("schedlab serve (cluster)")
        front = self

        @app.get("/health")
        async def health():
            return front.health()

        @app.get("/v1/models")
        async def models():
            return models_body(front.model_name)

        @app.get("/metrics")
        async def metrics():
            ups = [r for r in front.replicas if r.up]
            await asyncio.gather(*(front._state(r) for r in ups))
            body, kind = front._metrics.render(front.replicas)
            return Response(body, media_type=kind)

        async def handle(http: HTTPRequest, chat: bool):
            if front.closing:
                return error(APIError(503, "the server is shutting down", kind="server_error"))
            arrival = front.now()
            ticket = front.ticket()
            front.in_flight += 1
            streaming = False
            try:
                raw = await http.body()
                info = await front.prepare(raw, chat)
                body = json.loads(raw)
                rec = Record(
                    front.claim_id(chat, http.headers.get("x-schedlab-request-id")),
                    chat,
                    bool(info["stream"]),
                    bool(info["include_usage"]),
                    arrival,
                    int(info["prompt_tokens"]),
                    int(info["max_tokens"]),
                    info.get("prompt"),
                    None
                    if info.get("messages") is None
                    else tuple((m["role"], m["content"]) for m in info["messages"]),
                )
                rec.ticket = ticket
                body["stream"] = True  # the front always streams from a replica: it sees each token come
                body["stream_options"] = {"include_usage": True}
                body["max_tokens" if "max_completion_tokens" not in body else "max_completion_tokens"] = rec.max_tokens
                up = json.dumps(body).encode()
                front.records.append(rec)
                agen = front.pd_events(rec, body) if front.pools else front.events(rec, up)
                created = int(time.time())
                if rec.stream:
                    try:
                        first = await agen.__anext__()  # routed and open (or an error with its status)
                    except APIError as e:
                        front._fail(rec, e.message)
                        return error(e)
                    except _Lost as exc:
                        front._fail(rec, str(exc))
                        return error(
                            APIError(502, f"request {rec.id}: its replicas went away ({exc})", kind="server_error")
                        )
                    streaming = True
                    return StreamingResponse(front._relay(rec, agen, first, created), media_type="text/event-stream")
                return await front._whole(rec, agen, created, http)
            except APIError as e:
                return error(e)
            finally:
                front.pass_turn(ticket)  # (routed by now, or never to be)
                if not streaming:
                    front.in_flight -= 1

        @app.post("/v1/completions")
        async def completions(http: HTTPRequest):
            return await handle(http, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(http: HTTPRequest):
            return await handle(http, chat=True)

        return app

    def claim_id(self, chat: bool, given: str | None) -> str:
        """The request's id: the client's (header ``X-Schedlab-Request-Id``: run-real sends its
        trace's ids) when fresh, else the next of ours."""
        if given and len(given) <= 200 and given not in self._used:
            rid = given
        else:
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{next(self._ids)}"
            while rid in self._used:
                rid = f"{'chatcmpl' if chat else 'cmpl'}-{next(self._ids)}"
        self._used.add(rid)
        return rid

    def health(self) -> dict[str, Any]:
        reps = []
        for r in self.replicas:
            d = r.describe()
            d["requests"] = sum(1 for rec in self.records if rec.replica == r.index)
            reps.append(d)
        return {
            "status": "shutting down" if self.closing else "ok",
            "router": self.router_name,
            "in_flight": self.in_flight,
            "requests": len(self.records),
            "retries": self.retries,
            "failures": self.failures,
            "replicas": reps,
        }

    def _take(self, rec: Record, item: dict) -> tuple[str | None, bool]:
        """Note a chunk's text, finish and usage on ``rec``: (its text, whether it is the usage chunk)."""
        if item.get("usage") is not None:
            rec.completion_tokens = item["usage"].get("completion_tokens")
        choices = item.get("choices") or []
        if not choices:
            return None, True
        c = choices[0]
        text = c.get("text") if not rec.chat else (c.get("delta") or {}).get("content")
        if text:
            rec.times.append(self.now())
        if c.get("finish_reason") is not None:
            rec.finish = self.now()
            rec.finish_reason = c["finish_reason"]
        return text, False

    async def _relay(self, rec: Record, agen, first, created: int):
        """A streaming client's events: the replica's chunks as they come (a role chunk once, the
        usage chunk only if asked for); a retry is invisible; a failure after text is an error event."""
        role_sent = False
        item = first
        try:
            while True:
                if item is _RESTART:
                    pass
                elif isinstance(item, dict) and "error" in item:
                    self._fail(rec, str((item.get("error") or {}).get("message")))
                    yield f"data: {json.dumps(item)}\n\n"
                    break
                else:
                    text, usage = self._take(rec, item)
                    if usage:
                        if rec.include_usage:
                            yield f"data: {json.dumps(item, ensure_ascii=False)}\n\n"
                    elif rec.chat and not text and "role" in ((item.get("choices") or [{}])[0].get("delta") or {}):
                        if not role_sent:
                            role_sent = True
                            yield f"data: {json.dumps(item, ensure_ascii=False)}\n\n"
                    else:
                        if text:
                            rec.saw_tokens = True
                        yield f"data: {json.dumps(item, ensure_ascii=False)}\n\n"
                try:
                    item = await agen.__anext__()
                except StopAsyncIteration:
                    break
            yield "data: [DONE]\n\n"
        except (_Lost, APIError) as exc:
            why = exc.message if isinstance(exc, APIError) else str(exc)
            self._fail(rec, why)
            if isinstance(exc, APIError):  # (nothing of the answer was sent: routing it again failed)
                e = exc
            else:
                e = APIError(
                    502,
                    f"request {rec.id}: its replica went away after sending part of the answer ({why}); not "
                    f"retried, as the text sent would come again",
                    kind="server_error",
                    code="replica_lost",
                )
            yield f"data: {json.dumps(e.body())}\n\n"
            yield "data: [DONE]\n\n"
        except BaseException:  # the client went away (cancelled): the replica is told by the closed stream
            if rec.finish is None and rec.failed is None:
                rec.cancelled = True
            raise
        finally:
            self.in_flight -= 1
            await _closed(agen)

    async def _whole(self, rec: Record, agen, created: int, http=None):
        from fastapi.responses import JSONResponse, Response

        parts: list[str] = []
        logprobs: list[dict] = []  # the chunks' logprobs, for a request that asked for them
        try:
            async for item in agen:
                if http is not None and await http.is_disconnected():  # its client went away: end it
                    rec.cancelled = True
                    return Response(status_code=499)
                if item is _RESTART:
                    parts.clear()
                    logprobs.clear()
                    continue
                if "error" in item:
                    err = item.get("error") or {}
                    self._fail(rec, str(err.get("message")))
                    status = 400 if err.get("type") == "invalid_request_error" else 500
                    return JSONResponse(item, status_code=status)
                text, _ = self._take(rec, item)
                if text:
                    parts.append(text)
                lp = ((item.get("choices") or [{}])[0] or {}).get("logprobs")
                if lp:
                    logprobs.append(lp)
        except APIError as e:
            self._fail(rec, e.message)
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
        except _Lost as exc:  # (a retried request whose second replica went away too)
            self._fail(rec, str(exc))
            e = APIError(502, f"request {rec.id}: its replicas went away ({exc})", kind="server_error")
            return JSONResponse(e.body(), status_code=e.status)
        except BaseException:
            if rec.finish is None and rec.failed is None:
                rec.cancelled = True
            raise
        finally:
            await _closed(agen)
        text = "".join(parts)
        choice: dict[str, Any] = {"index": 0, "finish_reason": rec.finish_reason, "logprobs": None}
        if logprobs and rec.chat:
            choice["logprobs"] = {"content": [e for lp in logprobs for e in lp.get("content") or []], "refusal": None}
        elif logprobs:  # (completions: OpenAI's legacy format, four lists)
            choice["logprobs"] = {k: [v for lp in logprobs for v in lp.get(k) or []] for k in logprobs[0]}
        if rec.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        n = rec.completion_tokens if rec.completion_tokens is not None else len(rec.times)
        return JSONResponse(
            {
                "id": rec.id,
                "object": "chat.completion" if rec.chat else "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [choice],
                "usage": {
                    "prompt_tokens": rec.prompt_tokens,
                    "completion_tokens": n,
                    "total_tokens": rec.prompt_tokens + n,
                },
            }
        )

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()


async def _closed(agen) -> None:
    """Close a request's upstream stream even while its handler is being cancelled (a client that
    went away: the replica sees its connection close and cancels the request at its next step)."""
    import anyio

    with anyio.CancelScope(shield=True):
        await agen.aclose()


async def _sse(resp):
    """The ``data:`` payloads of a server-sent event stream: dicts, then ``_DONE``."""
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            yield _DONE
            return
        try:
            yield json.loads(data)
        except ValueError:
            continue


def _upstream_error(status: int, content: bytes, retry_after: str | None = None) -> APIError:
    """A replica's error response, as the front's own (a 429's Retry-After with it)."""
    try:
        err = json.loads(content)["error"]
        return APIError(
            status,
            str(err.get("message")),
            err.get("param"),
            err.get("code"),
            err.get("type") or "server_error",
            headers={"Retry-After": retry_after} if retry_after is not None else None,
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        return APIError(status, f"a replica answered {status}", kind="server_error")


class _Metrics:
    """/metrics: Prometheus text (``prometheus_client``), per replica, with vLLM's names where
    vLLM has one."""

    def __init__(self, model_name: str, n: int):
        import prometheus_client
        from prometheus_client import CollectorRegistry, Counter, Gauge

        prometheus_client.disable_created_metrics()  # (the front's process only: no *_created series)
        self.registry = reg = CollectorRegistry()
        labels = ["model_name", "replica"]
        self.model_name = model_name
        self.running = Gauge("vllm:num_requests_running", "Requests running on the replica", labels, registry=reg)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting on the replica", labels, registry=reg)
        self.kv = Gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full)", labels, registry=reg)
        self.up = Gauge("schedlab:replica_up", "1 when the replica takes requests", labels, registry=reg)
        self.routed_c = Counter(
            "schedlab:requests_routed", "Routing decisions naming the replica", labels, registry=reg
        )
        self.retries = Counter("schedlab:request_retries", "Requests started again on another replica", registry=reg)
        self.failures = Counter("schedlab:request_failures", "Requests ended with an error", registry=reg)
        for i in range(n):
            self.routed_c.labels(model_name, str(i))

    def routed(self, i: int) -> None:
        self.routed_c.labels(self.model_name, str(i)).inc()

    def retried(self) -> None:
        self.retries.inc()

    def failed(self) -> None:
        self.failures.inc()

    def render(self, replicas: list[Replica]) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        for r in replicas:
            labels = (self.model_name, str(r.index))
            st = r.last_state if r.up else None
            self.up.labels(*labels).set(1 if r.up else 0)
            self.running.labels(*labels).set(st["running"] if st else 0)
            self.waiting.labels(*labels).set(st["waiting"] if st else 0)
            cap = st["kv_capacity"] if st else 0
            self.kv.labels(*labels).set(st.get("kv_usage", st["kv_used"] / cap if cap else 0) if st else 0)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


# ---------------------------------------------------------------------------- the command


def replica_command() -> list[str]:
    """The argv that runs ``schedlab serve`` in this environment."""
    return [
        sys.executable,
        "-c",
        "import sys; from schedlab.cli import main; sys.argv[0] = 'schedlab'; main()",
        "serve",
    ]


class Cluster:
    """N replica processes and the front: ``start`` (every replica listening, then the front),
    ``watch`` (the replicas' processes, once), ``shutdown`` (no new requests; the replicas finish
    theirs and exit), ``finish`` (the files and the summary)."""

    def __init__(
        self,
        n: int,
        router,
        router_options: dict,
        replica_args: list[str],
        *,
        host: str,
        port: int,
        out: Path | None,
        policy_name: str,
        served_name: str | None,
        log,
        prog: str = "serve",
        pools: tuple[int, int] | None = None,
        decode_router=None,
    ):
        shares = cpu_shares(n)
        self.replicas = []
        self.kv_dir = None  # prefill and decode apart: where the prefill replicas write the KV they hand on
        if pools is not None:
            from schedlab.engine import kvfile

            self.kv_dir = kvfile.shared_dir()
        for i in range(n):
            argv = [*replica_command(), *replica_args, "--host", "127.0.0.1", "--port", "0", "-q"]
            if out is not None:
                argv += ["--out", str(Path(out) / f"replica-{i}")]
            pool = None if pools is None else "prefill" if i < pools[0] else "decode"
            if pool == "prefill":
                argv += ["--kv-dir", str(self.kv_dir)]
            self.replicas.append(Replica(i, argv, shares[i], pool))
        self.decode_router = decode_router
        self.link: dict[str, Any] | None = None  # prefill and decode apart: probe_link's measure
        self.router, self.router_options = router, router_options
        self.host, self.port, self.out = host, port, out
        self.policy_name, self.served_name = policy_name, served_name
        self.log, self.prog = log, prog
        self.front: Front | None = None
        self.url: str | None = None
        self._http: dict[str, Any] = {}
        self._last_probe = time.monotonic()

    def _echo(self, i: int, line: str) -> None:
        text = re.sub(r"^(schedlab )?serve: ", "", line)
        print(f"{self.prog}: replica {i}: {text}", file=sys.stderr, flush=True)

    def start(self, sequential: bool = False) -> str:
        """Start the replicas (``sequential``: each once the one before listens) and the front;
        the front's URL."""
        import uvicorn

        replicas = self.replicas
        t_start = time.perf_counter()
        for r in replicas:
            r.start(self._echo)
            if sequential:  # (the first replica calibrates, the others find its profile)
                _wait_listening([r], replicas)
        _wait_listening(replicas, replicas)
        for r in replicas:
            r.up = True
        if self.kv_dir is not None:
            self.link = probe_link(self.kv_dir, next(r.url for r in replicas if r.pool == "decode"))
        model_name = self.served_name or _model_name(replicas[0])
        front = Front(
            replicas, self.router, self.router_options, model_name, self.policy_name, self.log, self.decode_router
        )
        config = server_config(front.app, self.host, self.port)
        hs = uvicorn.Server(config)
        t = threading.Thread(target=hs.run, name="schedlab-front", daemon=True)
        t.start()
        while not hs.started and t.is_alive():
            time.sleep(0.01)
        self._http.update(server=hs, thread=t)
        where = listening(hs) if hs.started else None
        if where is None:
            raise SchedlabError(
                f"cannot listen on {self.host}:{self.port} (in use, or not an address of this machine?)"
            )
        self.front = front
        self.url = f"http://{where[0]}:{where[1]}"
        self.log(
            "progress",
            f"{len(replicas)} replicas up in {time.perf_counter() - t_start:.1f} s: "
            + ", ".join(
                f"{r.index}{f' {r.pool}' if r.pool else ''} {r.url} (pid {r.pid}, cpus {_cpus(r.cpus)})"
                for r in replicas
            ),
        )
        return self.url

    def watch(self) -> None:
        """Look at the replicas once: a process that ended is down; one down after a connection
        error whose process lives is tried again (every ``PROBE_S``)."""
        _watch(self.front, self.replicas)
        if time.monotonic() - self._last_probe >= PROBE_S:
            self._last_probe = time.monotonic()
            _probe(self.front, self.replicas)

    def shutdown(self, aborting=lambda: False) -> None:
        """No new requests (503); the replicas get SIGTERM, finish what they hold and exit; until
        they have and the front's requests in flight ended. ``aborting()`` true: SIGTERM again
        (the replicas abort), then KeyboardInterrupt."""
        front = self.front
        front.closing = True
        self.log("progress", f"shutting down: finishing {front.in_flight} request(s) in flight")
        for r in self.replicas:
            r.signal(signal.SIGTERM)
        gone_at = None
        while True:
            _watch(front, self.replicas)
            if aborting():
                for r in self.replicas:
                    r.signal(signal.SIGTERM)  # a second signal: the replicas abort
                raise KeyboardInterrupt
            if all(r.dead for r in self.replicas):
                gone_at = gone_at or time.monotonic()
                # what is left in flight ends as the replicas' connections close (bounded: a response
                # whose client went away before it began never says it ended)
                if front.in_flight <= 0 or time.monotonic() - gone_at > 5:
                    break
            time.sleep(POLL_S)

    def close(self) -> None:
        """Stop the front's server and every replica left (SIGTERM, then SIGKILL after 30 s)."""
        hs = self._http.get("server")
        if hs is not None:
            hs.should_exit = True
            self._http["thread"].join(timeout=10)
        for r in self.replicas:
            r.signal(signal.SIGTERM)
        _reap(self.replicas, 30)
        if self.kv_dir is not None:
            import shutil

            shutil.rmtree(self.kv_dir, ignore_errors=True)

    def finish(self, quiet: bool) -> dict[str, Any]:
        """Write ``OUT/trace.json`` and ``OUT/cluster.json``; print the summary; the summary."""
        front = self.front
        summary = cluster_summary(front)
        if self.out is not None:
            out = Path(self.out)
            out.mkdir(parents=True, exist_ok=True)
            write_served_trace(out / "trace.json", front)
            data = cluster_json(front, summary)
            if self.link is not None:
                data["link"] = self.link
            (out / "cluster.json").write_text(json.dumps(data, indent=1) + "\n")
        if not quiet:
            from schedlab.sim.metrics import format_summary

            print(format_summary(summary))
            print(
                f"Cluster: {front.retries} request(s) retried on another replica, {front.failures} failed; "
                + ", ".join(f"replica {r.index}: {_ended(r)}" for r in self.replicas)
            )
        return summary


def serve_cluster(
    n: int,
    router,
    router_options: dict,
    replica_args: list[str],
    *,
    host: str,
    port: int,
    out: Path | None,
    policy_name: str,
    served_name: str | None,
    quiet: bool,
    sequential: bool,
    log,
    pools: tuple[int, int] | None = None,
    decode_router=None,
) -> None:
    """``serve --replicas N``: run the cluster until SIGINT/SIGTERM; print its summary. ``pools``:
    (P, D), ``serve --prefill P --decode D``: the first P replicas prefill, the other D decode
    (``decode_router`` routes among those)."""
    cluster = Cluster(
        n,
        router,
        router_options,
        replica_args,
        host=host,
        port=port,
        out=out,
        policy_name=policy_name,
        served_name=served_name,
        log=log,
        pools=pools,
        decode_router=decode_router,
    )
    state = {"signals": 0, "serving": False}

    def on_signal(signum, frame) -> None:
        state["signals"] += 1
        if not state["serving"]:
            raise KeyboardInterrupt  # still starting: stop now

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        url = cluster.start(sequential)
        state["serving"] = True
        front = cluster.front
        what = f"{pools[0]} prefill + {pools[1]} decode replicas" if pools else f"{n} replicas"
        print(
            f"serve: listening on {url} ({what}, router {front.router_name}, "
            f"policy {policy_name}, model {front.model_name})",
            file=sys.stderr,
            flush=True,
        )
        while state["signals"] == 0:
            time.sleep(POLL_S)
            cluster.watch()
        cluster.shutdown(lambda: state["signals"] > 1)
    except KeyboardInterrupt:
        cluster.close()
        from ._app import Interrupted

        raise Interrupted("the replicas were stopped") from None
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        cluster.close()
    cluster.finish(quiet)


def run_real_cluster(
    trace,
    n: int,
    router,
    router_options: dict,
    replica_args: list[str],
    *,
    out: Path | None,
    policy_name: str,
    ignore_eos: bool,
    quiet: bool,
    sequential: bool,
    log,
    pools: tuple[int, int] | None = None,
    decode_router=None,
) -> list[str]:
    """``run-real --replicas N``: the cluster of ``serve --replicas N`` on 127.0.0.1, fed ``trace``
    at its arrival times by an HTTP client (each request's text, ``max_tokens`` its output tokens,
    the trace's ids), then shut down; its summary printed, ``OUT`` as ``serve --replicas`` writes
    it. The requests that failed, one line each."""
    uncounted = [r.id for r in trace.requests if not r.has_text]
    if uncounted:
        raise SchedlabError(
            f"run-real --replicas sends each request's text to the replicas over HTTP, but trace {trace.name} has "
            f"{len(uncounted)} request(s) with token counts only (e.g. {uncounted[0]}): use a trace with text "
            f"(sonnet, or a trace.json that serve wrote)"
        )
    cluster = Cluster(
        n,
        router,
        router_options,
        replica_args,
        host="127.0.0.1",
        port=0,
        out=out,
        policy_name=policy_name,
        served_name=None,
        log=log,
        prog="run-real",
        pools=pools,
        decode_router=decode_router,
    )
    errors: dict[str, str] = {}
    # SIGTERM (timeout, a job scheduler, a container stop) ends the run as Ctrl-C does: every
    # replica it started, at once, calibrating or not
    old = {}
    if threading.current_thread() is threading.main_thread():
        old = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        url = cluster.start(sequential)
        cluster.front.trace_name = trace.name
        replay = threading.Thread(
            target=lambda: errors.update(asyncio.run(_replay(url, cluster.front.model_name, trace, ignore_eos))),
            name="run-real-client",
            daemon=True,
        )
        replay.start()
        while replay.is_alive():
            time.sleep(POLL_S)
            cluster.watch()
        cluster.shutdown()
    except KeyboardInterrupt:
        for r in cluster.replicas:
            r.kill()
        cluster.close()
        from ._app import Interrupted

        raise Interrupted("the replicas were stopped") from None
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        cluster.close()
    cluster.finish(quiet)
    return [f"request {rid}: {why}" for rid, why in errors.items()]


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


async def _replay(url: str, model: str, trace, ignore_eos: bool) -> dict[str, str]:
    """Send every request of ``trace`` at its arrival time (from the first); the errors by id."""
    import httpx

    errors: dict[str, str] = {}
    reqs = list(trace.requests)
    first = reqs[0].arrival_s if reqs else 0.0
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), limits=limits) as client:
        t0 = time.perf_counter()

        async def one(r) -> None:
            delay = (r.arrival_s - first) - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            body: dict[str, Any] = {"model": model, "max_tokens": r.output_tokens}
            if r.messages is not None:
                path, body["messages"] = "/v1/chat/completions", r.chat()
            else:
                path, body["prompt"] = "/v1/completions", r.prompt
            if ignore_eos:
                body["ignore_eos"] = True
            try:
                resp = await client.post(url + path, json=body, headers={"x-schedlab-request-id": r.id})
            except httpx.HTTPError as exc:
                errors[r.id] = f"{type(exc).__name__}: {exc}"
                return
            if resp.status_code != 200:
                try:
                    errors[r.id] = str(resp.json()["error"]["message"])
                except (ValueError, KeyError, TypeError):
                    errors[r.id] = f"HTTP {resp.status_code}"

        await asyncio.gather(*(one(r) for r in reqs))
    return errors


PROBE_BYTES = 32 << 20  # the KV file the link probe writes and reads


def probe_link(kv_dir: Path, url: str, rounds: int = 5) -> dict[str, Any]:
    """What moving a request's KV from a prefill replica to a decode replica costs on this machine,
    measured before serving (``cluster.json``'s ``link``: what ``validate --served`` simulates the
    transfer with): ``bandwidth_gbs``, of writing a KV file in the shared folder and reading it
    back (``engine.kvfile``, the replicas' own code; median of ``rounds``), and ``latency_s``, two
    HTTP round trips to the decode replica (the front asks it for its state to route, then hands
    the request over)."""
    import httpx
    import numpy as np

    from schedlab.engine import kvfile

    kv = np.ones((32, 2, 8, PROBE_BYTES // (32 * 2 * 8 * 64 * 4), 64), dtype=np.float32)  # (64 tokens of a 7B's)
    path = kv_dir / "probe.kv"
    times, rtts = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        kvfile.write(path, [0] * (kv.shape[3] + 1), [(layer[0], layer[1]) for layer in kv], "float32")
        kvfile.read(path)
        times.append(time.perf_counter() - t0)
        path.unlink()
    with httpx.Client(timeout=10) as client:
        client.get(url + "/state")  # (the connection opened)
        for _ in range(4 * rounds):
            t0 = time.perf_counter()
            client.get(url + "/state")
            rtts.append(time.perf_counter() - t0)
    return {
        "bandwidth_gbs": kv.nbytes / statistics.median(times) / 1e9,
        "latency_s": 2 * statistics.median(rtts),
        "measured": f"a {kv.nbytes >> 20} MiB KV file written and read in {kv_dir.parent} (median of {rounds}); "
        f"two HTTP round trips to the decode replica (median of {4 * rounds})",
    }


def _cpus(cpus: list[int]) -> str:
    return ",".join(map(str, cpus))


def _ended(r: Replica) -> str:
    s = r.exit_status
    if s is None:
        return "running"
    if s < 0:
        return f"killed by signal {-s}" + (f" at {r.down_s:.2f} s" if r.down_s is not None else "")
    return f"exit status {s}"


def _wait_listening(wait: list[Replica], every: list[Replica]) -> None:
    """Until every replica of ``wait`` listens; one that exits first stops them all (one line)."""
    while True:
        if all(r.listening.is_set() for r in wait):
            return
        for r in wait:
            if not r.listening.is_set() and r.proc.poll() is not None:
                why = r.last_line()
                for other in every:
                    other.signal(signal.SIGTERM)
                _reap(every, 10)
                raise SchedlabError(f"replica {r.index} did not start: {why}")
        time.sleep(POLL_S)


def _reap(replicas: list[Replica], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for r in replicas:
        if r.proc is None:
            continue
        try:
            r.exit_status = r.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.exit_status = r.proc.wait()
        r.dead = True
        if r._reader is not None:
            r._reader.join(timeout=2)


def _watch(front: Front, replicas: list[Replica]) -> None:
    for r in replicas:
        if not r.dead and r.proc.poll() is not None:
            r.dead = True
            r.exit_status = r.proc.returncode
            front.mark_down(r, f"its process ended ({_ended(r)})")


def _probe(front: Front, replicas: list[Replica]) -> None:
    """A replica down after a connection error whose process lives: up again once it answers."""
    import httpx

    for r in replicas:
        if r.up or r.dead or front.closing:
            continue
        try:
            ok = httpx.get(r.url + "/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok and not r.dead:
            r.up = True
            front.log("warning", f"replica {r.index} (pid {r.pid}) answers again: up")


def _model_name(r: Replica) -> str:
    import httpx

    try:
        return httpx.get(r.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        raise SchedlabError(f"replica {r.index} at {r.url} does not say which model it serves") from None


# ---------------------------------------------------------------------------- what it writes


def _served_by(rec: Record, r: Replica) -> bool:
    """Whether replica ``r`` served ``rec`` (the last replica it went to; a prefill replica, the one
    that made its first token)."""
    if r.pool == "prefill":
        return len(rec.replicas) > (rec.kv is not None) and rec.replicas[-2 if rec.kv is not None else -1] == r.index
    return rec.replica == r.index


def _finished(rec: Record) -> bool:
    return rec.finish is not None and rec.failed is None


def cluster_summary(front: Front) -> dict[str, Any]:
    """The summary (``vllm bench serve``'s metrics) as the front measured them: a request's
    arrival at the front, each piece of its text as it came from its replica, its end."""
    import numpy as np

    from schedlab.sim.metrics import dist

    def part(records: list[Record], start: float | None = None) -> dict[str, Any]:
        done = [r for r in records if _finished(r)]
        ttft, tpot, e2e, itl, rates = [], [], [], [], []
        for r in done:
            n = r.completion_tokens if r.completion_tokens is not None else len(r.times)
            first = r.times[0] if r.times else r.finish
            ttft.append((first - r.arrival) * 1e3)
            e2e.append((r.finish - r.arrival) * 1e3)
            if n > 1 and r.finish > first:
                tpot.append((r.finish - first) / (n - 1) * 1e3)
                rates.append((n - 1) / (r.finish - first))
            itl.extend((np.diff(r.times) * 1e3).tolist())
        arrivals = [r.arrival for r in records]
        t0 = start if start is not None else (min(arrivals) if arrivals else 0.0)
        end = max((r.finish for r in done), default=t0)
        makespan = end - t0
        out_tokens = sum(r.completion_tokens or len(r.times) for r in done)
        return {
            "requests": len(records),
            "finished": len(done),
            "rejected": 0,
            "makespan_s": makespan,
            "total_input_tokens": sum(r.prompt_tokens for r in done),
            "total_output_tokens": out_tokens,
            "output_throughput_tok_s": out_tokens / makespan if makespan > 0 else None,
            "request_throughput_rps": len(done) / makespan if makespan > 0 else None,
            "ttft_ms": dist(ttft),
            "tpot_ms": dist(tpot),
            "itl_ms": dist(itl),
            "e2e_ms": dist(e2e),
            "decode_rate_tok_s": {
                "min": float(min(rates)) if rates else None,
                "p50": float(np.percentile(rates, 50)) if rates else None,
                "max": float(max(rates)) if rates else None,
            },
        }

    records = [r for r in front.records if r.replica is not None]
    start = min((r.arrival for r in records), default=0.0)
    failures = [  # as the simulator's summary lists a --fail
        {
            "replica": r.index,
            "at_s": r.down_s - start,
            "retried": sum(1 for x in records if r.index in x.replicas[:-1]),
            "refused": sum(1 for x in records if x.failed and x.replica == r.index),
        }
        for r in front.replicas
        if r.failed and r.down_s is not None
    ]
    summary = {
        "policy": front.policy,
        "mode": "real",
        "trace": front.trace_name,
        **part(records),
        "steps": 0,
        "measured_at": "the front (arrival, each piece of text relayed, end)",
        "cluster": {
            "replicas": len(front.replicas),
            "router": front.router_name,
            "router_options": front.router_options,
            "retries": front.retries,
            "failed_requests": front.failures,
            **({"failures": failures} if failures else {}),
        },
        "replicas": [
            {
                "replica": r.index,
                **({"pool": r.pool} if r.pool else {}),
                **part([x for x in records if _served_by(x, r)], start),
            }
            for r in front.replicas
        ],
    }
    failed = sum(1 for r in records if r.failed)
    if failed:
        summary["failed"] = failed
    return summary


def cluster_json(front: Front, summary: dict[str, Any]) -> dict[str, Any]:
    recs = [r for r in front.records if r.replica is not None]
    return {
        "replicas": len(front.replicas),
        "router": front.router_name,
        "router_options": front.router_options,
        "policy": front.policy,
        "model": front.model_name,
        "requests": len(recs),
        "finished": sum(1 for r in recs if _finished(r)),
        "retries": front.retries,
        "failures": front.failures,
        "router_errors": front.route_errors,
        "per_replica": [
            {
                "index": r.index,
                "pid": r.pid,
                "url": r.url,
                "cpus": r.cpus,
                **({"pool": r.pool} if r.pool else {}),
                "requests": sum(1 for x in recs if _served_by(x, r)),
                "routed": r.routed,
                "failed_requests": sum(1 for x in recs if x.replica == r.index and x.failed),
                "exit_status": r.exit_status,
                "failed": r.failed,
                "down_s": r.down_s,
                "down_reason": r.down_reason,
                "run_dir": f"replica-{r.index}",
            }
            for r in front.replicas
        ],
        "summary": summary,
    }


def write_served_trace(path: Path, front: Front) -> None:
    """trace.json: the requests as they arrived at the front (times from the first arrival), as
    single-replica serve writes it, plus each request's ``replica`` (the last it was sent to),
    ``retried`` when it was sent to a second one and ``failed`` (why) when it ended in an error.
    A finished request's output_tokens are the tokens it generated; any other keeps its max_tokens."""
    from schedlab.traces.schema import Trace

    recs = [r for r in front.records if r.replica is not None]
    t0 = min((r.arrival for r in recs), default=0.0)
    reqs = []
    extra: dict[str, dict[str, Any]] = {}
    for r in recs:
        made = r.completion_tokens if _finished(r) and r.completion_tokens else r.max_tokens
        if r.cancelled and r.times:
            made = len(r.times)  # (about: the pieces of text its client had before it went away)
        req = r.request(round(r.arrival - t0, 6))
        from dataclasses import replace

        reqs.append(replace(req, output_tokens=int(made)))
        e: dict[str, Any] = {"replica": r.replica}
        if r.retried:
            e["retried"] = True
            e["replicas"] = list(r.replicas)
        if r.failed:
            e["failed"] = r.failed
        if r.cancelled:
            e["cancelled"] = True
        if r.kv is not None:  # prefill and decode apart: its two replicas, the KV handed between them
            e["replicas"] = list(r.replicas)
            e["kv"] = {
                k: r.kv[k] for k in ("tokens", "bytes", "export_s", "notice_s", "handoff_s", "exposed_s") if k in r.kv
            }
        extra[r.id] = e
    trace = Trace(
        name="served",
        description=f"requests served by schedlab serve --replicas {len(front.replicas)} (router {front.router_name}, "
        f"policy {front.policy}, model {front.model_name}); arrival_s at the front from the first arrival; "
        f"output_tokens: the tokens each generated; replica: the replica that served it",
        requests=reqs,
    )
    data = trace.to_json()
    data["requests"] = [{**row, **extra[row["id"]]} for row in data["requests"]]
    path.write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n")
