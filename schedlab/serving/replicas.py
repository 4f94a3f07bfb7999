"""The replicas a front routes to. ``Replica``: a process it starts, each a ``schedlab serve`` on
127.0.0.1 and a free port, pinned to its share of the cores, in a session of its own; started,
waited for, signalled, killed and reaped here. The process that starts them owns them: a replica
dies with it (PR_SET_PDEATHSIG on Linux; ``single.exit_with_front`` elsewhere). ``Remote``: a
``schedlab serve`` already listening at a URL (``serve --replica-url``), which the front reads and
routes to as it does its own but never starts, signals or ends. (``ray_replicas``: replicas
started as Ray actors.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from schedlab.errors import SchedlabError

POLL_S = 0.05  # how often the main thread looks at the replica processes
PROBE_S = 0.5  # how often a replica down after a connection error (its process alive) is tried again
_LISTENING = re.compile(r"listening on (http://[^\s]+:\d+)")


def cpu_shares(n: int) -> list[list[int]]:
    """The cores this process may use, split into ``n`` contiguous shares (one core each, round
    the cores, when there are fewer cores than replicas)."""
    if hasattr(os, "sched_getaffinity"):
        cores = sorted(os.sched_getaffinity(0))
    else:  # pragma: no cover - macOS: no affinity; the shares only size the thread counts
        cores = list(range(os.cpu_count() or 1))
    k = len(cores)
    if k >= n:
        return [cores[i * k // n : (i + 1) * k // n] for i in range(n)]
    return [[cores[i % k]] for i in range(n)]


def _death_signal():
    """``prctl`` (Linux), for a replica's preexec_fn: killed when the front dies."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        prctl = None
    return prctl


_PRCTL = _death_signal()


def spawn(argv: list[str], env: dict[str, str], cpus: list[int] | None = None) -> subprocess.Popen:
    """A replica's ``schedlab serve`` process, its stderr piped, in a session of its own (a Ctrl-C
    at a terminal reaches its parent only, which tells it), on ``cpus`` if given; killed when the
    thread that starts it ends (PR_SET_PDEATHSIG: the parent's main thread, or the thread that
    waits for it)."""
    parent = os.getpid()

    def preexec() -> None:  # in the child, before exec
        if cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cpus)
        if _PRCTL is not None and sys.platform.startswith("linux"):
            # SIGKILL: nobody is left to answer to, so nothing to finish (a SIGTERM would let a
            # replica that is still calibrating go on for minutes)
            _PRCTL(1, int(signal.SIGKILL))
            if os.getppid() != parent:  # the parent died before that: no signal will come
                os._exit(1)

    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
        preexec_fn=preexec,
    )


class Replica:
    """One replica process as the front knows it."""

    owned = True  # the front started it: it ends it (a ``Remote`` one it only routes to)

    def __init__(self, index: int, argv: list[str], cpus: list[int], pool: str | None = None):
        self.index = index
        self.pool = pool  # "prefill" or "decode" when prefill and decode run apart, else None
        self.argv = argv
        self.cpus = cpus
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.listening = threading.Event()
        self.up = False
        self.dead = False  # its process exited
        self.exit_status: int | None = None
        self.down_s: float | None = None  # when it went down (front time)
        self.down_reason: str | None = None
        self.failed = False  # it went down while the cluster served (not at its shutdown)
        self.routed = 0  # routing decisions that named it (a retry's included)
        self.in_flight = 0  # requests being relayed from it now
        self.sent = [0, 0, 0]  # requests, prompt tokens, output tokens forwarded to it (cumulative)
        self.last_state: dict[str, Any] | None = None
        self.lines: list[str] = []  # its stderr, but for the listening line
        self._reader: threading.Thread | None = None

    @property
    def started(self) -> bool:
        return self.proc is not None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def where(self) -> str:
        """How a line names it: its process (and cores)."""
        return f"pid {self.pid}" + (f", cpus {_cpus(self.cpus)}" if self.cpus else "")

    def poll(self) -> int | None:
        """Its exit status once its process has ended, else None."""
        return self.proc.poll() if self.proc is not None else None

    def wait(self, timeout: float) -> int:
        """Until its process ends (killed past ``timeout`` s): its exit status."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def release(self) -> None:
        """What holds it once it has ended (a Ray actor: ``ray_replicas``); nothing for a process."""

    def start(self, echo) -> None:
        threads = str(len(self.cpus))
        env = dict(
            os.environ, OPENBLAS_NUM_THREADS=threads, OMP_NUM_THREADS=threads, SCHEDLAB_FRONT_PID=str(os.getpid())
        )
        self.proc = spawn(self.argv, env, self.cpus)
        self._reader = threading.Thread(target=self._read, args=(echo,), name=f"replica-{self.index}", daemon=True)
        self._reader.start()

    def _read(self, echo) -> None:
        for line in iter(self.proc.stderr.readline, ""):
            self._line(line.rstrip("\n"), echo)

    def _line(self, line: str, echo) -> None:
        """One line of its stderr: the listening line gives its URL; the others are echoed."""
        if self.url is None:
            m = _LISTENING.search(line)
            if m:
                self.url = m.group(1)
                self.listening.set()
                return
        self.lines.append(line)
        if self.url is None and re.match(r"(schedlab )?serve: error: ", line):
            return  # (one that does not start: the front says why, in one line)
        echo(self.index, line)

    def last_line(self) -> str:
        if self._reader is not None:
            self._reader.join(timeout=2)
        lines = [x for x in self.lines if x.strip()]
        errors = [x for x in lines if "error" in x]
        text = (errors or lines or ["(nothing on stderr)"])[-1]
        return re.sub(r"^(schedlab )?serve: (error: )?", "", text)

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.send_signal(signum)
            except ProcessLookupError:  # pragma: no cover - it just exited
                pass

    def kill(self) -> None:
        """End it now, whatever it is doing, with anything it started (its own session)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # pragma: no cover - it just exited
                self.proc.kill()

    def describe(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "url": self.url,
            "pid": self.pid,
            "cpus": self.cpus,
            **({} if self.owned else {"started": False}),
            **({"pool": self.pool} if self.pool else {}),
            "up": self.up,
            "routed": self.routed,
            "in_flight": self.in_flight,
        }


class Remote(Replica):
    """A ``schedlab serve`` already listening at ``url`` (``serve --replica-url``): routed to and
    read (``/state``, ``/prepare``, ``/health``) as a replica the front started, down when a
    connection to it fails and up again once it answers, but never started, signalled or ended
    here: it goes on serving when the front stops."""

    owned = False

    def __init__(self, index: int, url: str):
        super().__init__(index, [], [])
        self.url = url.rstrip("/")
        self.listening.set()

    @property
    def started(self) -> bool:
        return False

    @property
    def where(self) -> str:
        return self.url

    def start(self, echo) -> None:
        pass

    def signal(self, signum: int) -> None:
        pass

    def kill(self) -> None:
        pass


def check_remote(replicas: list[Replica]) -> None:
    """Each ``Remote`` replica answers as a ``schedlab serve`` replica (its ``/state``, what the
    front routes by): else one line naming the first that does not (exit status 2)."""
    import httpx

    for r in replicas:
        if r.owned:
            continue
        try:
            resp = httpx.get(r.url + "/state", timeout=5.0)
            ok = resp.status_code == 200 and isinstance(resp.json(), dict) and "waiting" in resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            why = f"does not answer ({type(exc).__name__}{f': {exc}' if str(exc) else ''})"
        else:
            if ok:
                continue
            why = f"answers GET /state with {resp.status_code}, not a replica's state (a `schedlab serve` of one replica?)"
        raise SchedlabError(f"replica {r.index} at {r.url} {why}", 2)


def check_urls(urls) -> list[str]:
    """``--replica-url`` values: each http(s)://host:port, no two alike; one-line errors."""
    from urllib.parse import urlsplit

    out = []
    for u in urls:
        parts = urlsplit(str(u).strip())
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
            raise SchedlabError(f"replica URL {u!r} is not http://host:port", 2)
        url = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"
        if url in out:
            raise SchedlabError(f"replica URL {u!r} is given twice", 2)
        out.append(url)
    return out


def replica_command() -> list[str]:
    """The argv that runs ``schedlab serve`` in this environment."""
    return [
        sys.executable,
        "-c",
        "import sys; from schedlab.cli import main; sys.argv[0] = 'schedlab'; main()",
        "serve",
    ]


def _cpus(cpus: list[int]) -> str:
    return ",".join(map(str, cpus))


def _ended(r: Replica) -> str:
    s = r.exit_status
    if not r.owned:
        return "not started here, left running"
    if s is None:
        return "running"
    if s < 0:
        return f"killed by signal {-s}" + (f" at {r.down_s:.2f} s" if r.down_s is not None else "")
    return f"exit status {s}"


def _wait_listening(wait: list[Replica], every: list[Replica]) -> None:
    """Until every replica of ``wait`` listens; one that exits first stops them all (one line)."""
    while True:
        if all(r.listening.is_set() for r in wait):
            return
        for r in wait:
            if not r.listening.is_set() and r.poll() is not None:
                why = r.last_line()
                for other in every:
                    other.signal(signal.SIGTERM)
                _reap(every, 10)
                raise SchedlabError(f"replica {r.index} did not start: {why}")
        time.sleep(POLL_S)


def _reap(replicas: list[Replica], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for r in replicas:
        if not r.owned or not r.started:
            continue
        r.exit_status = r.wait(max(deadline - time.monotonic(), 0.1))
        r.dead = True
        if r._reader is not None:
            r._reader.join(timeout=2)


def serve_args(
    policy: str,
    options: dict[str, Any] | None = None,
    *,
    model: str,
    dtype: str = "float32",
    sampling: str = "greedy",
    seed: int = 0,
    model_seed: int = 0,
    block_size: int = 16,
    prefix_caching: bool = False,
    profile: str | None = None,
    kv_tokens: int | None = None,
    noise: str | None = None,
    calibrate: bool = False,
    max_tokens: int | None = None,
    served_name: str | None = None,
    max_waiting: int | None = None,
    speculative: str | None = None,
) -> list[str]:
    """The options of ``schedlab serve`` one replica process starts with (each loads the policy,
    the model and its cost model itself): ``policy`` a bundled name or ``file.py:Class``,
    ``options`` its options; the rest as ``serve``'s flags."""
    args = ["--policy", policy, "--model", model, "--dtype", dtype, "--block-size", str(block_size)]
    args += ["--sampling", sampling, "--seed", str(seed), "--model-seed", str(model_seed)]
    args += [x for k, v in (options or {}).items() for x in ("-o", f"{k}={v}")]
    for flag, value in (
        ("--max-tokens", max_tokens),
        ("--served-model-name", served_name),
        ("--profile", profile),
        ("--kv-tokens", kv_tokens),
        ("--noise", noise),
        ("--speculative", speculative),
        ("--max-waiting", max_waiting),
    ):
        args += [flag, str(value)] if value is not None else []
    return args + ["--calibrate"] * calibrate + ["--prefix-caching"] * prefix_caching
