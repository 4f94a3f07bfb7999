"""A request's KV as one file: how a prefill replica hands a prompt's keys and values to a
decode replica (``serve --prefill P --decode D``). No mlx here: the HTTP side reads the file.

The file is a one-line JSON header, then the raw arrays: every layer's keys and values of the
prompt's ``tokens`` positions, shape ``(layers, 2, kv_heads, tokens, head_dim)`` in the model's
activation dtype (16-bit dtypes stored as their bits, ``uint16``: numpy has no bfloat16). The
header carries the token ids the KV was computed from plus the first generated token, so the
decode replica continues exactly where the prefill stopped.

A model with other cache kinds (sliding windows, recurrent or convolution state) hands over its
caches whole (``write_caches``, version 2): the header describes each layer's cache object (its
class and attributes, ``engine.backend`` encodes them) and lists its arrays, which follow in
order; ``read`` returns that list instead of one array. Where the machine has ``/dev/shm``
(a tmpfs: memory, not disk) the files go there; else the system's temporary folder.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .errors import EngineError

MAGIC = "schedlab-kv"
VERSION = 1
CACHES_VERSION = 2
SIXTEEN_BIT = ("bfloat16", "float16")


SHARED_PREFIX = "schedlab-kv-"  # the name of every folder ``shared_dir`` makes starts so


def shared_dir() -> Path:
    """A fresh folder for KV files: under ``/dev/shm`` when there is one (memory), else the system's
    temporary folder."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix=SHARED_PREFIX, dir=base))


def check_handed(path: str | Path) -> None:
    """An ``EngineError`` unless ``path`` names what a prefill replica hands on: a ``.kv`` file
    (or nothing yet) right in a folder ``shared_dir`` made. A decode replica reads the path from a
    request's header, and reads and then deletes the file: no other file is ever opened so (an
    outsider could otherwise learn which files exist, or have any KV file deleted)."""
    p = Path(path).resolve()
    if p.suffix != ".kv" or not p.parent.name.startswith(SHARED_PREFIX) or (p.exists() and not p.is_file()):
        raise EngineError(
            f"{str(path)[:200]}: not a KV file a prefill replica hands on (a .kv file in a {SHARED_PREFIX}* folder)"
        )


def write(path: str | Path, ids: Sequence[int], layers: Sequence[tuple[np.ndarray, np.ndarray]], dtype: str) -> int:
    """Write every layer's ``(keys, values)``, each ``(kv_heads, tokens, head_dim)`` (``uint16`` bits
    for a 16-bit ``dtype``; any strides: each is copied once, straight into the file), with ``ids``
    (the prompt's ids and the first generated one): the file's size."""
    shape = (len(layers), 2, *layers[0][0].shape)
    if len(shape) != 5 or any(a.shape != shape[2:] for kv in layers for a in kv):
        raise ValueError(f"every layer's keys and values must be (kv_heads, tokens, head_dim) alike, got {shape}")
    if len(ids) != shape[3] + 1:
        raise ValueError(f"{len(ids)} token ids for KV of {shape[3]} tokens (expected tokens + 1)")
    head = {"magic": MAGIC, "version": VERSION, "dtype": dtype, "shape": list(shape), "ids": [int(i) for i in ids]}
    return _write(path, head, [a for kv in layers for a in kv])


def _write(path: str | Path, head: dict[str, Any], arrays: Sequence[np.ndarray]) -> int:
    """The header as one JSON line, then each array's bytes (any strides: each copied once,
    straight into the file); the file's size."""
    line = (json.dumps(head) + "\n").encode()
    tmp = Path(str(path) + ".part")
    size = len(line)
    with open(tmp, "wb") as f:  # (renamed when whole: a reader never sees half a file)
        f.write(line)
        for a in arrays:
            a = np.ascontiguousarray(a)
            f.write(a.data)
            size += a.nbytes
    os.replace(tmp, path)
    return size


def write_caches(
    path: str | Path, ids: Sequence[int], tokens: int, caches: Any, arrays: Sequence[np.ndarray], dtypes: Sequence[str]
) -> int:
    """Write a request's whole caches: ``caches`` (JSON: each layer's cache as the engine encodes it,
    its arrays by index), then ``arrays`` (``dtypes``: each one's dtype; 16-bit ones given as
    ``uint16`` bits). ``ids``: the prompt's ``tokens`` ids and the first generated one."""
    if len(ids) != tokens + 1:
        raise ValueError(f"{len(ids)} token ids for caches of {tokens} tokens (expected tokens + 1)")
    head = {
        "magic": MAGIC,
        "version": CACHES_VERSION,
        "tokens": int(tokens),
        "ids": [int(i) for i in ids],
        "caches": caches,
        "arrays": [[list(a.shape), d] for a, d in zip(arrays, dtypes)],
    }
    return _write(path, head, arrays)


def prompt_tokens(head: dict[str, Any]) -> int:
    """How many prompt tokens the file's KV (or caches) hold."""
    return int(head["tokens"]) if head.get("version") == CACHES_VERSION else int(head["shape"][3])


def _read_caches(f, head: dict[str, Any], path) -> list[np.ndarray]:
    out = []
    for shape, dtype in head["arrays"]:
        kind = np.uint16 if dtype in SIXTEEN_BIT else np.dtype(dtype)
        count = int(np.prod(shape))
        a = np.fromfile(f, dtype=kind, count=count)
        if a.size != count:
            raise EngineError(f"{path}: KV file is cut short or its header does not match its data")
        out.append(a.reshape(shape))
    if f.read(1):
        raise EngineError(f"{path}: KV file is longer than its header says")
    if len(head["ids"]) != int(head["tokens"]) + 1:
        raise EngineError(f"{path}: KV file's token ids do not match its tokens")
    return out


def read(path: str | Path) -> tuple[dict[str, Any], Any]:
    """(header, KV array) of a file ``write`` wrote, or (header, list of arrays) of one
    ``write_caches`` wrote; an ``EngineError`` naming what is wrong."""
    try:
        with open(path, "rb") as f:
            line = f.readline()
            try:
                head = json.loads(line)
            except ValueError:
                head = None
            if not isinstance(head, dict) or head.get("magic") != MAGIC:
                raise EngineError(f"{path}: not a schedlab KV file")
            if head.get("version") == CACHES_VERSION:
                return head, _read_caches(f, head, path)
            if head.get("version") != VERSION:
                raise EngineError(
                    f"{path}: KV file version {head.get('version')}, this engine reads {VERSION} and {CACHES_VERSION}"
                )
            shape = tuple(int(x) for x in head["shape"])
            kind = np.uint16 if head["dtype"] in SIXTEEN_BIT else np.dtype(head["dtype"])
            kv = np.fromfile(f, dtype=kind)
    except FileNotFoundError:
        raise EngineError(f"{path}: no such KV file (its prefill replica's folder is gone?)") from None
    except EngineError:
        raise
    except (OSError, KeyError, TypeError, ValueError) as exc:
        raise EngineError(f"{path}: cannot read the KV file ({exc})") from None
    if kv.size != int(np.prod(shape)) or len(shape) != 5 or len(head["ids"]) != shape[3] + 1:
        raise EngineError(f"{path}: KV file is cut short or its header does not match its data")
    return head, kv.reshape(shape)
