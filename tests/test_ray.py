"""The ray executor: ``sweep`` and ``capacity`` on a real local Ray (2 CPUs) give the very rows
the local executor gives, and classes run in this process are refused on Ray in one line.

Ray is a test dependency (CI installs ``schedlab[ray]``): without it this fails, as it should.
One child process starts one Ray for both (started on first use, kept for the second call);
the reference rows come from the local executor in this process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from test_capacity import mixed_trace

import schedlab
from schedlab.api.sweeps import sweep_rows
from schedlab.sim.cost import LinearCostModel
from simkit import KNOWN

pytestmark = pytest.mark.slow

SLO = {"ttft_ms": 400.0}


def _profile(path):
    path.write_text(json.dumps({"schema": "schedlab-profile/1", "model": "test", "coefficients": dict(KNOWN)}))
    return path


def test_sweep_and_capacity_on_ray_equal_the_local_executor(tmp_path):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps(mixed_trace(40).to_json()))
    profile = _profile(tmp_path / "prof.json")
    driver = tmp_path / "driver.py"
    driver.write_text(
        textwrap.dedent(
            f"""
            import json, sys
            import schedlab
            from schedlab.api.sweeps import sweep_rows
            sw = schedlab.sweep("chunked-prefill,vllm", {str(trace)!r}, "2,8", profile={str(profile)!r},
                                slo={SLO!r}, executor="ray", workers=2)
            cap = schedlab.capacity("chunked-prefill,vllm", {str(trace)!r}, slo={SLO!r}, attainment=0.9,
                                    replicas="1,2", profile={str(profile)!r},
                                    executor="ray", workers=2)
            import ray
            cpus = ray.cluster_resources().get("CPU")
            json.dump({{"sweep": sweep_rows(sw), "capacity": cap.to_dict("records"),
                        "points": cap.attrs["points"], "cpus": cpus}}, open(sys.argv[1], "w"), default=str)
            """
        )
    )
    out = tmp_path / "ray.json"
    p = subprocess.run([sys.executable, str(driver), str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    got = json.loads(out.read_text())
    assert got["cpus"] == 2  # the local Ray it started: workers=2 CPUs

    sw = schedlab.sweep("chunked-prefill,vllm", str(trace), "2,8", profile=str(profile), slo=SLO, workers=2)
    want_sweep = json.loads(json.dumps(sweep_rows(sw), default=str))
    assert len(want_sweep) == 4 and all(r["error"] is None for r in want_sweep)
    assert got["sweep"] == want_sweep

    cap = schedlab.capacity(
        "chunked-prefill,vllm",
        str(trace),
        slo=SLO,
        attainment=0.9,
        replicas="1,2",
        profile=str(profile),
        workers=2,
    )
    want = json.loads(json.dumps({"c": cap.to_dict("records"), "p": cap.attrs["points"]}, default=str))
    assert len(want["c"]) == 4 and all(r["error"] is None for r in want["c"])
    assert got["capacity"] == want["c"]
    assert got["points"] == want["p"]  # the same rates tried, the same answers, in the same order


def test_classes_run_in_this_process_are_refused_on_ray():
    class Mine(schedlab.policies.ChunkedPrefill):
        name = "mine"

    with pytest.raises(schedlab.SchedlabError, match="classes and policy objects run in this process"):
        schedlab.sweep([Mine], mixed_trace(10), "1", executor="ray")
    with pytest.raises(schedlab.SchedlabError, match="classes and policy objects run in this process"):
        schedlab.capacity([Mine], mixed_trace(10), slo=SLO, cost=LinearCostModel(dict(KNOWN)), executor="ray")
