"""What the commands share: one-line errors and exit codes, ``-o key=value`` options, and the
closing report of rejected requests and aborted runs. The work itself is ``schedlab.api``'s."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import NoReturn

import typer

from .errors import _CLI, SchedlabError, one_line, user_error_types

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


def fail(message: str, code: int = 1) -> NoReturn:
    raise UserError(message, code)


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


# ---------------------------------------------------------------- clients and KV options


def check_kv_layout(block_size: int) -> None:
    if block_size < 1:
        fail(f"--block-size must be >= 1, got {block_size}", 2)


def parse_rate(text: str | None, what: str = "--request-rate") -> float | None:
    """A request rate (req/s): a number > 0 or ``inf``; None when not given."""
    if text is None:
        return None
    try:
        v = float(text)
    except ValueError:
        fail(f"{what} must be a number > 0 or inf (requests/s), got {text!r}", 2)
    if math.isnan(v) or v <= 0:
        fail(f"{what} must be a number > 0 or inf (requests/s), got {text!r}", 2)
    return v


def check_client_options(max_concurrency: int | None, request_rate: float | None, burstiness: float | None,
                         think_time: float | None) -> None:
    if max_concurrency is not None and max_concurrency < 1:
        fail(f"--max-concurrency must be >= 1, got {max_concurrency}", 2)
    if burstiness is not None:
        if request_rate is None:
            fail("--burstiness shapes the --request-rate schedule: give --request-rate too", 2)
        if math.isnan(burstiness) or burstiness <= 0:
            fail(f"--burstiness must be > 0 (1: Poisson; inf: constant gaps), got {burstiness:g}", 2)
    if think_time is not None:
        if max_concurrency is None:
            fail("--think-time is the pause of a closed-loop client: give --max-concurrency too", 2)
        if not (think_time >= 0 and math.isfinite(think_time)):
            fail(f"--think-time must be a finite number of seconds >= 0, got {think_time:g}", 2)


def make_arrivals(requests, max_concurrency: int | None = None, request_rate: float | None = None,
                  burstiness: float | None = None, think_time: float | None = None, seed: int = 0):
    """The requests themselves (a trace replay), or closed-loop clients (``sim.sources.clients``)
    when any client option is given; bad options are one-line usage errors."""
    check_client_options(max_concurrency, request_rate, burstiness, think_time)
    from schedlab.sim.sources import clients

    return clients(requests, max_concurrency, request_rate, burstiness, think_time or 0.0, seed)


def parse_slo(text: str | None) -> dict[str, float]:
    """``--slo ttft_ms=500,tpot_ms=50`` -> {key: limit}, checked as the API checks it."""
    from .api import _slo

    return _slo(text)


def load_cost_model(profile, kv_tokens: int | None):
    """(linear cost model, KV capacity, profile path): ``profile``, else the bundled default."""
    from .api import _linear

    return _linear(profile, kv_tokens)
