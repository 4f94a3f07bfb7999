"""``serve --prefill 1 --decode 1``: prefill and decode apart, for real. Two replica processes
(SmolLM2-135M on the real MLX engine, one core each) behind the front: the prefill replica makes
each request's first token and writes its prompt's KV to shared memory; the decode replica reads
it and makes the rest. Driven by the ``openai`` SDK; answers must be the model alone's, the KV
must be copied, not recomputed (the decode replica computes no prompt token), and every request
answered once.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from simkit import command
from test_server import MODEL, QUESTIONS, Served, chat
from test_serve_cluster import health, ref

pytestmark = pytest.mark.slow  # two real replicas on a real model


@pytest.fixture(scope="module")
def pd(smol, tmp_path_factory):
    d = tmp_path_factory.mktemp("pd")
    s = Served(["--prefill", "1", "--decode", "1", "--policy", "mlx-default", "--max-tokens", "24"], d / "out")
    yield s
    if s.proc.poll() is None:
        s.proc.kill()
        s.proc.wait()


def test_answers_are_the_model_alones_with_the_kv_moved_not_recomputed(pd, smol):
    h = health(pd)
    assert [(r["index"], r["pool"]) for r in h["replicas"]] == [(0, "prefill"), (1, "decode")]
    c = pd.client()
    asked = QUESTIONS[:3]

    def ask(q):
        r = c.chat.completions.create(model=MODEL, messages=chat(q), max_tokens=16)
        return r.choices[0].message.content, r.usage.completion_tokens, r.choices[0].finish_reason

    with ThreadPoolExecutor(len(asked)) as ex:  # at once: the decode replica batches them
        got = dict(zip(asked, ex.map(ask, asked)))
    assert got == {q: ref(smol, question=q) for q in asked}
    # streamed: the first token's text from one replica, the rest from the other, one role chunk
    text, n, reason = ref(smol, question=QUESTIONS[4])
    chunks = list(
        c.chat.completions.create(
            model=MODEL, messages=chat(QUESTIONS[4]), max_tokens=16, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.role) == 1
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == reason
    assert chunks[-1].usage.completion_tokens == n and chunks[-1].usage.prompt_tokens > 5
    # a stop string the decode replica meets in text that began at the prefill replica
    whole, _, _ = ref(smol, prompt="The capital of France is", max_tokens=12)
    assert "." in whole[1:]
    r = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, stop=["."])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (whole[: whole.index(".")], "stop")
    # one token: the prefill replica's alone, no KV handed on
    r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=1)
    assert (r.choices[0].text, r.usage.completion_tokens) == ref(smol, prompt="Once upon a time", max_tokens=1)[:2]


def test_a_bad_kv_hand_off_is_a_400_at_the_replica(pd, tmp_path):
    reps = health(pd)["replicas"]
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3}
    # only a .kv file in a folder made for the hand-off is ever opened: another path says nothing of its file
    for path in ("/nonexistent.kv", "/etc/hostname", "/dev/zero", str(tmp_path / "schedlab-kv-x" / "..")):
        r = httpx.post(reps[1]["url"] + "/v1/completions", json=body, headers={"x-schedlab-kv-import": path})
        assert r.status_code == 400 and "not a KV file a prefill replica hands on" in r.json()["error"]["message"]
    shared = tempfile.mkdtemp(prefix="schedlab-kv-", dir=tmp_path)
    r = httpx.post(reps[1]["url"] + "/v1/completions", json=body, headers={"x-schedlab-kv-import": f"{shared}/0.kv"})
    assert r.status_code == 400 and "no such KV file" in r.json()["error"]["message"]
    r = httpx.post(reps[1]["url"] + "/v1/completions", json=body, headers={"x-schedlab-kv-export": "1"})
    assert r.status_code == 400 and "--kv-dir" in r.json()["error"]["message"]
    r = pd.client().completions.create(model=MODEL, prompt="Hello", max_tokens=3)  # nothing else lost
    assert r.usage.completion_tokens == 3


def test_bad_pool_options_are_one_line_errors(tmp_path):
    from schedlab.api.replicas import pools
    from schedlab.errors import SchedlabError

    assert pools(0, 0, 1, False) is None and pools(2, 3, 1, False) == (2, 3)
    for args, said in [  # (called from Python: the options' Python names)
        ((1, 0, 1, False), "^prefill and decode go together"),
        ((2, -1, 1, False), "^prefill and decode go together"),
        ((1, 1, 3, False), "^replicas does not go with"),
        ((1, 1, 1, True), "^prefix_caching does not go with"),
    ]:
        with pytest.raises(SchedlabError, match=said):
            pools(*args)
    for args in (["run-real", "--trace", "mixed"],):  # (serve's is the same function's)
        p = subprocess.run(
            [*command(args[0]), *args[1:], "--policy", "vllm", "--prefill", "1"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        err = p.stderr.strip()
        assert p.returncode != 0 and "--prefill and --decode go together" in err and len(err.splitlines()) == 1, err


def test_shut_down_every_request_once_and_the_decode_replica_ran_no_prompt(pd):
    code, stdout = pd.stop()
    assert code == 0, "".join(pd.stderr)
    assert "1 prefill + 1 decode replicas" in "".join(pd.stderr)
    out = pd.out
    served = json.loads((out / "trace.json").read_text())["requests"]
    assert len(served) == len({r["id"] for r in served}) == 3 + 1 + 1 + 1 + 1  # + the 400s' good request
    on = [r for r in served if "kv" in r]
    assert [r for r in served if "kv" not in r] == [next(r for r in served if r["output_tokens"] == 1)]
    assert all(r["replicas"] == [0, 1] and r["kv"]["tokens"] == r["prompt_tokens"] for r in on)
    assert all(r["kv"]["exposed_s"] > 0 and r["kv"]["bytes"] > r["kv"]["tokens"] for r in on)
    assert all(r["kv"]["exposed_s"] == pytest.approx(r["kv"]["notice_s"] + r["kv"]["handoff_s"]) for r in on)
    pre, dec = (json.loads((out / f"replica-{i}" / "meta.json").read_text())["engine"] for i in (0, 1))
    moved = sum(r["prompt_tokens"] for r in on)
    assert pre["kv_exported_tokens"] == dec["kv_imported_tokens"] == moved
    assert dec["prefill_tokens"] == 0  # mlx-lm's hand-off: the first token is a decode row's input
    assert pre["decode_rows"] <= len(served)  # (the prefill replica: each prompt's last token at most)
    cluster = json.loads((out / "cluster.json").read_text())
    assert [(r["pool"], r["requests"]) for r in cluster["per_replica"]] == [
        ("prefill", len(served)),
        ("decode", len(on)),
    ]
    assert cluster["summary"]["finished"] == len(served)
    # each replica's own part: the prefill replica one token per request, the decode replica the
    # rest, from the KV's hand-off (its first token is the second): together the cluster's tokens
    whole = cluster["summary"]
    p, d = whole["replicas"]
    assert (p["pool"], p["total_output_tokens"], p["finished"]) == ("prefill", len(served), len(served))
    assert (d["pool"], d["finished"]) == ("decode", len(on))
    assert p["total_output_tokens"] + d["total_output_tokens"] == whole["total_output_tokens"]
    assert 0 < d["ttft_ms"]["p50"] and p["tpot_ms"]["p50"] is None  # (one token each: no TPOT there)
    # confirmed by the simulation of the same pools, with the link the front measured
    import schedlab
    from schedlab.api.cluster_validation import format_served

    link = cluster["link"]
    assert link["bandwidth_gbs"] > 0 and link["latency_s"] > 0
    v = schedlab.validate_served(out)
    assert v["pools"] == ["prefill", "decode"] and v["transfer"]["requests"] == len(on)
    assert v["total"]["metrics"]["ttft_ms.p50"]["sim"] > 0 and v["per_replica"][1]["metrics"]["itl_ms.p50"]["sim"] > 0
    assert "KV transfer (" in format_served(v)
