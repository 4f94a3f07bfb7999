"""Everything the commands share: one-line errors, ``-o key=value`` options, ``--slo``, the cost
model and KV capacity a run uses, and the closing report of rejected requests and aborted runs."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import NoReturn

import typer

try:  # typer >= 0.16 vendors click as typer._click
    from typer._click import exceptions as _cx
except ImportError:  # pragma: no cover - older typer uses click itself
    from click import exceptions as _cx


class UserError(Exception):
    """Anything the user can fix; printed as one line, exit status 1 (2 for usage)."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


class Interrupted(UserError):
    """Ctrl-C: printed as ``prog: interrupted[: what was dropped]``, exit status 130."""

    def __init__(self, detail: str = ""):
        super().__init__(detail, 130)


def user_error_types() -> tuple[type[BaseException], ...]:
    """Every exception that means bad input, not a bug. Imported lazily (no mlx here)."""
    from policies import OptionError, PolicyNotFound
    from sim.cost import ProfileError
    from traces.schema import TraceError

    types: list[type[BaseException]] = [UserError, OptionError, PolicyNotFound, ProfileError, TraceError]
    try:  # engine errors exist only when the engine package imports
        from engine.errors import EngineError

        types.append(EngineError)
    except ImportError:
        pass
    return tuple(types)


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
    """Run a Typer app; usage errors and bad input become one line on stderr."""
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
        print(f"{prog}: error: {_one_line(exc.format_message())}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None
    except BrokenPipeError:
        raise SystemExit(1) from None
    except Exception as exc:
        if isinstance(exc, user_error_types()):
            code = getattr(exc, "code", 1)
            print(f"{prog}: error: {_one_line(str(exc))}", file=sys.stderr)
            raise SystemExit(code) from None
        raise


def _one_line(text: str) -> str:
    return " ".join(text.split())


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


def parse_slo(text: str | None) -> dict[str, float]:
    """``--slo ttft_ms=500,tpot_ms=50`` -> {key: limit}; the same check for every command."""
    from sim.metrics import SLO_KEYS

    out: dict[str, float] = {}
    if not text:
        return out
    for item in text.split(","):
        item = item.strip()
        if "=" not in item:
            fail(f"SLO '{item}' is not key=value (keys: {', '.join(SLO_KEYS)})", 2)
        k, v = (x.strip() for x in item.split("=", 1))
        if k not in SLO_KEYS:
            fail(f"unknown SLO key {k!r} (use {', '.join(SLO_KEYS)})", 2)
        try:
            limit = float(v)
        except ValueError:
            fail(f"SLO {k}={v!r} is not a number", 2)
        if not math.isfinite(limit) or limit <= 0:
            fail(f"SLO {k}={v!r} must be a finite number > 0", 2)
        out[k] = limit
    return out


def check_kv_tokens(kv_tokens: int | None) -> None:
    if kv_tokens is not None and kv_tokens < 1:
        fail(f"--kv-tokens must be >= 1, got {kv_tokens}", 2)


def policy_options(pol) -> dict:
    get = getattr(pol, "options", None)
    return get() if callable(get) else {}


def load_cost_model(profile: str | Path | None, kv_tokens: int | None):
    """(linear cost model, KV capacity, profile path): ``profile``, else the bundled default."""
    from sim.cost import DEFAULT_KV_TOKENS, LinearCostModel
    from sim.profiles import resolve_profile

    check_kv_tokens(kv_tokens)
    path = resolve_profile(profile)
    cost = LinearCostModel.from_profile(path)
    capacity = kv_tokens if kv_tokens is not None else int(cost.meta.get("kv_tokens", DEFAULT_KV_TOKENS))
    return cost, capacity, path


def pick_cost_model(profile, kv_tokens, hardware, model_config, quant):
    """A measured profile (default), or the analytic model of --hardware/--model-config."""
    if hardware is None and model_config is None:
        if quant is not None:
            fail("--quant goes with --hardware and --model-config", 2)
        cost, capacity, path = load_cost_model(profile, kv_tokens)
        return cost, capacity, {"profile": str(path)}
    if not (hardware and model_config):
        fail("--hardware and --model-config go together", 2)
    if profile is not None:
        fail("give either --profile or --hardware/--model-config, not both", 2)
    check_kv_tokens(kv_tokens)
    from analysis.analytic import make_analytic_cost_model

    cost, capacity, meta = make_analytic_cost_model(hardware, model_config, quant)
    return cost, (kv_tokens if kv_tokens is not None else capacity), {"analytic": meta}


def report_problems(result) -> None:
    """Rejected requests and aborted runs: one line each, non-zero exit (the rest is kept)."""
    lines = []
    if result.rejected:
        shown = ", ".join(f"{r.id} ({r.kv_footprint})" for r, _ in result.rejected[:5])
        more = f" and {len(result.rejected) - 5} more" if len(result.rejected) > 5 else ""
        lines.append(f"{len(result.rejected)} request(s) rejected: their prompt + output exceeds "
                     f"the KV capacity of {result.kv_capacity} tokens: {shown}{more}; the other requests ran")
    if result.error:
        lines.append(result.error)
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
    from sim.sources import clients

    return clients(requests, max_concurrency, request_rate, burstiness, think_time or 0.0, seed)
