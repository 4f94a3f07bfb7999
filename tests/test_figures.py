"""Every figure has a source: the measured numbers README.md and docs/*.md quote carry a marker

    3.2 s<!-- fig policies.json:summaries/prefer-prefill/ttft_ms/p50 *0.001 -->

naming a JSON file (relative to bench/results/, or ``git:REV:PATH`` read with ``git show``), a key
path (``/`` between keys, list items by index) and an optional scale. The checker below reads the
number before each marker, walks the JSON to the value, scales it, and fails when the quoted number
is not the value rounded to the quoted decimals, or when the file or key is missing; a "goal met?"
answer (``yes<!-- met FILE:KEY -->``) is checked the same way. Plain functions, no import of
bench/; the README's length and picture and every relative link of the docs are checked here too.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250

MARKER = re.compile(r"<!--\s*fig\s+(?P<body>.*?)\s*-->")
# a "goal met?" answer: yes or no, then the value or the comparison that decides it
VERDICT = re.compile(r"<!--\s*met\s+(?P<body>.*?)\s*-->")
# a file spec ends at the first ".json:"; what follows is the key path (keys may hold ':')
SOURCE = re.compile(r"^(?P<file>.+?\.json):(?P<key>.*)$")
# a quoted number: optional sign (a hyphen or U+2212 not glued to a word, so 0.98-1.15 reads 1.15),
# digits with optional thousands separators, optional decimals
NUMBER = re.compile(r"(?:(?<![\w.])[-\u2212])?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")


@dataclass(frozen=True)
class Figure:
    path: Path
    line: int
    quoted: str  # as written, e.g. "1,056,759" or "−5.3"
    source: str  # FILE:KEY
    scale: float
    problem: str | None = None  # a malformed marker


def doc_files(root: Path) -> list[Path]:
    """README.md and docs/*.md under ``root``."""
    return [p for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))] if p.exists()]


def find_figures(path: Path) -> list[Figure]:
    """Every marker in ``path`` with the number before it on its line."""
    figures = []
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        start = 0
        for m in MARKER.finditer(line):
            # after an earlier marker, a hyphen glued to it is a range's dash (0.98<!-- .. -->-1.22)
            before = ("x" if start else "") + line[start : m.start()]
            start = m.end()
            # FILE:KEY, then an optional *SCALE (keys may hold spaces: "passes (all), held out")
            body = re.match(r"^(?P<source>.*?)(?:\s+\*(?P<scale>\S+))?$", m.group("body"))
            source, scale, problem = body.group("source"), 1.0, None
            if body.group("scale") is not None:
                try:
                    scale = float(body.group("scale"))
                except ValueError:
                    problem = f"bad scale {body.group('scale')!r}"
            numbers = NUMBER.findall(before)
            if not numbers and problem is None:
                problem = "no number before the marker"
            figures.append(Figure(path, line_no, numbers[-1] if numbers else "", source, scale, problem))
    return figures


def parse_number(text: str) -> tuple[float, int]:
    """(value, decimals) of a quoted number such as '1,056,759', '−5.3' or '0.40'."""
    text = text.replace(",", "").replace("\u2212", "-")
    decimals = len(text.split(".", 1)[1]) if "." in text else 0
    return float(text), decimals


def load_source(file: str, root: Path, cache: dict) -> object:
    """The parsed JSON of a marker's FILE: bench/results/FILE under ``root``, or git:REV:PATH from the
    repository's history. Raises LookupError when it is missing."""
    if file not in cache:
        if file.startswith("git:"):
            _, rev, path = file.split(":", 2)
            out = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO, capture_output=True, text=True)
            if out.returncode != 0:
                cache[file] = LookupError(f"missing file {file} ({out.stderr.strip().splitlines()[-1:]})")
            else:
                cache[file] = json.loads(out.stdout)
        else:
            p = root / "bench" / "results" / file
            cache[file] = (
                json.loads(p.read_text()) if p.is_file() else LookupError(f"missing file bench/results/{file}")
            )
    if isinstance(cache[file], LookupError):
        raise cache[file]
    return cache[file]


def walk(data: object, key: str) -> object:
    """The value at ``key`` ('/' between keys, list items by index). A key that itself holds '/'
    (e.g. 'join/leave') matches when no shorter one does. Raises LookupError naming what is missing."""
    parts = key.split("/") if key else []

    def go(node, i):
        if i == len(parts):
            return node
        if isinstance(node, list):
            try:
                return go(node[int(parts[i])], i + 1)
            except (ValueError, IndexError):
                raise LookupError(f"missing key {'/'.join(parts[: i + 1])}") from None
        if isinstance(node, dict):
            error = LookupError(f"missing key {'/'.join(parts[: i + 1])}")
            for j in range(i + 1, len(parts) + 1):
                k = "/".join(parts[i:j])
                if k in node:
                    try:
                        return go(node[k], j)
                    except LookupError as e:
                        error = e  # the deepest miss, unless a longer key matches
            raise error
        raise LookupError(f"missing key {'/'.join(parts[: i + 1])} (not an object)")

    return go(data, 0)


def check_figure(fig: Figure, root: Path, cache: dict) -> str | None:
    """None when the figure matches its source, else one line: where, what was quoted, what is there."""
    where = f"{fig.path.relative_to(root) if fig.path.is_relative_to(root) else fig.path}:{fig.line}"
    if fig.problem:
        return f"{where}: {fig.problem}"
    m = SOURCE.match(fig.source)
    if not m:
        return f"{where}: marker {fig.source!r} is not FILE.json:KEY"
    try:
        value = walk(load_source(m.group("file"), root, cache), m.group("key"))
    except LookupError as e:
        return f"{where}: {e.args[0]} ({fig.source})"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{where}: {fig.source} is {value!r}, not a number"
    quoted, decimals = parse_number(fig.quoted)
    actual = value * fig.scale
    if abs(actual - quoted) > 0.5 * 10**-decimals * (1 + 1e-9) + 1e-12:
        return f"{where}: quoted {fig.quoted}, actual {actual:.{decimals}f} ({actual!r}; {fig.source})"
    return None


def check_figures(paths: list[Path], root: Path = REPO) -> list[str]:
    """Every mismatch, missing file or missing key of the markers in ``paths``."""
    cache: dict = {}
    problems = []
    for path in paths:
        for fig in find_figures(path):
            problem = check_figure(fig, root, cache)
            if problem:
                problems.append(problem)
    return problems


def check_verdicts(paths: list[Path], root: Path = REPO) -> list[str]:
    """Every "goal met?" answer that disagrees with its source: ``yes`` or ``no`` right before a
    ``<!-- met FILE:KEY -->`` marker is the value there (true or false), or before
    ``<!-- met FILE:KEY OP OTHER -->`` (OP ``<=``, ``>=`` or ``==``) whether that comparison holds,
    OTHER a number or another key of the same file."""
    cache: dict = {}
    problems = []
    for path in paths:
        for line_no, line in enumerate(path.read_text().splitlines(), 1):
            for m in VERDICT.finditer(line):
                where = f"{path.relative_to(root) if path.is_relative_to(root) else path}:{line_no}"
                word = re.search(r"\b(yes|no)$", line[: m.start()])
                cmp = re.match(r"^(?P<left>.+?)\s+(?P<op><=|>=|==)\s+(?P<right>\S.*)$", m.group("body"))
                src = SOURCE.match(cmp.group("left") if cmp else m.group("body"))
                if not word or not src:
                    problems.append(f"{where}: {'no yes or no before' if src else 'not FILE.json:KEY in'} {m.group(0)}")
                    continue
                try:
                    data = load_source(src.group("file"), root, cache)
                    met = walk(data, src.group("key"))
                    if cmp:
                        right = cmp.group("right")
                        other = float(right) if NUMBER.fullmatch(right) else walk(data, right)
                        met = {"<=": met <= other, ">=": met >= other, "==": met == other}[cmp.group("op")]
                except LookupError as e:
                    problems.append(f"{where}: {e.args[0]} ({m.group('body')})")
                    continue
                if not isinstance(met, bool):
                    problems.append(f"{where}: {m.group('body')} is {met!r}, not true or false")
                elif met != (word.group(1) == "yes"):
                    problems.append(f"{where}: says {word.group(1)}, but {m.group('body')} is {met}")
    return problems


def _without_code(text: str) -> str:
    """``text`` with fenced code blocks blanked (their lines kept): they hold what only looks like markdown."""
    return re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings, as GitHub makes them."""
    heads = re.findall(r"^#+\s+(.*?)\s*$", _without_code(path.read_text()), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def broken_links(paths: list[Path]) -> list[str]:
    """Relative links (not http or mailto) whose file does not exist, or whose #anchor names no
    heading of the markdown file it points at."""
    problems = []
    for path in paths:
        for line_no, line in enumerate(_without_code(path.read_text()).splitlines(), 1):
            for m in LINK.finditer(re.sub(r"`[^`]*`", "", line)):
                target = m.group("target")
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                    continue
                file, _, anchor = target.partition("#")
                dest = path.parent / file if file else path
                if not dest.exists():
                    problems.append(f"{path.name}:{line_no}: {target}")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    problems.append(f"{path.name}:{line_no}: {target} (no such heading)")
    return problems


# ---- the repository's docs ----


def test_readme_and_docs_figures_match_their_sources():
    paths = doc_files(REPO)
    assert REPO / "README.md" in paths and len(paths) > 1, "README.md and docs/*.md expected"
    problems = check_figures(paths) + check_verdicts(paths)
    assert not problems, "figures that disagree with their sources:\n" + "\n".join(problems)


def test_the_readme_quotes_figures_of_record():
    figures = find_figures(REPO / "README.md")
    assert len(figures) >= 5, "the README's figures of record carry markers"
    assert len({f.source.split(":", 1)[0] for f in figures}) >= 3, "from several benches"


def test_the_readme_says_which_goals_its_figures_meet():
    """The figures of record's "goal met?" column answers (yes or no, checked against the JSON by
    ``check_verdicts``) exactly the rows whose bench JSON sets a goal (a key naming a goal or a
    target); the others set none and answer none."""
    lines = (REPO / "README.md").read_text().splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| what |"))
    assert lines[head].rstrip(" |").endswith("goal met?")
    rows = []
    for line in lines[head + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(line)
    cache: dict = {}
    for row in rows:
        files = {SOURCE.match(m.group("body")).group("file") for m in MARKER.finditer(row)}
        sets_goal = any(
            re.search("goal|target", k) for f in files if not f.startswith("git:") for k in load_source(f, REPO, cache)
        )
        assert bool(VERDICT.search(row)) == sets_goal, row[:80]
    assert sum(bool(VERDICT.search(row)) for row in rows) >= 4


def test_the_readme_picture_is_what_its_bench_drew_from_the_policy_tables_runs():
    """README.md's picture near its top (``bench/readme_figure.py``): the files it shows are those
    the bench wrote (their SHA-256 recorded beside its numbers), and the runs it drew are the ones
    of the policy table (``policies.json``: the same simulations, the same p50 and p99)."""
    rec = json.loads((REPO / "bench" / "results" / "readme_figure.json").read_text())
    lines = (REPO / "README.md").read_text().splitlines()
    shown = [(i, m.group(1)) for i, line in enumerate(lines, 1) for m in re.finditer(r'<img src="([^"]+)"', line)]
    assert sorted(src for _, src in shown) == sorted(f["path"] for f in rec["figures"].values())
    assert all(i <= 30 for i, _ in shown), "near the top"
    for f in rec["figures"].values():
        png = (REPO / f["path"]).read_bytes()
        assert png.startswith(b"\x89PNG\r\n") and hashlib.sha256(png).hexdigest() == f["sha256"], f["path"]
    table = json.loads((REPO / "bench" / "results" / "policies.json").read_text())
    assert rec["trace"] == table["trace"]
    assert rec["policies"] == {
        p: {m: {q: s[m][q] for q in ("p50", "p99")} for m in ("ttft_ms", "itl_ms")}
        for p, s in table["summaries"].items()
    }


def test_readme_is_short():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


def test_relative_links_point_at_files():
    problems = broken_links(doc_files(REPO))
    assert not problems, "links to files or headings that do not exist:\n" + "\n".join(problems)


def test_link_checker_reports_a_missing_file_and_heading(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n## What stands in the way: the machine's speed\n")
    doc = tmp_path / "README.md"
    doc.write_text(
        "[ok](a.md#what-stands-in-the-way-the-machines-speed) [gone](b.md) [bad](a.md#nothing)\n"
        "`[code](c.md)` [web](https://example.com/x.md)\n"
    )
    assert broken_links([doc]) == ["README.md:1: b.md", "README.md:1: a.md#nothing (no such heading)"]


# ---- the checker itself ----


def test_checker_reports_exactly_the_figure_whose_value_changed(tmp_path):
    figures = [f for f in find_figures(REPO / "README.md") if f.problem is None and not f.source.startswith("git:")]
    assert figures, "the README has figures read from bench/results/"
    sources = [f.source for f in figures]
    target = next((f for f in figures if sources.count(f.source) == 1), figures[0])
    file, key = SOURCE.match(target.source).groups()

    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    results = tmp_path / "bench" / "results"
    for f in {SOURCE.match(s).group("file") for s in sources}:
        (results / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / "bench" / "results" / f, results / f)
    readme = [tmp_path / "README.md"]
    assert check_figures(readme, tmp_path) == []

    data = json.loads((results / file).read_text())
    *parents, last = key.split("/")
    node = walk(data, "/".join(parents))
    index = int(last) if isinstance(node, list) else last
    node[index] = node[index] * 3 + 7  # a different value at any rounding
    (results / file).write_text(json.dumps(data))

    problems = check_figures(readme, tmp_path)
    expected = {f"README.md:{f.line}" for f in figures if f.source == target.source}
    assert {p.split(": ", 1)[0] for p in problems} == expected
    assert all(f"quoted {target.quoted}," in p for p in problems), problems


def test_checker_reports_a_missing_key_and_a_missing_file(tmp_path):
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "b.json").write_text(json.dumps({"a": {"x": [1.5, 2.25]}, "k/v": 3}))
    doc = tmp_path / "README.md"
    doc.write_text(
        "fine 2.3 s<!-- fig b.json:a/x/1 -->, 150 %<!-- fig b.json:a/x/0 *100 -->, 3<!-- fig b.json:k/v -->\n"
        "gone 1.0<!-- fig b.json:a/y -->\n"
        "out of range 1.0<!-- fig b.json:a/x/5 -->\n"
        "no file 1.0<!-- fig nothing.json:a -->\n"
        "wrong −1.5<!-- fig b.json:a/x/0 -->\n"
    )
    problems = check_figures([doc], tmp_path)
    assert [p.split(": ", 1)[0] for p in problems] == ["README.md:2", "README.md:3", "README.md:4", "README.md:5"]
    assert "missing key a/y" in problems[0]
    assert "missing key a/x/5" in problems[1]
    assert "missing file bench/results/nothing.json" in problems[2]
    assert "quoted −1.5, actual 1.5" in problems[3]


def test_checker_reads_numbers_as_written(tmp_path):
    assert parse_number("1,056,759") == (1056759.0, 0)
    assert parse_number("\u22125.3") == (-5.3, 1)
    assert parse_number("0.40") == (0.4, 2)
    assert NUMBER.findall("0.98-1.15x")[-1] == "1.15"
    assert NUMBER.findall("total -3.0")[-1] == "-3.0"
    doc = tmp_path / "doc.md"
    doc.write_text("0.98<!-- fig a.json:x -->-1.22x<!-- fig a.json:y -->, \u22124.5 %<!-- fig a.json:z *100 -->\n")
    assert [(f.quoted, f.scale) for f in find_figures(doc)] == [("0.98", 1.0), ("1.22", 1.0), ("\u22124.5", 100.0)]


def test_checker_reads_files_from_git_history(tmp_path):
    doc = tmp_path / "README.md"
    doc.write_text(
        "19366<!-- fig git:08fa966:bench/results/vs_vidur.json:workload/requests -->\n"
        "1<!-- fig git:08fa966:bench/results/no_such_file.json:a -->\n"
    )
    problems = check_figures([doc], tmp_path)
    assert len(problems) == 1 and problems[0].startswith("README.md:2: missing file git:08fa966:"), problems


def test_checker_reports_a_goal_answer_its_source_contradicts(tmp_path):
    (tmp_path / "bench" / "results").mkdir(parents=True)
    data = {"meets_goal": True, "wall_s": 118.0, "goal": {"wall_s": 120}, "rows": 21, "within": 11, "n": 3}
    (tmp_path / "bench" / "results" / "b.json").write_text(json.dumps(data))
    doc = tmp_path / "README.md"
    doc.write_text(
        "| yes<!-- met b.json:meets_goal --> | yes<!-- met b.json:wall_s <= goal/wall_s --> | "
        "no<!-- met b.json:within == rows --> / yes<!-- met b.json:wall_s >= 100 --> |\n"
        "no<!-- met b.json:meets_goal -->\n"
        "yes<!-- met b.json:within == rows -->\n"
        "maybe<!-- met b.json:meets_goal -->\n"
        "yes<!-- met b.json:n -->\n"
        "yes<!-- met b.json:gone -->\n"
    )
    problems = check_verdicts([doc], tmp_path)
    assert [p.split(": ", 1)[0] for p in problems] == [f"README.md:{i}" for i in range(2, 7)], problems
    assert "says no, but b.json:meets_goal is True" in problems[0]
    assert "says yes, but b.json:within == rows is False" in problems[1]
    assert "no yes or no before" in problems[2]
    assert "b.json:n is 3, not true or false" in problems[3]
    assert "missing key gone" in problems[4]
