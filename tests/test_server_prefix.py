"""``serve --prefix-caching``: chats that share a head (a system prompt) share its cached blocks,
keyed by their real token ids, and the answers stay the model's own; ``usage.prompt_tokens_details
.cached_tokens`` says how many prompt tokens came from the cache, as OpenAI and vLLM do (load
clients such as AIPerf read it). The installed command, the real SmolLM2-135M, the ``openai`` SDK."""

from __future__ import annotations

from test_server import MODEL, Served, needs_wheel

SYSTEM = "You are a careful assistant. " * 12  # a head every request shares: whole blocks of it cached


def test_cached_prompt_tokens_are_reported_in_usage(tmp_path):
    needs_wheel()
    s = Served(["--policy", "vllm", "--prefix-caching", "--kv-tokens", "2048", "--max-tokens", "8"], tmp_path / "run")
    try:
        c = s.client()
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
    finally:
        s.stop()
