"""Shared CLI plumbing: one-line errors, ``-o key=value`` options, defaults."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn

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


def parse_kv_floats(text: str | None, what: str) -> dict[str, float]:
    """``ttft_ms=500,tpot_ms=50`` -> dict of floats."""
    out: dict[str, float] = {}
    if not text:
        return out
    for item in text.split(","):
        if "=" not in item:
            fail(f"{what} '{item}' is not key=value", 2)
        k, v = item.split("=", 1)
        try:
            out[k.strip()] = float(v)
        except ValueError:
            fail(f"{what} {k.strip()}={v!r} is not a number", 2)
    return out


def default_profile_path() -> Path:
    from sim.profiles import default_profile

    return default_profile()


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


Callback = Callable[..., Any]
