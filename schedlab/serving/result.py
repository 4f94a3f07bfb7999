"""What a real cluster's run gives back (``ClusterRun``): light, so that the API can name it
without importing the HTTP stack."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class ClusterRun:
    """A real cluster's run as its front measured it: ``summary`` (summary.json's metrics over
    every request, with its ``cluster`` and per-``replicas`` parts), ``problems`` (the requests
    that failed, one line each), ``path`` (where it wrote ``trace.json``, ``cluster.json`` and
    each replica's run directory ``replica-<i>``; None: nowhere) and ``report()``, the summary as
    ``vllm bench serve`` prints it."""

    summary: dict[str, Any]
    problems: list[str]
    path: Path | None
    text: str

    def report(self) -> str:
        return self.text
