"""Tokenize out of the worker's GIL: a small pool of helper processes that hand back int32 ids through shared memory.

The Rust tokenizer runs without the GIL, but what it hands back does not: one Python
``Encoding`` per text, its ``.ids`` list, their frees (less with texts joined,
:mod:`dask_surge.engine.joined`, most of it then a Python int per token; ``docs/ab_studies.md``).
On a GPU worker every microsecond of GIL per text caps the
texts/s one process can feed. A :class:`TokenPool` moves that work into helper processes:

- the caller joins a block's texts into one UTF-8 buffer and writes it, with the character
  offsets, into a shared-memory block (a C-level join and encode);
- a helper (a fresh interpreter started with ``python -c``, never a fork: a Dask worker is
  multithreaded) tokenizes them with a copy of the caller's tokenizer (truncation, prompt) and
  writes the lengths, the overflow flags and the int32 ids into a second block;
- the caller copies the three arrays out (:class:`TokenizedBlock`); no per-text Python object
  crosses the boundary.

The caller creates, owns and unlinks every block; the helpers only map them. A helper that dies
is reported as :class:`TokenizerProcessError`; :meth:`dask_surge.engine.tokenizing.TextPacker.blocks`
then tokenizes the rest in process, with a warning, so no row is lost and the ids are the same.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import SurgeError
from ..io.texts import ArrowTexts
from . import tuning
from ._tokenhelper import out_layout, read_message, write_message

__all__ = ["TokenPool", "TokenizedBlock", "TokenizerProcessError", "auto_processes"]


logger = logging.getLogger(__name__)

#: The helper's program, run as a script: it imports nothing of the package (which would import
#: Dask, seconds on a busy machine); its folder, first on the helper's ``sys.path``, shadows no
#: module of the standard library or of a dependency (``tests/test_tokenpool.py`` checks).
_HELPER = Path(__file__).with_name("_tokenhelper.py")


class TokenizerProcessError(SurgeError, RuntimeError):
    """A tokenizer helper process died (:attr:`died`) or could not take a block (see :class:`TokenPool`)."""

    def __init__(self, message: str, *, died: bool = False) -> None:
        super().__init__(message)
        #: True when a helper process died (the pool is not to be trusted any more); False when one
        #: block could not be handed over or tokenized there (the next may be).
        self.died = died


def auto_processes(device_type: str) -> int:
    """Helper processes ``surge.tuning.tokenize-processes`` gives on a device of type ``device_type``.

    ``auto`` is 0 on every device. On a CPU worker the cores are the bottleneck, and a helper adds
    work (the hand-off) without taking any off the cores. On CUDA, where one worker process feeds a
    GPU and its GIL may cap the texts/s, helpers could let two SuperBatches tokenize at once, but no
    GPU run has shown it yet: off until one does (``docs/tuning.md``).

    Examples
    --------
    >>> auto_processes("cpu"), auto_processes("cuda")
    (0, 0)
    >>> import dask
    >>> with dask.config.set({"surge.tuning.tokenize-processes": 2}):
    ...     auto_processes("cuda")
    2
    """
    return int(tuning.setting("tokenize-processes", device_type))


@dataclass(frozen=True)
class TokenizedBlock:
    """One block of texts as arrays: per text its length and overflow flag, and all ids (from a helper
    process, or from :class:`~dask_surge.engine.joined.JoinedTokenizer` in process).

    Attributes
    ----------
    lengths : numpy.ndarray
        int32 token length of each text (special and prompt tokens included, after truncation).
    overflow : numpy.ndarray
        bool per text: truncation left tokens over (the text was cut).
    ids : numpy.ndarray
        int32 ids of every text, one after the other, in text order (empty when only the lengths
        were asked for).

    Examples
    --------
    >>> w = TokenizedBlock(np.array([2, 3], np.int32), np.zeros(2, bool), np.arange(5, dtype=np.int32))
    >>> len(w), w.starts.tolist()
    (2, [0, 2])
    """

    lengths: np.ndarray
    overflow: np.ndarray
    ids: np.ndarray

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def starts(self) -> np.ndarray:
        """int64 offset of each text's ids in :attr:`ids`."""
        lengths = self.lengths.astype(np.int64)
        return np.cumsum(lengths) - lengths


def _grown(size: int) -> int:
    """A block size for ``size`` bytes with room to grow (1.5x, at least 1 MiB, 4 KiB pages)."""
    return max(1 << 20, (size * 3 // 2 + 4095) // 4096 * 4096)


class _Helper:
    """One helper process and the two blocks it reads and writes; used by one call at a time."""

    def __init__(self, setup: dict[str, Any], index: int) -> None:
        self.index = index
        self.proc = subprocess.Popen(
            [sys.executable, str(_HELPER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
        )
        self.blocks: dict[str, SharedMemory] = {}
        self.send(setup)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def block(self, role: str, size: int) -> SharedMemory:
        """This helper's ``role`` block ("in" or "out"), made anew (the old one unlinked) when too small."""
        shm = self.blocks.get(role)
        if shm is None or shm.size < size:
            if shm is not None:
                _unlink(shm)
                del self.blocks[role]
            shm = self.blocks[role] = SharedMemory(create=True, size=_grown(size))
        return shm

    def send(self, message: Any) -> None:
        assert self.proc.stdin is not None
        try:
            write_message(self.proc.stdin, message)
        except (BrokenPipeError, OSError, ValueError) as err:
            raise self.died(f"writing to it failed ({err})") from None

    def receive(self) -> Any:
        assert self.proc.stdout is not None
        try:
            reply = read_message(self.proc.stdout)
        except (OSError, ValueError, EOFError) as err:
            raise self.died(f"reading from it failed ({err})") from None
        if reply is None:
            raise self.died("it closed its pipe")
        return reply

    def died(self, how: str) -> TokenizerProcessError:
        code = _reap(self.proc)
        what = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        hint = " (signal 9 is usually the out-of-memory killer)" if code == -9 else ""
        return TokenizerProcessError(
            f"tokenizer helper process {self.proc.pid} {what}{hint}: {how}. The texts it held are tokenized "
            "in this process instead, with the same ids. Fix: give the worker more memory, or set "
            "surge.tuning.tokenize-processes to 0 to tokenize in the worker (dask.config.set({'surge.tuning.tokenize-processes': 0}) "
            "or DASK_SURGE__TUNING__TOKENIZE_PROCESSES=0).",
            died=True,
        )

    def close(self) -> None:
        """Close the pipe (the helper exits at EOF), wait a little, kill if needed, unlink the blocks."""
        _stop(self.proc)
        for shm in self.blocks.values():
            _unlink(shm)
        self.blocks.clear()


def _start(setup: dict[str, Any], index: int) -> _Helper:
    """A new helper process, or :class:`TokenizerProcessError` (``died``) when it cannot start."""
    try:
        return _Helper(setup, index)
    except OSError as err:
        raise TokenizerProcessError(
            f"could not start a tokenizer helper process ({err}). Texts are tokenized in this process instead. "
            "Fix: set surge.tuning.tokenize-processes to 0 to tokenize in the worker.",
            died=True,
        ) from None


def _stop(proc: subprocess.Popen) -> None:
    for stream in (proc.stdin, proc.stdout):
        try:
            if stream is not None:
                stream.close()
        except OSError:
            pass
    _reap(proc)


def _reap(proc: subprocess.Popen) -> int:
    """``proc``'s exit code: it has 5 s to exit, then it is killed."""
    try:
        return proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _unlink(shm: SharedMemory) -> None:
    with contextlib.suppress(BufferError):  # a view is still alive somewhere: the mapping goes with it
        shm.close()
    with contextlib.suppress(FileNotFoundError):
        shm.unlink()


class _State:
    """What closing a pool needs, apart from the pool (its finalizer must not hold the pool)."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.helpers: list[_Helper] = []  # started ones
        self.idle: list[_Helper] = []
        self.closed = False

    def close(self) -> None:
        with self.lock:
            self.closed = True
            helpers, self.helpers, self.idle = self.helpers, [], []
            self.lock.notify_all()
        for helper in helpers:
            helper.close()


class Pending:
    """A block handed to a helper; :meth:`result` waits for it (and must be called, once)."""

    def __init__(self, pool: TokenPool, helper: _Helper, n: int, want_ids: bool) -> None:
        self._pool, self._helper, self._n, self._want_ids = pool, helper, n, want_ids
        self._done = False

    def result(self) -> TokenizedBlock:
        """The tokenized block (copied out of shared memory); the helper is free again.

        Raises
        ------
        TokenizerProcessError
            If the helper died (it is then dropped from the pool), or failed on this block.
        """
        if self._done:
            raise RuntimeError("Pending.result() was already called")
        self._done = True
        helper, n = self._helper, self._n
        try:
            reply = helper.receive()
        except TokenizerProcessError:
            self._pool._drop(helper)
            raise
        try:
            if reply[0] != "ok":
                raise TokenizerProcessError(
                    f"tokenizer helper process {helper.pid} failed on a block: {reply[1]}: {reply[2]}"
                )
            total = int(reply[1])
            out = helper.blocks["out"]
            flags_at, ids_at = out_layout(n)
            buf = out.buf
            assert buf is not None
            lengths = np.frombuffer(buf, dtype=np.int32, count=n).copy()
            overflow = np.frombuffer(buf, dtype=np.uint8, count=n, offset=flags_at).astype(bool)
            ids = (
                np.frombuffer(buf, dtype=np.int32, count=total, offset=ids_at).copy()
                if self._want_ids
                else np.empty(0, dtype=np.int32)
            )
            del buf
            return TokenizedBlock(lengths, overflow, ids)
        finally:
            self._pool._release(helper)

    def discard(self) -> None:
        """Wait for the helper and drop the result (a block the caller no longer wants)."""
        if not self._done:
            with contextlib.suppress(TokenizerProcessError):
                self.result()


class TokenPool:
    """Up to ``processes`` helper processes that tokenize blocks of texts, started on first use.

    Parameters
    ----------
    tokenizer_json : str
        The tokenizer, as ``tokenizers.Tokenizer.to_str()`` writes it, truncation and padding set
        as the ids should come out (:class:`~dask_surge.engine.tokenizing.TextPacker` passes its own).
    max_length : int
        The truncation length: a text whose encoding is this long may have been cut, and its
        overflow flag is read.
    prompt : str, default ""
        Put before every text.
    processes : int, default 1
        Helper processes at most; each serves one block at a time.

    Notes
    -----
    Closed by :meth:`close`, when the pool is garbage collected, and at interpreter exit; each
    helper also exits when its pipe closes (its caller died). Shared-memory blocks are created
    and unlinked by this process (and registered with its resource tracker, which unlinks them
    if the process dies).

    Examples
    --------
    >>> from transformers import AutoTokenizer
    >>> from dask_surge.engine.tokenizing import StageClock, TextPacker
    >>> from dask_surge.testing import packaged_model_dir
    >>> packer = TextPacker(AutoTokenizer.from_pretrained(str(packaged_model_dir())), 8, clock=StageClock())
    >>> pool = TokenPool(packer.tokenizer_json(), 8)
    >>> w = pool.tokenize(["a dog", "", "one two three four five six seven"])
    >>> w.lengths.tolist(), w.overflow.tolist(), w.ids[:4].tolist()
    ([4, 2, 8], [False, False, True], [101, 1037, 3899, 102])
    >>> pool.close(); pool.closed
    True
    """

    def __init__(
        self,
        tokenizer_json: str,
        max_length: int,
        *,
        prompt: str = "",
        processes: int = 1,
        gc_pause: bool = False,
        joined: bool = True,
    ) -> None:
        if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
            raise ValueError(f"processes={processes!r} must be a positive int")
        self.processes = processes
        self.max_length = int(max_length)
        # the helper imports nothing of the package: the tuning settings travel in its setup message
        self._setup = {
            "tokenizer": tokenizer_json,
            "prompt": prompt,
            "max_length": self.max_length,
            "gc_pause": bool(gc_pause),
            "joined": bool(joined),
        }
        # ids per text at most, beyond one per byte of text: the prompt's (one per byte), special tokens and a
        # word-start marker (a helper whose ids do not fit says so, and the block is tokenized here)
        self._per_text = len(prompt.encode("utf-8", "surrogatepass")) + 16
        self._state = _State()
        self._finalizer = weakref.finalize(self, self._state.close)  # also runs at interpreter exit

    @property
    def tuned(self) -> tuple[bool, bool]:
        """``(gc_pause, joined)``: the tuning settings the helpers were started with."""
        return bool(self._setup["gc_pause"]), bool(self._setup["joined"])

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._state.closed

    @property
    def pids(self) -> list[int]:
        """Process ids of the helpers started (and not dropped)."""
        with self._state.lock:
            return [h.pid for h in self._state.helpers]

    @property
    def segments(self) -> list[str]:
        """Names of the shared-memory blocks the pool holds now."""
        with self._state.lock:
            return [shm.name for h in self._state.helpers for shm in h.blocks.values()]

    def _acquire(self, block: bool) -> _Helper | None:
        state = self._state
        with state.lock:
            while True:
                if state.closed:
                    raise TokenizerProcessError("this TokenPool was closed. Fix: use a new one.")
                if state.idle:
                    return state.idle.pop()
                if len(state.helpers) < self.processes:
                    helper = _start(self._setup, len(state.helpers))
                    state.helpers.append(helper)
                    return helper
                if not block:
                    return None
                state.lock.wait()

    def _release(self, helper: _Helper) -> None:
        with self._state.lock:
            if helper in self._state.helpers and not self._state.closed:
                self._state.idle.append(helper)
                self._state.lock.notify()

    def _drop(self, helper: _Helper) -> None:
        with self._state.lock:
            if helper in self._state.helpers:
                self._state.helpers.remove(helper)
            self._state.lock.notify()
        helper.close()

    def submit(self, texts: Sequence[str], *, ids: bool = True, block: bool = True) -> Pending | None:
        """Hand ``texts`` to a free helper (starting one if fewer than ``processes`` run).

        Parameters
        ----------
        texts : sequence of str
            A list, or an :class:`~dask_surge.io.texts.ArrowTexts`, whose UTF-8 bytes and byte
            offsets are copied as they are.
        ids : bool, default True
            False: only the lengths and the overflow flags (``count_tokens``).
        block : bool, default True
            Wait for a free helper; False returns None when none is free. A caller holding
            :class:`Pending` blocks must not block (two callers could each wait for the other's
            helper): take a result first.

        Returns
        -------
        Pending or None

        Raises
        ------
        TypeError
            If an element of ``texts`` is not a str (nothing was handed over).
        UnicodeEncodeError
            If a text cannot be written as UTF-8 (nothing was handed over).
        TokenizerProcessError
            If the helper died before it took the block (it is dropped from the pool).
        """
        n = len(texts)
        joined: bytes | memoryview
        if isinstance(texts, ArrowTexts):  # the column's own UTF-8 bytes and byte offsets: no per-text work
            offsets, joined = texts.utf8()
            unit = "bytes"
        else:
            joined = "".join(texts).encode("utf-8", "surrogatepass")  # TypeError for a non-str
            offsets = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(np.fromiter(map(len, texts), dtype=np.int64, count=n), out=offsets[1:])
            unit = "chars"
        tokens = min(n * self.max_length, len(joined) + n * self._per_text) if ids else 0
        _, ids_at = out_layout(n)
        need = 8 * (n + 1) + len(joined) + ids_at + 4 * tokens
        room = shm_room()
        if room is not None and room < 2 * need:
            raise TokenizerProcessError(
                f"{room:,} bytes are free in /dev/shm, under twice the {need:,} a block of {n:,} texts needs "
                "(a full /dev/shm kills the process that writes to it). The block is tokenized in this process "
                "instead. Fix: make /dev/shm larger (docker run --shm-size=1g), or set surge.tuning.tokenize-processes "
                "to 0 to tokenize in the worker."
            )
        helper = self._acquire(block)
        if helper is None:
            return None
        try:
            src = helper.block("in", 8 * (n + 1) + len(joined))
            dst = helper.block("out", ids_at + 4 * tokens)
            buf = src.buf
            assert buf is not None
            buf[: 8 * (n + 1)] = offsets.tobytes()
            buf[8 * (n + 1) : 8 * (n + 1) + len(joined)] = joined
            del buf
            helper.send((src.name, src.size, n, len(joined), dst.name, dst.size, ids, unit))
        except TokenizerProcessError:
            self._drop(helper)
            raise
        except BaseException:
            self._release(helper)
            raise
        return Pending(self, helper, n, ids)

    def tokenize(self, texts: Sequence[str], *, ids: bool = True) -> TokenizedBlock:
        """:meth:`submit` ``texts`` and wait for them (see :class:`TokenizedBlock`)."""
        pending = self.submit(texts, ids=ids)
        assert pending is not None
        return pending.result()

    def close(self) -> None:
        """Stop the helpers and unlink the shared-memory blocks; idempotent. Blocks in flight fail."""
        self._finalizer()


def shm_room() -> int | None:
    """Free bytes of ``/dev/shm`` (where POSIX shared memory lives on Linux), None elsewhere."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
