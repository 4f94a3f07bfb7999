"""``serve --replicas 2``: two real replica processes (SmolLM2-135M on the real MLX engine, one core
each) behind the front, routed by the simulator's own ``least-requests`` router on the replicas'
live state, driven by the ``openai`` SDK.

One cluster serves the whole module (starting it loads the model twice): the answers are the
model alone's, streamed or whole, and spread over both replicas; a router's illegal answer is a
500 for that request only; the last test kills a replica with requests in flight and then shuts
the cluster down and reads what it wrote. The router is ``least-requests`` itself, reached through
a user's router file that hands every decision to it but for two prompts that ask for an illegal
answer (the route a user's router may get wrong).
"""

from __future__ import annotations
from simkit import command, until

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

from schedlab import engine  # noqa: F401  (OpenBLAS before mlx)
from schedlab import traces
from schedlab.engine.backend import reference_tokens
from schedlab.traces.schema import Request
from test_server import MODEL, QUESTIONS, Served, chat, expected

ASKED = QUESTIONS[:4]  # (one max_tokens for all: the references are computed once, see ref())

pytestmark = pytest.mark.slow  # two real replicas on a real model

KV = 320  # per replica: a long prompt running keeps a second long one waiting (see the fault test)

ROUTER = '''
from schedlab.routers import ROUTERS


class LeastRequestsUnlessTold:
    """least-requests, but for prompts that ask for an illegal route."""

    name = "least-requests-unless-told"

    def __init__(self):
        self.inner = ROUTERS["least-requests"]()

    def route(self, view):
        if view.request.prompt == "ROUTE ME TO 7":
            return 7
        if view.request.prompt == "ROUTE ME TO ZERO":
            return "zero"
        return self.inner.route(view)
'''


@pytest.fixture(scope="module")
def cluster(smol, tmp_path_factory):
    d = tmp_path_factory.mktemp("cluster")
    (d / "unless_told.py").write_text(ROUTER)
    t0 = time.monotonic()
    s = Served(
        [
            *("--replicas", "2", "--router", f"{d / 'unless_told.py'}:LeastRequestsUnlessTold"),
            *("--policy", "vllm", "--no-calibrate", "--kv-tokens", str(KV), "--max-tokens", "24"),
        ],
        d / "out",
    )
    s.started_s = time.monotonic() - t0
    yield s
    if s.proc.poll() is None:
        s.proc.kill()
        s.proc.wait()
        for r in getattr(s, "health_at_start", {}).get("replicas", []):
            try:
                os.kill(r["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass


_REFS: dict = {}


def _long(word: str, n: int) -> str:
    return f"Here is a list of words to {word}: " + " ".join(f"item{i}" for i in range(n)) + ". Now say them back."


def ref(smol, *, question: str | None = None, prompt: str | None = None, max_tokens: int = 16):
    """``expected`` (the model alone's greedy answer), computed once per question (seconds each)."""
    key = (question, prompt, max_tokens)
    if key not in _REFS:
        _REFS[key] = expected(
            smol, messages=None if question is None else chat(question), prompt=prompt, max_tokens=max_tokens
        )
    return _REFS[key]


S1 = chat(_long("remember", 45))  # (the fault test's long prompts and its undisturbed stream)
S2 = chat(_long("forget", 60))
T1 = chat("Count from 1 to 100.")


def health(s) -> dict:
    return httpx.get(s.url + "/health", timeout=10).json()


def routed(s) -> list[int]:
    return [r["routed"] for r in health(s)["replicas"]]


def test_cluster_starts_with_each_replica_on_its_own_core(cluster):
    h = cluster.health_at_start = health(cluster)
    assert h["status"] == "ok" and h["router"] == "least-requests-unless-told"
    reps = h["replicas"]
    assert [r["index"] for r in reps] == [0, 1] and all(r["up"] for r in reps)
    assert len({r["pid"] for r in reps}) == 2 and cluster.proc.pid not in {r["pid"] for r in reps}
    for r in reps:
        assert os.sched_getaffinity(r["pid"]) == set(r["cpus"])
        state = httpx.get(r["url"] + "/state").json()  # what the router reads
        assert state == {
            "waiting": 0,
            "running": 0,
            "prompt_tokens": 0,
            "output_tokens": 0,
            "kv_used": 0,
            "kv_capacity": KV,
            "kv_usage": 0.0,
            "received": {"requests": 0, "prompt_tokens": 0, "output_tokens": 0},
        }
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:  # (CI: 2 cores, one each)
        assert set(reps[0]["cpus"]).isdisjoint(reps[1]["cpus"])
    print(f"2-replica cluster up in {cluster.started_s:.1f} s")


def test_answers_are_the_model_alones_streamed_or_whole_and_spread_over_both(cluster, smol):
    c = cluster.client()
    r = c.chat.completions.create(model=MODEL, messages=chat(ASKED[0]), max_tokens=16)
    text, n, reason = ref(smol, question=ASKED[0])
    assert (r.choices[0].message.content, r.usage.completion_tokens, r.choices[0].finish_reason) == (text, n, reason)
    assert r.choices[0].message.role == "assistant" and r.object == "chat.completion" and r.model == MODEL
    r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12)
    want = ref(smol, prompt="Once upon a time", max_tokens=12)
    assert (r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason) == want
    text, n, reason = ref(smol, question=ASKED[2])
    chunks = list(
        c.chat.completions.create(
            model=MODEL, messages=chat(ASKED[2]), max_tokens=16, stream=True, stream_options={"include_usage": True}
        )
    )
    deltas = [ch.choices[0].delta.content or "" for ch in chunks if ch.choices]
    assert (
        chunks[0].choices[0].delta.role == "assistant"
        and sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.role) == 1
    )
    assert "".join(deltas) == text and sum(1 for d in deltas if d) > 3
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    chunks = list(c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, stream=True))
    text, n, reason = ref(smol, prompt="Once upon a time", max_tokens=12)
    assert "".join(ch.choices[0].text for ch in chunks) == text and all(ch.usage is None for ch in chunks)
    assert [m.id for m in c.models.list().data] == [MODEL]
    # at once: least-requests sends them to both replicas, each answer still the model alone's
    before = routed(cluster)
    want = {q: ref(smol, question=q) for q in ASKED}

    def ask(q):
        r = c.chat.completions.create(model=MODEL, messages=chat(q), max_tokens=16)
        return r.choices[0].message.content, r.usage.completion_tokens, r.choices[0].finish_reason

    with ThreadPoolExecutor(len(ASKED)) as ex:
        got = dict(zip(ASKED, ex.map(ask, ASKED)))
    assert got == want
    spread = [a - b for a, b in zip(routed(cluster), before)]
    assert sum(spread) == len(ASKED) and min(spread) >= 1, spread
    h = health(cluster)
    assert h["in_flight"] == 0 and h["retries"] == 0 and h["failures"] == 0
    assert sum(r["requests"] for r in h["replicas"]) == h["requests"] == 4 + len(ASKED)


def test_metrics_are_prometheus_text_per_replica(cluster):
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(cluster.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {
        (s.name, s.labels.get("replica")): s.value
        for fam in text_string_to_metric_families(r.text)
        for s in fam.samples
    }
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert samples[(name, "0")] == samples[(name, "1")] == 0, name
    assert samples[("schedlab:replica_up", "0")] == samples[("schedlab:replica_up", "1")] == 1
    h = health(cluster)
    assert [samples[("schedlab:requests_routed_total", str(i))] for i in (0, 1)] == [x["routed"] for x in h["replicas"]]
    assert samples[("schedlab:request_retries_total", None)] == 0
    # each replica's own vLLM counters and histograms, relayed with its label: what it says itself
    for i, rep in enumerate(h["replicas"]):
        mine = {
            s.name: s.value
            for fam in text_string_to_metric_families(httpx.get(rep["url"] + "/metrics").text)
            for s in fam.samples
            if not s.labels.get("le") and not s.labels.get("finished_reason")
        }
        for name in (
            "vllm:generation_tokens_total",
            "vllm:prompt_tokens_total",
            "vllm:e2e_request_latency_seconds_count",
        ):
            assert samples[(name, str(i))] == mine[name], (name, i)
    assert sum(samples[("vllm:generation_tokens_total", str(i))] for i in (0, 1)) > 0
    kinds = {fam.name: fam.type for fam in text_string_to_metric_families(r.text)}
    assert kinds["vllm:time_to_first_token_seconds"] == "histogram" and kinds["vllm:request_success"] == "counter"


def test_bad_requests_and_illegal_routes_are_openai_errors_and_lose_nothing_else(cluster, smol):
    c = cluster.client()
    want = ref(smol, question=ASKED[1])
    with ThreadPoolExecutor(1) as ex:
        in_flight = ex.submit(lambda: c.chat.completions.create(model=MODEL, messages=chat(ASKED[1]), max_tokens=16))
        for kwargs, param in (
            (dict(max_tokens=KV), "max_tokens"),  # fits the context, never a replica's KV cache
            (dict(temperature=2.5), "temperature"),  # past OpenAI's 0-2
            (dict(messages=[]), "messages"),
        ):
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(**{"model": MODEL, "messages": chat("hi"), **kwargs})
            assert e.value.body["param"] == param, kwargs
        assert "KV capacity is 320" in _message(c, max_tokens=KV)
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model="gpt-4o", messages=chat("hi"))
        r = httpx.post(
            cluster.url + "/v1/completions", content=b"not json", headers={"content-type": "application/json"}
        )
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        # a router that names no replica: that request's 500, naming the router and what it said
        for prompt, words in (
            ("ROUTE ME TO 7", "returned replica 7, but the cluster has replicas 0 to 1"),
            ("ROUTE ME TO ZERO", "returned 'zero', not a replica index"),
        ):
            for stream in (False, True):
                with pytest.raises(openai.InternalServerError) as e:
                    list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=4, stream=stream)) if stream else (
                        c.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
                    )
                msg = e.value.body["message"]
                assert e.value.status_code == 500 and "router 'least-requests-unless-told'" in msg and words in msg
                assert e.value.body["code"] == "router_error"
        r = in_flight.result(timeout=120)
    assert (r.choices[0].message.content, r.usage.completion_tokens, r.choices[0].finish_reason) == want
    h = health(cluster)
    assert h["in_flight"] == 0 and all(x["up"] for x in h["replicas"])


def _message(c, **kwargs) -> str:
    try:
        c.chat.completions.create(model=MODEL, messages=chat("hi"), **kwargs)
    except openai.APIStatusError as e:
        return e.body["message"]
    raise AssertionError("no error")


def _without_eos(smol, messages, n: int) -> str:
    key = (messages[0]["content"], "no eos", n)
    if key in _REFS:
        return _REFS[key]
    ids = traces.prompt_ids(
        Request("q", 0.0, None, 1, messages=tuple((m["role"], m["content"]) for m in messages)), smol.tokenizer
    )
    eos = set(smol.eos_token_ids or ())
    # (special tokens past the EOS have no text in an answer, as in vLLM)
    _REFS[key] = smol.tokenizer.decode(
        [t for t in reference_tokens(smol, ids, n) if t not in eos], skip_special_tokens=True
    )
    return _REFS[key]


def test_a_killed_replica_is_shown_down_and_what_it_held_is_retried_or_refused(cluster, smol):
    """Replica 0 is killed holding: S1, streaming (it has sent text: it ends in an error event); S2,
    streamed but waiting for KV behind S1 (no text yet: retried, exact); W2, not streamed (retried,
    exact). Replica 1 goes on with T1 and W1. Placement is least-requests': S1 to 0 (a tie), T1 to 1,
    S2 to 0 (a tie: 1 each), W1 to 1 (0 has 2), W2 to 0 (a tie: 2 each). S1's and S2's prompts
    together are more than replica 0's KV, so S2 (and W2 behind it) cannot be admitted beside S1."""
    c = cluster.client()
    assert health(cluster)["in_flight"] == 0
    base = routed(cluster)
    s1_msgs, s2_msgs = S1, S2
    n1 = len(traces.prompt_ids(Request("q", 0.0, None, 1, messages=(("user", s1_msgs[0]["content"]),)), smol.tokenizer))
    n2 = len(traces.prompt_ids(Request("q", 0.0, None, 1, messages=(("user", s2_msgs[0]["content"]),)), smol.tokenizer))
    assert n1 + 150 - 1 <= KV and n2 > (KV - n1) and n1 > KV // 3, (n1, n2)  # (see the docstring)
    s2_want = ref(smol, question=S2[0]["content"])[0]
    w_want = {q: ref(smol, question=q) for q in ASKED[2:4]}
    t1_want = _without_eos(smol, T1, 40)

    s1 = iter(
        c.chat.completions.create(
            model=MODEL, messages=s1_msgs, max_tokens=150, stream=True, extra_body={"ignore_eos": True}
        )
    )
    pieces = 0
    while pieces < 2:
        ch = next(s1)
        pieces += bool(ch.choices and ch.choices[0].delta.content)
    t1 = iter(
        c.chat.completions.create(
            model=MODEL,
            messages=T1,
            max_tokens=40,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    t1_text = ""
    while not t1_text:
        ch = next(t1)
        t1_text += (ch.choices[0].delta.content or "") if ch.choices else ""
    s2 = iter(c.chat.completions.create(model=MODEL, messages=s2_msgs, max_tokens=16, stream=True))
    assert next(s2).choices[0].delta.role == "assistant"  # routed and submitted: nothing of its answer yet
    ex = ThreadPoolExecutor(2)
    ws = {}
    for k, q in enumerate(ASKED[2:4]):
        ws[q] = ex.submit(lambda q=q: c.chat.completions.create(model=MODEL, messages=chat(q), max_tokens=16))
        until(f"W{k + 1} routed", lambda k=k: sum(routed(cluster)) >= sum(base) + 4 + k)
    h = health(cluster)
    assert [r["routed"] - b for r, b in zip(h["replicas"], base)] == [3, 2]
    assert [r["in_flight"] for r in h["replicas"]][0] == 3, h  # S1, S2, W2 on replica 0
    victim = h["replicas"][0]

    os.kill(victim["pid"], signal.SIGKILL)
    until("replica 0 shown down after its kill", lambda: not health(cluster)["replicas"][0]["up"])

    # S2 and W2 had sent no text: they start again on replica 1 and end as the model alone's
    assert "".join(ch.choices[0].delta.content or "" for ch in s2 if ch.choices) == s2_want
    for q, f in ws.items():
        r = f.result(timeout=120)
        assert (r.choices[0].message.content, r.usage.completion_tokens, r.choices[0].finish_reason) == w_want[q]
    ex.shutdown()
    # S1 had: its stream ends with an error event (the openai SDK raises it)
    with pytest.raises(openai.APIError) as e:
        for _ in s1:
            pass
    assert e.value.body["code"] == "replica_lost" and "not retried" in e.value.body["message"]
    t1_text += "".join(ch.choices[0].delta.content or "" for ch in t1 if ch.choices)
    assert t1_text == t1_want  # replica 1 went on undisturbed
    # from now on replica 1 serves everything
    h = health(cluster)
    assert [r["up"] for r in h["replicas"]] == [False, True] and h["retries"] == 2
    before = routed(cluster)
    want = {q: ref(smol, question=q) for q in ASKED[:3]}
    with ThreadPoolExecutor(3) as pool:
        got = dict(
            zip(want, pool.map(lambda q: c.chat.completions.create(model=MODEL, messages=chat(q), max_tokens=16), want))
        )
    assert {
        q: (r.choices[0].message.content, r.usage.completion_tokens, r.choices[0].finish_reason) for q, r in got.items()
    } == want
    after = routed(cluster)
    assert after[0] == before[0] and after[1] == before[1] + 3

    # shutdown: the summary, and what it wrote
    rc, stdout = cluster.stop()
    assert rc == 0, "".join(cluster.stderr)
    assert re.search(r"Replicas:\s+2\b", stdout) and re.search(r"Replica 0 failed at \(s\):", stdout)
    assert re.search(r"its requests sent elsewhere / refused:\s+2 / 1\b", stdout)
    out = cluster.out
    info = json.loads((out / "cluster.json").read_text())
    assert info["replicas"] == 2 and info["router"] == "least-requests-unless-told" and info["retries"] == 2
    assert info["router_errors"] == 4 and info["policy"] == "vllm" and info["model"] == MODEL
    p0, p1 = info["per_replica"]
    assert p0["exit_status"] == -signal.SIGKILL and p0["failed"] and p1["exit_status"] == 0 and not p1["failed"]
    # down as its stream broke or as the front saw its process end, whichever the front met first
    assert p0["down_s"] is not None and re.search(
        r"went away|its process ended \(killed by signal 9", p0["down_reason"]
    )
    served = json.loads((out / "trace.json").read_text())
    rows = served["requests"]
    assert len(rows) == info["requests"] and rows[0]["arrival_s"] == 0
    assert sorted({r["replica"] for r in rows}) == [0, 1]
    by_text = {r["messages"][0]["content"]: r for r in rows if "messages" in r}
    s1_row, s2_row = by_text[s1_msgs[0]["content"]], by_text[s2_msgs[0]["content"]]
    assert s1_row["replica"] == 0 and "went away" in s1_row["failed"] and s1_row["output_tokens"] == 150
    assert s2_row["replica"] == 1 and s2_row["retried"] and s2_row["replicas"] == [0, 1]
    assert by_text[ASKED[3]]["replicas"] == [0, 1]  # W2
    assert sum(1 for r in rows if r.get("failed")) == 1 and sum(1 for r in rows if r.get("retried")) == 2
    assert [r["replica"] for r in rows].count(0) == p0["requests"] and [r["replica"] for r in rows].count(1) == p1[
        "requests"
    ]
    # replica 1's own run directory names the requests as the front did; replica 0 died before writing
    assert not (out / "replica-0").exists()
    rep1 = json.loads((out / "replica-1" / "summary.json").read_text())
    ids1 = {json.loads(line)["id"] for line in (out / "replica-1" / "texts.jsonl").read_text().splitlines()}
    assert {r["id"] for r in rows if r["replica"] == 1} <= ids1 and rep1["finished"] >= p1["requests"]
    # the served trace is a trace: it replays in the simulator
    loaded = traces.load(str(out / "trace.json"))
    assert len(loaded) == len(rows)
    sim = subprocess.run(
        [
            *command("simulate"),
            "--policy",
            "vllm",
            "--trace",
            str(out / "trace.json"),
            "--replicas",
            "2",
            "--router",
            "least-requests",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert sim.returncode == 0, sim.stderr


def test_run_real_replays_a_trace_through_the_cluster(smol, tmp_path):
    """run-real --replicas 2: the trace's requests at their times through a real cluster (round-robin:
    two each), its ids kept, every answer the model alone's, the OUT layout of serve --replicas.
    (One cluster: the command is ``schedlab.run_real`` behind its options, and prints the
    ``ClusterRun``'s report; a second run through the Python API doubled the test's time and met
    the same code.)"""
    trace = tmp_path / "asked.json"
    rows = [
        # (0.1 s apart: a replica counts each prompt before the front routes it, and a loaded machine
        # can finish two countings out of order; the front still routes them in arrival order)
        {"id": f"q{i}", "arrival_s": 0.1 * i, "output_tokens": 16, "messages": chat(q)}
        for i, q in enumerate(ASKED)
    ]
    trace.write_text(json.dumps({"name": "asked", "requests": rows}))
    out = tmp_path / "out"
    r = subprocess.run(
        [
            *command("run-real"),
            *("--policy", "vllm", "--model", MODEL, "--no-calibrate", "--kv-tokens", str(KV)),
            *("--trace", str(trace), "--replicas", "2", "--router", "round-robin", "--out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert re.search(r"Successful requests:\s+4\b", r.stdout) and re.search(r"Trace:\s+asked\b", r.stdout)
    served = json.loads((out / "trace.json").read_text())["requests"]
    assert [(x["id"], x["replica"]) for x in served] == [("q0", 0), ("q1", 1), ("q2", 0), ("q3", 1)]
    texts = {}
    for i in (0, 1):
        assert json.loads((out / f"replica-{i}" / "summary.json").read_text())["finished"] == 2
        for line in (out / f"replica-{i}" / "texts.jsonl").read_text().splitlines():
            t = json.loads(line)
            texts[t["id"]] = (t["text"], t["output_tokens"], t["finish_reason"])
    assert texts == {f"q{i}": ref(smol, question=q) for i, q in enumerate(ASKED)}
    info = json.loads((out / "cluster.json").read_text())
    assert info["router"] == "round-robin" and [p["requests"] for p in info["per_replica"]] == [2, 2]
    # and validate --served: the simulation of what was served, on 2 replicas behind round-robin
    v = subprocess.run([*command("validate"), "--served", str(out), "--out", str(tmp_path / "v")],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert v.returncode == 0, v.stderr
    got = json.loads((tmp_path / "v" / "validation.json").read_text())
    assert got["replicas"] == 2 and got["router"] == "round-robin" and got["policy"] == "vllm"
    assert got["routing"]["sim_share"] == [0.5, 0.5] and got["routing"]["runs"][0]["same_replica"] == 1.0
    total = got["total"]["metrics"]
    real = [json.loads((out / f"replica-{i}" / "summary.json").read_text()) for i in (0, 1)]
    # the cluster's measured TTFTs are the replicas' own, pooled (their clocks do not matter to latencies)
    assert total["ttft_ms.p50"]["real"] == pytest.approx(
        float(np.percentile([r["ttft_ms"] for r in rows_of(out)], 50)), rel=1e-9
    )
    assert [p["metrics"]["makespan_s"]["real"] for p in got["per_replica"]] == [r["makespan_s"] for r in real]
    assert "routing: simulated share per replica 0.50 / 0.50" in v.stdout
    # what the front summed up (ClusterRun.summary; the report run-real printed above is its report())
    assert info["summary"]["finished"] == info["finished"] == 4


def rows_of(out: Path) -> list[dict]:
    """Every finished request of a cluster's replicas (their requests.csv rows, ttft_ms as a number)."""
    import csv

    rows = []
    for i in (0, 1):
        with open(out / f"replica-{i}" / "requests.csv", newline="") as f:
            rows += [{**r, "ttft_ms": float(r["ttft_ms"])} for r in csv.DictReader(f) if r["status"] == "finished"]
    return rows


def test_bad_cluster_options_are_one_line_errors(tmp_path):
    (tmp_path / "counts.json").write_text(
        json.dumps(
            {"name": "counts", "requests": [{"id": "a", "arrival_s": 0, "prompt_tokens": 5, "output_tokens": 2}]}
        )
    )
    for cmd, args, words in (
        ("serve", ["--replicas", "0"], "--replicas must be >= 1, got 0"),
        ("serve", ["--replicas", "2", "--router", "nope"], "unknown router 'nope'"),
        ("serve", ["--replicas", "2", "--router", "least-requests", "--router-option", "bogus=1"], "no option 'bogus'"),
        ("serve", ["--replicas", "2", "--router-option", "seed=1"], "--router-option goes with --router"),
        ("run-real", ["--replicas", "0", "--trace", "sonnet"], "--replicas must be >= 1, got 0"),
        ("run-real", ["--replicas", "2", "--router", "nope", "--trace", "sonnet"], "unknown router 'nope'"),
        ("run-real", ["--router", "least-kv", "--trace", "sonnet"], "--router goes with --replicas N > 1"),
        ("serve", ["--router", "least-kv"], "--router goes with --replicas N > 1"),
        ("run-real", ["--replicas", "2", "--trace", str(tmp_path / "counts.json")], "token counts only"),
        ("run-real", ["--replicas", "2", "--trace", "sonnet", "--max-concurrency", "2"], "does not go with --replicas"),
    ):
        r = subprocess.run([*command(cmd), "--policy", "vllm", *args], capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and words in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def _replicas_of(pid: int) -> list[int]:
    """Replica processes (``schedlab serve``) whose parent is ``pid`` (Linux /proc)."""
    kids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                argv = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"serve" in argv:
                kids.append(int(d.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize(
    "cmd, how, phase",
    [("run-real", "SIGTERM", "serving"), ("serve", "SIGINT", "calibrating"), ("run-real", "SIGKILL", "calibrating")],
)
def test_the_parent_ends_its_replicas_at_once_however_it_is_stopped(cmd, how, phase, tmp_path):
    """``run-real --replicas 2`` or ``serve --replicas 2`` stopped as a job scheduler, a terminal or
    the OOM killer stops it (SIGTERM, SIGINT, SIGKILL), its replicas serving with requests in
    flight or the first still calibrating (a fresh profile cache; the second starts once it
    listens): no replica it started is left. Handled, it ends them before it exits itself; killed,
    the kernel ends them as it dies. What is checked is that none is left, not how long that took."""
    env = dict(os.environ, SCHEDLAB_CACHE_DIR=str(tmp_path / "cache"))
    argv = [*command(cmd), "--policy", "vllm", "--model", MODEL, "--replicas", "2"]
    argv += ["--trace", "sonnet"] if cmd == "run-real" else ["--port", "0"]
    if phase == "serving":
        argv += ["--no-calibrate"]
    elif cmd == "serve":
        argv += ["--calibrate"]  # (run-real calibrates where no profile matches)
    want = 2 if phase == "serving" else 1
    parent = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(parent.stderr), daemon=True)
    reader.start()
    try:
        kids = until(
            f"{want} replica(s) started", lambda: parent.poll() is None and len(_replicas_of(parent.pid)) == want
        )
        kids = _replicas_of(parent.pid)
        if phase == "serving":  # every replica listens and the trace's first requests are sent
            until("the replicas up", lambda: any("replicas up" in x for x in lines) or parent.poll() is not None)
        else:
            time.sleep(3.0)  # (loaded, or loading: calibrating next)
        assert parent.poll() is None and all(map(_alive, kids)) and len(_replicas_of(parent.pid)) == want, lines
        parent.send_signal(getattr(signal, how))
        if how != "SIGKILL":
            # handled: it kills every replica's session and reaps them before it exits, so none is
            # left the moment it has gone (no wait: a replica left to notice by itself fails here)
            assert parent.wait(timeout=60) == 130
            assert not [k for k in kids if _alive(k)], f"replicas left after {how}"
            reader.join(timeout=10)
            assert "interrupted: the replicas were stopped" in lines[-1], lines
        else:
            # the kernel sends each replica SIGKILL as the parent dies (PR_SET_PDEATHSIG); the guard
            # only bounds the wait for that kill to land (a replica calibrating on ran for minutes)
            until(f"no replica left after {how}", lambda: not [k for k in kids if _alive(k)])
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.wait()
