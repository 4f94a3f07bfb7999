"""`simulate` end to end through its console script: output, files, determinism, errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from simkit import command, KNOWN, read_table

BIN = Path(sys.executable).parent


def cli(name: str, *args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([*command(name), *args], capture_output=True, text=True, cwd=cwd, timeout=300)


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("prof") / "known.json"
    p.write_text(
        json.dumps({"schema": "schedlab-profile/1", "model": "test", "kv_tokens": 262144, "coefficients": KNOWN})
    )
    return p


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    for frag in fragments:
        assert frag in lines[0], lines[0]
    return lines[0]


def test_summary_for_a_bundled_trace_from_any_directory(tmp_path, profile):
    proc = cli(
        "simulate", "--policy", "prefer-prefill", "--trace", "mixed.json", "--profile", str(profile), cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for label in (
        "Serving Benchmark Result",
        "Successful requests:",
        "Benchmark duration (s):",
        "Request throughput (req/s):",
        "Output token throughput (tok/s):",
        "Mean TTFT (ms):",
        "Median TTFT (ms):",
        "P99 TTFT (ms):",
        "Mean TPOT (ms):",
        "P99 ITL (ms):",
        "Median E2EL (ms):",
        "Min decode rate (tok/s):",
        "Max decode rate (tok/s):",
    ):
        assert label in out, label
    assert "Successful requests:                     300" in out


def test_out_dir_files_and_their_agreement(tmp_path, profile):
    out = tmp_path / "run"
    proc = cli(
        "simulate",
        "-p",
        "chunked-prefill",
        "-t",
        "real-mixed",
        "--profile",
        str(profile),
        "-o",
        "budget=256",
        "--out",
        str(out),
        "--passes",
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    for key in (
        "policy",
        "mode",
        "trace",
        "requests",
        "finished",
        "makespan_s",
        "output_throughput_tok_s",
        "request_throughput_rps",
    ):
        assert key in summary
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(summary[key]) == {"mean", "p50", "p90", "p99"}
    assert set(summary["decode_rate_tok_s"]) == {"min", "p50", "max"}
    assert summary["mode"] == "sim" and summary["policy"] == "chunked-prefill"

    reqs = read_table(out / "requests.csv")
    assert list(reqs[0]) == [
        "id",
        "arrival_s",
        "prompt_tokens",
        "output_tokens",
        "first_token_s",
        "finish_s",
        "ttft_ms",
        "tpot_ms",
        "e2e_ms",
        "decode_rate_tok_s",
        "status",
        "preemptions",
        "recomputed_tokens",
        "cached_tokens",
        "scheduled_s",
    ]
    assert all(r["preemptions"] == "0" and r["scheduled_s"] == r["arrival_s"] for r in reqs)
    assert len(reqs) == summary["requests"] == summary["finished"]
    tokens = read_table(out / "tokens.parquet")
    assert len(tokens) == sum(int(r["output_tokens"]) for r in reqs)
    # requests.csv agrees with tokens.parquet: first and last token times, TTFT
    by_req: dict[str, list[float]] = {}
    for t in tokens:
        by_req.setdefault(t["request_id"], []).append(float(t["time_s"]))
    for r in reqs:
        times = by_req[r["id"]]
        assert float(r["first_token_s"]) == times[0] and float(r["finish_s"]) == times[-1]
        assert float(r["ttft_ms"]) == pytest.approx((times[0] - float(r["arrival_s"])) * 1e3)
    steps = read_table(out / "steps.parquet")
    assert list(steps[0]) == [
        "step",
        "start_s",
        "end_s",
        "predicted_s",
        "measured_s",
        "decode_rows",
        "prefill_tokens",
        "passes",
        "kv_tokens",
    ]
    assert all(s["measured_s"] == "" for s in steps)  # nothing is measured in a simulation
    assert sum(int(s["prefill_tokens"]) for s in steps) == sum(int(r["prompt_tokens"]) for r in reqs)
    for s in steps:  # in simulation a step lasts exactly what was predicted
        assert float(s["end_s"]) - float(s["start_s"]) == pytest.approx(float(s["predicted_s"]), abs=1e-9)
    passes = read_table(out / "passes.parquet")
    prefilled: dict[str, int] = {}
    token_times = {(t["request_id"], float(t["time_s"])) for t in tokens}
    for p in passes:
        if p["kind"] == "prefill":
            prefilled[p["request_id"]] = prefilled.get(p["request_id"], 0) + int(p["tokens"])
        else:  # every decode row put out a token at the end of its pass
            assert (p["request_id"], float(p["end_s"])) in token_times
    assert prefilled == {r["id"]: int(r["prompt_tokens"]) for r in reqs}
    assert {int(p["step"]) for p in passes} == {int(s["step"]) for s in steps}

    # without --passes the same run writes the same files but passes.parquet, and does not
    # leave the earlier run's there; --passes needs --out
    before = {f: (out / f).read_bytes() for f in ("summary.json", "requests.csv", "tokens.parquet", "steps.parquet")}
    proc = cli(
        "simulate",
        "-p",
        "chunked-prefill",
        "-t",
        "real-mixed",
        "--profile",
        str(profile),
        "-o",
        "budget=256",
        "--out",
        str(out),
        "-q",
    )
    assert proc.returncode == 0, proc.stderr
    assert not (out / "passes.parquet").exists()
    assert before == {f: (out / f).read_bytes() for f in before}
    proc = cli("simulate", "-p", "chunked-prefill", "-t", "real-mixed", "--profile", str(profile), "--passes")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "simulate: error: --passes writes passes.parquet into the --out directory: give --out DIR too"
    ]


@pytest.mark.slow
def test_same_seed_byte_identical_other_seed_differs(tmp_path, profile):
    def go(seed: int, name: str) -> Path:
        out = tmp_path / name
        proc = cli(
            "simulate",
            "-p",
            "unified",
            "-t",
            "mooncake_conv_10min",
            "--profile",
            str(profile),
            "--seed",
            str(seed),
            "--out",
            str(out),
            "-q",
            "--passes",
        )
        assert proc.returncode == 0, proc.stderr
        return out

    a, b, c = go(1, "a"), go(1, "b"), go(2, "c")
    for f in ("summary.json", "requests.csv", "tokens.parquet", "steps.parquet", "passes.parquet"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    assert (a / "requests.csv").read_bytes() != (c / "requests.csv").read_bytes()


@pytest.mark.slow
def test_bad_inputs_are_one_line_errors(tmp_path, profile):
    prof = ["--profile", str(profile)]
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"requests": [{"id": 1, "arrival_s": 0, "prompt_tokens": 0, "output_tokens": 3}]}')
    not_json = tmp_path / "not.json"
    not_json.write_text("{nope")
    bad_prof = tmp_path / "prof.json"
    bad_prof.write_text('{"coefficients": {"d_pass": "fast"}}')
    cases = [
        (["-p", "nope", "-t", "mixed"] + prof, ["unknown policy 'nope'"]),
        (["-p", "static", "-t", "mixed", "-o", "batch_size=big"] + prof, ["batch_size", "not a valid int"]),
        (["-p", "static", "-t", "mixed", "-o", "batch_size"] + prof, ["not key=value"]),
        (["-p", "static", "-t", str(bad_json)] + prof, ["empty prompt"]),
        (["-p", "static", "-t", str(not_json)] + prof, ["invalid JSON"]),
        (["-p", "static", "-t", "no-such-trace"] + prof, ["trace not found"]),
        (["-p", "static", "-t", "mixed", "--profile", str(bad_prof)], ["d_pass"]),
        (["-p", "static", "-t", "mixed", "--profile", str(tmp_path / "none.json")], ["profile not found"]),
        (["-p", "static", "-t", "mixed", "--kv-tokens", "0"] + prof, ["--kv-tokens"]),
        (["-p", "static", "-t", "mixed", "--frobnicate"] + prof, ["No such option"]),
        (["-p", "static"] + prof, ["Missing option"]),
        # --slo is checked alike by every command: a misspelt key or a NaN limit would
        # otherwise fail or pass every request silently
        (["-p", "static", "-t", "mixed", "--slo", "ttft_s=1e9"] + prof, ["unknown SLO key 'ttft_s'"]),
        (["-p", "static", "-t", "mixed", "--slo", "ttft_ms=nan"] + prof, ["ttft_ms", "finite number > 0"]),
        (["-p", "static", "-t", "mixed", "--slo", "tpot_ms=-5"] + prof, ["tpot_ms", "finite number > 0"]),
        (["-p", "static", "-t", "mixed", "--slo", "e2e_ms"] + prof, ["not key=value"]),
    ]
    for args, frags in cases:
        assert_one_line_error(cli("simulate", *args), *frags)
    # run-real and sweep read --slo with the same check, before any work
    assert_one_line_error(
        cli("run-real", "-p", "static", "-t", "real-smoke", "--slo", "ttft_s=1"), "unknown SLO key 'ttft_s'"
    )
    assert_one_line_error(
        cli("sweep", "-p", "static", "-t", "mixed", "--rates", "1", "--slo", "ttft_ms=inf"), "finite number > 0"
    )


def test_impossible_plan_and_crashing_policy(tmp_path, profile):
    f = tmp_path / "bad_policies.py"
    f.write_text(
        "from schedlab.policies.base import Plan, Pass\n"
        "class DecodeWaiting:\n"
        "    name = 'decode-waiting'\n"
        "    def plan(self, view):\n"
        "        return Plan(passes=[Pass(decode=[view.waiting[0].id])])\n"
        "class Crash:\n"
        "    name = 'crash'\n"
        "    def plan(self, view):\n"
        "        return 1 / 0\n"
        "class Lazy:\n"
        "    name = 'lazy'\n"
        "    def plan(self, view):\n"
        "        return Plan()\n"
    )
    prof = ["--profile", str(profile)]
    line = assert_one_line_error(
        cli("simulate", "-p", f"{f}:DecodeWaiting", "-t", "real-smoke", *prof),
        "policy 'decode-waiting' step 0",
        "which is waiting",
    )
    assert line.startswith("simulate: error:")
    assert_one_line_error(
        cli("simulate", "-p", f"{f}:Crash", "-t", "real-smoke", *prof), "policy 'crash' step 0 raised ZeroDivisionError"
    )
    assert_one_line_error(
        cli("simulate", "-p", f"{f}:Lazy", "-t", "real-smoke", *prof), "planned nothing", "no arrivals left"
    )


def test_prompt_larger_than_kv_capacity_loses_no_other_request(tmp_path, profile):
    tr = tmp_path / "t.json"
    tr.write_text(
        json.dumps(
            {
                "name": "t",
                "requests": [
                    {"id": "small1", "arrival_s": 0.0, "prompt_tokens": 100, "output_tokens": 10},
                    {"id": "huge", "arrival_s": 0.1, "prompt_tokens": 5000, "output_tokens": 10},
                    {"id": "small2", "arrival_s": 0.2, "prompt_tokens": 200, "output_tokens": 10},
                ],
            }
        )
    )
    out = tmp_path / "run"
    proc = cli(
        "simulate",
        "-p",
        "mlx-default",
        "-t",
        str(tr),
        "--profile",
        str(profile),
        "--kv-tokens",
        "1000",
        "--out",
        str(out),
    )
    assert_one_line_error(proc, "1 request(s) rejected", "huge", "the other requests ran")
    assert "Successful requests:                     2" in proc.stdout
    status = {r["id"]: r["status"] for r in read_table(out / "requests.csv")}
    assert status == {"small1": "finished", "huge": "rejected", "small2": "finished"}


def test_help_lists_every_option():
    proc = cli("simulate", "--help")
    assert proc.returncode == 0
    for opt in ("--policy", "--trace", "--option", "--profile", "--kv-tokens", "--seed", "--out"):
        assert opt in proc.stdout


def test_a_profile_with_a_bad_kv_tokens_or_a_negative_coefficient_is_one_line(tmp_path):
    # every command reads the profile alike: an unusable KV capacity (0 held no request; a
    # string, null or a list crashed) or a negative coefficient (negative latencies, exit 0)
    def profile_with(name: str, **changes) -> str:
        data = {"schema": "schedlab-profile/1", "model": "test", "kv_tokens": 262144, "coefficients": dict(KNOWN)}
        data.update(changes)
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(data))
        return str(p)

    run = ["-p", "vllm", "-t", "real-smoke", "--out", str(tmp_path / "run")]
    for i, bad in enumerate((0, -5, "big", None, [1], True, 1000.5)):
        path = profile_with(f"kv{i}", kv_tokens=bad)
        assert_one_line_error(
            cli("simulate", *run, "--profile", path), path, f"kv_tokens must be an integer >= 1, got {bad!r}"
        )
    assert not (tmp_path / "run").exists()
    neg = profile_with("neg", coefficients={**KNOWN, "d_pass": -0.001})
    assert_one_line_error(cli("simulate", *run, "--profile", neg), neg, "d_pass", ">= 0", "-0.001")
    bad = profile_with("kv-str", kv_tokens="big")
    for name, extra in (("sweep", ["--rates", "1"]), ("capacity", ["--slo", "ttft_ms=1000"])):
        line = assert_one_line_error(
            cli(name, "-p", "vllm", "-t", "real-smoke", "--profile", bad, *extra, "--out", str(tmp_path / name)),
            bad,
            "kv_tokens must be an integer >= 1, got 'big'",
        )
        assert line.startswith(f"schedlab {name}: error:")
    # an integral number is a capacity like any other (as --kv-tokens 160 would be)
    ok = profile_with("kv-ok", kv_tokens=160.0)
    proc = cli("simulate", *run, "--profile", ok)
    assert "Traceback" not in proc.stderr and "KV capacity of 160 tokens" in proc.stderr, proc.stderr


def test_a_kv_capacity_under_one_block_is_refused_up_front(tmp_path, profile):
    # it held no request at all: every one was "rejected" against a capacity of 0 blocks
    run = ["-p", "vllm", "-t", "real-smoke", "--profile", str(profile), "--out", str(tmp_path / "run")]
    line = assert_one_line_error(cli("simulate", *run, "--kv-tokens", "10"), "--kv-tokens 10", "--block-size 16")
    assert line == "simulate: error: --kv-tokens 10 is less than one block (--block-size 16)"
    assert_one_line_error(
        cli("simulate", *run, "--kv-tokens", "1000", "--block-size", "2000"), "--kv-tokens 1000", "--block-size 2000"
    )
    for name, extra in (("sweep", ["--rates", "1"]), ("capacity", ["--slo", "ttft_ms=1000"])):
        assert_one_line_error(cli(name, *run, *extra, "--kv-tokens", "15"), "--kv-tokens 15", "--block-size 16")
    # the profile's own capacity is held to the same
    small = tmp_path / "small.json"
    small.write_text(json.dumps({**json.loads(profile.read_text()), "kv_tokens": 8}))
    assert_one_line_error(
        cli("simulate", "-p", "vllm", "-t", "real-smoke", "--profile", str(small)),
        str(small),
        "8 tokens",
        "--block-size 16",
    )
    assert not (tmp_path / "run").exists()
    # one block is enough to start: the requests that do not fit are refused one by one
    proc = cli("simulate", *run, "--kv-tokens", "16")
    assert_one_line_error(proc, "10 request(s) rejected", "KV capacity of 16 tokens")


def test_an_empty_out_is_a_usage_error(tmp_path, profile):
    # Path("") is the current directory: the run's files went there, exit 0
    common = ["-p", "vllm", "-t", "real-smoke", "--profile", str(profile)]
    for name, extra in (
        ("simulate", common),
        ("sweep", [*common, "--rates", "1"]),
        ("capacity", [*common, "--slo", "ttft_ms=1000"]),
        ("run-real", ["-p", "vllm", "-t", "real-smoke"]),
        ("validate", ["-p", "vllm", "-t", "real-smoke"]),
        ("calibrate", ["--quick"]),
        ("serve", []),
        ("plot", [str(tmp_path)]),
    ):
        proc = cli(name, *extra, "--out", "", cwd=tmp_path)
        assert proc.returncode == 2, (name, proc.stderr)
        assert_one_line_error(proc, "'--out'", "must not be empty")
    assert list(tmp_path.iterdir()) == []


def test_a_speculative_seed_that_is_not_an_integer_is_named(tmp_path, profile):
    run = ["-p", "vllm", "-t", "real-smoke", "--profile", str(profile)]
    for seed in ("x", "1.5"):
        proc = cli("simulate", *run, "--speculative", f"ngram:k=4,accept=0.5,seed={seed}")
        assert proc.returncode == 2
        line = assert_one_line_error(proc)
        assert line == f"simulate: error: --speculative: seed must be an integer, got '{seed}'"


def test_prefix_caching_says_when_text_prompts_share_nothing_it_can_see():
    # the simulated cache keys a prompt by its prefix_ids; sonnet.json's prompts are text sharing a
    # ~195-token head it cannot see without the model's tokens: a warning, not a silent 0 % hit rate
    proc = subprocess.run([*command("simulate"), "-p", "vllm", "-t", "sonnet", "--prefix-caching", "-q"],
                          capture_output=True, text=True)  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 0 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("simulate: warning: --prefix-caching: 100 of 100 request(s) have text prompts")
    spec = "random:n=20,input_len=1200,output_len=16,prefix_len=1024,rate=2"  # (prefix_ids: seen, no warning)
    proc = subprocess.run([*command("simulate"), "-p", "vllm", "-t", spec, "--prefix-caching"],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert float(re.search(r"Prefix cache hit rate \(prompt tokens\):\s+([\d.]+)%", proc.stdout).group(1)) > 0
