"""The helper process of :mod:`dask_surge.engine.tokenpool`: tokenize blocks of texts out of the worker.

This file runs on its own (``python _tokenhelper.py``, started by
:class:`~dask_surge.engine.tokenpool.TokenPool`): it imports only the standard library, NumPy and ``tokenizers`` (importing the
package would import Dask, seconds on a busy machine), so keep it that way. It loads its sibling
``joined.py`` (the same constraint) by path: a helper tokenizes with
:class:`~dask_surge.engine.joined.JoinedTokenizer` where the tokenizer allows it, as the worker does.

Protocol, over the helper's stdin (requests) and a duplicate of its stdout (replies; fd 1 then
points at stderr, so a stray print cannot corrupt the stream): each message is a 4-byte
little-endian length and a pickle.

- First message: ``{"tokenizer": <json str>, "prompt": str, "max_length": int}``. The tokenizer JSON
  is the caller's own copy (truncation set, padding off), so the ids are the same.
- Then requests ``(in_name, in_size, n, data_bytes, out_name, out_size, want_ids, unit)``:
  shared-memory block ``in_name`` holds ``n + 1`` int64 offsets then ``data_bytes`` bytes of UTF-8
  (the texts joined); the offsets count characters (``unit`` "chars": texts the caller joined from
  Python strings) or bytes (``"bytes"``: an Arrow string column's own offsets); the helper writes
  into block ``out_name``: ``n`` int32 lengths, ``n`` bytes of overflow flags (1: truncation left
  tokens over), padded to 4 bytes, then the int32 ids of every text one after the other (only
  with ``want_ids``). Reply ``("ok", tokens, cpu_seconds)`` or
  ``("error", type_name, message)``.
- EOF on stdin (the caller closed the pipe, or died): the helper exits.

Shared memory is opened without :class:`multiprocessing.shared_memory.SharedMemory` on POSIX:
attaching with it registers the block with this process's resource tracker, which would unlink
the caller's block when the helper exits. The caller creates, owns and unlinks every block.
"""

from __future__ import annotations

import gc
import importlib.util
import mmap
import os
import pickle
import struct
import sys
import time
from itertools import pairwise
from pathlib import Path
from types import ModuleType
from typing import IO, Any

_HEADER = struct.Struct("<I")


def read_message(stream: IO[bytes]) -> Any:
    """The next message of ``stream`` (see the protocol above); None at EOF."""
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(head)
    body = stream.read(size)
    if len(body) < size:
        return None
    return pickle.loads(body)


def write_message(stream: IO[bytes], message: Any) -> None:
    """Write ``message`` to ``stream`` (length-prefixed pickle) and flush."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(body)) + body)
    stream.flush()


def out_layout(n: int) -> tuple[int, int]:
    """Byte offsets of the overflow flags and of the ids in an output block of ``n`` texts."""
    flags = 4 * n
    return flags, flags + (n + 3) // 4 * 4


class _SharedBlock:
    """A shared-memory block opened by name, mapped read-write (POSIX: ``shm_open``, no tracker)."""

    def __init__(self, name: str, size: int) -> None:
        self.name, self.size = name, size
        try:
            import _posixshmem
        except ImportError:  # Blocks: named mappings, no resource tracker to mind
            from multiprocessing.shared_memory import SharedMemory

            self._shm: Any = SharedMemory(name)
            buf = self._shm.buf
            assert buf is not None
            self.buf: memoryview = buf
            return
        self._shm = None
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.buf = memoryview(self._map)

    def close(self) -> None:
        self.buf.release()
        if self._shm is not None:
            self._shm.close()
        else:
            self._map.close()


def _sibling(name: str) -> ModuleType:
    """This folder's module ``name`` loaded by path, alone (a helper process runs without the package)."""
    key = f"_dask_surge_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, Path(__file__).with_name(f"{name}.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


try:
    from . import joined as _joined
except ImportError:  # run as a script (a helper process): no package around it
    _joined = _sibling("joined")


class Helper:
    """The tokenizer and the blocks last used, for one helper process (or a test, in process)."""

    def __init__(
        self, tokenizer_json: str, prompt: str, max_length: int, *, gc_pause: bool = True, joined: bool = True
    ) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self.encode_batch = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        self._flat_ids = _joined.flat_ids
        #: Texts joined into few tokenizer inputs where the tokenizer allows it (the same ids), else None.
        self.joined = _joined.JoinedTokenizer.of(self.tokenizer) if joined else None
        #: Hold off the garbage collector during a tokenizer call (``surge.tuning.gc-pause`` of the worker).
        self.gc_pause = gc_pause
        self.prompt = prompt
        self.max_length = max_length
        self._blocks: dict[str, _SharedBlock] = {}  # role -> the block last mapped for it

    def _block(self, role: str, name: str, size: int) -> _SharedBlock:
        block = self._blocks.get(role)
        if block is None or block.name != name or block.size != size:
            if block is not None:
                block.close()
            block = self._blocks[role] = _SharedBlock(name, size)
        return block

    def encode(
        self,
        in_name: str,
        in_size: int,
        n: int,
        data_bytes: int,
        out_name: str,
        out_size: int,
        want_ids: bool,
        unit: str = "chars",
    ) -> tuple[str, int, float]:
        """Serve one request (see the protocol above): ``("ok", tokens, cpu_seconds)``."""
        import numpy as np

        c0 = time.process_time()
        src = self._block("in", in_name, in_size)
        dst = self._block("out", out_name, out_size)
        bounds = np.frombuffer(src.buf, dtype=np.int64, count=n + 1).tolist()
        data = bytes(src.buf[8 * (n + 1) : 8 * (n + 1) + data_bytes])
        if unit == "bytes":  # each text decoded from its own bytes (no array the size of the data)
            texts = [data[a:b].decode("utf-8", "surrogatepass") for a, b in pairwise(bounds)]
        else:
            joined = data.decode("utf-8", "surrogatepass")
            texts = [joined[a:b] for a, b in pairwise(bounds)]
            del joined
        del data
        if self.prompt:
            texts = [self.prompt + t for t in texts]
        if self.joined is not None:
            lengths, overflow, ids = self.joined.encode(texts)
        else:
            lengths, overflow, ids = self._one_by_one(texts, want_ids)
        del texts
        total = int(lengths.sum())
        flags_at, ids_at = out_layout(n)
        self._check_fits(ids_at, total, want_ids, out_size)
        np.frombuffer(dst.buf, dtype=np.int32, count=n)[:] = lengths
        np.frombuffer(dst.buf, dtype=np.uint8, count=n, offset=flags_at)[:] = overflow
        if want_ids and total:
            np.frombuffer(dst.buf, dtype=np.int32, count=total, offset=ids_at)[:] = ids
        return "ok", total, time.process_time() - c0

    def _one_by_one(self, texts: list[str], want_ids: bool) -> tuple[Any, Any, Any]:
        """``(lengths, overflow, ids)`` of ``texts`` from one ``Encoding`` each (ids empty unless ``want_ids``)."""
        import numpy as np

        paused = self.gc_pause and gc.isenabled()
        if paused:
            gc.disable()  # one GC-tracked Encoding per text, no cycles (see tokenizing.gc_paused)
        try:
            encodings = self.encode_batch(texts)
            lengths = np.fromiter(map(len, encodings), dtype=np.int32, count=len(encodings))
            overflow = np.zeros(len(encodings), dtype=bool)
            for i in np.flatnonzero(lengths >= self.max_length).tolist():
                overflow[i] = bool(encodings[i].overflowing)
            ids = self._flat_ids(encodings, int(lengths.sum())) if want_ids else np.zeros(0, np.int32)
            del encodings
        finally:
            if paused:
                gc.enable()
        return lengths, overflow, ids

    @staticmethod
    def _check_fits(ids_at: int, total: int, want_ids: bool, out_size: int) -> None:
        if ids_at + (4 * total if want_ids else 0) > out_size:
            raise ValueError(f"{total:,} tokens do not fit the {out_size:,}-byte output block")

    def close(self) -> None:
        for block in self._blocks.values():
            block.close()
        self._blocks.clear()


def main() -> None:
    """Serve requests on stdin until EOF (see the protocol above)."""
    requests = sys.stdin.buffer
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print goes to stderr, not into the replies
    sys.stdout = sys.stderr
    setup = read_message(requests)
    if setup is None:
        return
    helper = Helper(
        setup["tokenizer"],
        setup["prompt"],
        setup["max_length"],
        gc_pause=setup.get("gc_pause", True),
        joined=setup.get("joined", True),
    )
    try:
        while (request := read_message(requests)) is not None:
            try:
                reply: tuple = helper.encode(*request)
            except Exception as err:  # noqa: BLE001 - the caller tokenizes this block itself, and says why
                reply = ("error", type(err).__name__, str(err))
            write_message(replies, reply)
    finally:
        helper.close()


if __name__ == "__main__":
    main()
