"""``serve``: a client that goes away ends its request at the replica's next step, whatever its
phase (waiting, mid-prefill, mid-decode; streamed or whole): its KV is freed at once, no other
request is disturbed, the served trace records when the client left and ``simulate`` replays
the cancellation. Then SIGTERM while requests are in flight (running and waiting): each is
finished whole, no new one is taken, the process exits 0 and writes what it served (summary,
requests, texts, trace.json), whose replay accounts for every request. One server for all of it
(starting one costs ~10 s). A real server on 127.0.0.1, the real SmolLM2-135M, the ``openai`` SDK
and raw sockets (a client that hangs up without reading the answer)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import httpx
import openai
import pytest
from simkit import command, read_table, until
from test_server import MODEL, QUESTIONS, Served, chat, expected


pytestmark = pytest.mark.slow  # a real server on a real model


def _hang_up_later(url: str, body: dict) -> socket.socket:
    """POST ``body`` (a whole, non-streamed request) on a socket of our own; closing the socket
    is the client going away."""
    u = urlparse(url)
    sock = socket.create_connection((u.hostname, u.port))
    data = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def test_cancelled_while_waiting_prefilling_and_decoding_ends_at_once_then_shutdown_finishes_the_rest(smol, tmp_path):
    opts = ["--policy", "chunked-prefill", "-o", "budget=16", "-o", "max_batch=2"]
    # the model alone's answers (seconds each), worked out in a thread of their own while the
    # server starts and serves the cancellations: A's, then those of the four the shutdown finds
    # in flight (neither A's question nor C's: 16 tokens each, the length the other server tests ask
    # these questions at, so that in a session their answers are computed once)
    model_alone = ThreadPoolExecutor(1)
    ref_a = model_alone.submit(expected, smol, messages=chat(QUESTIONS[5]), max_tokens=48)
    ref_four = model_alone.submit(lambda: {q: expected(smol, messages=chat(q), max_tokens=16) for q in QUESTIONS[1:5]})
    model_alone.shutdown(wait=False)  # (what was submitted still runs)
    s = Served([*opts, "--max-tokens", "24"], tmp_path / "run")
    c = s.client()
    state = lambda: httpx.get(s.url + "/state").json()  # noqa: E731
    health = lambda: httpx.get(s.url + "/health").json()  # noqa: E731

    # A: the request nothing may disturb, streamed from start to end
    got: list[str] = []

    def a():
        for ch in c.chat.completions.create(model=MODEL, messages=chat(QUESTIONS[5]), max_tokens=48, stream=True):
            if ch.choices and ch.choices[0].delta.content:
                got.append(ch.choices[0].delta.content)

    ta = threading.Thread(target=a)
    ta.start()
    until("A running", lambda: state()["running"] == 1)

    # B: a long prompt, whole (not streamed), prefilled 16 tokens a step: hung up mid-prefill
    long = " ".join(["The quick brown fox jumps over the lazy dog."] * 30)
    b = _hang_up_later(s.url, {"model": MODEL, "messages": chat(long), "max_tokens": 8})
    until("B admitted", lambda: state()["running"] == 2)
    start = state()["prompt_tokens"]
    until("B mid-prefill", lambda: 0 < state()["prompt_tokens"] < start - 16)

    # C: waiting (max_batch 2 is full): streamed, the client closes before any token
    cs = c.chat.completions.create(model=MODEL, messages=chat(QUESTIONS[0]), max_tokens=24, stream=True)
    until("C waiting", lambda: state()["waiting"] == 1)
    cs.close()
    until("C cancelled", lambda: health()["cancelled"] == 1 and state()["waiting"] == 0)
    assert state()["running"] == 2  # (A and B go on)

    b.close()
    st = until("B cancelled, its KV freed", lambda: health()["cancelled"] == 2 and (x := state())["running"] == 1 and x)
    assert st["prompt_tokens"] == 0  # B's prompt no longer outstanding: its prefill stopped

    # D: mid-decode, streamed: three pieces of its answer, then the client goes
    ds = c.chat.completions.create(model=MODEL, messages=chat("Count from 1 to 100."), max_tokens=200, stream=True)
    pieces = 0
    for ch in ds:
        pieces += bool(ch.choices and ch.choices[0].delta.content)
        if pieces == 3:
            break
    ds.close()
    until("D cancelled", lambda: health()["cancelled"] == 3)
    ta.join(timeout=120)
    want_a = ref_a.result(timeout=300)
    assert "".join(got) == want_a[0]  # A, beside all of it, is exactly the model's answer
    st = until("all done", lambda: (x := state())["running"] == 0 and x)
    assert st["kv_used"] == 0 and st["waiting"] == 0
    n = health()["cancelled"]
    assert health() == {"status": "ok", "in_flight": 0, "cancelled": n} and n == 3

    # shutdown: four streams in flight (max_batch 2: two running, two waiting), then SIGTERM; the
    # server takes no new request and finishes every one it has, the waiting ones included
    want = ref_four.result(timeout=300)
    answers: dict[str, str] = {}

    def stream(q):
        parts = []
        for ch in c.chat.completions.create(model=MODEL, messages=chat(q), max_tokens=16, stream=True):
            if ch.choices and ch.choices[0].delta.content:
                parts.append(ch.choices[0].delta.content)
        answers[q] = "".join(parts)

    threads = [threading.Thread(target=stream, args=(q,)) for q in want]
    for t in threads:
        t.start()
    until("all four in flight", lambda: health()["in_flight"] == len(want))
    until("two running, two waiting", lambda: (x := state())["running"] == 2 and x["waiting"] == 2)
    os.kill(s.proc.pid, signal.SIGTERM)  # the server is asked to stop
    # ... and says so on /health while it finishes (a load balancer sends it nothing more)
    r = until("/health to say shutting down", lambda: (x := httpx.get(s.url + "/health")).status_code != 200 and x)
    assert r.status_code == 503 and r.json()["status"] == "shutting down" and r.json()["in_flight"] >= 1
    for t in threads:
        t.join(timeout=180)
    assert answers == {q: w[0] for q, w in want.items()}  # every answer in flight finished, whole
    with pytest.raises((openai.APIConnectionError, openai.InternalServerError)):
        c.chat.completions.create(model=MODEL, messages=chat("one more?"))  # no new request taken
    rc, stdout = s.stop(signalled=True)
    assert rc == 0, "".join(s.stderr)
    finished = 1 + len(want)  # A and the four
    assert re.search(rf"Successful requests:\s+{finished}\b", stdout), stdout
    assert re.search(rf"Cancelled requests:\s+{n}\b", stdout), stdout
    m = re.search(r"shutting down: finishing (\d+) request", "".join(s.stderr))
    assert m and int(m.group(1)) >= 1  # it stopped with answers still being written

    rows = {r["id"]: r for r in read_table(s.out / "requests.csv")}
    cancelled = [r for r in rows.values() if r["status"] == "cancelled"]
    assert len(cancelled) == n and len(rows) == n + finished
    assert sum(r["status"] == "finished" for r in rows.values()) == finished
    served = json.loads((s.out / "trace.json").read_text())["requests"]
    assert len(served) == len(rows) and all(len(r["messages"]) == 1 for r in served)
    assert served[0]["arrival_s"] == 0 and served[0]["messages"][0]["content"] == QUESTIONS[5]
    by_q = {r["messages"][0]["content"]: r for r in served}
    assert len(by_q) == len(served)
    left = (long, QUESTIONS[0], "Count from 1 to 100.")  # B, C, D: whose clients went away
    gone = {r["id"]: r for r in served if "cancel_after_s" in r}  # only the cancelled ones
    assert set(gone) == {r["id"] for r in cancelled} == {by_q[q]["id"] for q in left}
    # each keeps when its client left, after its arrival (a replay must be able to run it): B came,
    # then C, which left while waiting; D came later and left mid-decode
    arrived = {q: by_q[q]["arrival_s"] for q in left}
    went = {q: by_q[q]["arrival_s"] + by_q[q]["cancel_after_s"] for q in left}
    assert all(by_q[q]["cancel_after_s"] > 0 for q in left), {q: by_q[q]["cancel_after_s"] for q in left}
    qb, qc, qd = left
    assert arrived[qb] < arrived[qc] < went[qc] and arrived[qc] < arrived[qd], (arrived, went)
    assert [by_q[q]["output_tokens"] for q in left] == [8, 24, 200]
    # the finished ones: the tokens each generated
    assert by_q[QUESTIONS[5]]["output_tokens"] == want_a[1]
    assert {q: by_q[q]["output_tokens"] for q in want} == {q: w[1] for q, w in want.items()}
    # B (the long one) and C had no token; D had its three pieces, then nothing
    assert rows[by_q[long]["id"]]["first_token_s"] in (None, "")
    assert rows[by_q[QUESTIONS[0]]["id"]]["first_token_s"] in (None, "")
    for r in cancelled:
        assert int(r["output_tokens"]) < gone[r["id"]]["output_tokens"]
    summary = json.loads((s.out / "summary.json").read_text())
    assert (summary["finished"], summary["cancelled"], summary["policy"], summary["mode"]) == (
        finished,
        n,
        "chunked-prefill",
        "real",
    )
    texts = {t["id"]: t["text"] for t in map(json.loads, (s.out / "texts.jsonl").read_text().splitlines())}
    assert {q: texts[by_q[q]["id"]] for q in [QUESTIONS[5], *want]} == {
        QUESTIONS[5]: want_a[0],
        **{q: w[0] for q, w in want.items()},
    }

    # the traffic as served replays in the simulator: every request finished or cancelled, each
    # cancellation where its client left
    sim = subprocess.run(
        [*command("simulate"), *opts, "--trace", str(s.out / "trace.json"), "--out", str(tmp_path / "sim")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert sim.returncode == 0, sim.stderr
    sim_rows = {r["id"]: r for r in read_table(tmp_path / "sim" / "requests.csv")}
    assert set(sim_rows) == set(rows)
    for rid, row in sim_rows.items():  # (one served whole is finished in the replay too)
        assert row["status"] == "finished" or (row["status"] == "cancelled" and rid in gone), (rid, row["status"])
    steps = [(float(r["start_s"]), float(r["end_s"])) for r in read_table(tmp_path / "sim" / "steps.parquet")]
    for rid, r in gone.items():
        at = r["arrival_s"] + r["cancel_after_s"]  # when its client left, on the replay's clock
        row = sim_rows[rid]
        end = float(row["finish_s"])
        if row["status"] == "cancelled":  # at the first step's start at or after that (or then, idle)
            assert end >= at - 1e-9 and not any(at <= a < end for a, _ in steps), rid
            assert int(row["output_tokens"]) < r["output_tokens"]
        else:  # finished by a step that had started before its client left
            assert row["status"] == "finished" and any(a < at and e == end for a, e in steps), rid
