"""``serve --prefix-caching``: chats that share a head (a system prompt) share its cached blocks,
keyed by their real token ids, and the answers stay the model's own; ``usage.prompt_tokens_details
.cached_tokens`` says how many prompt tokens came from the cache, as OpenAI and vLLM do (load
clients such as AIPerf read it). The installed command, the real SmolLM2-135M, the ``openai`` SDK."""

from __future__ import annotations

from test_server import MODEL, Served, needs_wheel

from schedlab import traces
from schedlab.traces.schema import Request

SYSTEM = "You are a careful assistant. " * 12  # a head every request shares: whole blocks of it cached


def three_chats(c) -> tuple[list, list[str]]:
    """(usages, answers) of three greedy chats after the shared head: a colour, a fruit, a colour."""
    usages, texts = [], []
    for ask in ("Name a colour.", "Name a fruit.", "Name a colour."):
        out = c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": ask}],
            max_tokens=8,
            temperature=0,
        )
        usages.append(out.usage)
        texts.append(out.choices[0].message.content)
    return usages, texts


def test_cached_prompt_tokens_are_reported_in_usage(tmp_path):
    needs_wheel()
    s = Served(["--policy", "vllm", "--prefix-caching", "--kv-tokens", "2048", "--max-tokens", "8"], tmp_path / "run")
    try:
        c = s.client()
        usages, texts = three_chats(c)
        first, second, again = usages
        # the same chat again, most of its prompt's keys and values copied from the cache: the same
        # greedy answer as when it computed them all
        assert texts[2] == texts[0] and again.prompt_tokens_details.cached_tokens > 0, (texts, again)
        assert first.prompt_tokens_details.cached_tokens == 0  # (nothing cached yet)
        cached = second.prompt_tokens_details.cached_tokens
        # the shared head, in whole blocks of 16, and never the whole prompt
        assert 16 <= cached < second.prompt_tokens and cached % 16 == 0, second
        # streamed: the final chunk's usage says the same
        stream = c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a tree."}],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        last = [chunk for chunk in stream][-1]
        assert last.usage.prompt_tokens_details.cached_tokens == cached
        # through a front (serve --replica-url): whole answers carry the replica's count too
        front = Served(["--replica-url", s.url], tmp_path / "front")
        try:
            usages, texts_front = three_chats(front.client())
            assert texts_front == texts
            assert all(u.prompt_tokens_details.cached_tokens == again.prompt_tokens_details.cached_tokens
                       for u in (usages[0], usages[2])), usages  # fmt: skip
            assert usages[1].prompt_tokens_details.cached_tokens > 0
        finally:
            front.stop()
    finally:
        s.stop()


def _ids(info, ask: str) -> list[int]:
    msgs = (("system", SYSTEM), ("user", ask))
    return traces.prompt_ids(Request("q", 0.0, None, 8, messages=msgs), info.tokenizer)


def test_one_token_blocks_reuse_every_shared_token(tmp_path, smol):
    """``--block-size 1``: what mlx_lm.server's prompt cache reuses, every token a prompt shares with
    an earlier one, not only whole 16-token blocks; the answers stay the model's own."""
    needs_wheel()
    colour, fruit = _ids(smol, "Name a colour."), _ids(smol, "Name a fruit.")
    shared = next(i for i, (a, b) in enumerate(zip(colour, fruit)) if a != b)
    assert shared % 16, "the test needs a shared head that is not whole 16-token blocks"
    s = Served(
        [
            "--policy",
            "mlx-default",
            "--prefix-caching",
            "--block-size",
            "1",
            "--kv-tokens",
            "2048",
            "--max-tokens",
            "8",
        ],
        tmp_path / "run",
    )
    try:
        c = s.client()
        usages, texts = three_chats(c)
        first, second, again = usages
        assert (first.prompt_tokens, second.prompt_tokens) == (len(colour), len(fruit))
        assert first.prompt_tokens_details.cached_tokens == 0
        # another question after the same head: every token the two prompts share
        assert second.prompt_tokens_details.cached_tokens == shared, (second, shared)
        # the same chat again: every prompt token but the last, which is computed to give the first
        # output token (vLLM's rule); the answer the one computed from scratch
        assert again.prompt_tokens_details.cached_tokens == len(colour) - 1, again
        assert texts[2] == texts[0], texts
    finally:
        s.stop()
