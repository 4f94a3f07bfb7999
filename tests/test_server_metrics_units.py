"""``serve``'s /metrics and admission control without a server: the pure helpers, ``Metrics``
rendered and parsed back, ``Bridge.unadmitted`` and ``Server.check_queue`` on stand-ins (the
real server: test_server_metrics)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace as NS

import pytest
from prometheus_client.parser import text_string_to_metric_families

from schedlab.serving.bridge import Bridge
from schedlab.serving.http import APIError
from schedlab.serving.metrics import Metrics, request_latencies, step_time_ratio
from schedlab.serving.server import Server


def test_step_time_ratio_is_total_measured_over_total_predicted():
    assert step_time_ratio([1.0, 2.0, 1.0], [1.5, 3.0, None]) == pytest.approx(4.5 / 3.0)
    assert step_time_ratio([0.0, 1.0], [5.0, 0.5]) == 0.5  # (a step predicted at 0 s is left out)
    assert step_time_ratio([], []) is None
    assert step_time_ratio([1.0], [None]) is None  # a simulation measures nothing


def test_request_latencies_as_vllm_observes_them():
    r = NS(arrival_s=1.0, admitted_s=1.25, first_token_s=2.0, finish_s=3.5, token_times=[2.0, 2.5, 3.5])
    assert request_latencies(r) == (0.25, 1.0, 2.5, [0.5, 1.0])
    gone = NS(arrival_s=1.0, admitted_s=None, first_token_s=None, finish_s=1.5, token_times=[])
    assert request_latencies(gone) == (None, None, 0.5, [])


class _Bridge:
    def __init__(self, prefix=None):
        self.state = NS(prefix=prefix)

    def signals(self):
        return {"running": 2, "waiting": 3, "kv_usage": 0.25}

    def cost_model_bias(self):
        return None


def _samples(m: Metrics) -> dict[str, float]:
    body, kind = m.render()
    assert kind.startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def _finished(**kw):
    r = dict(
        id="a",
        arrival_s=0.0,
        admitted_s=0.5,
        first_token_s=1.0,
        finish_s=2.0,
        token_times=[1.0, 1.5, 2.0],
        prompt_tokens=7,
        generated=3,
        preemptions=0,
        cached_tokens=0,
    )
    r.update(kw)
    return NS(**r)


def test_metrics_count_finished_requests_and_read_gauges_live():
    m = Metrics("m", _Bridge(prefix=object()))
    m.finished(_finished(), "length")
    m.finished(_finished(id="b", preemptions=2, cached_tokens=4, token_times=[1.0]), "stop")
    m.finished(_finished(id="c", admitted_s=None, first_token_s=None, token_times=[], generated=0), "abort")
    m.finished(NS(id="d", finish_s=None), "length")  # refused on arrival: larger than the KV cache
    m.rejected("queue_full")
    s = _samples(m)
    assert s["vllm:prompt_tokens_total"] == 14  # (the aborted one never had its prompt processed)
    assert s["vllm:generation_tokens_total"] == 6
    assert [s[f"vllm:request_success_total{{finished_reason={x}}}"] for x in ("stop", "length", "abort")] == [1, 1, 1]
    assert s["vllm:num_preemptions_total"] == 2
    assert (s["vllm:prefix_cache_queries_total"], s["vllm:prefix_cache_hits_total"]) == (14, 4)
    assert s["vllm:time_to_first_token_seconds_count"] == 2 and s["vllm:time_to_first_token_seconds_sum"] == 2.0
    assert s["vllm:request_queue_time_seconds_count"] == 2 and s["vllm:request_queue_time_seconds_sum"] == 1.0
    assert s["vllm:e2e_request_latency_seconds_count"] == 3 and s["vllm:e2e_request_latency_seconds_sum"] == 6.0
    assert s["vllm:inter_token_latency_seconds_count"] == 2
    assert s["vllm:inter_token_latency_seconds_bucket{le=0.5}"] == 2  # (vLLM's buckets)
    assert s["schedlab:requests_rejected_total{reason=queue_full}"] == 1
    assert s["schedlab:requests_rejected_total{reason=kv_capacity}"] == 1
    assert (s["vllm:num_requests_running"], s["vllm:num_requests_waiting"], s["vllm:kv_cache_usage_perc"]) == (2, 3, 0.25)  # fmt: skip
    assert "schedlab:cost_model_bias" not in s  # (none known yet: no sample)
    assert m.retry_after() == 1  # the mean queue time, at least 1 s
    assert "vllm:prompt_tokens_total" in _samples(Metrics("m", _Bridge()))  # a registry per server: no clash


def _bridge():
    backend = NS(
        start=lambda state, requests=None: None, no_eos=set(), stopped=set(), request_sampling={}, on_token=None
    )  # (MLXBackend's attributes the Bridge touches)
    return Bridge(backend, 64)


def test_unadmitted_counts_requests_sent_and_never_admitted():
    b = _bridge()
    loop = asyncio.new_event_loop()
    try:
        for rid in "abcd":
            b.open(rid, loop)
        assert b.unadmitted() == 4  # (no state yet: none admitted)
        b.state = NS(by_id={"a": NS(admitted_s=0.1), "b": NS(admitted_s=None)})  # c, d: not delivered yet
        assert b.unadmitted() == 3
        b.state.by_id["b"].admitted_s = 0.2
        b.drop("d")  # never submitted
        assert b.unadmitted() == 1
        b.on_finish(
            NS(id="c", finish_s=None, kv_footprint=99, prompt_tokens=50, output_tokens=50, fixed_tokens=0), 0.3
        )  # refused
        assert b.unadmitted() == 0
    finally:
        loop.close()


def test_check_queue_answers_429_with_retry_after_and_frees_the_id():
    b = _bridge()
    srv = Server(NS(tokenizer=None, eos_token_ids=()), None, b, "m", max_waiting=2)
    loop = asyncio.new_event_loop()
    try:
        srv.check_queue("x")  # none waiting
        b.open("a", loop)
        srv.check_queue("x")
        b.open("b", loop)
        rid = srv.claim_id(False, "given")
        with pytest.raises(APIError) as e:
            srv.check_queue(rid)
        assert e.value.status == 429 and e.value.headers == {"Retry-After": "1"}
        assert e.value.body()["error"]["type"] == "rate_limit_exceeded" and e.value.code == "queue_full"
        assert "2 request(s) wait to be admitted (serve --max-waiting 2)" in e.value.message
        assert srv.claim_id(False, "given") == "given"  # the client may send it again
        assert _samples(srv.metrics)["schedlab:requests_rejected_total{reason=queue_full}"] == 1
        Server(NS(tokenizer=None, eos_token_ids=()), None, _bridge(), "m").check_queue("y")  # no limit
    finally:
        loop.close()


def test_a_cluster_front_relays_a_replicas_429_with_its_retry_after():
    from schedlab.serving.front import _upstream_error

    body = b'{"error": {"message": "the server\'s queue is full", "type": "rate_limit_exceeded", "code": "queue_full"}}'
    e = _upstream_error(429, body, "3")
    assert (e.status, e.kind, e.code, e.headers) == (429, "rate_limit_exceeded", "queue_full", {"Retry-After": "3"})
    assert _upstream_error(400, b'{"error": {"message": "bad"}}').headers is None


class _ClockLoop(asyncio.SelectorEventLoop):
    """An event loop on the test's clock: ``time()`` (what every timer, ``sleep`` and ``wait_for``
    reads) is what ``advance`` added, plus the real monotonic clock when ``real`` (a server's loop,
    which must tick on its own). The tests below move it on instead of waiting for time to pass."""

    def __init__(self, real: bool = False):
        super().__init__()
        self.real = real
        self.added = 0.0

    def time(self) -> float:
        return self.added + (super().time() if self.real else 0.0)

    async def advance(self, seconds: float) -> None:
        """``seconds`` pass at once; then the callbacks that fell due run, and what they started."""
        self.added += seconds
        await _settle()


async def _settle(rounds: int = 100) -> None:
    """Let every task that can run do so (rounds of the loop; no time passes)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


def _arrivals(front, n: int, routed=lambda ticket: True):
    """``n`` requests' tickets, each request's task and the event that ends its prompt's counting
    (the test sets them in the order it chooses); ``order``: the tickets as they were routed."""
    order: list[int] = []
    tickets = [front.ticket() for _ in range(n)]
    counted = {t: asyncio.Event() for t in tickets}

    async def arrive(ticket: int) -> None:
        await counted[ticket].wait()  # its prompt counted
        if routed(ticket):
            await front.wait_turn(ticket)
            order.append(ticket)
        front.pass_turn(ticket)
        front.pass_turn(ticket)  # (passing twice changes nothing)

    tasks = [asyncio.ensure_future(arrive(t)) for t in tickets]
    return tickets, counted, tasks, order


def test_a_cluster_front_routes_requests_first_in_the_order_they_arrived():
    """The front counts each prompt at a replica (/prepare) before routing it; countings end in any
    order, and routers that keep state (round-robin) must see the requests in arrival order. Each
    request takes a ticket on arrival and is first routed only after every earlier one has been
    routed or dropped (a refused request passes its turn unrouted); passing twice changes nothing.
    Here the countings end in an order unlike the arrivals', the first one's last, and none is held
    back long enough to lose its place (TURN_WAIT_S: the test's clock does not move)."""
    from schedlab.serving.front import Front
    from schedlab.routers import RoundRobin

    front = Front([], RoundRobin(), {}, "m", "vllm", log=lambda *a: None)

    async def main() -> list[int]:
        t, counted, tasks, order = _arrivals(front, 5, routed=lambda ticket: ticket != 2)  # 2: refused
        for x in (t[1], t[4], t[3], t[2]):
            counted[x].set()
            await _settle()
        assert order == []  # all of them wait for the first, still being counted
        counted[t[0]].set()
        await _settle()
        assert all(task.done() for task in tasks)
        assert front.ticket() == 5
        after = asyncio.ensure_future(front.wait_turn(5))
        await _settle()
        assert after.done()  # the next one waits for no one
        return order

    loop = _ClockLoop()
    try:
        assert loop.run_until_complete(main()) == [0, 1, 3, 4]
    finally:
        loop.close()


def test_a_request_whose_counting_hangs_does_not_hold_the_ones_after_it():
    """A request stuck before routing (its prompt's counting at a stopped replica) holds the later
    ones TURN_WAIT_S at most, and until then it holds them; then they go in their own order, and so
    does it when it comes. TURN_WAIT_S passes on the test's clock, whatever the machine's speed."""
    from schedlab.serving import front as _front
    from schedlab.routers import RoundRobin

    wait_s = _front.TURN_WAIT_S
    front = _front.Front([], RoundRobin(), {}, "m", "vllm", log=lambda *a: None)
    loop = _ClockLoop()

    async def main() -> list[int]:
        t, counted, tasks, order = _arrivals(front, 4)
        for x in (t[2], t[1], t[3]):  # counted; the first one's counting hangs
            counted[x].set()
            await _settle()
        await loop.advance(wait_s * 0.999)
        assert order == []  # held: the first may still come
        await loop.advance(wait_s * 0.002)
        assert order == [1, 2, 3]  # its time is up: the others go, in their own order
        counted[t[0]].set()
        await _settle()
        assert all(task.done() for task in tasks)
        return order

    try:
        assert loop.run_until_complete(main()) == [1, 2, 3, 0]
    finally:
        loop.close()


def _answers_after_idle(config, idle_s: float) -> tuple[bytes, bytes]:
    """The answers to a request on a fresh keep-alive connection to a server of ``config``, and to
    the same request on the same connection after it lay idle ``idle_s`` seconds of the server's
    clock (its loop's: moved on, not waited for); b"" where the server had closed the connection."""
    import socket
    import threading
    import time

    import uvicorn

    hs = uvicorn.Server(config)
    loop = _ClockLoop(real=True)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    t = threading.Thread(target=loop.run_until_complete, args=(hs.serve(sockets=[sock]),), daemon=True)
    t.start()
    deadline = time.monotonic() + 30  # (a guard: it starts in well under a second)
    while not hs.started and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hs.started
    ask = b"GET /v1/no-such-path HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"

    def response(c) -> bytes:  # one whole response (its headers, then content-length bytes); b"" if closed
        got = b""
        try:
            c.sendall(ask)
            while b"\r\n\r\n" not in got:
                part = c.recv(65536)
                if not part:
                    return got
                got += part
            head, _, body = got.partition(b"\r\n\r\n")
            length = next(
                int(v) for k, _, v in (h.partition(b":") for h in head.split(b"\r\n")) if k.lower() == b"content-length"
            )
            while len(body) < length:
                part = c.recv(65536)
                if not part:
                    break
                body += part
        except (ConnectionResetError, BrokenPipeError):
            return b""
        return head + b"\r\n\r\n" + body

    try:
        with socket.create_connection(sock.getsockname(), timeout=10) as c:
            first = response(c)
            asyncio.run_coroutine_threadsafe(loop.advance(idle_s), loop).result(timeout=30)
            second = response(c)
    finally:
        hs.should_exit = True
        t.join(10)
        loop.close()
        sock.close()
    return first, second


def test_an_idle_connection_stays_open_past_a_clients_pool_expiry():
    """Our servers (a replica's and the cluster's front: ``server_config``) keep an idle keep-alive
    connection open past the time an HTTP client drops it from its pool (httpx's, under the openai
    SDK and the front: 5 s), so the client closes it first. At uvicorn's default (5 s too) a request
    sent on a connection the server is closing that instant is lost ("Server disconnected without
    sending a response"): here the same raw connection still answers after the client's expiry,
    and at uvicorn's default it would not (the server's clock is moved on, so the idle costs no
    time)."""
    import httpx
    import uvicorn

    from schedlab.serving.http import KEEP_ALIVE_S, openai_app, server_config

    app, _ = openai_app("keep-alive")
    expiry = httpx.Limits().keepalive_expiry
    assert KEEP_ALIVE_S > expiry
    first, second = _answers_after_idle(server_config(app, "127.0.0.1", 0), expiry + 0.5)
    for got in (first, second):
        assert got.startswith(b"HTTP/1.1 404") and got.endswith(b'"code":null}}'), (first, second)
    default = uvicorn.Config(app, log_level="warning")
    assert default.timeout_keep_alive <= expiry
    first, second = _answers_after_idle(default, expiry + 0.5)
    assert first.startswith(b"HTTP/1.1 404") and second == b"", (first, second)
