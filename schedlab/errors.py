"""The one exception type of schedlab's API and commands (imports nothing heavy)."""

from __future__ import annotations

import contextvars

_CLI = contextvars.ContextVar("schedlab_cli", default=False)


class SchedlabError(ValueError):
    """Bad input to schedlab (a policy, trace, option, profile, model, ...): the message is one
    line for the user. ``code`` is the exit status the commands give it (2: a usage error)."""

    def __init__(self, message: object = "", code: int = 1):
        super().__init__(one_line(str(message)))
        self.code = code


class SchedlabWarning(UserWarning):
    """A warning from the API (e.g. a profile measured on another model or machine)."""


def one_line(text: str) -> str:
    return " ".join(text.split())


def opt(name: str) -> str:
    """An option's name as the user gave it: ``kv_tokens`` from Python, ``--kv-tokens`` on the
    command line (``schedlab.commands._app.run_app`` marks a command's context)."""
    return f"--{name.replace('_', '-')}" if _CLI.get() else name


def user_error_types() -> tuple[type[BaseException], ...]:
    """Every exception that means bad input, not a bug. Imported lazily (no mlx here)."""
    from schedlab.policies import OptionError, PolicyNotFound
    from schedlab.routers import RouterNotFound, RouterOptionError
    from schedlab.sim.cost import ProfileError
    from schedlab.traces.schema import TraceError

    types: list[type[BaseException]] = [
        SchedlabError,
        OptionError,
        PolicyNotFound,
        RouterNotFound,
        RouterOptionError,
        ProfileError,
        TraceError,
    ]
    try:  # engine errors exist only when the engine package imports
        from schedlab.engine.errors import EngineError

        types.append(EngineError)
    except ImportError:
        pass
    return tuple(types)


SchedlabError.__module__ = SchedlabWarning.__module__ = "schedlab"  # shown as schedlab.SchedlabError
