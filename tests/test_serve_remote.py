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


def test_fronts_over_ray_actors_and_over_replicas_they_did_not_start(tmp_path):
    """One pair of replicas for both: a front starts them as Ray actors on a local Ray; a second
    front routes to their URLs (``--replica-url``: replicas it did not start) and leaves them
    running when it stops; ending the first front ends the actors, their replicas and the Ray."""
    nowhere = _nowhere()
    dead = subprocess.Popen([*command("serve"), "--replica-url", nowhere], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    front = Served([*REPLICA, "--replicas", "2", "--executor", "ray", "--router", "round-robin"], tmp_path / "out")
    try:
        said = "".join(front.stderr)
        assert "2 replicas on Ray" in said, said
        reps = httpx.get(front.url + "/health").json()["replicas"]
        pids, urls = [r["pid"] for r in reps], [r["url"] for r in reps]
        assert all(r["up"] for r in reps) and len(set(pids)) == 2 and all(map(_alive, pids))
        ray_procs = _children(front.proc.pid)  # (the local Ray the front started: its processes)
        assert ray_procs and not set(pids) & set(ray_procs)  # (each replica a child of its actor)
        got = _answers(front)
        assert [_received(u) for u in urls] == [1, 1] and all(got.values())

        # a front over the same replicas by URL: it routes to both and never owns them
        other = Served(["--replica-url", urls[0], "--replica-url", urls[1] + "/", "--router", "round-robin"],
                       tmp_path / "front")  # fmt: skip
        said = "".join(other.stderr)
        assert "2 replicas at the URLs given" in said and "policy vllm" in said and f"model {MODEL}" in said, said
        c = other.client()  # (chats: its ids are its own, not the first front's chatcmpl-0 and -1 again)
        again = [c.chat.completions.create(model=MODEL, messages=chat(q), max_tokens=4) for q in ASKED]
        assert all(a.choices[0].message.content for a in again) and len({a.id for a in again}) == 2
        assert [_received(u) for u in urls] == [2, 2] and len(again) == 2  # (one each: round-robin)
        h = httpx.get(other.url + "/health").json()
        assert [(r["url"], r["routed"], r["pid"], r["started"]) for r in h["replicas"]] == [
            (u, 1, None, False) for u in urls
        ]
        rc, stdout = other.stop()
        assert rc == 0, "".join(other.stderr)
        assert "replica 0: not started here, left running" in stdout, stdout
        info = json.loads((tmp_path / "front" / "cluster.json").read_text())
        assert [(p["url"], p["requests"], p["run_dir"]) for p in info["per_replica"]] == [(u, 1, None) for u in urls]
        assert info["policy"] == "vllm" and info["model"] == MODEL
        assert all(map(_alive, pids)) and [httpx.get(u + "/health").json()["status"] for u in urls] == ["ok", "ok"]
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

        rc, stdout = front.stop()
        assert rc == 0, "".join(front.stderr)
        assert re.search(r"Successful requests:\s+2\b", stdout)
        # ending the front ended the actors, their replica processes and the local Ray
        until("the replicas and the local Ray gone", lambda: not [p for p in pids + ray_procs if _alive(p)], 30)
        for i in (0, 1):  # each replica wrote its run directory as it shut down
            assert json.loads((tmp_path / "out" / f"replica-{i}" / "summary.json").read_text())["finished"] == 2
    finally:
        if front.proc.poll() is None:
            front.proc.kill()
            front.proc.wait()
    # the replica URL where nothing answers (on the command line): one line, status 2
    _, err = dead.communicate(timeout=60)
    assert dead.returncode == 2 and len(err.strip().splitlines()) == 1, err
    assert f"replica 0 at {nowhere} does not answer (ConnectError" in err, err
