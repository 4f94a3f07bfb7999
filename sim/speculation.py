"""Speculative decoding in the simulator: how many drafts a verify row accepts.

A pass's decode rows may verify draft tokens (``Pass.draft``: k per row; the policy chooses k,
``policies.speculative``). On the real engine the target model decides which drafts it
accepts; in a simulation an **acceptance profile** does: ``accept[i]`` is the probability that
draft i + 1 is accepted given that the first i were (per position, not one geometric rate: the
first drafts of an n-gram match are accepted more often than the later ones, and a geometric
mean under-predicts the accepted length). A row that verifies k drafts accepts the leading run
of positions whose draw falls under their probability, at most k; positions past the profile's
length are never accepted.

Draws are per request, from its own generator seeded by (``seed``, request id), and every
verify row draws as many numbers as the profile is long whatever its k: the same request meets
the same luck under every policy and every k, so two runs differ by their schedules, not by
their dice.

Where a profile comes from: typed (``accept=0.8/0.6/0.4``), measured from vLLM's spec-decode
counters of a run (``Acceptance.from_counters``: a real run's ``summary.json`` ``speculative``),
or read from a file (``Acceptance.from_file``: a run's summary.json, a ``calibrate
--speculative`` profile's ``acceptance``, a trace's ``speculative_acceptance``). ``parse`` takes
each (numbers, or else a path).
"""

from __future__ import annotations

import json
import math
import random
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from schedlab.policies.speculative import expected_tokens


class SpeculationError(ValueError):
    """A bad acceptance profile: one line."""


@dataclass(frozen=True)
class Acceptance:
    """Per-position acceptance probabilities (``accept[i]``: of draft i + 1, given the first i
    were accepted), and the seed of the per-request draws; ``source``: where it came from (a
    file, a trace: meta.json says so), no part of its value."""

    accept: tuple[float, ...]
    seed: int = 0
    source: str | None = field(default=None, compare=False)
    # of the rows given room to draft, the share whose drafter proposes anything (an n-gram
    # lookup finds no match in the others: they decode plainly, their positions not computed)
    propose: float = 1.0
    # per request id: its own (accept, propose), measured on it (``from_requests``); a request
    # not in it draws from the profile above
    per_request: Mapping[str, tuple[tuple[float, ...], float]] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        acc = tuple(self.accept) if isinstance(self.accept, (list, tuple)) else None
        if not acc:
            raise SpeculationError(f"an acceptance profile is one probability per draft position, got {self.accept!r}")
        for p in acc:
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not (math.isfinite(p) and 0 <= p <= 1):
                raise SpeculationError(f"an acceptance probability is a number in [0, 1], got {p!r}")
        object.__setattr__(self, "accept", tuple(float(p) for p in acc))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise SpeculationError(f"the acceptance draws' seed is an integer, got {self.seed!r}")
        q = self.propose
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not (math.isfinite(q) and 0 < q <= 1):
            raise SpeculationError(f"the share of rows that propose drafts is a number in (0, 1], got {q!r}")

    def _rng(self, rid: str, rngs: dict) -> random.Random:
        """Request ``rid``'s generator of draws in ``rngs`` (one run's), made on first use."""
        rng = rngs.get(rid)
        if rng is None:
            rng = rngs[rid] = random.Random(zlib.crc32(f"{self.seed}/{rid}".encode()))
        return rng

    def proposes(self, rid: str, rngs: dict) -> bool:
        """Whether request ``rid``'s drafter proposes anything at this verify: always when
        ``propose`` (its own, with ``per_request``) is 1 (no draw), else its next draw from its
        generator in ``rngs``."""
        share = self.propose if self.per_request is None or rid not in self.per_request else self.per_request[rid][1]
        if share >= 1.0:
            return True
        return self._rng(rid, rngs).random() < share

    def accepted(self, rid: str, k: int, rngs: dict) -> int:
        """How many of request ``rid``'s ``k`` drafts this verify accepts: its next draws from
        its generator in ``rngs`` (one run's: a run starts with an empty dict)."""
        rng = self._rng(rid, rngs)
        accept = self.accept if self.per_request is None or rid not in self.per_request else self.per_request[rid][0]
        draws = [rng.random() for _ in accept]
        a = 0
        for u, p in zip(draws, accept[:k]):
            if u >= p:
                break
            a += 1
        return a

    def expected_tokens(self, k: int) -> float:
        """Tokens a verify row of ``k`` drafts yields on average: 1 + the expected accepted
        (``policies.speculative.expected_tokens``, what the adaptive k weighs)."""
        return expected_tokens(self.accept, k)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"accept": list(self.accept), "seed": self.seed}
        if self.propose < 1.0:
            out["propose"] = self.propose
        if self.per_request:
            out["per_request"] = len(self.per_request)
        if self.source:
            out["source"] = self.source
        return out

    @classmethod
    def parse(cls, value: "str | Path | Sequence[float] | Acceptance", seed: int = 0) -> "Acceptance":
        """``"0.8/0.6/0.4"`` (or a sequence of numbers) as a profile; a string that is not
        numbers (or a ``Path``) names a JSON file that holds one (``from_file``); an
        ``Acceptance`` is taken with this ``seed``."""
        if isinstance(value, Acceptance):
            return replace(value, seed=seed)
        if isinstance(value, Path):
            return cls.from_file(value, seed)
        if isinstance(value, str):
            try:
                value = [float(x) for x in value.replace(",", "/").split("/") if x.strip()]
            except ValueError:
                return cls.from_file(value, seed)
        return cls(tuple(value), seed)

    @classmethod
    def from_counters(cls, counters: Mapping[str, Any], seed: int = 0, source: str | None = None) -> "Acceptance":
        """The profile vLLM's spec-decode counters of a run imply (a summary.json's
        ``speculative``: ``conditional_acceptance``); a run that verified no draft has none."""
        accept = conditional_acceptance(counters)
        if not accept:
            raise SpeculationError("the run verified no drafts: it measured no acceptance")
        empty = counters.get("empty_drafts") or 0
        if isinstance(empty, bool) or not isinstance(empty, int) or empty < 0:
            raise SpeculationError(f"spec-decode counters: empty_drafts is an integer >= 0, got {empty!r}")
        return cls(accept, seed, source, counters["drafts"] / (counters["drafts"] + empty))

    @classmethod
    def from_requests(
        cls,
        pooled: Mapping[str, Any],
        by_request: Mapping[str, Mapping[str, Any]],
        seed: int = 0,
        source: str | None = None,
    ) -> "Acceptance":
        """A profile per request (``RunResult.speculative_requests``: each request's counters)
        over the pooled one (``from_counters`` of ``pooled``, for requests not in it): a replay
        of a measured workload whose requests accept very differently (measured here: of three
        copy requests, one took 19 verify steps for 45 tokens, another 40) keeps each one's
        luck, which one pooled profile averages away. A request that never drafted proposes
        nothing; one that drafted but accepted none has a profile of 0."""
        base = cls.from_counters(pooled, seed, source)
        mine = {}
        for rid, c in by_request.items():
            drafts, empty = int(c.get("drafts") or 0), int(c.get("empty_drafts") or 0)
            if drafts + empty == 0:
                continue
            accept = conditional_acceptance(c) if drafts else ()
            mine[str(rid)] = (tuple(accept) or (0.0,), drafts / (drafts + empty))
        return replace(base, per_request=mine)

    @classmethod
    def from_entry(
        cls, entry: Mapping[str, Any], seed: int = 0, source: str | None = None, where: str = "acceptance"
    ) -> "Acceptance":
        """The profile of an acceptance entry (``calibrate --speculative``'s ``acceptance``, a
        trace's ``speculative_acceptance``): its ``accept`` list and, when it has one, its
        ``propose`` share; checked as a profile (one line naming ``where`` if not)."""
        accept = entry.get("accept")
        if not isinstance(accept, list) or not accept:
            raise SpeculationError(f"{where}: 'accept' is a list of probabilities per draft position, got {accept!r}")
        try:
            return cls(tuple(accept), seed, source, entry.get("propose", 1.0))
        except SpeculationError as exc:
            raise SpeculationError(f"{where}: {exc}") from None

    @classmethod
    def from_file(cls, path: str | Path, seed: int = 0) -> "Acceptance":
        """The profile a JSON file holds, decided by its content: a run's summary.json (its
        ``speculative`` counters, real or simulated), a ``calibrate --speculative`` profile or
        acceptance file (``acceptance``), a trace (``speculative_acceptance``); anything else,
        or a file that cannot be read, is one line."""
        p = Path(path)
        kinds = (
            "a JSON file holding one: a run's summary.json (its speculative counters), a calibrate --speculative "
            "profile (acceptance) or a trace (speculative_acceptance)"
        )
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise SpeculationError(
                f"accept={path}: no such file (accept is probabilities per position such as 0.8/0.6/0.4, or {kinds})"
            ) from None
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else " ".join(str(exc).split())
            raise SpeculationError(f"accept={path}: not a readable JSON file ({why})") from None
        where = f"accept={path}"
        if isinstance(data, dict) and isinstance(data.get("acceptance"), Mapping):
            return cls.from_entry(data["acceptance"], seed, f"{p} (acceptance)", f"{where}: acceptance")
        if isinstance(data, dict) and isinstance(data.get("speculative_acceptance"), Mapping):
            entry = data["speculative_acceptance"]
            return cls.from_entry(
                entry, seed, f"{p} (the trace's speculative_acceptance)", f"{where}: speculative_acceptance"
            )
        if isinstance(data, dict) and isinstance(data.get("speculative"), Mapping):
            try:
                return cls.from_counters(data["speculative"], seed, f"{p} (the run's speculative counters)")
            except SpeculationError as exc:
                raise SpeculationError(f"{where}: speculative: {exc}") from None
        raise SpeculationError(f"{where}: no acceptance profile in it (accept=FILE is {kinds})")


def conditional_acceptance(counters: Mapping[str, Any]) -> tuple[float, ...]:
    """Per-position conditional acceptance from vLLM's spec-decode counters (``drafts``: the
    verify rows that proposed drafts; ``accepted_per_position[i]``: the rows that accepted draft
    i + 1): ``accepted_per_position[0] / drafts``, then ``accepted_per_position[i] /
    accepted_per_position[i - 1]``. It ends before the first position no row reached (its
    denominator 0: nothing measured there; in a simulation a position past the profile is never
    accepted, which is what a row that reached none of them did): () for a run with no drafts.

    A row whose drafter proposed fewer drafts than a position counts as a rejection there (the
    counters do not say how many each row proposed), as it yields no more tokens."""
    drafts = counters.get("drafts") if isinstance(counters, Mapping) else None
    per_pos = counters.get("accepted_per_position") if isinstance(counters, Mapping) else None
    if (
        isinstance(drafts, bool)
        or not isinstance(drafts, int)
        or drafts < 0
        or not isinstance(per_pos, (list, tuple))
        or not all(isinstance(a, int) and not isinstance(a, bool) and a >= 0 for a in per_pos)
    ):
        raise SpeculationError(
            "spec-decode counters are drafts (an integer) and accepted_per_position (a list of integers), "
            f"got {_short(counters)}"
        )
    out, before = [], drafts
    for accepted in per_pos:
        if not before:
            break
        if accepted > before:
            raise SpeculationError(
                f"spec-decode counters: {accepted} rows accepted draft {len(out) + 1} but only {before} reached it"
            )
        out.append(accepted / before)
        before = accepted
    return tuple(out)


def pooled_counters(runs: Sequence[Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """Several runs' spec-decode counters (summary.json's ``speculative``; None: a run with no
    drafts) added up as one run's (``counters``); None when none verified a draft."""
    got = [r for r in runs if r]
    if not got:
        return None
    per_pos: list[int] = []
    for r in got:
        for i, a in enumerate(r.get("accepted_per_position") or ()):
            if i == len(per_pos):
                per_pos.append(0)
            per_pos[i] += int(a)
    return counters(
        *(sum(int(r.get(k, 0)) for r in got) for k in ("drafts", "draft_tokens", "accepted_tokens")),
        per_pos,
        sum(int(r.get("empty_drafts") or 0) for r in got),
    )


def counters(
    drafts: int, draft_tokens: int, accepted_tokens: int, per_pos: Sequence[int], empty: int = 0
) -> dict[str, Any]:
    """vLLM's spec-decode counters as summary.json's ``speculative`` holds them: verify rows that
    drafted, draft tokens, accepted ones, per position the rows that accepted it, with the
    acceptance rate and the mean acceptance length (1 + accepted per verify row); and one of
    ours, ``empty_drafts``: rows given room to draft whose drafter found nothing (an n-gram
    lookup with no match: a plain decode row; vLLM counts none of them)."""
    return {
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted_tokens,
        "accepted_per_position": list(per_pos),
        "acceptance_rate": accepted_tokens / draft_tokens if draft_tokens else None,
        "mean_acceptance_length": 1 + accepted_tokens / drafts if drafts else None,
        "empty_drafts": empty,
    }


def _short(value: Any) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= 60 else text[:57] + "..."
