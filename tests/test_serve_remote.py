"""A front over replicas it did not start (``serve --replica-url``) and over replicas it starts as
Ray actors (``serve --replicas 2 --executor ray``), each a real ``schedlab serve`` of SmolLM2-135M
(the smallest model that takes text: ``tiny`` has no tokenizer), driven by the ``openai`` SDK.

By URL: two replica servers started by hand, a front routing to both (round-robin: two requests
each, as each replica's own ``/state`` counts them); stopping the front leaves them serving. On
Ray: a real local Ray (2 CPUs, one per replica) started by the front, the replicas reached by URL;
ending the front ends the actors and their replica processes. Ray is a test dependency (CI installs
``schedlab[ray]``): without it the Ray test fails, as it should.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from simkit import command, until
from test_serve_cluster import _alive
from test_server import MODEL, Served, chat

import schedlab

pytestmark = pytest.mark.slow  # real replicas of a real model

REPLICA = ["--policy", "vllm", "--model", MODEL, "--no-calibrate", "--kv-tokens", "320", "--max-tokens", "8"]
ASKED = ["What is 2+2?", "Say hello."]  # (round-robin: one each)


def _answers(s: Served) -> dict[str, str]:
    c = s.client()
    with ThreadPoolExecutor(len(ASKED)) as ex:
        got = ex.map(lambda q: c.chat.completions.create(model=MODEL, messages=chat(q), max_tokens=4), ASKED)
        return {q: r.choices[0].message.content for q, r in zip(ASKED, got)}


def _received(url: str) -> int:
    return httpx.get(url + "/state", timeout=10).json()["received"]["requests"]


def _children(pid: int) -> list[int]:
    kids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(d.name))
            except OSError:
                continue
    return kids


def _nowhere() -> str:
    """A URL where nothing listens (a port just free)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_a_front_routes_to_replicas_it_did_not_start_and_leaves_them_running(tmp_path):
    nowhere = _nowhere()
    dead = subprocess.Popen([*command("serve"), "--replica-url", nowhere], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    with ThreadPoolExecutor(2) as ex:  # (at once: each loads the model)
        replicas = list(ex.map(lambda i: Served(REPLICA, tmp_path / f"by-hand-{i}"), range(2)))
    urls = [r.url for r in replicas]
    try:
        front = Served(["--replica-url", urls[0], "--replica-url", urls[1] + "/", "--router", "round-robin"],
                       tmp_path / "front")  # fmt: skip
        said = "".join(front.stderr)
        assert "2 replicas at the URLs given" in said and "policy vllm" in said and f"model {MODEL}" in said, said
        got = _answers(front)
        # routed to both: each replica's own count, and the front's
        assert [_received(u) for u in urls] == [1, 1]
        h = httpx.get(front.url + "/health").json()
        assert [(r["url"], r["routed"], r["pid"], r["started"]) for r in h["replicas"]] == [
            (u, 1, None, False) for u in urls
        ]
        # the answers are the replicas' own (greedy: the same question asked of a replica directly)
        direct = replicas[1].client().chat.completions.create(model=MODEL, messages=chat(ASKED[0]), max_tokens=4)
        assert got[ASKED[0]] == direct.choices[0].message.content and all(got.values())

        rc, stdout = front.stop()
        assert rc == 0, "".join(front.stderr)
        assert "replica 0: not started here, left running" in stdout, stdout
        info = json.loads((tmp_path / "front" / "cluster.json").read_text())
        assert [(p["url"], p["requests"], p["run_dir"]) for p in info["per_replica"]] == [(u, 1, None) for u in urls]
        assert info["policy"] == "vllm" and info["model"] == MODEL
        # the replicas go on serving
        assert all(r.proc.poll() is None for r in replicas)
        assert [httpx.get(u + "/health").json()["status"] for u in urls] == ["ok", "ok"]
        assert [_received(u) for u in urls] == [1, 2]  # (and replica 1 had the direct question)
    finally:
        for r in replicas:
            if r.proc.poll() is None:
                rc, _ = r.stop()
                assert rc == 0, "".join(r.stderr)

    # the replica URL where nothing answers (on the command line: one line, status 2) and the rest
    # through the API
    _, err = dead.communicate(timeout=60)
    assert dead.returncode == 2 and len(err.strip().splitlines()) == 1, err
    assert f"replica 0 at {nowhere} does not answer (ConnectError" in err, err
    for kwargs, words in (
        (dict(replica_urls=[urls[0]], replicas=2), "replicas does not go with the replicas at URLs"),
        (dict(replica_urls=urls, policy="vllm"), "run their own policies: leave out policy"),
        (dict(replica_urls=urls, kv_tokens=100), "kv_tokens does not go with replica_urls"),
        (dict(replica_urls=["localhost"]), "replica URL 'localhost' is not http://host:port"),
        (dict(replica_urls=[urls[0], urls[0] + "/"]), "is given twice"),
        (dict(policy="vllm", executor="ray"), "executor ray starts the replicas of replicas N > 1"),
        (dict(policy="vllm", executor="ray", prefill=1, decode=1), "executor ray does not go with prefill/decode"),
        (dict(policy="vllm", ray_address="x:1"), "ray_address goes with the ray executor"),
        (dict(), "policy is needed"),
    ):
        with pytest.raises(schedlab.SchedlabError, match=re.escape(words)):
            schedlab.serve(**kwargs)


def test_replicas_started_as_ray_actors_on_a_local_ray(tmp_path):
    front = Served([*REPLICA, "--replicas", "2", "--executor", "ray", "--router", "round-robin"], tmp_path / "out")
    try:
        said = "".join(front.stderr)
        assert "2 replicas on Ray" in said, said
        h = httpx.get(front.url + "/health").json()
        reps = h["replicas"]
        pids = [r["pid"] for r in reps]
        assert all(r["up"] for r in reps) and len(set(pids)) == 2 and all(map(_alive, pids))
        ray_procs = _children(front.proc.pid)  # (the local Ray the front started: its processes)
        assert ray_procs and not set(pids) & set(ray_procs)  # (each replica a child of its actor)
        got = _answers(front)
        assert [_received(r["url"]) for r in reps] == [1, 1] and all(got.values())
        rc, stdout = front.stop()
        assert rc == 0, "".join(front.stderr)
        assert re.search(r"Successful requests:\s+2\b", stdout)
        # ending the front ended the actors, their replica processes and the local Ray
        until("the replicas and the local Ray gone", lambda: not [p for p in pids + ray_procs if _alive(p)], 30)
        for i in (0, 1):  # each replica wrote its run directory as it shut down
            assert json.loads((tmp_path / "out" / f"replica-{i}" / "summary.json").read_text())["finished"] == 1
    finally:
        if front.proc.poll() is None:
            front.proc.kill()
            front.proc.wait()
