"""The engine bridge: hands each request's tokens from the replica's thread back to its HTTP
handler (``Bridge``), and their text as it grows, cut at stop strings (``TextDelta``), with
their logprobs in OpenAI's formats (``TokenLogprobs``)."""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, Any

from .http import APIError
from .metrics import BIAS_STEPS, step_time_ratio

if TYPE_CHECKING:  # pragma: no cover
    from .metrics import Metrics


def _unlink(path: str) -> None:
    import os

    try:
        os.unlink(path)
    except OSError:
        pass


class _Stream:
    """One request's way back to its handler: events on an asyncio queue of the server's loop;
    with stop strings, its text as the engine makes it (to end the request at one)."""

    __slots__ = ("loop", "queue", "text", "cancelled", "hit_stop")

    def __init__(self, loop: asyncio.AbstractEventLoop, text: "TextDelta | None" = None):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.text = text  # a TextDelta with the request's stop strings, or None
        self.cancelled = False  # its client went away: the replica ends it at its next step
        self.hit_stop = False

    def put(self, item: tuple) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class Bridge:
    """Hands each request's tokens from the replica's thread to its handler.

    Events: ``("tokens", [ids])`` as each token is made (``MLXBackend.on_token``: at the end of
    the pass that made it, not of the step; ``("tokens", [ids], [logprobs])`` for a request that
    asked for logprobs), then ``("done", finish_reason)`` or ``("error",
    APIError)``. A token that completes one of the request's stop strings, or that comes after its
    client went away (``cancel``), is its last (``on_token`` says so to the engine, which ends it as
    at EOS). ``on_token`` and ``on_finish`` run on the replica's thread; ``open`` and ``cancel`` on
    the server's."""

    def __init__(self, backend, kv_capacity: int, tokenizer=None, eos: frozenset[int] = frozenset()):
        self.backend = backend
        self.kv_capacity = kv_capacity
        self.tokenizer = tokenizer
        self.eos = eos
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self.cancelled = 0  # requests ended early because their client went away
        self.on_cancel = None  # where a cancellation goes: the live source's cancel (serve sets it)
        backend.on_token = self.on_token
        # what GET /state reads (a cluster's router): the replica's ReplicaState, known once the
        # run starts (the loop hands it to the backend's start), and what was sent to it
        self.state = None
        self.received = [0, 0, 0]  # requests, prompt tokens, output tokens submitted (cumulative)
        self._refused = [0, 0]  # prompt and output tokens of requests refused on arrival
        self._sizes: dict[str, tuple[int, int]] = {}
        # requests sent and not admitted yet (admission control counts them: ``unadmitted``)
        self._unadmitted: dict[str, None] = {}
        self.metrics: Metrics | None = None  # the server's /metrics, once it has one
        start = backend.start

        def start_and_keep(state, requests=None):
            self.state = state
            return start(state, requests)

        backend.start = start_and_keep

    def open(
        self,
        rid: str,
        loop: asyncio.AbstractEventLoop,
        stop: tuple[str, ...] = (),
        ignore_eos: bool = False,
        sizes: tuple[int, int] | None = None,
        sampling=None,
        seen: tuple[int, ...] = (),
    ) -> _Stream:
        """A stream for request ``rid`` (``sizes``: its prompt and output tokens, counted as sent;
        ``sampling``: its own ``engine.sampling.Sampling``, else it samples as the server does;
        ``seen``: tokens its client already has from another replica, which a stop string may span)."""
        st = _Stream(loop, TextDelta(self.tokenizer, self.eos, stop) if stop else None)
        if st.text is not None and seen:
            st.text.feed(list(seen))
        with self._lock:
            self._streams[rid] = st
            if sampling is not None and sampling != self.backend.sampling:
                self.backend.request_sampling[rid] = sampling
            self._unadmitted[rid] = None
            if ignore_eos:
                self.backend.no_eos.add(rid)
            if sizes is not None:
                self._sizes[rid] = sizes
                self._count(sizes, 1)
        return st

    def _count(self, sizes: tuple[int, int], sign: int) -> None:
        self.received[0] += sign
        self.received[1] += sign * sizes[0]
        self.received[2] += sign * sizes[1]

    def drop(self, rid: str) -> None:
        """Forget ``rid``: it was never submitted."""
        with self._lock:
            self._streams.pop(rid, None)
            self._unadmitted.pop(rid, None)
            self.backend.no_eos.discard(rid)
            self.backend.request_sampling.pop(rid, None)
            sizes = self._sizes.pop(rid, None)
            if sizes is not None:
                self._count(sizes, -1)

    def cancel(self, rid: str) -> None:
        """The client of ``rid`` went away: the replica ends it at its next step, whatever its
        phase (``on_cancel``: the arrival source's ``cancel``); its tokens meanwhile go nowhere."""
        with self._lock:
            st = self._streams.get(rid)
            if st is None or st.cancelled:
                return
            st.cancelled = True
            self.cancelled += 1
        if self.on_cancel is not None:
            self.on_cancel(rid)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    def on_token(self, rid: str, token: int, logprobs=None) -> bool:
        """``logprobs``: for a request that asked, (its token's log-probability, [(id,
        log-probability)] of the most likely alternatives): the stream's event carries them."""
        with self._lock:
            st = self._streams.get(rid)
        if st is None:
            return False
        if st.cancelled:  # (the replica ends it before its next step)
            return False
        st.put(("tokens", [token]) if logprobs is None else ("tokens", [token], [logprobs]))
        if st.text is not None:
            st.text.feed([token])
            st.hit_stop = st.text.stopped
        return st.hit_stop

    def on_finish(self, r, t: float) -> None:
        with self._lock:
            st = self._streams.pop(r.id, None)
            self._unadmitted.pop(r.id, None)
            self.backend.no_eos.discard(r.id)
            self.backend.request_sampling.pop(r.id, None)
            sizes = self._sizes.pop(r.id, None)
            if sizes is not None and r.finish_s is None:  # refused: its tokens are never done
                self._refused[0] += sizes[0]
                self._refused[1] += sizes[1]
        reason = "stop" if r.id in self.backend.stopped or (st is not None and st.hit_stop) else "length"
        if self.metrics is not None:
            gone = getattr(r, "cancelled_s", None) is not None or (st is not None and st.cancelled)
            self.metrics.finished(r, "abort" if gone else reason)
        exported = getattr(self.backend, "exported", None)  # (a prefill replica's requests: their KV written)
        kv = exported.pop(r.id, None) if exported else None
        if kv is not None and (st is None or reason != "length"):
            _unlink(kv["path"])  # it ended here (EOS, a stop string, its client gone): nobody reads it
            kv = None
        if st is None:
            return
        if kv is not None:
            st.put(("kv", kv))
        if r.finish_s is None:  # refused on arrival: the replica's own reason (it can never fit its KV cache)
            rejected = getattr(self.state, "rejected", None)
            why = rejected[-1][1] if rejected and rejected[-1][0] is r else None
            if why is None or "KV capacity" in why:
                why = kv_refusal(r.prompt_tokens, r.output_tokens, r.fixed_tokens, self.kv_capacity)
            st.put(("error", APIError(400, why, "max_tokens" if "KV" in why else "prompt")))
            return
        st.put(("done", reason))

    def signals(self) -> dict[str, Any]:
        """GET /state: the replica as a router reads it (``routers.ReplicaSignals``' fields): requests
        waiting (sent and not admitted: in the source's queue or the waiting queue) and running,
        prompt and output tokens outstanding (sent less what the steps did), KV used and capacity
        (tokens), ``kv_usage`` (the fraction of KV blocks held by requests, vLLM's
        ``kv_cache_usage_perc``); and ``received``, what was sent to it so far (requests, prompt
        tokens, output tokens). Read from the replica loop's state while it runs (plain counters: a
        snapshot, not a locked one). GET /metrics's gauges are these."""
        st = self.state
        with self._lock:
            in_flight = len(self._streams)
            n, p, o = self.received
            rp, ro = self._refused
        running = len(st.running) if st is not None else 0
        return {
            "waiting": max(in_flight - running, 0),
            "running": running,
            "prompt_tokens": max(p - rp - (st.prompt_done if st is not None else 0), 0),
            "output_tokens": max(o - ro - (st.output_done if st is not None else 0), 0),
            "kv_used": st.kv_used if st is not None else 0,
            "kv_capacity": st.kv_capacity if st is not None else self.kv_capacity,
            "kv_usage": st.blocks_used / st.kv_blocks if st is not None and st.kv_blocks else 0.0,
            "received": {"requests": n, "prompt_tokens": p, "output_tokens": o},
        }

    def unadmitted(self) -> int:
        """Requests sent and not admitted yet (in the source's queue or the waiting queue, never
        admitted: a preempted request is not counted again), exactly: what ``serve --max-waiting``
        bounds. On the server's thread."""
        st = self.state
        with self._lock:
            if st is not None:
                by_id = st.by_id
                admitted = [
                    rid for rid in self._unadmitted if (r := by_id.get(rid)) is not None and r.admitted_s is not None
                ]
                for rid in admitted:
                    del self._unadmitted[rid]
            return len(self._unadmitted)

    def cost_model_bias(self, last: int = BIAS_STEPS) -> float | None:
        """The replica's measured over predicted step time over its ``last`` steps (None before
        any): how much slower (> 1) or faster than its cost model the replica runs now."""
        steps = getattr(self.state, "steps", None)  # the loop's StepLog (sim.loop.ReplicaLoop)
        if steps is None:
            return None
        fields = steps.fields
        cols = steps.columns  # (a real run's: plain lists, appended to one step at a time)
        measured = cols[fields.index("measured_s")]
        n = len(measured)  # (appended after predicted_s)
        k = max(n - last, 0)
        return step_time_ratio(cols[fields.index("predicted_s")][k:n], measured[k:n])

    def fail_all(self, error: APIError) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
            self._unadmitted.clear()
        for st in streams:
            st.put(("error", error))


def kv_refusal(prompt_tokens: int, max_tokens: int, fixed: int, capacity: int) -> str:
    """Why a request whose KV (prompt + max_tokens - 1, plus ``fixed`` tokens of sliding windows and
    recurrent state) can never fit a replica of ``capacity`` tokens is refused: its 400's message."""
    held = f" + {fixed} for its sliding windows and recurrent state" if fixed else ""
    return (
        f"this request needs {prompt_tokens + max_tokens - 1 + fixed} KV tokens (prompt {prompt_tokens} + max_tokens "
        f"{max_tokens} - 1{held}) but the server's KV capacity is {capacity} (serve --kv-tokens)"
    )


class TextDelta:
    """Incremental text of a growing list of token ids: each ``feed`` returns the new text. Held
    back: an incomplete UTF-8 sequence at the end (the tokenizer's replacement character), and
    an end that may begin one of the ``stop`` strings; the text ends before the first stop string
    (``stopped`` then), which it never contains, as OpenAI's API returns it. Special tokens (EOS,
    chat-template markers, ...) have no text in it, as vLLM's default ``skip_special_tokens``."""

    def __init__(self, tokenizer, eos: frozenset[int], stop: tuple[str, ...] = ()):
        self.tok = tokenizer
        self.eos = eos
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False

    def feed(self, ids: list[int], final: bool = False) -> str:
        if self.stopped:
            return ""
        self.ids += [i for i in ids if i not in self.eos]
        full = self.tok.decode(self.ids, skip_special_tokens=True)
        cuts = [i for i in (full.find(x) for x in self.stop) if i >= 0]
        if cuts:
            full, final, self.stopped = full[: min(cuts)], True, True
        if not final:
            if full.endswith("\ufffd"):
                return ""
            hold = max((k for x in self.stop for k in range(1, len(x)) if full.endswith(x[:k])), default=0)
            full = full[: len(full) - hold]
        if not full.startswith(self.text):
            return ""  # (a decoding that rewrote earlier text: what was sent stands)
        delta, self.text = full[len(self.text) :], full
        return delta


class TokenLogprobs:
    """A request's tokens with their logprobs, as OpenAI returns them: each token's text (its
    share of the answer: a token that ends inside a character has "" and the character goes with
    the token that completes it; EOS is not part of the text and is left out), its offset in the
    answer, its log-probability and the most likely alternatives. ``take(upto)`` hands over the
    tokens whose text lies within the first ``upto`` characters of the answer (what was sent so
    far); ``final``: those that start before it, the last cut there (at a stop string)."""

    def __init__(self, tokenizer, eos: frozenset[int]):
        self.tok = tokenizer
        self.eos = eos
        self.pieces = TextDelta(tokenizer, eos)
        self.offset = 0
        self.pending: list[list] = []  # [offset, text, token id, (logprob, [(id, logprob)]) or None]

    def add(self, ids: list[int], logprobs: list | None) -> None:
        for t, lp in zip(ids, logprobs or [None] * len(ids)):
            if t in self.eos:
                continue
            piece = self.pieces.feed([t])
            self.pending.append([self.offset, piece, t, lp])
            self.offset += len(piece)

    def take(self, upto: int, final: bool = False) -> list[list]:
        if final:
            rest = self.pieces.feed([], final=True)  # (a character left incomplete at the end)
            if rest and self.pending:
                self.pending[-1][1] += rest
        out = []
        while self.pending:
            off, piece = self.pending[0][:2]
            whole = off + len(piece) <= upto and (piece or len(self.pending) > 1)  # ("": a character to come)
            if not (whole or (final and off < upto)):
                break
            entry = self.pending.pop(0)
            entry[1] = piece[: upto - off]
            out.append(entry)
        if final:
            self.pending = []
        return out

    def _bytes(self, token: int) -> bytes:
        """The token's own bytes (part of a character, for some: ``TextTokenizer.token_bytes``)."""
        as_bytes = getattr(self.tok, "token_bytes", None)
        return as_bytes(token) if as_bytes is not None else self.tok.decode([token]).encode()

    def _alt(self, token: int) -> str:
        """A token as an alternative names it: its text, or where its bytes are part of a character,
        ``bytes:\\xNN...`` as OpenAI writes them (so no two alternatives share a name)."""
        raw = self._bytes(token)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def chat(self, entries: list[list]) -> dict[str, Any]:
        """``choices[i].logprobs`` of a chat completion (or chunk)."""
        content = []
        for _, piece, t, lp in entries:
            logprob, top = lp if lp is not None else (None, [])
            alts = [{"token": self._alt(i), "logprob": v, "bytes": list(self._bytes(i))} for i, v in top]
            # (its text is its share of the answer; its bytes its own, part of a character for some)
            content.append({"token": piece, "logprob": logprob, "bytes": list(self._bytes(t)), "top_logprobs": alts})
        return {"content": content, "refusal": None}

    def legacy(self, entries: list[list]) -> dict[str, Any]:
        """``choices[i].logprobs`` of a completion (or chunk), OpenAI's legacy format: the top
        alternatives of each token and the token itself (up to N + 1, as OpenAI's)."""
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for off, piece, t, lp in entries:
            logprob, top = lp if lp is not None else (None, [])
            alts = {self._alt(i): v for i, v in top}
            if logprob is not None:
                alts.setdefault(self._alt(t), logprob)
            out["tokens"].append(piece)
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append(alts)
            out["text_offset"].append(off)
        return out
