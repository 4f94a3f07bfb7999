"""One replica's OpenAI-compatible FastAPI app (``Server``): its handlers turn requests into
``traces.Request`` objects, submit them to the replica's live arrival source and read their
tokens back from the ``Bridge``; a cluster's front reads ``GET /state`` and asks
``POST /prepare/...``; a prefill replica hands a request's KV to a decode replica through a file."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from typing import Any

from fastapi import Request as HTTPRequest  # (module level: FastAPI resolves handler annotations here)

from .bridge import Bridge, TextDelta, TokenLogprobs, _Stream, _unlink, kv_refusal
from .http import DEFAULT_MAX_TOKENS, APIError, models_body, openai_app
from .metrics import Metrics
from .params import Params


LONG_PROMPT_CHARS = 1 << 16  # a prompt this long is tokenized off the event loop (Server.counted)


async def _json(http: HTTPRequest) -> Any:
    try:
        return await http.json()
    except (ValueError, UnicodeDecodeError):
        raise APIError(400, "the request body is not valid JSON") from None


class Server:
    """The HTTP side: a FastAPI app whose handlers submit to ``source`` and read ``bridge``;
    ``max_waiting``: a request arriving while that many wait to be admitted gets a 429."""

    def __init__(
        self,
        info,
        source,
        bridge: Bridge,
        model_name: str,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        max_waiting: int | None = None,
        kv_dir=None,
        policy: str | None = None,
    ):
        self.info = info
        self.policy = policy  # its name, on /info (a front routing to it by URL reports it)
        self.kv_dir = kv_dir  # where this replica writes the KV it hands to a decode replica (serve --kv-dir)
        self._kv_files = itertools.count()
        self.tokenizer = info.tokenizer
        self.eos = frozenset(info.eos_token_ids or ())
        self.source = source
        self.bridge = bridge
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self._ids = itertools.count()
        self._used: set[str] = set()  # request ids given so far (the replica's state keeps them all)
        self.max_waiting = max_waiting
        self.metrics = bridge.metrics = Metrics(model_name, bridge)
        self.app = self._make_app()

    @property
    def sampling(self):
        """The server's sampling (serve --sampling: the backend's), what a request gets for any
        sampling parameter it does not give."""
        return self.bridge.backend.sampling

    def claim_id(self, chat: bool, given: str | None = None) -> str:
        """A fresh request id: ``given`` (a cluster's front names its requests, header
        ``X-Schedlab-Request-Id``) unless already used here, else the next of ours."""
        if given is not None:
            if not given or len(given) > 200 or given in self._used:
                raise APIError(400, f"request id {given[:200]!r} is empty, too long or already used on this replica")
            rid = given
        else:
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{next(self._ids)}"
            while rid in self._used:
                rid = f"{'chatcmpl' if chat else 'cmpl'}-{next(self._ids)}"
        self._used.add(rid)
        return rid

    def request(self, params: Params, chat: bool, rid: str = "request"):
        """A ``traces.Request`` for ``params``, counted with the model's tokenizer (not stamped)."""
        from schedlab import traces
        from schedlab.engine.errors import EngineError
        from schedlab.traces.schema import Request, TraceError

        req = Request(rid, 0.0, None, 1, prompt=params.prompt, messages=params.messages)
        try:
            n = len(traces.prompt_ids(req, self.tokenizer))
        except TraceError as exc:
            raise APIError(400, str(exc), "messages" if chat else "prompt") from None
        if n < 1:
            raise APIError(400, "the prompt is 0 tokens for this model's tokenizer", "messages" if chat else "prompt")
        ctx = self.info.max_context
        if params.max_tokens is None:  # (what the context leaves, at most the default, and what fits the KV)
            room = self.default_max_tokens if ctx is None else min(self.default_max_tokens, ctx - n)
            if room < 1:
                raise APIError(
                    400,
                    f"the prompt is {n} tokens and the model's context is {ctx}: no room for output",
                    "messages" if chat else "prompt",
                )
            fits = self.kv_room(n)
            if fits < 1:
                _, fixed, capacity = self.kv_need(n, 1)
                held = f" + {fixed} for its sliding windows and recurrent state" if fixed else ""
                raise APIError(
                    400,
                    f"the prompt is {n} tokens{held} and the server's KV capacity is {capacity} (serve --kv-tokens): "
                    "no room for output",
                    "messages" if chat else "prompt",
                )
            max_tokens, key = min(room, fits), "max_tokens"
        else:
            max_tokens, key = params.max_tokens, params.max_tokens_key
        req = Request(rid, 0.0, n, max_tokens, prompt=params.prompt, messages=params.messages)
        try:
            self.info.check_trace([req])
        except EngineError as exc:
            raise APIError(
                400, str(exc).replace(f"request {rid} needs", "this request needs").replace("+ output", f"+ {key}"), key
            ) from None
        return req

    async def counted(self, params: Params, chat: bool, rid: str = "request"):
        """``request``, a long prompt counted on a worker thread: tokenizing megabytes takes
        seconds, which the event loop would otherwise spend not streaming anyone's tokens."""
        size = len(params.prompt) if params.prompt is not None else sum(len(c) for _, c in params.messages)
        if size < LONG_PROMPT_CHARS:
            return self.request(params, chat, rid)
        return await asyncio.to_thread(self.request, params, chat, rid)

    def _make_app(self):
        from fastapi.responses import JSONResponse, Response, StreamingResponse

        from schedlab.sim.sources import SourceClosed

        app, error = openai_app("schedlab serve")
        server = self

        @app.get("/health")
        async def health():  # (503 once shutting down: a load balancer sends it nothing more)
            closing = getattr(server.source, "closed", False)
            body = {
                "status": "shutting down" if closing else "ok",
                "in_flight": server.bridge.in_flight(),
                "cancelled": server.bridge.cancelled,
            }
            return JSONResponse(body, status_code=503 if closing else 200)

        @app.get("/info")
        async def info():  # what it runs (a front routing to it by URL reports its policy)
            return {"policy": server.policy, "model": server.model_name}

        @app.get("/state")
        async def state():  # what a cluster's router reads (routers.ReplicaSignals' fields)
            return server.bridge.signals()

        @app.get("/metrics")
        async def metrics():  # Prometheus text
            body, kind = server.metrics.render()
            return Response(body, media_type=kind)

        async def prepare(http: HTTPRequest, chat: bool):
            """A completion request checked and counted, not submitted (a cluster's front asks
            before it routes): its prompt and max_tokens, or the error it would get."""
            try:
                params = Params(await _json(http), server, chat)
                req = await server.counted(params, chat)
                server.check_fits(req)
            except APIError as e:
                return error(e)
            return {
                "prompt_tokens": req.prompt_tokens,
                "max_tokens": req.output_tokens,
                "stream": params.stream,
                "include_usage": params.include_usage,
                "prompt": req.prompt,
                "messages": req.chat(),
            }

        @app.post("/prepare/completions")
        async def prepare_completions(http: HTTPRequest):
            return await prepare(http, chat=False)

        @app.post("/prepare/chat/completions")
        async def prepare_chat_completions(http: HTTPRequest):
            return await prepare(http, chat=True)

        @app.get("/v1/models")
        async def models():
            return models_body(server.model_name)

        async def handle(http: HTTPRequest, chat: bool):
            try:
                params = Params(await _json(http), server, chat)
                rid = server.claim_id(chat, http.headers.get("x-schedlab-request-id"))
            except APIError as e:
                return error(e)
            seen: tuple[int, ...] = ()
            try:
                req = await server.counted(params, chat, rid)
                if http.headers.get("x-schedlab-kv-import"):  # a decode replica's: it comes with its KV
                    req, seen = await server.take_kv(req, http.headers["x-schedlab-kv-import"])
                server.check_fits(req)
                server.check_queue(rid)
                if http.headers.get("x-schedlab-kv-export"):  # a prefill replica's: it leaves its KV
                    server.export_kv(rid)
            except APIError as e:
                server.forget(rid)
                return error(e)
            st = server.bridge.open(
                req.id,
                asyncio.get_running_loop(),
                params.stop,
                params.ignore_eos,
                (req.prompt_tokens, req.output_tokens),
                sampling=params.sampling,
                seen=seen,
            )
            try:
                server.source.submit(req)
            except SourceClosed as exc:
                server.bridge.drop(req.id)
                server.forget(req.id)
                return error(APIError(503, str(exc), kind="server_error"))
            created = int(time.time())
            if params.stream:  # (Starlette ends the stream's generator when its client goes away)
                return StreamingResponse(
                    server._events(req, st, params, chat, created, seen), media_type="text/event-stream"
                )
            return await server._whole_unless_gone(http, req, st, params, chat, created)

        @app.post("/v1/completions")
        async def completions(http: HTTPRequest):
            return await handle(http, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(http: HTTPRequest):
            return await handle(http, chat=True)

        return app

    async def _whole_unless_gone(self, http: HTTPRequest, req, st: _Stream, params: "Params", chat: bool, created: int):
        """The whole answer, unless its client goes away first (the connection closes: ASGI's
        ``http.disconnect``, which nothing else awaits for a response not yet started): then the
        request is cancelled at once, wherever it is, as a stream's is."""
        from fastapi import Response

        async def gone() -> None:
            while (await http.receive())["type"] != "http.disconnect":
                pass

        answer = asyncio.ensure_future(self._whole(req, st, params, chat, created))
        watch = asyncio.ensure_future(gone())
        try:
            await asyncio.wait((answer, watch), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            answer.cancel()  # (which cancels the request)
            raise
        finally:
            watch.cancel()
        if answer.done():
            return answer.result()
        self.bridge.cancel(req.id)
        answer.cancel()
        return Response(status_code=499)  # (nobody reads it: nginx's "client closed request")

    async def take_kv(self, req, path: str):
        """A decode replica's request (header ``X-Schedlab-KV-Import``: a KV file a prefill replica
        wrote): the request as it arrives here, its prompt plus its first token with the prompt's KV
        given (``sim.disagg.TransferredRequest``), and that first token (its client has it)."""
        from schedlab.engine import kvfile
        from schedlab.engine.errors import EngineError
        from schedlab.sim.disagg import TransferredRequest

        try:
            kvfile.check_handed(path)
            head, kv = await asyncio.to_thread(kvfile.read, path)
            n = kvfile.prompt_tokens(head)
            if n != req.prompt_tokens:
                raise EngineError(f"the KV given holds {n} prompt tokens, but the prompt is {req.prompt_tokens}")
            moved = TransferredRequest(
                req.id, 0.0, n + 1, req.output_tokens, prompt=req.prompt, messages=req.messages, kv_transferred=n
            )
            self.info.check_trace([moved])
            self.bridge.backend.expect_kv(req.id, head, kv)
        except EngineError as exc:
            raise APIError(400, str(exc), code="kv_transfer") from None
        _unlink(path)  # (read: the KV is this replica's now)
        return moved, (int(head["ids"][-1]),)

    def export_kv(self, rid: str) -> None:
        """A prefill replica's request (header ``X-Schedlab-KV-Export``): when it ends at its one
        token its prompt's KV is written to a file in ``kv_dir`` (its stream says where)."""
        if self.kv_dir is None:
            raise APIError(400, "this replica hands no KV on: it was started without --kv-dir", code="kv_transfer")
        self.bridge.backend.export_kv[rid] = str(self.kv_dir / f"{next(self._kv_files)}.kv")

    def forget(self, rid: str) -> None:
        """A request refused before it was submitted: its id is free again, nothing kept for it."""
        self._used.discard(rid)
        drop = getattr(self.bridge.backend, "drop_kv", None)  # (the MLX engine's: any other hands no KV on)
        if drop is not None:
            drop(rid)

    def check_queue(self, rid: str) -> None:
        """The 429 of a request arriving while ``max_waiting`` requests wait to be admitted (its id
        is free again: the client may send it again)."""
        if self.max_waiting is None:
            return
        n = self.bridge.unadmitted()
        if n < self.max_waiting:
            return
        self._used.discard(rid)
        self.metrics.rejected("queue_full")
        raise APIError(
            429,
            f"the server's queue is full: {n} request(s) wait to be admitted (serve --max-waiting "
            f"{self.max_waiting}); retry later",
            code="queue_full",
            kind="rate_limit_exceeded",
            headers={"Retry-After": str(self.metrics.retry_after())},
        )

    def kv_need(self, prompt_tokens: int, max_tokens: int) -> tuple[int, int, int]:
        """What a request of these sizes holds at most, as the replica counts it on arrival: its KV
        tokens (prompt + max_tokens - 1), the tokens it holds besides (sliding windows, recurrent
        state: ``ReplicaState.fixed_tokens_for``), and the replica's KV capacity."""
        st = self.bridge.state
        kv = prompt_tokens + max_tokens - 1
        if st is None:  # (before the run starts: no layout known yet)
            return kv, 0, self.bridge.kv_capacity
        return kv, st.fixed_tokens_for(kv), st.kv_capacity

    def kv_room(self, prompt_tokens: int) -> int:
        """The most output tokens a request with this prompt can ask for and fit the KV cache."""
        capacity = self.kv_need(prompt_tokens, 1)[2]
        lo, hi = 0, capacity - prompt_tokens + 1  # (held besides the KV only grows with it)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            kv, fixed, _ = self.kv_need(prompt_tokens, mid)
            if kv + fixed <= capacity:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def check_fits(self, req) -> None:
        """The 400 the replica gives on arrival a request larger than its KV capacity, said before
        the answer starts (a stream's status could no longer say it)."""
        kv, fixed, capacity = self.kv_need(req.prompt_tokens, req.output_tokens)
        if kv + fixed > capacity:
            raise APIError(400, kv_refusal(req.prompt_tokens, req.output_tokens, fixed, capacity), "max_tokens")

    def _usage(self, req, completion: int) -> dict:
        usage = {
            "prompt_tokens": req.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": req.prompt_tokens + completion,
        }
        st = self.bridge.state
        if st is not None and st.prefix is not None:  # (--prefix-caching) as OpenAI and vLLM say it
            r = st.by_id.get(req.id)
            usage["prompt_tokens_details"] = {"cached_tokens": r.cached_tokens if r is not None else 0}
        return usage

    async def _whole(self, req, st: _Stream, params: Params, chat: bool, created: int):
        from fastapi.responses import JSONResponse

        ids: list[int] = []
        lps = TokenLogprobs(self.tokenizer, self.eos) if params.logprobs is not None else None
        try:
            while True:
                item = await st.queue.get()
                kind, value = item[0], item[1]
                if kind == "tokens":
                    ids += value
                    if lps is not None:
                        lps.add(value, item[2] if len(item) > 2 else None)
                elif kind == "error":
                    return JSONResponse(value.body(), status_code=value.status)
                elif kind == "done":
                    break
        except asyncio.CancelledError:  # the client went away: the replica ends it at its next step
            self.bridge.cancel(req.id)
            raise
        text = TextDelta(self.tokenizer, self.eos, params.stop)
        text.feed(ids, final=True)
        text = text.text
        choice: dict[str, Any] = {"index": 0, "finish_reason": value, "logprobs": None}
        if lps is not None:
            taken = lps.take(len(text), final=True)
            choice["logprobs"] = lps.chat(taken) if chat else lps.legacy(taken)
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return JSONResponse(
            {
                "id": req.id,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [choice],
                "usage": self._usage(req, len(ids)),
            }
        )

    async def _events(self, req, st: _Stream, params: Params, chat: bool, created: int, seen: tuple[int, ...] = ()):
        obj = "chat.completion.chunk" if chat else "text_completion"

        lps = TokenLogprobs(self.tokenizer, self.eos) if params.logprobs is not None else None

        def chunk(delta: str | None = None, finish: str | None = None, role: bool = False, usage=None, lp=None) -> str:
            if lp:  # the logprobs of the tokens whose text this chunk completes
                lp = lps.chat(lp) if chat else lps.legacy(lp)
            if usage is not None:
                choices: list = []
            elif chat:
                d: dict[str, Any] = {"role": "assistant"} if role else {}
                if delta is not None:
                    d["content"] = delta
                choices = [{"index": 0, "delta": d, "finish_reason": finish, "logprobs": lp or None}]
            else:
                choices = [{"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": lp or None}]
            out: dict[str, Any] = {
                "id": req.id,
                "object": obj,
                "created": created,
                "model": self.model_name,
                "choices": choices,
            }
            if usage is not None:
                out["usage"] = usage
            return f"data: {json.dumps(out, ensure_ascii=False)}\n\n"

        text = TextDelta(self.tokenizer, self.eos, params.stop)
        text.feed(list(seen))  # (text its client has from the replica that made those tokens)
        if lps is not None and seen:  # (and their logprobs: this answer's offsets start after them)
            lps.offset = len(lps.pieces.feed(list(seen)))
        n = 0
        ended = False
        handed_on = False  # its KV went to a file: another replica goes on from its last token
        try:
            if chat:
                yield chunk("", role=True)
            while True:
                item = await st.queue.get()
                kind, value = item[0], item[1]
                if kind == "tokens":
                    n += len(value)
                    delta = text.feed(value)
                    if lps is not None:
                        lps.add(value, item[2] if len(item) > 2 else None)
                    if delta:
                        yield chunk(delta, lp=lps.take(len(text.text)) if lps is not None else None)
                elif kind == "kv":  # (for the cluster's front: not an OpenAI event)
                    handed_on = True
                    yield f"data: {json.dumps({'schedlab_kv': value})}\n\n"
                elif kind == "error":
                    ended = True
                    yield f"data: {json.dumps(value.body())}\n\n"
                    break
                else:
                    ended = True
                    # (text held back, an unfinished character or a stop string's start, is the
                    # next replica's to send when the request goes on there)
                    rest = "" if handed_on else text.feed([], final=True)
                    last = lps.take(len(text.text), final=True) if lps is not None else None
                    if rest or last:
                        yield chunk(rest, lp=last)
                    yield chunk(None if chat else "", finish=value)
                    if params.include_usage:
                        yield chunk(usage=self._usage(req, n))
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not ended:  # the client went away: the replica ends the request at its next step
                self.bridge.cancel(req.id)
