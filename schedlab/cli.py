"""The ``schedlab`` command: one subcommand per module of ``schedlab.commands``, each a small
Typer app over the API, imported only when it runs (``schedlab simulate`` never imports the
server or MLX; ``schedlab --help`` imports no command at all); errors are one line
(``schedlab.commands._app``). ``simulate`` and ``run-real`` also stand alone (pyproject's
[project.scripts])."""

from __future__ import annotations

import sys

# name -> (module, entry function, one line for ``schedlab --help``)
COMMANDS = {
    "simulate": ("schedlab.commands.simulate", "main", "simulate a policy over a trace with a calibrated cost model"),
    "run-real": ("schedlab.commands.real", "main", "run the same policy on the real MLX engine"),
    "serve": (
        "schedlab.commands.serve",
        "main",
        "serve a policy on the real engine behind an OpenAI-compatible HTTP server",
    ),
    "validate": (
        "schedlab.commands.validate",
        "main",
        "run-real and simulate on one trace: prediction against measurement",
    ),
    "calibrate": (
        "schedlab.commands.calibrate",
        "main",
        "time the real engine and fit the cost-model profile simulate uses",
    ),
    "sweep": (
        "schedlab.commands.sweep",
        "main",
        "every policy at every request rate: latency against load, SLO capacity",
    ),
    "capacity": (
        "schedlab.commands.capacity",
        "main",
        "the highest request rate each configuration serves within its SLOs (bracket and bisect)",
    ),
    "plot": ("schedlab.commands.plot", "main", "TTFT/ITL CDFs, decode rates and step timelines of run directories"),
    "export-mlx": ("schedlab.commands.export", "main", "write a GGUF model as an mlx-lm checkpoint directory"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: schedlab COMMAND [OPTIONS]   (schedlab COMMAND --help: its options)", "", "commands:"]
    lines += [f"  {name:<{width}}  {about}" for name, (_, _, about) in COMMANDS.items()]
    return "\n".join(lines)


def main() -> None:
    """``schedlab COMMAND ...``: run one subcommand (its own Typer app, prog ``schedlab COMMAND``)."""
    import importlib

    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        raise SystemExit(0 if args else 2)
    if args[0] == "--version":
        from . import __version__

        print(f"schedlab {__version__}")
        raise SystemExit(0)
    name = args[0]
    if name not in COMMANDS:
        print(
            f"schedlab: error: no command {name!r}; one of: {', '.join(COMMANDS)} (see schedlab --help)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    module, entry, _ = COMMANDS[name]
    sys.argv = [f"schedlab {name}", *args[1:]]
    getattr(importlib.import_module(module), entry)()
