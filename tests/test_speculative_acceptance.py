"""Speculative decoding's acceptance measured on real runs and used by simulations: the profile
vLLM's counters give, ``accept=`` naming a file, a trace carrying its own profile, ``calibrate
--speculative``, ``validate --speculative``.

Real parts: the real MLX engine on the ``micro`` preset (seeded random weights whose greedy
outputs repeat themselves: n-gram drafts get accepted), the ``validate`` and ``calibrate``
commands in subprocesses, SimPy and the bundled profile for the simulations.
"""

from __future__ import annotations

import json
import math
import re
import subprocess

import pytest

import schedlab
from schedlab import traces
from schedlab.sim.profiles import resolve_profile
from schedlab.sim.speculation import Acceptance, SpeculationError, conditional_acceptance
from simkit import command

# micro's greedy outputs, each request alone in its prompt ids: repeats that n-gram lookup finds
REQUESTS = [{"id": f"r{i}", "arrival_s": 0.02 * i, "prompt_tokens": 10 + 7 * i, "output_tokens": 60} for i in range(5)]
K = 3


def cli(name: str, *args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([*command(name), *args], capture_output=True, text=True, cwd=cwd, timeout=600)


def one_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


def by_hand(counters: dict) -> list[float]:
    """Per position: the rows that accepted it over the rows that accepted the one before (the
    first over the rows that drafted), up to the first position no row reached."""
    out, before = [], counters["drafts"]
    for accepted in counters["accepted_per_position"]:
        if before == 0:
            break
        out.append(accepted / before)
        before = accepted
    return out


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "repeats.json"
    path.write_text(json.dumps({"name": "repeats", "description": "micro's repeats", "requests": REQUESTS}))
    return path


@pytest.fixture(scope="module")
def validated(trace_file, tmp_path_factory):
    """``validate --speculative ngram:k=3`` of unified on micro (analytic cost: no calibration)."""
    out = tmp_path_factory.mktemp("validate") / "val"
    proc = cli(
        "validate", "--policy", "unified", "--trace", str(trace_file), "--model", "micro", "--hardware",
        "cpu-local", "--speculative", f"ngram:k={K}", "--out", str(out), "-q",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc, out


def test_validate_speculates_in_both_and_compares_the_acceptance(validated):
    proc, out = validated
    real = json.loads((out / "real" / "summary.json").read_text())["speculative"]
    sim = json.loads((out / "sim" / "summary.json").read_text())["speculative"]
    assert (
        0 < real["accepted_tokens"] < real["draft_tokens"]
        and sum(real["accepted_per_position"]) == real["accepted_tokens"]
    )
    # the simulation drew from what the real run measured, per position
    meta = json.loads((out / "sim" / "meta.json").read_text())
    assert meta["acceptance"]["accept"] == pytest.approx(by_hand(real)) and "real runs" in meta["acceptance"]["source"]
    assert meta["policy_options"]["speculative"]["k"] == K
    v = json.loads((out / "validation.json").read_text())
    assert v["policy"] == f"unified+ngram-k{K}"
    spec = v["speculative"]
    assert spec["profile"] == meta["acceptance"]["accept"]
    for key in ("acceptance_rate", "mean_acceptance_length", "drafts"):
        row = spec[key]
        assert row["sim"] == sim[key] and row["real"] == real[key], key
        assert row["error_pct"] == pytest.approx(100 * (sim[key] - real[key]) / real[key]), key
    assert spec["per_position"]["real"] == pytest.approx(by_hand(real))
    assert spec["per_position"]["sim"] == pytest.approx(by_hand(sim))
    assert spec["real_runs"] == [real]
    # printed under the latency table
    assert "TTFT p50 (ms)" in proc.stdout
    assert re.search(r"acceptance rate\s+[\d.]+ %\s+[\d.]+ %", proc.stdout), proc.stdout
    assert "mean acceptance length" in proc.stdout and "position 1 (given 0)" in proc.stdout


def test_a_simulation_given_a_real_runs_summary_draws_with_its_profile(validated):
    """accept=summary.json: the profile its counters give; on a long trace the simulated
    per-position acceptance is that profile within the binomial spread of the rows drawn (and the
    rows that drafted fewer than a position near a request's end, which count as not accepted)."""
    summary = validated[1] / "real" / "summary.json"
    profile = by_hand(json.loads(summary.read_text())["speculative"])
    assert Acceptance.from_file(summary).accept == pytest.approx(profile)
    n = 8
    long = [traces.Request(f"q{i}", 0.0, 64, 1500) for i in range(n)]
    run = schedlab.simulate("vllm", long, speculative=f"ngram:k={K},accept={summary}")
    assert run.meta["deployment"]["acceptance"]["accept"] == pytest.approx(profile)
    assert str(summary) in run.meta["deployment"]["acceptance"]["source"]
    got = run.summary["speculative"]
    before = got["drafts"]
    for i, p in enumerate(profile):
        accepted = got["accepted_per_position"][i]
        spread = 4 * math.sqrt(p * (1 - p) / before) + n * K / before
        assert abs(accepted / before - p) <= spread, (i, accepted / before, p, spread)
        before = accepted
        if not before:
            break


def test_calibrate_measures_the_acceptance_and_accept_reads_it(validated, trace_file, tmp_path):
    out = tmp_path / "acceptance.json"  # (calibrate --acceptance-only --speculative ngram:k=3 --trace T)
    got = schedlab.calibrate(
        model="micro", speculative=f"ngram:k={K}", trace=trace_file, acceptance_only=True, out=out, log=lambda *_: None
    )
    assert got.report().startswith(f"acceptance of ngram k={K} drafts on repeats")
    data = json.loads(out.read_text())
    entry = data["acceptance"]
    assert data["schema"] == "schedlab-acceptance/1" and entry["model"] == "micro" and entry["k"] == K
    assert entry["trace"] == {"name": "repeats", "description": "micro's repeats", "requests": len(REQUESTS)}
    # greedy: the same tokens, drafts and acceptances as validate's real run of the same trace
    real = json.loads((validated[1] / "real" / "summary.json").read_text())["speculative"]
    assert entry["counters"] == real and entry["accept"] == pytest.approx(by_hand(real))
    assert Acceptance.parse(str(out)).accept == tuple(entry["accept"])
    # a full profile keeps it under acceptance too (beside its coefficients), and accept= reads it
    prof = schedlab.Profile(dict(json.loads(resolve_profile("tiny-cpu").read_text()), acceptance=entry))
    path = prof.save(tmp_path / "profile.json")
    assert "acceptance of ngram" in prof.report() and "## Speculative acceptance" in path.with_suffix(".md").read_text()
    run = schedlab.simulate("unified", trace_file, profile=path, speculative=f"ngram:k={K},accept={path}")
    assert run.meta["deployment"]["acceptance"]["accept"] == entry["accept"]


def test_a_trace_carries_its_profile_and_accept_overrides_it(tmp_path):
    carried = {"accept": [0.9, 0.5], "method": "ngram", "k": 2, "model": "smollm2-135m"}
    path = tmp_path / "carries.json"
    path.write_text(json.dumps({"name": "carries", "speculative_acceptance": carried, "requests": REQUESTS}))
    tr = traces.load(path)
    assert tr.speculative_acceptance == carried
    assert traces.to_rate(tr, 5.0).speculative_acceptance == carried  # (a transform keeps the requests' profile)
    assert traces.load(traces.save_json(tr, tmp_path / "again.json")).speculative_acceptance == carried
    run = schedlab.simulate("vllm", path, speculative="ngram:k=2")
    acc = run.meta["deployment"]["acceptance"]
    assert acc["accept"] == [0.9, 0.5] and acc["source"] == "the speculative_acceptance of trace carries"
    assert run.summary["speculative"]["drafts"] > 0
    given = schedlab.simulate("vllm", path, speculative="ngram:k=2,accept=0.2/0.1")
    assert given.meta["deployment"]["acceptance"]["accept"] == [0.2, 0.1]
    assert "source" not in given.meta["deployment"]["acceptance"]
    # accept= may name the trace file itself
    assert Acceptance.parse(str(path)).accept == (0.9, 0.5)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"speculative_acceptance": {"accept": [1.5]}, "requests": REQUESTS}))
    with pytest.raises(traces.TraceError, match=re.escape("'accept' holds probabilities in [0, 1], got 1.5")):
        traces.load(bad)
    bad.write_text(json.dumps({"speculative_acceptance": {"accept": [0.5], "propose": 0}, "requests": REQUESTS}))
    with pytest.raises(traces.TraceError, match=re.escape("'propose' (the share of rows whose drafter proposes)")):
        traces.load(bad)
    shares = tmp_path / "shares.json"
    shares.write_text(json.dumps({"speculative_acceptance": {"accept": [0.9], "propose": 0.25}, "requests": REQUESTS}))
    assert Acceptance.parse(str(shares)).propose == 0.25  # (the share a trace carries is drawn from)


def test_the_profile_of_counters_ends_where_no_row_reached():
    assert conditional_acceptance({"drafts": 10, "accepted_per_position": [6, 3, 0, 0]}) == (0.6, 0.5, 0.0)
    assert conditional_acceptance({"drafts": 0, "accepted_per_position": []}) == ()
    with pytest.raises(SpeculationError, match="verified no drafts"):
        Acceptance.from_counters({"drafts": 0, "accepted_per_position": [0, 0]})
    with pytest.raises(SpeculationError, match="only 3 reached it"):
        conditional_acceptance({"drafts": 3, "accepted_per_position": [4]})


def test_bad_acceptance_inputs_are_one_line_and_exit_2(tmp_path):
    plain = tmp_path / "summary.json"  # a run without speculation: no counters
    plain.write_text(json.dumps({"policy": "vllm", "requests": 3}))
    over = tmp_path / "over.json"
    over.write_text(json.dumps({"acceptance": {"accept": [0.5, 1.2]}}))
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    for accept, message in (
        (tmp_path / "missing.json", "no such file"),
        (plain, "no acceptance profile in it"),
        (over, "acceptance: an acceptance probability is a number in [0, 1], got 1.2"),
        (broken, "not a readable JSON file"),
    ):
        with pytest.raises(schedlab.SchedlabError, match=re.escape(message)) as err:
            schedlab.simulate("vllm", "mixed", speculative=f"ngram:k=2,accept={accept}")
        assert "\n" not in str(err.value) and err.value.code == 2
    # neither accept= nor a trace that carries one: both ways said
    with pytest.raises(schedlab.SchedlabError, match="accept=FILE .* or a trace that carries one"):
        schedlab.simulate("vllm", "mixed", speculative="ngram:k=2")
    for kwargs, message in (
        ({"trace": "mixed"}, "trace goes with speculative"),
        ({"speculative": "ngram:k=2", "trace": "mixed", "acceptance_only": True, "replay": True}, "drop replay"),
    ):
        with pytest.raises(schedlab.SchedlabError, match=message) as err:
            schedlab.calibrate(model="micro", out=tmp_path / "p.json", **kwargs)
        assert err.value.code == 2
    proc = cli("simulate", "--policy", "vllm", "--trace", "mixed", "--speculative", "ngram:k=2,accept=nowhere.json")
    assert proc.returncode == 2 and "accept=nowhere.json: no such file" in one_line(proc.stderr)
    proc = cli("calibrate", "--speculative", "ngram:k=2", "--acceptance-only", "--out", str(tmp_path / "p.json"))
    assert proc.returncode == 2 and "--speculative goes with --trace" in one_line(proc.stderr)
