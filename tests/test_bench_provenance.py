"""Every results file keeps how it was made: ``bench/common.py``'s ``write_json``, which every
bench writes its results through, puts a ``provenance`` block first (the commit, whether the
tree was dirty, when it was written, the machine) with no code in the bench."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"


@pytest.fixture(scope="module")
def common():
    """bench/common.py, loaded from its file (it imports nothing of bench/)."""
    spec = importlib.util.spec_from_file_location("bench_common", BENCH / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _git(repo: Path, *args: str) -> str:
    cmd = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com", *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


def test_write_json_puts_the_provenance_first_and_keeps_the_data(common, tmp_path):
    data = {"bench": "x", "provenance": {"commit": "stale"}, "figures": {"a": 1.5}}
    before = datetime.now(timezone.utc).replace(microsecond=0)
    path = common.write_json(data, tmp_path / "results" / "x.json")
    after = datetime.now(timezone.utc)
    got = json.loads(path.read_text())
    assert list(got) == ["provenance", "bench", "figures"] and got["figures"] == {"a": 1.5}
    assert data["provenance"] == {"commit": "stale"}  # the caller's dict as it was
    p = got["provenance"]
    assert set(p) == {"commit", "dirty", "written_at", "machine"}
    assert p["commit"] == _git(REPO, "rev-parse", "HEAD") and re.fullmatch(r"[0-9a-f]{40}", p["commit"])
    assert isinstance(p["dirty"], bool)
    assert before <= datetime.fromisoformat(p["written_at"]) <= after  # (recorded times, compared)
    assert p["machine"] == common.machine()
    assert [f.name for f in path.parent.iterdir()] == ["x.json"]  # (no part file left)


def test_dirty_means_code_changed_not_results_written(common, tmp_path):
    repo = tmp_path / "repo"
    (repo / "bench" / "results").mkdir(parents=True)
    (repo / "code.py").write_text("x = 1\n")
    (repo / "bench" / "results" / "a.json").write_text("{}\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "one")
    head = _git(repo, "rev-parse", "HEAD")
    assert {k: common.provenance(repo)[k] for k in ("commit", "dirty")} == {"commit": head, "dirty": False}
    (repo / "bench" / "results" / "a.json").write_text('{"new": 1}\n')  # a bench wrote its results
    (repo / "notes.txt").write_text("untracked\n")
    assert common.provenance(repo)["dirty"] is False
    (repo / "code.py").write_text("x = 2\n")
    assert common.provenance(repo)["dirty"] is True
    _git(repo, "add", "code.py")  # staged counts too
    assert common.provenance(repo)["dirty"] is True
    outside = tmp_path / "not-a-checkout"
    outside.mkdir()
    assert {k: common.provenance(outside)[k] for k in ("commit", "dirty")} == {"commit": None, "dirty": None}


def test_every_bench_writes_its_results_through_write_json():
    benches = [p for p in sorted(BENCH.glob("*.py")) if p.name != "common.py"]
    assert len(benches) > 10
    for p in benches:
        text = p.read_text()
        assert not re.search(r"json\.dump\(|write_text\(\s*json\.dumps", text), f"{p.name} writes JSON itself"
        if "result_path(" in text:
            assert "write_json(" in text, f"{p.name} names a results file but does not write it with write_json"
