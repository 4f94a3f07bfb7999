"""The cluster's front: the OpenAI API over the replicas (``Front``). Per request: a replica
checks and counts it (``/prepare``), the front reads every up replica's ``/state``, shows the
router a ``ClusterView`` and forwards the request to the replica it names, always streamed,
relaying the stream to a streaming client or gathering it into one answer; a request that lost
its replica before its client saw text is routed again, once. ``Record``: one request as the
front saw it."""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request as HTTPRequest  # (module level: FastAPI resolves handler annotations here)

from .http import APIError, models_body, openai_app
from .metrics import FrontMetrics
from .replicas import Replica

_DONE = object()  # the end of an upstream stream ([DONE])
_RESTART = object()  # the request starts again on another replica (nothing reached its client)


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
    prompt_tokens_details: dict | None = None  # its usage's (cached_tokens: a replica with --prefix-caching)
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
        # replicas at URLs may serve other fronts too: this front's ids carry a tag of its own
        # (``chatcmpl-<tag>-N``), or two fronts' chatcmpl-0 would meet at one replica
        self._id_tag = "" if all(r.owned for r in replicas) else secrets.token_hex(4) + "-"
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
        self._metrics = FrontMetrics(model_name, len(replicas))
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
                self.log("warning", f"replica {r.index} ({r.where}) is down: {why}")

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

    async def _replica_metrics(self, r: Replica) -> str | None:
        """Replica ``r``'s own /metrics text (None where it gives none: the front's gauges still say
        what its /state does)."""
        import httpx

        try:
            resp = await self.client().get(r.url + "/metrics", timeout=5.0)
            resp.raise_for_status()
        except httpx.HTTPError:
            return None
        return resp.text

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
        from schedlab.routers import ClusterView, ReplicaSignals, RouteError, route_checked

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
            try:
                j = route_checked(self.routers[pool], view, where)
            except RouteError as exc:  # the user's router code: that request's 500, the others go on
                self.route_errors += 1
                raise APIError(500, str(exc), kind="server_error", code="router_error") from None
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
        # the prompt's cached tokens are the prefill replica's to say (the decode replica was given its KV)
        cached = next((h["usage"].get("prompt_tokens_details") for h in held if h.get("usage") is not None), None)
        rest = json.dumps({**body, key: rec.max_tokens - 1}).encode()
        async for item in self.events(rec, rest, "decode", {"x-schedlab-kv-import": kv["path"]}):
            usage = item.get("usage") if isinstance(item, dict) else None
            if usage is not None:  # every token, the prompt as the client sent it
                done = int(usage.get("completion_tokens") or 0) + 1
                usage = {**usage, "prompt_tokens": rec.prompt_tokens, "completion_tokens": done}
                usage["total_tokens"] = rec.prompt_tokens + done
                usage.pop("prompt_tokens_details", None)
                if cached is not None:
                    usage["prompt_tokens_details"] = cached
                item = {**item, "usage": usage}
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
        async def health():  # (503 once shutting down: a load balancer sends it nothing more)
            from fastapi.responses import JSONResponse

            return JSONResponse(front.health(), status_code=503 if front.closing else 200)

        @app.get("/v1/models")
        async def models():
            return models_body(front.model_name)

        @app.get("/metrics")
        async def metrics():
            ups = [r for r in front.replicas if r.up]
            texts = await asyncio.gather(*(front._state(r) for r in ups), *(front._replica_metrics(r) for r in ups))
            own = {r.index: t for r, t in zip(ups, texts[len(ups) :]) if t is not None}
            body, kind = front._metrics.render(front.replicas, own)
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
            kind = f"{'chatcmpl' if chat else 'cmpl'}-{self._id_tag}"
            rid = f"{kind}{next(self._ids)}"
            while rid in self._used:
                rid = f"{kind}{next(self._ids)}"
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
            rec.prompt_tokens_details = item["usage"].get("prompt_tokens_details")
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
        usage: dict[str, Any] = {"prompt_tokens": rec.prompt_tokens, "completion_tokens": n}
        usage["total_tokens"] = rec.prompt_tokens + n
        if rec.prompt_tokens_details is not None:  # (as the replica's own whole answer has it)
            usage["prompt_tokens_details"] = rec.prompt_tokens_details
        return JSONResponse(
            {
                "id": rec.id,
                "object": "chat.completion" if rec.chat else "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [choice],
                "usage": usage,
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
