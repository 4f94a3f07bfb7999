"""Replicas started as Ray actors (``serve --replicas N --executor ray [--ray-address ADDR]``):
each actor (one of Ray's CPUs) runs a ``schedlab serve`` process on its node, and the front
reaches it by URL, as it does a ``--replica-url`` one. Without an address a local Ray is started
in this process (N CPUs; ``analysis.executors``, as ``capacity`` starts one) and shut down with
the front; with one, the actors run on that cluster (whose nodes have the same schedlab and
model), each replica listening on its node's address.

The front owns them as it owns its processes: ending the front (its shutdown, a signal) ends
every actor, whose replica process dies with it (PR_SET_PDEATHSIG); so does the front's death
(Ray ends the actors a dead driver owned)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from typing import Any

from schedlab.errors import SchedlabError

from .replicas import _LISTENING, Replica, replica_command, spawn

FOLLOW_S = 1.0  # how long one call to an actor waits for news of its replica


class ReplicaActor:
    """In a Ray worker: one ``schedlab serve`` process (``args``, on 127.0.0.1 for a local Ray,
    else on every address of the node, its URL then the node's), its stderr kept for the front."""

    def __init__(self, args: list[str], local: bool):
        import ray

        self.node = "127.0.0.1" if local else ray.util.get_node_ip_address()
        self.argv = [*replica_command(), *args, "--host", "127.0.0.1" if local else "0.0.0.0", "--port", "0", "-q"]
        self.lines: list[str] = []
        self.status: int | None = None
        self.pid: int | None = None
        self.proc: subprocess.Popen | None = None
        self.news = threading.Condition()
        # the thread that starts the process waits for it (PR_SET_PDEATHSIG is that thread's)
        threading.Thread(target=self._run, name="replica", daemon=True).start()

    def _run(self) -> None:
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        try:
            proc = spawn(self.argv, env)  # (it dies with this thread, so with this actor)
        except OSError as exc:
            with self.news:
                self.lines.append(f"serve: error: cannot start: {exc}")
                self.status = 1
                self.news.notify_all()
            return
        with self.news:
            self.proc, self.pid = proc, proc.pid
        for line in iter(proc.stderr.readline, ""):
            line = line.rstrip("\n")
            m = _LISTENING.search(line)
            if m and "0.0.0.0" in m.group(1):
                line = line.replace(m.group(1), m.group(1).replace("0.0.0.0", self.node))
            with self.news:
                self.lines.append(line)
                self.news.notify_all()
        status = proc.wait()
        with self.news:
            self.status = status
            self.news.notify_all()

    def follow(self, seen: int, timeout: float) -> dict[str, Any]:
        """The lines after the first ``seen``, once there are any, it has ended or ``timeout`` s passed."""
        with self.news:
            self.news.wait_for(lambda: len(self.lines) > seen or self.status is not None, timeout)
            return {"lines": self.lines[seen:], "status": self.status, "pid": self.pid, "node": self.node}

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)


def start_ray(n: int, address: str | None):
    """Ray, started here (a local Ray of ``n`` CPUs, or connected to ``address``) unless it
    already is: (the ``ray`` module, whether this call started it); one-line errors."""
    from schedlab.analysis.executors import ExecutorUnavailable, _start_ray

    try:
        import ray

        before = ray.is_initialized()
    except ImportError:
        before = False
    try:
        ray = _start_ray(n, address)
    except ExecutorUnavailable as exc:
        raise SchedlabError(str(exc), 2) from None
    return ray, not before


class RayReplica(Replica):
    """A replica as a Ray actor, as the front knows it: its process's lines and exit status come
    from the actor (``ReplicaActor.follow``, in a thread); signalled through it, ended with it."""

    def __init__(self, index: int, args: list[str], ray, local: bool):
        super().__init__(index, args, [])
        self.ray, self.local = ray, local
        self.actor = None
        self._pid: int | None = None
        self.node: str | None = None
        self._status: int | None = None

    @property
    def started(self) -> bool:
        return self.actor is not None

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def where(self) -> str:
        return f"Ray actor, pid {self._pid}" + ("" if self.local else f" on {self.node}")

    def start(self, echo) -> None:
        actor = self.ray.remote(ReplicaActor).options(num_cpus=1, max_concurrency=4)
        self.actor = actor.remote(self.argv, self.local)
        self._reader = threading.Thread(target=self._follow, args=(echo,), name=f"replica-{self.index}", daemon=True)
        self._reader.start()

    def _follow(self, echo) -> None:
        seen = 0
        while True:
            try:
                got = self.ray.get(self.actor.follow.remote(seen, FOLLOW_S))
            except Exception as exc:  # (RayActorError: the actor, or its node, is gone)
                self.lines.append(f"its Ray actor ended ({type(exc).__name__})")
                self._status = -int(signal.SIGKILL)
                return
            self._pid, self.node = got["pid"], got["node"]
            for line in got["lines"]:
                self._line(line, echo)
            seen += len(got["lines"])
            if got["status"] is not None:
                self._status = got["status"]
                return

    def poll(self) -> int | None:
        return self._status

    def wait(self, timeout: float) -> int:
        self._reader.join(timeout)
        if self._status is None:
            self.kill()
            self._reader.join(10)
        return self._status if self._status is not None else -int(signal.SIGKILL)

    def signal(self, signum: int) -> None:
        if self.actor is not None and self._status is None:
            self.actor.signal.remote(signum)

    def kill(self) -> None:
        """The actor killed: its replica process dies with it."""
        self.release()

    def release(self) -> None:
        if self.actor is not None:
            try:
                self.ray.kill(self.actor, no_restart=True)
            except Exception:  # pragma: no cover - (already gone)
                pass
