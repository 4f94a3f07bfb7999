"""traces/: loaders on the real bundled files, malformed input, jitter, transforms, generators,
and the byte-identical rebuild of traces/data."""

from __future__ import annotations

import csv
import datetime as dt
import json
import math
import re
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from schedlab import traces
from schedlab.traces import Request, Trace, TraceError
from schedlab.traces import build as tbuild
from schedlab.traces.loaders import DATA_DIR, MOONCAKE_TICK_S, jitter_ticks, parse_azure_timestamp
from schedlab.traces.transforms import head, mean_rate, scale_lengths, scale_rate, thin, to_rate, window

ROOT = Path(__file__).resolve().parents[1]
#: the source traces, where traces/build.py looks by default: shared/traces beside the clone (CI has it)
SOURCE = ROOT.parent / "shared" / "traces"
CONV_CSV = DATA_DIR / "azure2023_conv.csv"
CODE_CSV = DATA_DIR / "azure2023_code.csv"
MC_WINDOW = DATA_DIR / "mooncake_conv_10min.jsonl"


@pytest.fixture(scope="module")
def conv() -> Trace:
    return traces.load("azure2023_conv")


@pytest.fixture(scope="module")
def mc_lines() -> list[dict]:
    return [json.loads(line) for line in MC_WINDOW.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def source() -> Path:
    """The source traces: a test that needs them fails without them (it does not skip)."""
    if not SOURCE.is_dir():
        pytest.fail(
            f"source traces not found: {SOURCE} (the shared/traces folder beside the clone, where "
            "traces/build.py looks by default); the tests that rebuild traces/data need them",
            pytrace=False,
        )
    return SOURCE


def _sorted_from_zero(tr: Trace) -> None:
    times = [r.arrival_s for r in tr.requests]
    assert times[0] == 0.0
    assert all(a <= b for a, b in zip(times, times[1:]))
    assert all(isinstance(r.id, str) for r in tr.requests)


# ---------------------------------------------------------------------------------------
# Azure CSV


def _reference_seconds(stamp: str) -> float:
    """Independent parse: strptime takes 6 fractional digits, the 7th is added by hand."""
    head_, frac = stamp.split(".")
    base = dt.datetime.strptime(f"{head_}.{frac[:6]}", "%Y-%m-%d %H:%M:%S.%f")
    return (base - dt.datetime(2023, 11, 16)).total_seconds() + int(frac[6:] or 0) * 1e-7


@pytest.mark.parametrize("path", [CONV_CSV, CODE_CSV], ids=["conv", "code"])
def test_azure_csv_loads_every_row_exactly(path):
    tr = traces.load(path.name)
    with path.open() as f:
        rows = list(csv.DictReader(f))
    assert len(tr) == len(rows)
    _sorted_from_zero(tr)
    ref = [_reference_seconds(r["TIMESTAMP"]) for r in rows]
    by_id = {r.id: r for r in tr.requests}
    worst = 0.0
    for i, row in enumerate(rows):
        req = by_id[str(i)]
        assert req.prompt_tokens == int(row["ContextTokens"])
        assert req.output_tokens == int(row["GeneratedTokens"])
        worst = max(worst, abs(req.arrival_s - (ref[i] - ref[0])))
    assert worst < 1e-9  # the 7th fractional digit (100 ns) is kept exactly


def test_azure_timestamp_keeps_the_seventh_digit(conv):
    a = parse_azure_timestamp("2023-11-16 18:15:46.6805900")
    b = parse_azure_timestamp("2023-11-16 18:15:46.6805901")
    assert b - a == 100  # ns
    assert parse_azure_timestamp("2023-11-16 18:15:47") - a == 319_410_000
    # rows 0 and 1 of the file: 18:15:46.6805900 and 18:15:50.9951690
    assert conv.requests[1].arrival_s == pytest.approx(4.314579, abs=1e-9)


def test_azure_description_names_source(conv):
    assert "Azure" in conv.description and "CC-BY-4.0" in conv.description


def test_azure_zero_rows_strict_and_dropped(tmp_path):
    p = tmp_path / "z.csv"
    p.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:47.0000000,0,10\n"
        "2023-11-16 18:15:48.0000000,12,0\n"
        "2023-11-16 18:15:49.5000000,20,5\n"
    )
    with pytest.raises(TraceError) as ei:
        traces.load(str(p))
    msg = str(ei.value)
    assert "\n" not in msg and "z.csv" in msg and "line 3" in msg and "empty prompt" in msg
    tr = traces.load(str(p), drop_invalid=True)
    assert [r.id for r in tr.requests] == ["0", "3"]
    assert tr.requests[1].arrival_s == pytest.approx(2.81941)
    assert "2 unservable row(s) dropped" in tr.description


def test_azure_csv_quoted_cells_and_bad_lines(tmp_path):
    """A line with quotes is parsed as CSV (a quoted cell, an escaped quote), one without is
    split on commas: both give the same requests; a bad line is one error naming its line."""
    plain = tmp_path / "plain.csv"
    plain.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:47.0000000,12,10\n"
    )
    quoted = tmp_path / "quoted.csv"
    quoted.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        '"2023-11-16 18:15:46.6805900","374",44\n'
        '2023-11-16 18:15:47.0000000,"12",10\n'
    )
    a, b = traces.load(str(plain)), traces.load(str(quoted))
    assert (
        [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in a.requests]
        == [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in b.requests]
        == [(0.0, 374, 44), (0.31941, 12, 10)]
    )
    for line, what in [
        ('2023-11-16 18:15:47.0000000,"1,2",10', "ContextTokens must be a non-negative integer, got '1,2'"),
        ("2023-11-16 18:15:47.0000000,12", "expected 3 cells, got 2"),
        ('2023-11-16 18:15:47.0000000,"12""",10', "ContextTokens must be a non-negative integer"),
        ("2023-11-16 18:15:47.0000000,x,10", "ContextTokens must be a non-negative integer"),
        ("16/11/2023,12,10", "timestamp"),
    ]:
        bad = tmp_path / "bad.csv"
        bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n" + line + "\n")
        with pytest.raises(TraceError) as ei:
            traces.load(str(bad))
        assert "bad.csv: line 3: " in str(ei.value) and what in str(ei.value), str(ei.value)


# ---------------------------------------------------------------------------------------
# Mooncake JSONL


def test_mooncake_tick_is_what_the_data_shows(mc_lines):
    stamps = sorted({r["timestamp"] for r in mc_lines})
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    assert len(gaps) > 100
    assert all(abs(g - MOONCAKE_TICK_S * 1000) <= 3 for g in gaps)
    assert traces.is_quantised([r["timestamp"] for r in mc_lines])


def test_mooncake_window_loads_fields_and_prefix_ids(mc_lines):
    tr = traces.load("mooncake_conv_10min", seed=0)
    assert len(tr) == len(mc_lines) > 1000
    _sorted_from_zero(tr)
    for r in tr.requests:
        line = mc_lines[int(r.id)]
        assert r.prompt_tokens == line["input_length"]
        assert r.output_tokens == line["output_length"]
        assert r.prefix_ids == tuple(line["hash_ids"])
    assert "seed 0" in tr.description


def test_jitter_stays_within_ticks_and_keeps_file_order(mc_lines):
    stamps = [float(r["timestamp"]) for r in mc_lines]
    times = jitter_ticks(stamps, MOONCAKE_TICK_S, seed=7)
    distinct = sorted(set(stamps))
    nxt = {a: b for a, b in zip(distinct, distinct[1:])}
    offsets = []
    for s, t in zip(stamps, times):
        end = min(s + 3000.0, nxt.get(s, math.inf))
        assert s / 1000 <= t < end / 1000
        offsets.append(t - s / 1000)
    # spread over the whole tick, not a token shift
    assert min(offsets) < 0.05 and max(offsets) > 2.9
    assert statistics.mean(offsets) == pytest.approx(1.5, abs=0.15)
    # requests sharing a stamp keep their file order
    for a, b, sa, sb in zip(times, times[1:], stamps, stamps[1:]):
        if sa == sb:
            assert a <= b


def test_jitter_tick_ends_at_the_next_stamp():
    # a stamp 1 s after the previous one ends that tick early: ticks never overlap or reorder
    stamps = [0.0] * 50 + [1000.0] * 50 + [7000.0]
    times = jitter_ticks(stamps, 3.0, seed=0)
    assert all(0.0 <= t < 1.0 for t in times[:50])
    assert all(1.0 <= t < 4.0 for t in times[50:100]) and max(times[50:100]) > 3.0
    assert 7.0 <= times[100] < 10.0
    with pytest.raises(TraceError):
        jitter_ticks(stamps, 0.0)


def test_jitter_seeded(mc_lines):
    a = traces.load("mooncake_conv_10min", seed=0)
    b = traces.load("mooncake_conv_10min", seed=0)
    c = traces.load("mooncake_conv_10min", seed=1)
    assert a.requests == b.requests
    assert [r.arrival_s for r in a.requests] != [r.arrival_s for r in c.requests]
    # the loader's arrivals are jitter_ticks re-based to the first request
    raw = jitter_ticks([float(r["timestamp"]) for r in mc_lines], seed=1)
    t0 = min(raw)
    got = {r.id: r.arrival_s for r in c.requests}
    assert all(got[str(i)] == pytest.approx(t - t0, abs=1e-9) for i, t in enumerate(raw))


def test_mooncake_jitter_off_keeps_stamps(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text(
        '{"timestamp": 3000, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n'
        '{"timestamp": 3000, "input_length": 11, "output_length": 3}\n'
        "\n"
        '{"timestamp": 9000, "input_length": 12, "output_length": 4, "hash_ids": []}\n'
    )
    tr = traces.load(str(p), jitter=False)
    assert [(r.id, r.arrival_s) for r in tr.requests] == [("0", 0.0), ("1", 0.0), ("2", 6.0)]
    assert tr.requests[1].prefix_ids is None and tr.requests[2].prefix_ids == ()
    jit = traces.load(str(p), seed=3)  # auto: stamps 6 s apart are quantised
    assert [r.arrival_s for r in jit.requests] != [r.arrival_s for r in tr.requests]


def test_mooncake_synthetic_poisson_stamps_kept(source):
    path = source / "mooncake_fast25" / "mooncake_fast25_synthetic.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    tr = traces.load(str(path), seed=5)
    assert "as stamped" in tr.description
    t0 = lines[0]["timestamp"]
    got = {r.id: r.arrival_s for r in tr.requests}
    assert all(got[str(i)] == pytest.approx((x["timestamp"] - t0) / 1000) for i, x in enumerate(lines))


# ---------------------------------------------------------------------------------------
# dispatch, bundled names


@pytest.mark.parametrize(
    "spec", ["mixed.json", "mixed", "azure2023_conv", "azure2023_code.csv", "mooncake_conv_10min", "real-smoke"]
)
def test_bare_names_from_another_directory(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tr = traces.load(spec)
    assert len(tr) > 0
    assert traces.resolve(spec).parent == DATA_DIR


def test_local_file_wins_over_bundled_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mixed.json").write_text(
        json.dumps({"requests": [{"id": "x", "arrival_s": 0, "prompt_tokens": 1, "output_tokens": 1}]})
    )
    assert [r.id for r in traces.load("mixed.json").requests] == ["x"]


def test_every_bundled_trace_loads():
    names = traces.bundled_names()
    assert {
        "mixed",
        "long-context",
        "sonnet",
        "real-smoke",
        "real-mixed",
        "azure2023_conv",
        "azure2023_code",
        "mooncake_conv_10min",
    } <= set(names)
    for n in names:
        _sorted_from_zero(traces.load(n))


# ---------------------------------------------------------------------------------------
# malformed input: one line, names the file and the line/request


def _req(**kw):
    row = {"id": "a", "arrival_s": 0.0, "prompt_tokens": 8, "output_tokens": 4}
    row.update(kw)
    return row


def _doc(*rows):
    return json.dumps({"name": "t", "requests": list(rows)})


BAD = [
    ("notjson.json", "{not json", ["line 1", "invalid JSON"]),
    ("list.json", "[1, 2]", ["'requests' list"]),
    ("type.json", _doc(_req(), _req(id="b", prompt_tokens="12")), ["request b", "prompt_tokens"]),
    (
        "nan.json",
        '{"requests": [{"id": "q", "arrival_s": 0, "prompt_tokens": NaN, "output_tokens": 1}]}',
        ["request q", "prompt_tokens"],
    ),
    (
        "inf.json",
        '{"requests": [{"id": "q", "arrival_s": 0, "prompt_tokens": 1, "output_tokens": Infinity}]}',
        ["request q", "output_tokens"],
    ),
    ("missing.json", _doc({"id": "a", "arrival_s": 0, "prompt_tokens": 3}), ["request #0", "output_tokens"]),
    ("negtime.json", _doc(_req(), _req(id="late", arrival_s=-1.5)), ["request late", "arrival_s"]),
    ("emptyprompt.json", _doc(_req(id="e", prompt_tokens=0)), ["request e", "empty prompt"]),
    ("zeroout.json", _doc(_req(id="z", output_tokens=0)), ["request z", "output_tokens"]),
    ("dup.json", _doc(_req(id="d"), _req(id="d", arrival_s=1)), ["request d", "duplicate"]),
    ("noreqs.json", _doc(), ["no requests"]),
    ("badname.json", json.dumps({"name": 3, "requests": [_req()]}), ["'name'"]),
    ("empty.json", "", ["empty file"]),
    ("blank.csv", "\n  \n", ["empty file"]),
    ("header.csv", "time,prompt,output\n2023-11-16 18:15:46.6805900,1,1\n", ["line 1", "header"]),
    (
        "cell.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,12,4\n2023-11-16 18:15:47.1,abc,4\n",
        ["line 3", "ContextTokens", "'abc'"],
    ),
    (
        "neg.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,12,-4\n",
        ["line 2", "GeneratedTokens"],
    ),
    ("stamp.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-13-16 18:15:46.1,12,4\n", ["line 2", "month"]),
    ("stamp2.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,12,4\n", ["line 2", "timestamp"]),
    ("cells.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,12\n", ["line 2", "cells"]),
    (
        "zero.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,12,0\n",
        ["line 2", "GeneratedTokens 0"],
    ),
    ("onlyheader.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n", ["no requests"]),
    (
        "line.jsonl",
        '{"timestamp": 0, "input_length": 5, "output_length": 1}\n\n{"timestamp": 1,\n',
        ["line 3", "invalid JSON"],
    ),
    ("obj.jsonl", "[1]\n", ["line 1", "expected an object"]),
    ("miss.jsonl", '{"timestamp": 0, "input_length": 5}\n', ["line 1", "output_length"]),
    ("negts.jsonl", '{"timestamp": -3000, "input_length": 5, "output_length": 1}\n', ["line 1", "timestamp"]),
    (
        "in0.jsonl",
        '{"timestamp": 0, "input_length": 5, "output_length": 1}\n'
        '{"timestamp": 0, "input_length": 0, "output_length": 1}\n',
        ["line 2", "empty prompt"],
    ),
    ("out.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1.5}\n', ["line 1", "output_length"]),
    (
        "hash.jsonl",
        '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": "ab"}\n',
        ["line 1", "hash_ids"],
    ),
    ("trace.txt", "hello\n", ["unknown trace format", ".txt"]),
]


@pytest.mark.parametrize("name,text,needles", BAD, ids=[b[0] for b in BAD])
def test_malformed_input_is_one_line(tmp_path, name, text, needles):
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(TraceError) as ei:
        traces.load(str(p))
    msg = str(ei.value)
    assert "\n" not in msg
    assert name in msg
    for needle in needles:
        assert needle in msg, msg


def test_binary_directory_missing_and_odd_ids(tmp_path):
    cases = []
    (tmp_path / "bin.json").write_bytes(b"\x00\x01\x02\xff")
    cases.append((str(tmp_path / "bin.json"), "binary"))
    (tmp_path / "latin.csv").write_bytes("TIMESTAMP,ContextTokens,GeneratedTokens\n\xe9\n".encode("latin-1"))
    cases.append((str(tmp_path / "latin.csv"), "UTF-8"))
    (tmp_path / "d.json").mkdir()
    cases.append((str(tmp_path / "d.json"), "directory"))
    cases.append((str(tmp_path / "nope.json"), "not found"))
    cases.append(("no-such-bundled-trace", "not found"))
    (tmp_path / "nl.json").write_text(_doc(_req(id="a\nb"), _req(id="a\nb")))
    cases.append((str(tmp_path / "nl.json"), "duplicate"))
    for spec, needle in cases:
        with pytest.raises(TraceError) as ei:
            traces.load(spec)
        msg = str(ei.value)
        assert "\n" not in msg and needle in msg, msg
    with pytest.raises(TraceError, match="do not apply"):
        traces.load("mixed", drop_invalid=True)


# ---------------------------------------------------------------------------------------
# transforms


def _small() -> Trace:
    return Trace(
        "s",
        "",
        [Request("a", 0.0, 3, 5, (1, 2)), Request("b", 1.0, 10, 1), Request("c", 2.5, 1, 2), Request("d", 4.0, 7, 7)],
    )


def test_scale_rate_halves_durations(conv):
    fast = scale_rate(conv, 2.0)
    assert [r.id for r in fast.requests] == [r.id for r in conv.requests]
    for a, b in zip(conv.requests[:500], fast.requests[:500]):
        assert b.arrival_s == pytest.approx(a.arrival_s / 2)
        assert (b.prompt_tokens, b.output_tokens) == (a.prompt_tokens, a.output_tokens)
    assert mean_rate(fast) == pytest.approx(2 * mean_rate(conv))


def test_to_rate_hits_the_target(conv):
    assert mean_rate(to_rate(conv, 1.25)) == pytest.approx(1.25)
    assert mean_rate(to_rate(_small(), 3.0)) == pytest.approx(3.0)
    with pytest.raises(TraceError):
        to_rate(Trace("one", "", [Request("a", 0.0, 1, 1)]), 2.0)


def test_thin_is_seeded_and_keeps_about_p(conv):
    a = thin(conv, 0.3, seed=11)
    b = thin(conv, 0.3, seed=11)
    c = thin(conv, 0.3, seed=12)
    assert [r.id for r in a.requests] == [r.id for r in b.requests]
    assert [r.id for r in a.requests] != [r.id for r in c.requests]
    n, p = len(conv), 0.3
    assert abs(len(a) - n * p) < 4 * math.sqrt(n * p * (1 - p))
    kept = {r.id for r in a.requests}
    assert kept < {r.id for r in conv.requests}
    assert len(thin(conv, 1.0)) == len(conv)
    _sorted_from_zero(a)


def test_window_rebases(conv):
    w = window(conv, 600.0, 1200.0)
    expect = [r for r in conv.requests if 600.0 <= r.arrival_s < 1200.0]
    assert [r.id for r in w.requests] == [r.id for r in expect]
    shift = expect[0].arrival_s
    assert w.requests[0].arrival_s == 0.0
    assert all(x.arrival_s == pytest.approx(y.arrival_s - shift) for x, y in zip(w.requests, expect))
    assert w.requests[-1].arrival_s < 600.0


def test_scale_lengths_rounds_and_never_below_one():
    t = _small()
    half = scale_lengths(t, prompt=0.5)
    assert [r.prompt_tokens for r in half.requests] == [2, 5, 1, 4]  # 1.5->2, 0.5->1 (floor 1), 3.5->4
    assert [r.output_tokens for r in half.requests] == [5, 1, 2, 7]
    assert all(r.prefix_ids is None for r in half.requests)
    tiny = scale_lengths(t, prompt=0.001, output=0.001)
    assert all(r.prompt_tokens == 1 and r.output_tokens == 1 for r in tiny.requests)
    out = scale_lengths(t, output=3)
    assert [r.output_tokens for r in out.requests] == [15, 3, 6, 21]
    assert out.requests[0].prefix_ids == (1, 2)


def test_head_and_input_unchanged():
    t = _small()
    before = list(t.requests)
    assert [r.id for r in head(t, 2).requests] == ["a", "b"]
    assert len(head(t, 99)) == 4
    window(t, 1.0, 3.0), thin(t, 0.5), scale_rate(t, 3)
    assert t.requests == before


@pytest.mark.parametrize(
    "call",
    [
        lambda t: scale_rate(t, 0),
        lambda t: scale_rate(t, -2),
        lambda t: scale_rate(t, float("nan")),
        lambda t: scale_rate(t, True),
        lambda t: to_rate(t, 0),
        lambda t: thin(t, 0),
        lambda t: thin(t, 1.5),
        lambda t: thin(t, 1e-12),
        lambda t: window(t, 5, 2),
        lambda t: window(t, 100, 200),
        lambda t: head(t, 0),
        lambda t: scale_lengths(t, prompt=0),
        lambda t: scale_lengths(t, output=-1),
    ],
    ids=[
        "k0",
        "kneg",
        "knan",
        "kbool",
        "rate0",
        "p0",
        "p>1",
        "thin-empty",
        "win-order",
        "win-empty",
        "head0",
        "len0",
        "lenneg",
    ],
)
def test_bad_transform_arguments(call):
    with pytest.raises(TraceError) as ei:
        call(_small())
    assert "\n" not in str(ei.value)


# ---------------------------------------------------------------------------------------
# bundled synthetic traces meet their specs


def test_mixed_trace_shape(conv):
    tr = traces.load("mixed")
    assert len(tr) == 300
    longs = [r for r in tr.requests if r.id.startswith("L")]
    chat = [r for r in tr.requests if r.id.startswith("c")]
    assert len(longs) == 30
    assert all(3000 <= r.prompt_tokens <= 8000 and 32 <= r.output_tokens <= 256 for r in longs)
    pairs = {(r.prompt_tokens, r.output_tokens) for r in conv.requests}
    assert all((r.prompt_tokens, r.output_tokens) in pairs for r in chat)
    assert all(r.prompt_tokens <= 1024 and r.output_tokens <= 256 for r in chat)
    assert len({(r.prompt_tokens, r.output_tokens) for r in chat}) > 200  # sampled, not one pair
    assert min(tr.requests.index(r) for r in longs) >= 10
    assert mean_rate(tr) == pytest.approx(tbuild.MIXED_RATE_RPS, rel=1e-4)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(tr.requests, tr.requests[1:])]
    cv = statistics.pstdev(gaps) / statistics.mean(gaps)
    assert 0.8 < cv < 1.2  # Poisson: exponential gaps


def test_small_bundled_traces_meet_their_specs():
    lc = traces.load("long-context")
    longs = [r for r in lc.requests if r.prompt_tokens >= 8000]
    assert 3 <= len(longs) <= 4 and all(
        r.prompt_tokens <= 16000 and 128 <= r.output_tokens <= 512 and r.arrival_s < 1.0 for r in longs
    )
    assert len(lc) - len(longs) >= 4

    son = traces.load("sonnet")
    assert len(son) == 100 and {(r.prompt_tokens, r.output_tokens) for r in son.requests} == {(1024, 128)}
    assert mean_rate(son) == pytest.approx(tbuild.SONNET_RATE_RPS, rel=1e-4)

    smoke = traces.load("real-smoke")
    assert 8 <= len(smoke) <= 10
    assert all(16 <= r.prompt_tokens <= 256 and 8 <= r.output_tokens <= 48 for r in smoke.requests)
    assert smoke.requests[-1].arrival_s <= 3.5
    assert sum(r.arrival_s > 0.5 for r in smoke.requests) >= 4  # mid-stream arrivals

    rm = traces.load("real-mixed")
    assert 24 <= len(rm) <= 32
    longs = [r for r in rm.requests if r.prompt_tokens >= 1000]
    assert 4 <= len(longs) <= 6 and all(r.prompt_tokens <= 2000 for r in longs)
    assert all(32 <= r.prompt_tokens <= 256 for r in rm.requests if r not in longs)
    assert longs[0].arrival_s > 0  # a long prompt arrives while others are running


def test_generators_are_deterministic_and_seeded(conv):
    from schedlab.traces import generate

    a = traces.dumps_json(generate.mixed(conv, rate=2.0, seed=4))
    assert a == traces.dumps_json(generate.mixed(conv, rate=2.0, seed=4))
    assert a != traces.dumps_json(generate.mixed(conv, rate=2.0, seed=5))
    with pytest.raises(TraceError):
        generate.sonnet(rate=0)


# ---------------------------------------------------------------------------------------
# python -m schedlab.traces.build


def _run_build(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "schedlab.traces.build", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_build_regenerates_every_bundled_file_byte_identical(source, tmp_path):
    """From its default source (no --source: the checkout's shared/traces beside it), byte for byte."""
    out = tmp_path / "data"
    res = _run_build("--out", str(out))
    assert res.returncode == 0, res.stderr
    built = sorted(p.name for p in out.iterdir())
    shipped = sorted(p.name for p in DATA_DIR.iterdir() if p.is_file())
    assert built == shipped
    for name in built:
        assert (out / name).read_bytes() == (DATA_DIR / name).read_bytes(), name


@pytest.mark.slow
def test_build_synthetic_only_matches_and_mixed_rate_override(synthetic_build, tmp_path):
    rc, same = synthetic_build  # main(["--out", SAME, "--synthetic-only"]) (conftest: once a session)
    assert rc == 0
    for name in tbuild.SYNTHETIC:
        assert (same / name).read_bytes() == (DATA_DIR / name).read_bytes(), name
    fast = tmp_path / "fast"
    assert tbuild.main(["--out", str(fast), "--synthetic-only", "--mixed-rate", "2.5"]) == 0
    tr = traces.load(str(fast / "mixed.json"))
    assert mean_rate(tr) == pytest.approx(2.5, rel=1e-4)
    base = traces.load("mixed")
    assert [(r.id, r.prompt_tokens, r.output_tokens) for r in tr.requests] == [
        (r.id, r.prompt_tokens, r.output_tokens) for r in base.requests
    ]
    assert (fast / "sonnet.json").read_bytes() == (DATA_DIR / "sonnet.json").read_bytes()


def test_build_bad_arguments_are_one_line(tmp_path):
    for args in (
        ["--mixed-rate", "-1"],
        ["--mixed-rate", "fast"],
        ["--source", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")],
    ):
        res = _run_build(*args)
        assert res.returncode != 0
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert "Traceback" not in res.stderr


def test_azure_slices_are_the_hours_consecutive_requests_scaled():
    conv = traces.load("azure2023_conv")
    by_id = {r.id: r for r in conv.requests}
    order = [r.id for r in conv.requests]
    for name, (n, start_s, fp, fo, rate) in tbuild.AZURE_SLICES.items():
        tr = traces.load(name)
        ids = [r.id for r in tr.requests]
        assert len(ids) == n
        first = order.index(ids[0])
        assert ids == order[first : first + n]  # consecutive, in the hour's order
        assert conv.requests[first].arrival_s >= start_s > conv.requests[first - 1].arrival_s
        src = [by_id[i] for i in ids]
        assert [r.prompt_tokens for r in tr.requests] == [max(1, int(s.prompt_tokens * fp + 0.5)) for s in src]
        assert [r.output_tokens for r in tr.requests] == [max(1, int(s.output_tokens * fo + 0.5)) for s in src]
        assert mean_rate(tr) == pytest.approx(rate, rel=1e-4)
        # the real gaps' shape is kept: each gap is the source's times one factor
        k = (src[-1].arrival_s - src[0].arrival_s) / tr.requests[-1].arrival_s
        for a, b, s, t in zip(tr.requests, tr.requests[1:], src, src[1:]):
            assert (b.arrival_s - a.arrival_s) * k == pytest.approx(t.arrival_s - s.arrival_s, abs=1e-4)


def test_requests_built_in_python_are_checked_as_a_files_are():
    # a list of traces.Request objects gets the checks a JSON trace or a DataFrame gets: one line each
    # (they ran: 10.5 prompt tokens were blamed on the policy, "0" arrivals were a TypeError)
    import schedlab
    from schedlab.traces.schema import Request

    ok = Request("a", 0.0, 10, 5)
    for reqs, why in (
        ([None], "traces.Request objects, got NoneType"),
        ([ok, None], "traces.Request objects, got NoneType"),
        ([Request("b", 0.0, 10.5, 5)], "request b: prompt_tokens must be an integer, got 10.5"),
        ([Request("b", 0.0, 10, 5.5)], "request b: output_tokens must be an integer, got 5.5"),
        ([Request("b", 0.0, True, 5)], "request b: prompt_tokens must be an integer, got True"),
        ([Request("b", "0", 10, 5)], "request b: arrival_s must be a number, got '0'"),
        ([ok, Request(3, 0.0, 10, 5)], "a request id is a non-empty string, got 3"),
        ([Request("b", 0.0, 10, 5, cancel_after_s=-1)], "request b: cancel_after_s must be a finite number >= 0"),
    ):
        with pytest.raises(schedlab.SchedlabError, match=re.escape(why)):
            schedlab.simulate("vllm", reqs)
    assert schedlab.simulate("vllm", [ok, Request("b", 0.0, np.int64(7), 3)]).summary["finished"] == 2
