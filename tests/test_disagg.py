"""Prefill and decode on different replicas, simulated (``sim.disagg``): a request is prefilled
(its first token) in the prefill pool, its KV moved (``sim.transfer``), and decoded in the decode
pool. Hand-computed timings on a trace with no overlap; every policy on both sides; KV pressure
on the decode side; one-line errors."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from schedlab.policies import POLICIES, make_policy
from schedlab.routers import make_router
from schedlab.sim.cost import LinearCostModel
from schedlab.sim import Deployment, DeploymentError, Group, run
from schedlab.sim.metrics import summarize
from schedlab.sim.sources import ClientSource
from schedlab.sim.transfer import KVTransfer, Link
from schedlab.traces.schema import Request

S, PP, PT, DP = 0.0005, 0.004, 5e-5, 0.003  # per step, per prefill pass, per prefill token, per decode pass
COST = LinearCostModel({"s_step": S, "p_pass": PP, "p_tokens": PT, "d_pass": DP})
LINK = Link(1.0, 0.001)  # 1 GB/s, 1 ms
BYTES = 1000.0  # KV bytes per token
TRACE = [Request(f"r{i}", 10.0 * i, 100 + 50 * i, 5) for i in range(3)]  # 10 s apart: no overlap


@dataclass
class Pool:
    """One pool as these tests build it: a policy object per replica, their cost model, router
    and KV capacity (changed by a test before the run)."""

    policies: list
    cost_model: object
    router: object
    kv_capacity: int


def run_disaggregated(arrivals, prefill: Pool, decode: Pool, transfer, *, block_size: int = 1):
    """``sim.run`` of the deployment of the two pools (each pool gets its own copy of the prefill
    pool's router: the tests give both pools the same kind)."""
    groups = tuple(
        Group(tuple(p.policies), p.cost_model, p.kv_capacity, name)
        for p, name in ((prefill, "prefill"), (decode, "decode"))
        if p.policies
    )
    return run(Deployment(groups, prefill.router, transfer=transfer, block_size=block_size), arrivals)


def pools(policy: str, n_p: int = 1, n_d: int = 1, kv: int = 100_000, **options):
    mk = lambda: make_policy(policy, options)  # noqa: E731
    return (
        Pool([mk() for _ in range(n_p)], COST, make_router("round-robin"), kv),
        Pool([mk() for _ in range(n_d)], COST, make_router("round-robin"), kv),
    )


@pytest.mark.parametrize("policy", ["unified", "mlx-default"])
def test_one_to_one_equals_prefill_then_transfer_then_decode_by_hand(policy):
    transfer = KVTransfer(BYTES, 4, LINK, "whole")
    res = run_disaggregated(TRACE, *pools(policy), transfer)
    assert res.error is None and not res.rejected
    for req, r in zip(TRACE, res.requests):
        p = req.prompt_tokens
        moved = LINK.latency_s + BYTES * p / 1e9
        if policy == "unified":
            # the prefill pool's step: the whole prompt, its last chunk yields the first token
            first = req.arrival_s + S + PP + PT * p
            # the decode pool computes the first token's KV (a one-token chunk): the second token
            second = first + moved + S + PP + PT * 1
        else:
            # mlx-lm: the prompt less its last token, then that token decoded (the hand-off);
            # on the decode side the one token left goes straight into the decode batch
            first = req.arrival_s + (S + PP + PT * (p - 1)) + (S + DP)
            second = first + moved + S + DP
        want = [first, second] + [second + k * (S + DP) for k in range(1, req.output_tokens - 1)]
        assert r.token_times == pytest.approx(want, abs=1e-12), req.id
        assert r.first_token_s == pytest.approx(first) and r.finish_s == pytest.approx(want[-1])
        assert res.cluster["transfer_s"][req.id] == pytest.approx(moved)
    s = summarize(res)
    assert s["finished"] == len(TRACE) and s["ttft_ms"]["p50"] == pytest.approx(
        1e3 * sorted(r.first_token_s - q.arrival_s for r, q in zip(res.requests, TRACE))[1]
    )
    # the decode replica computed one token of each prompt (none under mlx-lm's hand-off)
    d = res.replicas[1]
    chunks = [n for p in d.passes.columns[4] for _, n in p.prefill]
    assert chunks == ([1] * len(TRACE) if policy == "unified" else [])
    assert res.replica == [1, 1, 1]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_serves_every_request_once_on_both_sides(policy):
    trace = [Request(f"q{i}", 0.02 * i, 30 + (i * 37) % 300, 1 + (i * 7) % 20) for i in range(40)]
    transfer = KVTransfer(BYTES, 8, LINK, "layerwise")
    res = run_disaggregated(trace, *pools(policy, n_p=2, n_d=3), transfer, block_size=16)
    assert res.error is None and not res.rejected
    assert [r.id for r in res.requests] == [q.id for q in trace]
    for q, r in zip(trace, res.requests):
        times = r.token_times
        assert len(times) == q.output_tokens and times == sorted(times), q.id
        assert r.first_token_s == times[0] >= q.arrival_s
        if q.output_tokens > 1:  # its second token came after its KV did
            assert times[1] >= times[0] + res.cluster["transfer_s"][q.id]
            assert 2 <= res.replica[trace.index(q)] <= 4
        else:
            assert q.id not in res.cluster["transfer_s"] and res.replica[trace.index(q)] in (0, 1)
    assert len(res.replicas) == 5


def test_layerwise_hides_what_the_prefill_covers_and_ttft_is_the_prefills():
    slow = Link(0.001, 0.0)  # 1 MB/s: 0.1 s per 100 tokens, longer than a prefill
    whole = run_disaggregated(TRACE, *pools("unified"), KVTransfer(BYTES, 10, slow, "whole"))
    layer = run_disaggregated(TRACE, *pools("unified"), KVTransfer(BYTES, 10, slow, "layerwise"))
    for a, b in zip(whole.requests, layer.requests):
        assert a.first_token_s == b.first_token_s  # TTFT: the prefill's first token either way
        assert b.token_times[1] < a.token_times[1]
        gap_a = a.token_times[1] - a.token_times[0]
        gap_b = b.token_times[1] - b.token_times[0]
        assert gap_a - gap_b == pytest.approx(whole.cluster["transfer_s"][a.id] - layer.cluster["transfer_s"][a.id])


def test_decode_side_kv_pressure_preempts_and_recomputes_to_the_end():
    trace = [Request(f"q{i}", 0.0, 200, 40) for i in range(6)]
    p, d = pools("vllm", kv=100_000)
    d.kv_capacity = 700  # three of the six fit at once
    res = run_disaggregated(trace, p, d, None, block_size=16)
    assert res.error is None and not res.rejected
    assert all(len(r.token_times) == 40 for r in res.requests)
    assert sum(r.preemptions for r in res.requests) > 0


def test_bad_disaggregated_runs_are_one_line_errors():
    p, d = pools("unified")
    cases = [
        (lambda: run_disaggregated(TRACE, Pool([], COST, make_router("round-robin"), 1000), d, None), "no prefill"),
        (lambda: run_disaggregated(TRACE, p, Pool([], COST, make_router("round-robin"), 1000), None), "no decode"),
        (lambda: run_disaggregated(ClientSource(TRACE, max_concurrency=2), p, d, None), "closed-loop"),
        (lambda: run_disaggregated([Request("c", 0.0, 10, 5, cancel_after_s=1.0)], p, d, None), "cancel"),
        (lambda: run_disaggregated(TRACE, p, d, "nvlink4"), "KVTransfer"),
    ]
    for call, words in cases:
        with pytest.raises(DeploymentError) as exc:
            call()
        assert words in str(exc.value) and "\n" not in str(exc.value)


# ---------------------------------------------------------------------------- the cluster file

DISAGG_TOML = """
router = "least-requests"

[transfer]
mode = "layerwise"
{transfer}

[[group]]
count = 1
policy = "vllm"
pool = "prefill"
hardware = "h100-sxm"
model_config = "llama-3.1-8b"

[[group]]
count = 2
policy = "vllm"
pool = "decode"
hardware = "h100-sxm"
model_config = "llama-3.1-8b"
"""


def test_a_cluster_file_with_pools_is_the_python_run(tmp_path):
    import subprocess

    import schedlab
    from schedlab import ClusterOptions
    from schedlab.analysis.analytic import kv_transfer, make_analytic_cost_model
    from simkit import command

    f = tmp_path / "pd.toml"
    f.write_text(DISAGG_TOML.format(transfer=""))
    out = tmp_path / "run"
    proc = subprocess.run(
        [*command("simulate"), "--cluster", str(f), "--trace", "mixed", "--block-size", "16", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Replicas (prefill + decode):             1 + 2" in proc.stdout
    assert "KV transfer:                             layerwise over nvlink4 (450 GB/s)" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert [p["pool"] for p in summary["replicas"]] == ["prefill", "decode", "decode"]
    assert "Replica 0 group:                         1: prefill, vllm" in proc.stdout
    assert "Replica 1 median KV to token (ms):" in proc.stdout  # (its requests' first token here is their second)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["cluster"]["disaggregated"] and [g["replicas"] for g in meta["cluster"]["groups"]] == [[0, 0], [1, 2]]
    # the same run from Python, by hand: the file's pools, link and model
    cost, kv, _ = make_analytic_cost_model("h100-sxm", "llama-3.1-8b", None)
    pool = lambda n: Pool([make_policy("vllm") for _ in range(n)], cost, make_router("least-requests"), kv)  # noqa: E731
    by_hand = run_disaggregated(
        schedlab.load_trace("mixed").requests,
        pool(1),
        pool(2),
        kv_transfer("llama-3.1-8b", "h100-sxm", "layerwise"),
        block_size=16,
    )
    ref = summarize(by_hand)
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        assert summary[key]["p50"] == pytest.approx(ref[key]["p50"]), key
    run = schedlab.simulate(None, "mixed", block_size=16, cluster=ClusterOptions.from_file(f))
    assert run.summary["ttft_ms"]["p99"] == pytest.approx(ref["ttft_ms"]["p99"])


BAD_POOLS = [
    ('pool = "prefill"', 'pool = "both"', "group 1: pool must be 'prefill' or 'decode'"),
    ('pool = "decode"', 'pool = "prefill"', "no decode group"),
    ('pool = "prefill"', "", "group 1: no pool"),
    ('mode = "layerwise"', 'mode = "teleport"', "transfer: mode must be one of whole, layerwise"),
    ('mode = "layerwise"', 'mode = "whole"\nspeed = 3', "transfer: unknown key 'speed'"),
    ('mode = "layerwise"', 'link = "nvlink4"\nbandwidth_gbs = 10', "give either link (a preset) or bandwidth_gbs"),
    ('mode = "layerwise"', 'link = "warp"', "transfer: unknown link 'warp'"),
    ('mode = "layerwise"', "latency_s = -1", "transfer: latency_s must be a finite number >= 0"),
    ('mode = "layerwise"', 'mode = "layerwise"\nkv_bytes_per_token = 4096', "needs the model's layers"),
    ('mode = "layerwise"', "kv_bytes_per_token = 0", "transfer: kv_bytes_per_token must be an integer >= 1"),
    (
        'mode = "layerwise"',
        'model_config = "llama-3.1-8b"\nkv_bytes_per_token = 4096\nlayers = 2',
        "give either model_config or kv_bytes_per_token",
    ),
]


@pytest.mark.parametrize("old,new,message", BAD_POOLS, ids=[m for *_, m in BAD_POOLS])
def test_bad_pool_definitions_are_one_line_errors(tmp_path, old, new, message):
    import subprocess

    from simkit import command

    text = DISAGG_TOML.format(transfer="")
    assert old in text
    f = tmp_path / "pd.toml"
    f.write_text(text.replace(old, new, 1))
    proc = subprocess.run(
        [*command("simulate"), "--cluster", str(f), "--trace", "mixed"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_pool_rules_that_span_groups_are_one_line_errors(tmp_path):
    import subprocess

    from simkit import command

    def run(text, *args):
        f = tmp_path / "pd.toml"
        f.write_text(text)
        return subprocess.run(
            [*command("simulate"), "--cluster", str(f), "--trace", "mixed", *args],
            capture_output=True,
            text=True,
            timeout=300,
        )

    text = DISAGG_TOML.format(transfer="")
    swapped = text.replace('pool = "prefill"', "POOL").replace('pool = "decode"', 'pool = "prefill"')
    swapped = swapped.replace("POOL", 'pool = "decode"')
    cases = [
        (run(swapped), "the prefill groups come before the decode groups"),
        (run(text, "--prefix-caching"), "no prefix cache yet"),
        (run(text, "--max-concurrency", "4"), "closed-loop clients are not supported yet"),
        (run(text.replace('pool = "prefill"\n', "").replace('pool = "decode"\n', "")), "transfer goes with prefill"),
        (
            run(text.replace('hardware = "h100-sxm"\nmodel_config = "llama-3.1-8b"', 'profile = "tiny-cpu"')),
            "transfer: give link",
        ),
        (
            run(
                text.replace('hardware = "h100-sxm"\nmodel_config = "llama-3.1-8b"', 'profile = "tiny-cpu"').replace(
                    'mode = "layerwise"', 'mode = "layerwise"\nlink = "nvlink4"'
                )
            ),
            "transfer: give model_config",
        ),
    ]
    for proc, message in cases:
        err = proc.stderr.strip()
        assert proc.returncode != 0 and message in err and len(err.splitlines()) == 1, err


def test_capacity_searches_disaggregated_cluster_files_beside_co_located_ones(tmp_path):
    """Equal GPU count (3): one co-located file, one of 1 prefill + 2 decode replicas; both are
    searched, each row's capacity meets the SLO, and per replica (a GPU each) it is the capacity / 3."""
    import schedlab

    pd = tmp_path / "pd-1-2.toml"
    pd.write_text(DISAGG_TOML.format(transfer=""))
    co = tmp_path / "co-3.toml"
    co.write_text(
        'router = "least-requests"\n\n[[group]]\ncount = 3\npolicy = "vllm"\n'
        'hardware = "h100-sxm"\nmodel_config = "llama-3.1-8b"\n'
    )
    table = schedlab.capacity(None, "mixed", slo="ttft_ms=500,tpot_ms=50", clusters=[str(co), str(pd)], workers=1)
    rows = {r["configuration"]: r for r in table.to_dict("records")}
    assert set(rows) == {"co-3", "pd-1-2"}
    for name, r in rows.items():
        assert r["capacity_rps"] > 0 and r["replicas"] == 3, r
        assert r["attainment_at_capacity"] >= 0.99
        assert r["capacity_per_replica_rps"] == pytest.approx(r["capacity_rps"] / 3)
        points = table.attrs["points"][name]
        assert any(p["passed"] for p in points) and not any(p["error"] for p in points)
    # the disaggregated configuration ran whole (its pools run in turn: no early stop)
    assert not any(p["stopped_early"] for p in table.attrs["points"]["pd-1-2"])


def test_capacity_pd_splits_searches_every_split_of_the_files_replicas(tmp_path):
    import subprocess

    import schedlab
    from schedlab import SchedlabError
    from simkit import command

    pd = tmp_path / "pd.toml"
    pd.write_text(DISAGG_TOML.format(transfer="").replace("count = 2", "count = 3"))  # 1 + 3 = 4 GPUs
    out = tmp_path / "cap"
    args = ["--cluster", str(pd), "--trace", "mixed", "--slo", "ttft_ms=500,tpot_ms=50", "--workers", "1"]
    proc = subprocess.run(
        [*command("capacity"), *args, "--pd-splits", "--out", str(out)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((out / "capacity.json").read_text())["configurations"]
    assert [r["configuration"] for r in rows] == ["pd 1:3", "pd 2:2", "pd 3:1"]
    assert all(r["replicas"] == 4 and r["capacity_rps"] > 0 for r in rows)
    # 1:3 is the file itself: the same capacity as searching the file alone
    alone = schedlab.capacity(None, "mixed", slo="ttft_ms=500,tpot_ms=50", clusters=[str(pd)], workers=1)
    assert list(alone["configuration"]) == ["pd"] and alone["capacity_rps"][0] == rows[0]["capacity_rps"]
    # without a pooled file, or with more than one group per pool: one line
    co = tmp_path / "co.toml"
    co.write_text('[[group]]\ncount = 2\npolicy = "vllm"\nhardware = "h100-sxm"\nmodel_config = "llama-3.1-8b"\n')
    three = tmp_path / "three.toml"
    three.write_text(
        DISAGG_TOML.format(transfer="")
        + '\n[[group]]\npool = "decode"\npolicy = "unified"\nhardware = "h100-sxm"\nmodel_config = "llama-3.1-8b"\n'
    )
    for f, words in (
        (co, "pd_splits goes with a cluster file of prefill and decode pools"),
        (three, "takes a file of one prefill group and one decode group, got 3 groups"),
    ):
        with pytest.raises(SchedlabError) as exc:
            schedlab.capacity(None, "mixed", slo="ttft_ms=500", clusters=[str(f)], pd_splits=True)
        assert words in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_a_request_either_pool_refuses_is_rejected_with_its_own_lengths():
    trace = [Request("small", 0.0, 50, 5), Request("huge", 1.0, 5000, 5), Request("long", 2.0, 900, 400)]
    p, d = pools("unified")
    p.kv_capacity = 2000  # the huge prompt does not fit the prefill replica
    d.kv_capacity = 1000  # the long one's prompt and output do not fit the decode replica
    res = run_disaggregated(trace, p, d, None)
    assert res.error is None
    s = summarize(res)
    assert s["finished"] == 1 and s["rejected"] == 2
    by_id = {r.id: r for r in res.requests}
    assert {r.id for r, _ in res.rejected} == {"huge", "long"}
    assert by_id["huge"].output_tokens == 5 and by_id["huge"].first_token_s is None
    # the long one got its first token from the prefill pool before the decode pool refused it
    assert by_id["long"].output_tokens == 400 and by_id["long"].token_times == [by_id["long"].first_token_s]
    assert len(by_id["small"].token_times) == 5


def test_a_models_kv_size_given_instead_of_its_config_is_the_python_run():
    """A measured profile's model has no bundled config: the transfer table gives its KV bytes per
    token (validate --served of a real disaggregated run does so with the engine's)."""
    import schedlab
    from schedlab import ClusterOptions

    group = {"policy": "unified", "profile": "tiny-cpu"}
    cu = ClusterOptions(
        groups=[{**group, "pool": "prefill"}, {**group, "pool": "decode", "count": 2}],
        transfer={"mode": "whole", "bandwidth_gbs": 0.5, "latency_s": 0.002, "kv_bytes_per_token": 50_000},
    )
    run = schedlab.simulate(None, "mixed", cluster=cu)
    moved = run.meta["cluster"]["transfer_s"]
    trace = {r.id: r for r in schedlab.load_trace("mixed").requests}
    assert moved and all(
        t == pytest.approx(0.002 + 50_000 * trace[rid].prompt_tokens / 0.5e9) for rid, t in moved.items()
    )
