"""A sliding-window layer's decode batch that can drop a row's last positions (speculative decoding).

mlx-lm batches a sliding-window layer as ``BatchRotatingKVCache``: a ring of ``window`` slots per
row, written in place. A verify pass writes k + 1 positions per row and then drops the rejected
ones, and a ring cannot give those back once it has wrapped (mlx-lm's ``trim`` works only before
the first rotation): the positions they overwrote are gone.

``WindowBatchKVCache`` keeps the layer as a plain batch cache instead (``BatchKVCache``: rows
left-padded, appended at ``_idx``, trimmed from the end like any other), with two differences:

- its attention mask is limited to the window (a query sees the ``window`` positions up to its
  own, as the ring does), whatever the model asks;
- ``forget()``, called before each forward, cuts the slots every row has left behind (further
  back than ``window`` from the end) once there are a 256-slot step of them, so the layer holds at
  most ``window + 256 + k`` slots per row, not the whole context.

Every row's slots are contiguous in time, so a slot's distance from the end is its distance in
positions: the window mask is exact. A row whose context is longer than what it keeps has a
negative left padding (its first positions cut), as mlx-lm's rotating batch does; its ``offset``
stays its true length (RoPE positions). Rows leave as mlx-lm's own ``RotatingKVCache``
(``extract``) and join from it (``from_rotating``), so nothing outside the decode batch changes.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, RotatingKVCache


class WindowBatchKVCache(BatchKVCache):
    def __init__(self, window: int, left_padding: Sequence[int]):
        super().__init__(list(left_padding))
        self.window = window

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **kwargs):
        return super().make_mask(N, return_array=return_array, window_size=window_size or self.window, **kwargs)

    def forget(self) -> None:
        """Cut the slots no row can attend to again, once there are a step of them."""
        stale = self._idx - self.window
        if self.keys is None or stale < self.step:
            return
        self.keys = self.keys[..., stale:, :]
        self.values = self.values[..., stale:, :]
        self._idx -= stale
        self.left_padding = self.left_padding - stale

    def extract(self, idx: int) -> RotatingKVCache:
        """Row ``idx`` as the ``RotatingKVCache`` a prefill leaves: its last ``window`` positions
        (all of them if fewer), in order."""
        mx.eval(self.left_padding, self.offset)
        length = self.offset.tolist()[idx]
        cache = RotatingKVCache(self.window)
        cache.offset = length
        if self.keys is None or length == 0:
            return cache
        start = self._idx - min(length, self.window)
        cache.keys = mx.contiguous(self.keys[idx : idx + 1, :, start : self._idx])
        cache.values = mx.contiguous(self.values[idx : idx + 1, :, start : self._idx])
        cache._idx = cache.keys.shape[2]
        return cache

    @classmethod
    def from_rotating(cls, caches: Sequence[RotatingKVCache]) -> "WindowBatchKVCache":
        """Requests' own sliding-window caches as one batch: each row's last ``window`` positions
        right-justified, with room for the next 256 tokens."""
        window = caches[0].max_size
        rows = []
        for c in caches:
            if c.keys is None or c.offset == 0:
                rows.append((0, None, None))
                continue
            k, v = c._temporal_order(c.keys), c._temporal_order(c.values)
            n = min(k.shape[2], window, c.offset)
            rows.append((c.offset, k[..., -n:, :], v[..., -n:, :]))
        longest = max((k.shape[2] for _, k, _ in rows if k is not None), default=0)
        if longest == 0:
            out = cls(window, [0] * len(caches))
            out.offset = mx.array([length for length, _, _ in rows])
            return out
        ref_k, ref_v = next((k, v) for _, k, v in rows if k is not None)
        slots = (longest // cls.step + 1) * cls.step
        keys = mx.zeros((len(caches), ref_k.shape[1], slots, ref_k.shape[3]), dtype=ref_k.dtype)
        values = mx.zeros((len(caches), ref_v.shape[1], slots, ref_v.shape[3]), dtype=ref_v.dtype)
        for i, (_, k, v) in enumerate(rows):
            if k is not None:
                keys[i : i + 1, :, longest - k.shape[2] : longest] = k
                values[i : i + 1, :, longest - v.shape[2] : longest] = v
        out = cls(window, [longest - length for length, _, _ in rows])
        out.keys, out.values = keys, values
        out.offset = out.offset + longest
        out._idx = longest
        return out


def windowed(c: Any) -> Any:
    """A decode batch's layer cache ready for verify passes: a rotating one as a
    ``WindowBatchKVCache`` (its rows extracted and joined again), any other as it is."""
    if type(c) is not BatchRotatingKVCache:
        return c
    n = c.offset.shape[0]
    return WindowBatchKVCache.from_rotating([c.extract(i) for i in range(n)])


def forget(caches: Sequence[Any]) -> None:
    """``WindowBatchKVCache.forget`` on every such layer of a batch."""
    for c in caches:
        if type(c) is WindowBatchKVCache:
            c.forget()
