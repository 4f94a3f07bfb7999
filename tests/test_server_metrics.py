"""``serve``'s ``GET /metrics`` (Prometheus text, vLLM's names) and admission control
(``--max-waiting``), on the installed ``serve`` command with the real SmolLM2-135M, driven by the
``openai`` SDK (``Served`` from test_server). What /metrics says is checked against what the
clients were told: the requests in flight, the ``usage`` and finish reasons the server returned,
and the 429s it answered."""

from __future__ import annotations

import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from simkit import command
from test_server import MODEL, Served, needs_wheel

pytestmark = pytest.mark.slow  # real servers on a real model

PROMPT = "Write a short story about a robot who learns to paint."


def scrape(url: str) -> dict[str, float]:
    """Every sample of GET /metrics: ``name{label="value",...}`` (labels sorted, model_name left out) -> value."""
    r = httpx.get(url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            assert s.labels.get("model_name") == MODEL, s
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Two requests run at a time (vllm's max_num_seqs); a fifth arriving while four wait gets a 429."""
    needs_wheel()
    s = Served(
        ["--policy", "vllm", "-o", "max_num_seqs=2", "--kv-tokens", "2048", "--max-tokens", "24", "--max-waiting", "4"],
        tmp_path_factory.mktemp("metrics"),
    )
    yield s
    s.stop()


def test_metrics_say_what_the_clients_saw(server):
    """Mid-stream: running + waiting = the requests in flight (two running, two waiting behind
    them), KV in use. After: the token counters went up by the sums of the usage returned,
    request_success_total by reason by the finish reasons returned, the TTFT/e2e/queue-time
    histograms by one observation per request, the inter-token one by one per token after each
    request's first; the gauges are back to 0."""
    client = server.client()
    before = scrape(server.url)
    sizes = (32, 32, 4, 4)  # the first two run long enough for the other two to wait behind them
    started = [threading.Event() for _ in sizes]
    go = threading.Event()
    results: list[tuple[int, int, str]] = []  # (prompt tokens, completion tokens, finish reason)
    lock = threading.Lock()

    def streamed(i: int) -> None:
        stream = client.completions.create(
            model=MODEL,
            prompt=f"{PROMPT} ({i})",
            max_tokens=sizes[i],
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage = finish = None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                started[i].set()
                go.wait(timeout=60)
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                usage = chunk.usage
        with lock:
            results.append((usage.prompt_tokens, usage.completion_tokens, finish))

    threads = [threading.Thread(target=streamed, args=(i,)) for i in range(len(sizes))]
    during = None
    try:
        for t in threads[:2]:
            t.start()
        assert started[0].wait(timeout=60) and started[1].wait(timeout=60)  # both running
        for t in threads[2:]:
            t.start()
        for _ in range(200):  # until the other two have arrived (their threads send them now)
            m = scrape(server.url)
            if m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] == len(sizes):
                during = m
                break
            time.sleep(0.02)
    finally:
        go.set()
        for t in threads:
            t.join(timeout=120)
    assert during is not None, "running + waiting never came to the 4 requests in flight"
    assert (during["vllm:num_requests_running"], during["vllm:num_requests_waiting"]) == (2, 2), during
    assert 0 < during["vllm:kv_cache_usage_perc"] <= 1
    assert sorted(r[1:] for r in results) == [(4, "length")] * 2 + [(32, "length")] * 2, results

    for kwargs in ({"stop": [" "]}, {"extra_body": {"ignore_eos": True}}):  # whole answers: stop, length
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, **kwargs)
        results.append((r.usage.prompt_tokens, r.usage.completion_tokens, r.choices[0].finish_reason))

    after = scrape(server.url)
    d = {k: v - before.get(k, 0.0) for k, v in after.items()}  # (the counters, histograms since this test began)
    n = len(results)
    assert d["vllm:prompt_tokens_total"] == sum(r[0] for r in results)
    assert d["vllm:generation_tokens_total"] == sum(r[1] for r in results)
    for reason in ("stop", "length", "abort"):
        want = sum(r[2] == reason for r in results)
        assert d[f'vllm:request_success_total{{finished_reason="{reason}"}}'] == want, (reason, results)
    for h in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert d[f"vllm:{h}_seconds_count"] == n, h
        assert d[f'vllm:{h}_seconds_bucket{{le="+Inf"}}'] == n, h
    assert d["vllm:inter_token_latency_seconds_count"] == sum(r[1] - 1 for r in results)
    ttft, e2e, queue = (d[f"vllm:{h}_seconds_sum"] for h in ("time_to_first_token", "e2e_request_latency", "request_queue_time"))  # fmt: skip
    itl = d["vllm:inter_token_latency_seconds_sum"]
    assert 0 < queue < ttft <= e2e and 0 < itl < e2e, d  # (two requests waited a whole answer)
    assert d["vllm:num_preemptions_total"] == 0  # (2048 KV tokens: room for all)
    assert after["vllm:prefix_cache_queries_total"] == after["vllm:prefix_cache_hits_total"] == 0  # (no prefix caching)
    assert d['schedlab:requests_rejected_total{reason="queue_full"}'] == 0
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0
    assert after["schedlab:cost_model_bias"] > 0  # (measured over predicted step time: present once steps ran)
    state = httpx.get(server.url + "/state").json()  # the same signals, as a router reads them
    assert (state["running"], state["waiting"], state["kv_usage"]) == (0, 0, 0)


def test_max_waiting_answers_429_and_leaves_the_admitted_alone(server):
    """Ten requests at once where two run and four may wait: the rest get 429 with Retry-After;
    every one admitted is answered whole, as it is alone (greedy); the counter counts the 429s."""
    client = server.client()
    before = scrape(server.url)

    def ask(_):
        try:
            return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, extra_body={"ignore_eos": True})
        except openai.RateLimitError as e:
            return e

    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(ask, range(10)))
    refused = [a for a in answers if isinstance(a, openai.RateLimitError)]
    served = [a for a in answers if not isinstance(a, openai.RateLimitError)]
    assert refused and len(served) >= 2, answers
    for e in refused:
        assert e.status_code == 429
        assert int(e.response.headers["retry-after"]) >= 1
        err = e.response.json()["error"]
        assert (err["type"], err["code"]) == ("rate_limit_exceeded", "queue_full")
        assert "queue is full" in err["message"] and "(serve --max-waiting 4)" in err["message"]
    alone = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, extra_body={"ignore_eos": True})
    assert alone.usage.completion_tokens == 8 and alone.choices[0].text
    for r in served:
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
        assert r.choices[0].text == alone.choices[0].text
    after = scrape(server.url)
    key = 'schedlab:requests_rejected_total{reason="queue_full"}'
    assert after[key] - before[key] == len(refused)
    key = "vllm:e2e_request_latency_seconds_count"
    assert after[key] - before[key] == len(served) + 1


@pytest.mark.parametrize("n", ["0", "-3"])
def test_max_waiting_below_one_is_refused_in_one_line(n):
    r = subprocess.run(
        [*command("serve"), "--policy", "vllm", "--max-waiting", n], capture_output=True, text=True, timeout=120
    )
    assert r.returncode != 0 and "--max-waiting must be >= 1" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
