"""Heterogeneous clusters from a cluster file (``simulate --cluster FILE``,
``ClusterOptions.from_file``, ``ReplicaGroup``): each replica runs its own group's policy, cost
model and KV capacity (a replica's requests are exactly what that group's single replica makes
of them); a one-group file is ``--replicas N`` byte for byte; the command line's router settings
override the file's; every bad file or flag is one line and a non-zero exit."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

import schedlab
from schedlab import ClusterOptions, ReplicaGroup, SchedlabError
from schedlab.traces.schema import Request
from simkit import KNOWN, command, read_table

REQS = [Request(f"q{i}", i * 0.15, 60 + (i * 37) % 400, 8 + (i * 13) % 40) for i in range(36)]


def cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([*command("simulate"), *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def write_profile(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({"schema": "schedlab-profile/1", "model": "test", "kv_tokens": 262144, "coefficients": KNOWN})
    )
    return path


def write_trace(path: Path, reqs=REQS) -> Path:
    rows = [
        {"id": r.id, "arrival_s": r.arrival_s, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens}
        for r in reqs
    ]
    path.write_text(json.dumps({"requests": rows}))
    return path


TWO_GROUPS = """
router = "round-robin"

[[group]]
count = 2
policy = "unified"
options = { token_budget = 256 }
hardware = "h100-sxm"
model_config = "llama-3.1-8b"

[[group]]
policy = "vllm"
options = { max_num_batched_tokens = 512 }
profile = "prof/known.json"  # relative to this file's folder
kv_tokens = 420
"""


def test_each_replica_runs_its_own_groups_policy_cost_and_kv(tmp_path):
    prof = write_profile(tmp_path / "prof" / "known.json")
    (tmp_path / "c.toml").write_text(TWO_GROUPS)
    run = schedlab.simulate(None, REQS, cluster=ClusterOptions.from_file(tmp_path / "c.toml"))
    assert run.error is None
    req = run.requests
    assert req["replica"].tolist() == [i % 3 for i in range(len(REQS))]  # round-robin over 3 replicas
    # each replica's requests are exactly what its group's policy, cost model and KV capacity
    # make of them on a replica of its own (round-robin, no delay: the replicas do not interact)
    alone = {
        0: dict(policy="unified", options={"token_budget": 256}, hardware="h100-sxm", model_config="llama-3.1-8b"),
        1: dict(policy="unified", options={"token_budget": 256}, hardware="h100-sxm", model_config="llama-3.1-8b"),
        2: dict(policy="vllm", options={"max_num_batched_tokens": 512}, profile=prof, kv_tokens=420),
    }
    for j, kw in alone.items():
        mine = [r for i, r in enumerate(REQS) if i % 3 == j]
        one = schedlab.simulate(kw.pop("policy"), mine, **kw).requests
        got = req[req["replica"] == j].drop(columns="replica").reset_index(drop=True)
        assert got.equals(one), j
    # the small KV shows on the group that has it, and only there
    rejected = req[req["status"] == "rejected"]
    assert len(rejected) > 0 and set(rejected["replica"]) == {2}
    assert all(r.prompt_tokens + r.output_tokens - 1 > 420 for r, _ in run._result.rejected)
    s = run.summary
    assert s["policy"] == "unified+vllm"
    parts = s["replicas"]
    assert [(p["replica"], p["group"], p["policy"]) for p in parts] == [
        (0, 1, "unified"),
        (1, 1, "unified"),
        (2, 2, "vllm"),
    ]
    assert [p["cost"] for p in parts] == ["h100-sxm llama-3.1-8b 16-bit"] * 2 + ["known.json"]
    h100_kv = schedlab.cost_model(hardware="h100-sxm", model_config="llama-3.1-8b").kv_tokens // 16 * 16
    assert [p["kv_tokens"] for p in parts] == [h100_kv, h100_kv, 416]  # (whole blocks of 16)
    assert sum(p["requests"] for p in parts) == s["requests"] == len(REQS)
    assert sum(p["finished"] for p in parts) == s["finished"] == len(REQS) - len(rejected)
    groups = run.meta["cluster"]["groups"]
    assert [(g["group"], g["replicas"], g["count"], g["policy"]) for g in groups] == [
        (1, [0, 1], 2, "unified"),
        (2, [2, 2], 1, "vllm"),
    ]
    assert groups[0]["analytic"]["hardware"] == "h100-sxm" and groups[1]["profile"] == str(prof)
    assert groups[0]["policy_options"]["token_budget"] == 256
    assert run.meta["cluster"]["file"] == str(tmp_path / "c.toml")
    assert run.meta["kv_tokens"] == [h100_kv, h100_kv, 416] and run.meta["policy_options"] is None
    # the same cluster built in Python
    same = ClusterOptions(
        router="round-robin",
        groups=[
            ReplicaGroup("unified", 2, {"token_budget": 256}, hardware="h100-sxm", model_config="llama-3.1-8b"),
            {"policy": "vllm", "options": {"max_num_batched_tokens": 512}, "profile": prof, "kv_tokens": 420},
        ],
    )
    assert same.replicas == 3
    assert schedlab.simulate(None, REQS, cluster=same).requests.equals(req)


def test_a_one_group_file_is_the_homogeneous_cluster_byte_for_byte(tmp_path):
    prof = write_profile(tmp_path / "known.json")
    trace = write_trace(
        tmp_path / "t.json", [Request(r.id, r.arrival_s / 8, r.prompt_tokens, r.output_tokens) for r in REQS]
    )
    (tmp_path / "one.toml").write_text(
        'router = "least-requests"\nrouter_delay = 0.1\n'
        f'[[group]]\ncount = 3\npolicy = "vllm"\noptions = {{ max_num_seqs = 4 }}\nprofile = "{prof}"\n'
    )
    a = cli("--cluster", str(tmp_path / "one.toml"), "-t", str(trace), "--out", str(tmp_path / "a"), "--passes")
    b = cli("-p", "vllm", "-o", "max_num_seqs=4", "--profile", str(prof), "-t", str(trace), "--replicas", "3",
            "--router", "least-requests", "--router-delay", "0.1", "--out", str(tmp_path / "b"), "--passes")  # fmt: skip
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout and "group:" not in a.stdout  # (one group: no group lines)
    for name in ("summary.json", "requests.csv", "tokens.parquet", "steps.parquet", "passes.parquet"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert len({r["replica"] for r in read_table(tmp_path / "a" / "requests.csv")}) == 3  # (all three served)
    assert [p["group"] for p in summary["replicas"]] == [1, 1, 1]
    ma, mb = (json.loads((tmp_path / d / "meta.json").read_text()) for d in "ab")
    for key in ("profile", "kv_tokens", "policy_options"):
        assert ma[key] == mb[key], key
    assert ma["cluster"]["groups"][0]["replicas"] == [0, 2] and "groups" not in mb["cluster"]


def test_the_command_lines_router_settings_override_the_files(tmp_path):
    prof = write_profile(tmp_path / "prof" / "known.json")
    trace = write_trace(tmp_path / "t.json", REQS[:12])
    f = tmp_path / "c.toml"
    f.write_text(
        'router = "random"\nrouter_options = { seed = 3 }\nrouter_delay = 0.5\n'
        f'[[group]]\ncount = 2\npolicy = "unified"\nprofile = "{prof}"\n'
        f'[[group]]\npolicy = "vllm"\nprofile = "prof/known.json"\nkv_tokens = 20000\n'
    )
    base = cli("--cluster", str(f), "-t", str(trace), "--out", str(tmp_path / "o0"), "-q")
    assert base.returncode == 0, base.stderr
    assert json.loads((tmp_path / "o0" / "summary.json").read_text())["cluster"] == {
        "replicas": 3,
        "router": "random",
        "router_options": {"seed": 3},
        "router_delay": 0.5,
    }
    for args, want in [
        (["--router", "round-robin"], ("round-robin", {}, 0.5)),  # the file's router_options go with its router
        (["--router-option", "seed=7", "--router-delay", "0"], ("random", {"seed": 7}, 0.0)),
    ]:
        out = tmp_path / f"o{len(args)}"
        proc = cli("--cluster", str(f), "-t", str(trace), "--out", str(out), "-q", *args)
        assert proc.returncode == 0, proc.stderr
        c = json.loads((out / "summary.json").read_text())["cluster"]
        assert (c["router"], c["router_options"], c["router_delay"]) == want
    rows = read_table(tmp_path / "o2" / "requests.csv")  # round-robin
    assert [int(r["replica"]) for r in rows] == [i % 3 for i in range(12)]


def test_bad_files_and_flags_are_one_line_and_a_non_zero_exit(tmp_path):
    write_profile(tmp_path / "known.json")
    trace = write_trace(tmp_path / "t.json", REQS[:4])
    good_group = '[[group]]\npolicy = "vllm"\nprofile = "known.json"\n'
    files = {
        "syntax": 'router = "round-robin"\n[[group]]\ncount = = 2\n',
        "top_key": 'routr = "random"\n' + good_group,
        "no_group": 'router = "random"\n',
        "group_key": good_group + '[[group]]\npolicy = "vllm"\nkv_token = 100\n',
        "count": '[[group]]\ncount = 0\npolicy = "vllm"\n',
        "kv": good_group + '[[group]]\npolicy = "vllm"\nkv_tokens = "x"\n',
        "no_policy": "[[group]]\ncount = 2\n",
        "policy": good_group + '[[group]]\npolicy = "nope"\n',
        "option": '[[group]]\npolicy = "vllm"\noptions = { budget = 1 }\n',
        "hardware": '[[group]]\npolicy = "vllm"\nhardware = "a100"\nmodel_config = "llama-3.1-8b"\n',
        "alone": '[[group]]\npolicy = "vllm"\nhardware = "h100-sxm"\n',
        "both": '[[group]]\npolicy = "vllm"\nprofile = "known.json"\nhardware = "h100-sxm"\nmodel_config = "qwen3-8b"\n',
        "profile": '[[group]]\npolicy = "vllm"\nprofile = "none.json"\n',
        "delay": "router_delay = -1\n" + good_group,
        "router": 'router = "nope"\n' + good_group,
        "router_option": 'router = "random"\nrouter_options = { nope = 1 }\n' + good_group,
    }
    for name, text in files.items():
        (tmp_path / f"{name}.toml").write_text(text)
    (tmp_path / "latin1.toml").write_bytes(b'router = "caf\xe9"\n')
    # the files' errors in this process (the same lines, without the command's prefix)
    in_process = [
        (".", ". is a directory"),
        ("latin1.toml", "latin1.toml: not a UTF-8 text file"),
        ("top_key.toml", "top_key.toml: unknown key 'routr'"),
        ("no_group.toml", "no_group.toml: no [[group]] table"),
        ("no_policy.toml", "no_policy.toml: group 1: no policy"),
        ("option.toml", "option.toml: group 1: policy 'vllm' has no option 'budget'"),
        ("alone.toml", "alone.toml: group 1: hardware and model_config go together"),
        ("both.toml", "both.toml: group 1: give either profile or hardware + model_config"),
        ("profile.toml", "profile.toml: group 1: profile not found: none.json"),
        ("delay.toml", "delay.toml: router_delay must be a finite number of seconds >= 0"),
        ("router.toml", "router.toml: unknown router 'nope'"),
        ("router_option.toml", "router_option.toml: router 'random' has no option 'nope'"),
    ]
    for name, frag in in_process:
        path = tmp_path / name
        with pytest.raises(SchedlabError) as info:
            schedlab.simulate(None, REQS[:4], cluster=ClusterOptions.from_file(path))
        line = str(info.value)
        assert "\n" not in line and frag.replace(name, str(path), 1) in line, (name, line)
    # and some through the command, with the flags that clash with a file
    cases = [
        (["--cluster", "missing.toml"], "missing.toml: no such cluster file (bundled: h100-a100"),
        (["--cluster", "syntax.toml"], "syntax.toml: invalid TOML:", "line 3"),
        (["--cluster", "group_key.toml"], "group_key.toml: group 2: unknown key 'kv_token'"),
        (["--cluster", "count.toml"], "count.toml: group 1: count must be an integer >= 1, got 0"),
        (["--cluster", "kv.toml"], "kv.toml: group 2: kv_tokens must be an integer >= 1, got 'x'"),
        (["--cluster", "policy.toml"], "policy.toml: group 2: unknown policy 'nope'"),
        (["--cluster", "hardware.toml"], "hardware.toml: group 1: unknown hardware 'a100'"),
        (["--cluster", "router.toml"], "router.toml: unknown router 'nope'"),
        (["--cluster", "router_option.toml"], "router_option.toml: router 'random' has no option 'nope'"),
        (["--cluster", "policy.toml", "-p", "vllm"], "--cluster policy.toml says each group's policy: drop --policy"),
        (["--cluster", "policy.toml", "--replicas", "2"], "drop --replicas"),
        (["--cluster", "policy.toml", "--kv-tokens", "100"], "drop --kv-tokens"),
        ([], "Missing option '--policy'"),
    ]
    procs = [  # (at once: each is a process start)
        subprocess.Popen(
            [*command("simulate"), "-t", str(trace), *args],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args, *_ in cases
    ]
    for (args, *frags), proc in zip(cases, procs):
        out, err = proc.communicate(timeout=300)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert proc.returncode in (1, 2), (args, proc.returncode, err)
        assert "Traceback" not in err and len(lines) == 1, (args, err)
        assert lines[0].startswith("simulate: error: ") and all(f in lines[0] for f in frags), (args, lines[0])


def test_the_api_checks_groups_when_they_are_made(tmp_path):
    for kw, frag in [
        (dict(policy="vllm", kv_tokens="x"), "ReplicaGroup: kv_tokens must be an integer >= 1, got 'x'"),
        (dict(policy="vllm", count=True), "ReplicaGroup: count must be an integer >= 1, got True"),
        (dict(policy=None), "ReplicaGroup: no policy"),
        (dict(policy="vllm", quant=4), "ReplicaGroup: quant goes with hardware and model_config"),
        (dict(policy="vllm", options=[1]), "ReplicaGroup: options must be a table"),
        (dict(policy="vllm", cost=object(), profile="x"), "ReplicaGroup: give one cost source"),
    ]:
        with pytest.raises(SchedlabError, match="^" + frag.replace("(", r"\(")):
            ReplicaGroup(**kw)
    with pytest.raises(SchedlabError, match="^group 2: unknown key 'kv'"):
        ClusterOptions(groups=[ReplicaGroup("vllm"), {"policy": "vllm", "kv": 1}])
    with pytest.raises(SchedlabError, match="give either replicas or groups: the groups' counts make 3 replicas"):
        ClusterOptions(replicas=2, groups=[ReplicaGroup("vllm", 3)])
    with pytest.raises(SchedlabError, match="non-empty sequence"):
        ClusterOptions(groups=[])
    cluster = ClusterOptions(groups=[ReplicaGroup("vllm", 2), ReplicaGroup("unified")])
    with pytest.raises(SchedlabError, match="give policy in a ReplicaGroup"):
        schedlab.simulate("vllm", REQS, cluster=cluster)
    with pytest.raises(SchedlabError, match="give kv_tokens in a ReplicaGroup"):
        schedlab.simulate(None, REQS, cluster=cluster, kv_tokens=1000)
    with pytest.raises(SchedlabError, match="^group 2: unknown policy 'nope'"):
        schedlab.simulate(None, REQS, cluster=ClusterOptions(groups=[ReplicaGroup("vllm"), ReplicaGroup("nope")]))
    # a policy object is copied for each replica (policies keep state): as its name would be
    obj = schedlab.simulate(None, REQS, cluster=ClusterOptions(groups=[ReplicaGroup(schedlab.policy("vllm"), 3)]))
    named = schedlab.simulate(None, REQS, cluster=ClusterOptions(groups=[ReplicaGroup("vllm", 3)]))
    assert obj.requests.equals(named.requests) and obj.summary["finished"] == len(REQS)


def test_the_bundled_cluster_file(tmp_path):
    c = ClusterOptions.from_file("h100-a100")
    assert [g.hardware for g in c.groups] == ["h100-sxm", "a100-40gb-sxm"] and c.replicas == 4
    assert Path(c.file).name == "h100-a100"
    run = schedlab.simulate(None, REQS, cluster=c)
    assert run.error is None and run.summary["finished"] == len(REQS)
    assert [p["group"] for p in run.summary["replicas"]] == [1, 1, 2, 2]
    assert [p["cost"].split()[0] for p in run.summary["replicas"]] == ["h100-sxm"] * 2 + ["a100-40gb-sxm"] * 2
