"""``Run``: one run of a policy over a trace, simulated or on the real engine, with its
tables as DataFrames (the columns of the files ``--out`` writes, see ``sim/output.py``); and
``load_run``, a run directory read back. Nothing here imports mlx."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from ..errors import SchedlabError
from ._base import as_path, check_bool, out_dir, public
from .figures import Figures

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd


def _failure(why: str) -> bool:
    """Whether a refusal's reason is a replica's failure (``sim.cluster``), not the KV capacity."""
    return why == "no replica is up" or (why.startswith("replica ") and " failed at " in why)


def real_dir_name(k: int) -> str:
    """The directory of a validation's ``k``-th real run (from 0): real, real-2, real-3, ..."""
    return "real" if k == 0 else f"real-{k + 1}"


RUN_FILES = (
    "summary.json",
    "requests.csv",
    "tokens.parquet",
    "steps.parquet",
    "passes.parquet",
    "features.parquet",
    "meta.json",
    "texts.jsonl",
)


class Run:
    """One run of a policy over a trace, simulated (``mode == "sim"``) or on the real engine
    (``"real"``).

    - ``summary``: the numbers of summary.json (``vllm bench serve``'s metrics);
    - ``requests``, ``tokens``, ``steps``, ``passes``: DataFrames with the columns of
      requests.csv, tokens.parquet, steps.parquet and passes.parquet (the tables are shared:
      copy one before changing it);
    - ``save(dir)`` writes the files ``--out`` writes; ``plot()`` draws the ``plot`` command's
      figures; ``report()`` is the printed summary.

    A run that stopped early (a plan the state machine refused, a policy that raised) keeps
    what ran: ``error`` says why; ``rejected`` lists requests larger than the KV capacity.
    """

    def __init__(
        self,
        result: Any = None,
        summary: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None,
        meta: Mapping[str, Any] | None = None,
        *,
        _dir: Path | None = None,
        _frames=None,
        _meta_file: Mapping[str, Any] | None = None,
        _write_texts=None,
    ):
        self._result = result
        self._write_texts = _write_texts  # a real run's texts.jsonl (run-real --out writes it)
        # the summary, or what computes it when first needed: ``save`` starts writing the large
        # tables before it asks, so that both go on at once
        self._summary_of = summary if callable(summary) else None
        self._summary_dict = None if callable(summary) else dict(summary or {})
        self._meta = dict(meta or {})  # what the command adds to meta.json (cost model, seed, ...)
        self._dir = _dir  # a run read back from a directory (load_run)
        self._frames: dict[str, Any] = dict(_frames or {})
        self._meta_file = dict(_meta_file) if _meta_file is not None else None

    # ---------------------------------------------------------------- numbers

    @property
    def _summary(self) -> dict[str, Any]:
        if self._summary_dict is None:
            self._summary_dict = dict(self._summary_of())
            self._summary_of = None
        return self._summary_dict

    @property
    def summary(self) -> dict[str, Any]:
        """summary.json's content (a copy)."""
        return copy.deepcopy({k: v for k, v in self._summary.items() if k not in ("wall_s", "meta")})

    @property
    def policy(self) -> str:
        return str(self._summary.get("policy"))

    @property
    def mode(self) -> str:
        return str(self._summary.get("mode"))

    @property
    def trace(self) -> str:
        return str(self._summary.get("trace"))

    @property
    def error(self) -> str | None:
        """Why the run stopped early, else None."""
        return self._summary.get("error")

    @property
    def rejected(self) -> list[tuple[str, str]]:
        """(request id, why) of every request rejected up front (larger than the KV capacity)."""
        if self._result is not None:
            return [(r.id, why) for r, why in self._result.rejected]
        req = self.requests
        return [(rid, "rejected") for rid in req.loc[req["status"] == "rejected", "id"]]

    @property
    def kv_tokens(self) -> int | None:
        """The KV capacity the run had, in tokens."""
        if self._result is not None:
            return self._result.kv_capacity
        return self.meta.get("kv_tokens")

    @property
    def wall_s(self) -> float | None:
        """Wall-clock seconds the run took (a simulation's, or the real engine's)."""
        if self._result is not None:
            return self._result.wall_s
        return self.meta.get("wall_s")

    @property
    def meta(self) -> dict[str, Any]:
        """What meta.json records about the run: the engine (model, BLAS, ...) for a real run,
        the cost model, KV capacity, seed and the policy's options."""
        if self._meta_file is not None:
            return copy.deepcopy(self._meta_file)
        return copy.deepcopy({**(self._result.meta or {}), **self._meta})

    @property
    def problems(self) -> list[str]:
        """One line per problem of the run (rejected requests, an early stop), as the commands
        print them; empty when every request ran."""
        lines = []
        # (requests refused because their replica failed are the experiment's, not a problem)
        rej = [(r, why) for r, why in self._result.rejected if not _failure(why)] if self._result is not None else []
        if rej:
            shown = ", ".join(f"{r.id} ({r.kv_footprint})" for r, _ in rej[:5])
            more = f" and {len(rej) - 5} more" if len(rej) > 5 else ""
            caps = {p.kv_capacity for p in self._result.replicas or ()}
            cap = (
                "the KV capacity of the replica each was routed to"
                if len(caps) > 1
                else f"the KV capacity of {self._result.kv_capacity} tokens"
            )
            lines.append(
                f"{len(rej)} request(s) rejected: the KV each would hold (prompt + output - 1, and any sliding "
                f"windows or recurrent state) exceeds {cap}: {shown}{more}; the other requests ran"
            )
        elif self._result is None and self.rejected:
            lines.append(f"{len(self.rejected)} request(s) rejected: the KV each would hold exceeds the KV capacity")
        if self.error:
            lines.append(self.error)
        return lines

    def report(self) -> str:
        """The summary as the commands print it (the layout of ``vllm bench serve``)."""
        from schedlab.sim.metrics import format_summary

        return format_summary(self._summary)

    # ---------------------------------------------------------------- tables

    def _frame(self, name: str):
        if name not in self._frames:
            from schedlab.sim import output

            r = self._result
            if r is None:  # read back from a directory that lacks the file
                raise SchedlabError(
                    f"{self._dir} has no {name}.parquet"
                    + (" (simulate writes it with --passes)" if name == "passes" else "")
                )
            if name == "passes" and not self._has_passes():
                raise SchedlabError("this run kept no pass log: simulate it with passes=True (the command: --passes)")
            if name == "requests":
                self._frames[name] = output.requests_frame(r)
            elif name == "tokens":
                self._frames[name] = output.tokens_table(r).to_pandas()
            elif name == "steps":
                self._frames[name] = output.steps_table(r.steps).to_pandas()
            else:
                self._frames[name] = output.passes_table(r.requests, r.passes).to_pandas()
        return self._frames[name]

    def _has_passes(self) -> bool:
        if self._result is not None:
            return getattr(self._result, "passes_recorded", True)
        return "passes" in self._frames

    @property
    def requests(self) -> "pd.DataFrame":
        """requests.csv: one row per request (id, arrival_s, prompt_tokens, output_tokens,
        first_token_s, finish_s, ttft_ms, tpot_ms, e2e_ms, decode_rate_tok_s, status)."""
        return self._frame("requests")

    @property
    def tokens(self) -> "pd.DataFrame":
        """tokens.parquet: one row per output token (request_id, token_index, time_s)."""
        return self._frame("tokens")

    @property
    def steps(self) -> "pd.DataFrame":
        """steps.parquet: one row per scheduler step (step, start_s, end_s, predicted_s,
        measured_s, decode_rows, prefill_tokens, passes, kv_tokens); measured_s is null in a
        simulation."""
        return self._frame("steps")

    @property
    def passes(self) -> "pd.DataFrame":
        """passes.parquet: one row per request per pass (step, pass, request_id, kind, tokens,
        start_s, end_s); kind is decode or prefill. (Made from the run when it is in memory; a
        run read back from a directory needs the file: ``simulate --passes``.)"""
        return self._frame("passes")

    @property
    def texts(self) -> "pd.DataFrame | None":
        """A real run's texts.jsonl: per request its generated token ids, their text (with a
        tokenizer) and why it ended (``stop``: EOS, ``length``: max_tokens); None for a
        simulation."""
        if "texts" not in self._frames:
            import pandas as pd

            if self._write_texts is not None:
                import tempfile

                with tempfile.TemporaryDirectory(prefix="schedlab-texts-") as tmp:
                    path = Path(tmp) / "texts.jsonl"
                    self._write_texts(path)
                    self._frames["texts"] = pd.read_json(path, lines=True, dtype={"id": str})
            elif self._dir is not None and (self._dir / "texts.jsonl").is_file():
                self._frames["texts"] = pd.read_json(self._dir / "texts.jsonl", lines=True, dtype={"id": str})
            else:
                self._frames["texts"] = None
        return self._frames["texts"]

    @property
    def features(self) -> "pd.DataFrame | None":
        """A real run's features.parquet: per measured step, its passes' cost features, the
        measured and predicted seconds, the idle gap before it and batch changes (what
        ``calibrate(from_runs=...)`` fits); None for a simulation."""
        if "features" not in self._frames:
            table = None
            if self._result is not None:
                from schedlab.sim.features import features_table, step_table

                cols = step_table(self._result)
                table = features_table(cols).to_pandas() if cols is not None else None
            elif self._dir is not None and (self._dir / "features.parquet").is_file():
                import pandas as pd

                table = pd.read_parquet(self._dir / "features.parquet")
            self._frames["features"] = table
        return self._frames["features"]

    def residuals(self) -> "pd.DataFrame | None":
        """A real run's per-step residuals (measured / predicted) by rows, tokens, context,
        joins/leaves, idle gap and batch change, as ``run-real --residuals`` prints them."""
        feats = self.features
        if feats is None:
            return None
        import pandas as pd
        from schedlab.analysis.residuals import residual_table

        return pd.DataFrame(residual_table({c: feats[c].to_numpy(dtype=float) for c in feats.columns}))

    # ---------------------------------------------------------------- files and figures

    def save(self, out: str | Path, *, passes: bool | None = None) -> Path:
        """Write the run directory ``--out`` writes: summary.json, requests.csv,
        tokens/steps.parquet, passes.parquet (``passes``: None writes it when the run has its
        pass log, which ``simulate(..., passes=False)`` does not keep), meta.json. Returns the
        directory."""
        out = out_dir(as_path(out))  # (a path is required here: None is not one)
        has = self._has_passes()
        if passes is None:
            passes = has
        elif check_bool(passes, "passes") and not has:
            raise SchedlabError(
                "this run has no pass log to write as passes.parquet "
                "(simulated with passes=False, or read back without the file)"
            )
        try:
            if self._result is not None:
                from schedlab.sim.output import write_run

                write_run(out, self._result, lambda: self._summary, meta=self._meta, passes=passes)
                if self._write_texts is not None:
                    self._write_texts(out / "texts.jsonl")
                return out
            out.mkdir(parents=True, exist_ok=True)
            for name in RUN_FILES:
                if name == "passes.parquet" and not passes:
                    if out.resolve() != self._dir.resolve():  # as write_run: no earlier run's timeline
                        (out / name).unlink(missing_ok=True)
                    continue
                src = self._dir / name
                if src.is_file() and src.resolve() != (out / name).resolve():
                    shutil.copyfile(src, out / name)
            return out
        except OSError as exc:
            raise SchedlabError(f"cannot write {out}: {exc.strerror or exc}") from None

    def _run_data(self, label: str | None = None, path: Path | None = None):
        from schedlab.analysis.plots import run_data, slug

        where = path or self._dir or Path(slug(f"{self.policy}-{self.mode}"))
        return run_data(self._summary, self.requests, self.tokens, self.steps, self.passes, path=where, label=label)

    def plot(
        self,
        *others: Any,
        out: str | Path | None = None,
        formats: Sequence[str] = ("png", "svg"),
        lanes: int = 60,
        window: tuple[float, float] | str | None = None,
        kinds: str | Sequence[str] | None = None,
    ) -> Figures:
        """The ``plot`` command's figures for this run (and ``others`` beside it): TTFT and ITL
        CDFs, per-request decode rates, a step timeline per run, each replica's load for a
        cluster's run (``kinds``: only some of ``ttft``, ``itl``, ``decode_rate``, ``timeline``,
        ``replica_load``). ``out``: also write them there, in ``formats``. See
        :func:`schedlab.plot`."""
        from .figures import plot

        return plot(self, *others, out=out, formats=formats, lanes=lanes, window=window, kinds=kinds)

    def __repr__(self) -> str:
        s = self._summary
        mk = s.get("makespan_s")
        mk = f"{mk:.3f}" if isinstance(mk, (int, float)) else mk
        err = f", error={self.error!r}" if self.error else ""
        return (
            f"Run(policy={self.policy!r}, mode={self.mode!r}, trace={self.trace!r}, "
            f"requests={s.get('requests')}, finished={s.get('finished')}, makespan_s={mk}{err})"
        )


@public
def load_run(path: str | Path) -> Run:
    """A run directory (``simulate --out DIR``) read back: the same ``Run`` the API returns,
    its tables read from the files."""
    import pandas as pd
    from schedlab.analysis.plots import load_run as read_dir
    from schedlab.sim.output import read_requests_csv

    p = as_path(path, "path")
    data = read_dir(p)  # checks the directory: one RunDirError line for anything wrong
    frames = {
        "requests": read_requests_csv(p / "requests.csv"),
        "tokens": pd.read_parquet(p / "tokens.parquet"),
        "steps": pd.read_parquet(p / "steps.parquet"),
    }
    if data.passes is not None:  # (simulate writes it with --passes; run.passes raises without)
        frames["passes"] = pd.read_parquet(p / "passes.parquet")
    meta = {}
    if (p / "meta.json").is_file():
        try:
            meta = json.loads((p / "meta.json").read_text())
        except (OSError, ValueError):
            meta = {}
    return Run(None, data.summary, _dir=p, _frames=frames, _meta_file=meta)
