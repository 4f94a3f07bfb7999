"""N replicas behind one front (``Cluster``): ``serve --replicas N`` (``serve_cluster``) and
``run-real --replicas N`` (``run_real_cluster``, a trace fed to the front at its arrival times);
the replicas processes it starts here, Ray actors it starts (``executor="ray"``:
``ray_replicas``) or servers already listening at the URLs it is given (``urls``: ``serve
--replica-url``); prefill and decode apart, with the link between them measured first
(``probe_link``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from schedlab.errors import SchedlabError

from .front import Front
from .http import listening, server_config
from .record import cluster_json, cluster_summary, write_served_trace
from .result import ClusterRun
from .replicas import POLL_S, Remote, Replica, _ended, _reap, _wait_listening, check_remote, cpu_shares, replica_command

PROBE_S = 0.5  # how often a replica down after a connection error (its process alive) is tried again


class Cluster:
    """N replicas and the front: ``start`` (every replica listening, then the front), ``watch``
    (the replicas' processes, once), ``shutdown`` (no new requests; the replicas finish theirs and
    exit; those at ``urls``, not started here, go on), ``finish`` (the files and the summary).
    ``executor``: "local" (processes here) or "ray" (Ray actors, on a local Ray or the cluster at
    ``ray_address``); ``urls``: the replicas are the servers there (``n`` and the executor unused)."""

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
        policy_name: str | None,
        served_name: str | None,
        log,
        prog: str = "serve",
        pools: tuple[int, int] | None = None,
        decode_router=None,
        urls: list[str] | None = None,
        executor: str = "local",
        ray_address: str | None = None,
    ):
        self.replicas: list[Replica] = []
        self.kv_dir = None  # prefill and decode apart: where the prefill replicas write the KV they hand on
        self.ray, self.ray_started = None, False  # (executor "ray": Ray, and whether this front started it)
        if pools is not None:
            from schedlab.engine import kvfile

            self.kv_dir = kvfile.shared_dir()
        if urls:
            self.replicas = [Remote(i, u) for i, u in enumerate(urls)]
        elif executor == "ray":  # (Ray started now: ray.init's handlers come before owned()'s)
            from .ray_replicas import RayReplica, start_ray

            self.ray, self.ray_started = start_ray(n, ray_address)
            for i in range(n):
                args = [*replica_args, *(["--out", str(Path(out) / f"replica-{i}")] if out is not None else [])]
                self.replicas.append(RayReplica(i, args, self.ray, ray_address is None))
        shares = cpu_shares(n) if not self.replicas else []
        for i in range(len(shares)):
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
        check_remote(replicas)  # (a URL that does not answer: one line)
        for r in replicas:
            r.up = True
        if self.kv_dir is not None:
            self.link = probe_link(self.kv_dir, next(r.url for r in replicas if r.pool == "decode"))
        model_name = self.served_name or _model_name(replicas[0])
        if not all(r.owned for r in replicas):  # the replicas at URLs: one model, their policies
            _same_model(replicas, model_name)
            self.policy_name = self.policy_name or _policies(replicas)
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
            + ", ".join(f"{r.index}{f' {r.pool}' if r.pool else ''} {r.url} ({r.where})" for r in replicas),
        )
        return self.url

    def watch(self) -> None:
        """Look at the replicas once: a process that ended is down; one down after a connection
        error whose process lives is tried again (every ``PROBE_S``)."""
        _watch(self.front, self.replicas)
        if time.monotonic() - self._last_probe >= PROBE_S:
            self._last_probe = time.monotonic()
            _probe(self.front, self.replicas)

    def shutdown(self) -> None:
        """No new requests (503); the replicas get SIGTERM, finish what they hold and exit; until
        they have and the front's requests in flight ended."""
        front = self.front
        front.closing = True
        self.log("progress", f"shutting down: finishing {front.in_flight} request(s) in flight")
        for r in self.replicas:
            r.signal(signal.SIGTERM)
        gone_at = None
        while True:
            _watch(front, self.replicas)
            if all(r.dead or not r.owned for r in self.replicas):
                gone_at = gone_at or time.monotonic()
                # what is left in flight ends as the replicas' connections close (bounded: a response
                # whose client went away before it began never says it ended), or as the replicas
                # not started here, still up, finish it
                left = any(r.up for r in self.replicas if not r.owned)
                if front.in_flight <= 0 or (time.monotonic() - gone_at > 5 and not left):
                    break
            time.sleep(POLL_S)

    def kill(self) -> None:
        """End every replica started here now, whatever it is doing (loading, calibrating,
        serving): each one's session (or Ray actor) killed, then reaped."""
        for r in self.replicas:
            r.kill()
        _reap(self.replicas, 10)

    def close(self) -> None:
        """Stop the front's server and every replica left (SIGTERM, then SIGKILL after 30 s)."""
        hs = self._http.get("server")
        if hs is not None:
            hs.should_exit = True
            self._http["thread"].join(timeout=10)
        for r in self.replicas:
            r.signal(signal.SIGTERM)
        _reap(self.replicas, 30)
        for r in self.replicas:
            r.release()
        if self.ray_started:  # (a local Ray, or a connection, that this front started)
            self.ray.shutdown()
            self.ray_started = False
        if self.kv_dir is not None:
            import shutil

            shutil.rmtree(self.kv_dir, ignore_errors=True)

    def finish(self) -> dict[str, Any]:
        """Write ``OUT/trace.json`` and ``OUT/cluster.json``; the summary."""
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
        return summary

    def report(self, summary: dict[str, Any]) -> str:
        """The summary as ``vllm bench serve`` prints it, and a line of how the replicas fared."""
        from schedlab.sim.metrics import format_summary

        front = self.front
        return (
            format_summary(summary)
            + f"\nCluster: {front.retries} request(s) retried on another replica, {front.failures} failed; "
            + ", ".join(f"replica {r.index}: {_ended(r)}" for r in self.replicas)
        )


@contextlib.contextmanager
def owned(cluster: Cluster, on_signal):
    """While the block runs the cluster owns its replicas: SIGINT and SIGTERM go to ``on_signal``
    (in the main thread: Python hands signals to no other, and there the default handlers stay);
    a ``KeyboardInterrupt`` (raised by it, or Ctrl-C's) ends every replica at once, calibrating or
    not, and goes on up. Whichever way the block ends, the front stops and no replica is left.
    The replicas also die with this process (``replicas.Replica``: PR_SET_PDEATHSIG)."""
    old = {}
    if threading.current_thread() is threading.main_thread():
        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            yield cluster
        except KeyboardInterrupt:
            cluster.kill()
            raise
        finally:
            cluster.close()
    except KeyboardInterrupt:  # (a signal while closing: no waiting for anyone)
        cluster.kill()
        raise
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def serve_cluster(
    n: int,
    router,
    router_options: dict,
    replica_args: list[str],
    *,
    host: str,
    port: int,
    out: Path | None,
    policy_name: str | None,
    served_name: str | None,
    sequential: bool,
    log,
    pools: tuple[int, int] | None = None,
    decode_router=None,
    urls: list[str] | None = None,
    executor: str = "local",
    ray_address: str | None = None,
) -> ClusterRun:
    """``serve --replicas N``: run the cluster until SIGINT/SIGTERM; what it served. ``pools``:
    (P, D), ``serve --prefill P --decode D``: the first P replicas prefill, the other D decode
    (``decode_router`` routes among those). ``urls``, ``executor``, ``ray_address``: see ``Cluster``."""
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
        urls=urls,
        executor=executor,
        ray_address=ray_address,
    )
    state = {"signals": 0, "serving": False}

    def on_signal(signum, frame) -> None:
        state["signals"] += 1
        if not state["serving"] or state["signals"] > 1:
            raise KeyboardInterrupt  # still starting, or a second signal: stop now

    with owned(cluster, on_signal):
        url = cluster.start(sequential)
        state["serving"] = True
        front = cluster.front
        what = f"{pools[0]} prefill + {pools[1]} decode replicas" if pools else f"{len(cluster.replicas)} replicas"
        what += " at the URLs given" if urls else " on Ray" if executor == "ray" else ""
        print(
            f"serve: listening on {url} ({what}, router {front.router_name}, "
            f"policy {front.policy}, model {front.model_name})",
            file=sys.stderr,
            flush=True,
        )
        while state["signals"] == 0:
            time.sleep(POLL_S)
            cluster.watch()
        cluster.shutdown()  # the first signal: the replicas finish what they hold
    summary = cluster.finish()
    return ClusterRun(summary, [], out, cluster.report(summary))


def run_real_cluster(
    trace,
    n: int,
    router,
    router_options: dict,
    replica_args: list[str],
    *,
    out: Path | None,
    policy_name: str | None,
    ignore_eos: bool,
    sequential: bool,
    log,
    pools: tuple[int, int] | None = None,
    decode_router=None,
    executor: str = "local",
    ray_address: str | None = None,
) -> ClusterRun:
    """``run-real --replicas N``: the cluster of ``serve --replicas N`` on 127.0.0.1, fed ``trace``
    at its arrival times by an HTTP client (each request's text, ``max_tokens`` its output tokens,
    the trace's ids), then shut down; ``OUT`` as ``serve --replicas`` writes it."""
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
        executor=executor,
        ray_address=ray_address,
    )
    errors: dict[str, str] = {}
    # SIGTERM (timeout, a job scheduler, a container stop) ends the run as Ctrl-C does
    with owned(cluster, _interrupt):
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
    summary = cluster.finish()
    problems = [f"request {rid}: {why}" for rid, why in errors.items()]
    return ClusterRun(summary, problems, out, cluster.report(summary))


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


def _watch(front: Front, replicas: list[Replica]) -> None:
    for r in replicas:
        if r.owned and not r.dead and r.poll() is not None:
            r.dead = True
            r.exit_status = r.poll()
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
            front.log("warning", f"replica {r.index} ({r.where}) answers again: up")


def _model_name(r: Replica) -> str:
    import httpx

    try:
        return httpx.get(r.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        raise SchedlabError(f"replica {r.index} at {r.url} does not say which model it serves") from None


def _same_model(replicas: list[Replica], name: str) -> None:
    for r in replicas[1:]:
        other = _model_name(r)
        if other != name:
            raise SchedlabError(
                f"replica {r.index} at {r.url} serves model {other}, replica 0 at {replicas[0].url} serves {name}: "
                f"a front routes to replicas of one model",
                2,
            )


def _policies(replicas: list[Replica]) -> str:
    """The policies the replicas at URLs say they run (their ``/info``), one name or several."""
    import httpx

    names = []
    for r in replicas:
        try:
            name = str(httpx.get(r.url + "/info", timeout=10).json().get("policy") or "?")
        except (httpx.HTTPError, ValueError, AttributeError):
            name = "?"
        if name not in names:
            names.append(name)
    return ",".join(names)
