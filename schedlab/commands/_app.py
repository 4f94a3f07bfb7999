"""What the commands share: one-line errors and exit codes, ``-o key=value`` options, the
help of options several commands have, and the closing report of rejected requests and aborted
runs. The work itself is the API's (``schedlab``'s public functions)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import NoReturn

import typer

from ..errors import _CLI, SchedlabError, SchedlabWarning, one_line, user_error_types

# the help of options several commands share
BLOCK_SIZE_HELP = "KV block size in tokens: KV is allocated in blocks (a request holds ceil(tokens / block))"
EXECUTOR_HELP = "where the simulations run: local (worker processes) or ray (Ray tasks; pip install 'schedlab[ray]')"
RAY_ADDRESS_HELP = (
    "with --executor ray: an existing Ray cluster (host:6379 or ray://host:10001); "
    "default: a local Ray started for this command"
)
PREFIX_HELP = "block-level prefix caching (vLLM's automatic prefix caching): cached prefixes are not computed again"
CONCURRENCY_HELP = (
    "closed-loop clients: at most C requests in flight, the next one sent when one finishes "
    "(vllm bench serve --max-concurrency)"
)
RATE_HELP = (
    "issue requests at this rate (req/s; inf: all at once) in trace order, replacing the trace's "
    "arrival times (vllm bench serve --request-rate)"
)
BURST_HELP = "with --request-rate: gamma shape of the gaps (1: Poisson, the default; vllm bench serve --burstiness)"
THINK_HELP = "with --max-concurrency: seconds a client waits after a response before its slot is free again"
PREFILL_HELP = (
    "with --decode: prefill and decode apart, this many prefill replicas (each request's first token; its "
    "prompt's KV then goes to a decode replica through shared memory)"
)
DECODE_HELP = "with --prefill: this many decode replicas (each request's other tokens)"
MODEL_HELP = (
    "preset (micro, tiny, small, micro-qwen3_5 and the other tiny families, smollm2-135m, gemma3-270m), "
    "a llama or gemma3 .gguf file or a local mlx-lm checkpoint directory"
)


NOISE_HELP = (
    "settings that may lower the real runs' spread, to compare: gc-off, pin=CPUS (0-1), warmup=N, "
    "malloc-keep, mlx-cache=SIZE (comma-separated; see engine/noise.py; also $SCHEDLAB_NOISE)"
)

try:  # typer >= 0.16 vendors click as typer._click
    from typer._click import exceptions as _cx
except ImportError:  # pragma: no cover - older typer uses click itself
    from click import exceptions as _cx


class UserError(SchedlabError):
    """Anything the user can fix; printed as one line, exit status 1 (2 for usage)."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message, code)


class Interrupted(UserError):
    """Ctrl-C: printed as ``prog: interrupted[: what was dropped]``, exit status 130."""

    def __init__(self, detail: str = ""):
        super().__init__(detail, 130)


@contextlib.contextmanager
def replicas_stopped(cluster: bool):
    """A ``KeyboardInterrupt`` (Ctrl-C, SIGTERM) while replica processes ran: each was ended at
    once (``schedlab.serving``); said as ``prog: interrupted: the replicas were stopped``."""
    try:
        yield
    except KeyboardInterrupt:
        if not cluster:
            raise
        raise Interrupted("the replicas were stopped") from None


def fail(message: str, code: int = 1) -> NoReturn:
    raise UserError(message, code)


def out_path(value: str) -> Path:
    """An ``--out`` option's parser: an empty path is a usage error (``Path("")`` is the current
    directory, which the user did not name)."""
    if value == "":
        raise typer.BadParameter("must not be empty")
    return Path(value)


out_path.__name__ = "path"  # typer names the value after its parser: --out <path>, as a Path option


def make_app(help_text: str) -> typer.Typer:
    return typer.Typer(
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode=None,
        help=help_text,
        context_settings={"help_option_names": ["-h", "--help"]},
    )


def run_app(app: typer.Typer, prog: str) -> None:
    """Run a Typer app; usage errors and bad input become one line on stderr. Run as a
    subcommand (``schedlab simulate``), messages name it so."""
    if sys.argv and sys.argv[0] == f"schedlab {prog}":
        prog = sys.argv[0]
    token = _CLI.set(True)  # messages name options as --kv-tokens, not kv_tokens
    try:
        _run_app(app, prog)
    finally:
        _CLI.reset(token)


def _run_app(app: typer.Typer, prog: str) -> None:
    import warnings

    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):  # the API's warnings: one line each
        if issubclass(category, SchedlabWarning):
            print(f"{prog}: warning: {one_line(str(message))}", file=sys.stderr, flush=True)
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        rc = app(prog_name=prog, standalone_mode=False)
        if isinstance(rc, int) and rc:
            if rc == 130:  # typer turns Ctrl-C into a silent exit 130
                print(f"{prog}: interrupted", file=sys.stderr)
            raise SystemExit(rc)
    except Interrupted as exc:
        detail = f": {exc}" if str(exc) else ""
        print(f"{prog}: interrupted{detail}", file=sys.stderr)
        raise SystemExit(130) from None
    except _cx.UsageError as exc:
        msg = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        print(f"{prog}: error: {msg} (see {prog} --help)", file=sys.stderr)
        raise SystemExit(2) from None
    except (KeyboardInterrupt, typer.Abort):
        print(f"{prog}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except typer.Exit as exc:
        raise SystemExit(exc.exit_code) from None
    except _cx.ClickException as exc:
        print(f"{prog}: error: {one_line(exc.format_message())}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None
    except BrokenPipeError:
        raise SystemExit(1) from None
    except Exception as exc:
        if isinstance(exc, user_error_types()):
            code = getattr(exc, "code", 1)
            print(f"{prog}: error: {one_line(str(exc))}", file=sys.stderr)
            raise SystemExit(code) from None
        raise


def parse_options(pairs: list[str] | None) -> dict[str, str]:
    """``-o key=value`` pairs (repeatable; ``-o a=1,b=2`` also works)."""
    out: dict[str, str] = {}
    for raw in pairs or []:
        for item in raw.split(","):
            item = item.strip()
            if not item:
                continue
            if "=" not in item:
                fail(f"option '{item}' is not key=value", 2)
            key, value = item.split("=", 1)
            key = key.strip().replace("-", "_")
            if not key:
                fail(f"option '{item}' has an empty key", 2)
            out[key] = value.strip()
    return out


def log_to_stderr(prog: str, quiet: bool):
    """An API ``log``: notes and warnings as ``prog: note: ...`` lines on stderr, progress as
    ``prog: ...`` unless ``quiet``."""

    def log(kind: str, message: str) -> None:
        if kind == "progress":
            if not quiet:
                print(f"{prog}: {message}", file=sys.stderr, flush=True)
        else:
            print(f"{prog}: {kind}: {message}", file=sys.stderr, flush=True)

    return log


def report_problems(run) -> None:
    """Rejected requests and aborted runs: one line each, non-zero exit (the rest is kept)."""
    lines = run.problems
    for line in lines:
        print(f"{Path(sys.argv[0]).name}: error: {line}", file=sys.stderr)
    if lines:
        raise typer.Exit(1)
