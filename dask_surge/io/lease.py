"""Leases: a path held by one live process, proven by a heartbeat.

Two things are leased: an output directory, by the run writing it (:class:`Claim`), and the
building of a reuse index (:mod:`dask_surge.io.reuse`). Both record who holds them
(:func:`holder_info`: host, pid, time) and both decide the same way whether the holder is
gone (:func:`stale`): its process is dead on this host, or its heartbeat is older than the
lease's time to live. The age of a heartbeat is read on the store's own clock (the
modification time the filesystem or object store gave the heartbeat file, against that of a
file written now: :func:`store_age`), so hosts whose clocks disagree never take a live lease
for a stale one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ..errors import SurgeOutputError
from .directory import META_DIR, _ls, _read_json, create_exclusive, discard, write_bytes_atomic

__all__ = ["CLAIM_TTL_S", "HEARTBEAT_S", "Claim", "holder_info", "stale", "store_age"]


def holder_info(**extra: Any) -> dict:
    """Who holds a lease: this host, this process and the time now (plus ``extra``).

    Examples
    --------
    >>> info = holder_info(run="r")
    >>> sorted(info), info["pid"] == os.getpid()
    (['host', 'pid', 'run', 'time'], True)
    """
    return {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time(), **extra}


def _mtime(info: dict) -> float | None:
    """The modification time an fsspec ``info`` gives (local ``mtime``, S3 ``LastModified``, GCS
    ``updated``, the in-memory filesystem's ``created``), as a POSIX timestamp; None if none."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(key)
        if isinstance(value, (int, float)) and value > 0:
            return float(value)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    return None


def store_age(fs: Any, root: str, path: str) -> float | None:
    """Seconds since ``path`` (below the output ``root``) was last written, on the clock of the
    filesystem or store that holds it: its modification time against that of a file written now
    in ``root``'s ``_surge/`` (then deleted). Hosts whose clocks disagree agree on this. None when
    the store gives no times or ``path`` is gone.

    Examples
    --------
    >>> import fsspec, tempfile
    >>> fs, root = fsspec.filesystem("file"), tempfile.mkdtemp()
    >>> fs.makedirs(f"{root}/_surge")
    >>> write_bytes_atomic(fs, f"{root}/_surge/CLAIM", b"1")
    >>> 0 <= store_age(fs, root, f"{root}/_surge/CLAIM") < 60
    True
    """
    clock = f"{root}/{META_DIR}/.clock-{uuid.uuid4().hex}"
    try:
        with contextlib.suppress(AttributeError, TypeError):
            fs.invalidate_cache(path)
        then = _mtime(fs.info(path))
        write_bytes_atomic(fs, clock, b"")
        try:
            now = _mtime(fs.info(clock))
        finally:
            with contextlib.suppress(OSError):
                discard(fs, root, clock)
    except (OSError, ValueError):
        return None
    return None if then is None or now is None else max(0.0, now - then)


def stale(info: dict, ttl: float, *, beat: str = "time", age: float | None = None) -> bool:
    """True when the holder ``info`` (see :func:`holder_info`) is gone: its heartbeat is older than
    ``ttl`` seconds, or it ran on this host and its process no longer exists.

    The heartbeat's ``age`` is best given as the store measures it (:func:`store_age`); without
    it, ``info[beat]`` (the holder's clock) is compared with this host's clock, which hosts
    whose clocks disagree get wrong.

    Examples
    --------
    >>> stale(holder_info(), ttl=60.0), stale({**holder_info(), "time": 0.0}, ttl=60.0)
    (False, True)
    >>> stale({**holder_info(), "time": 0.0, "host": "elsewhere"}, ttl=60.0, age=3.0)  # a skewed clock
    False
    """
    if age is None:
        age = time.time() - float(info.get(beat, 0) or 0)
    if age > ttl:
        return True
    if info.get("host") == socket.gethostname():
        try:
            os.kill(int(info.get("pid", 0)), 0)
        except ProcessLookupError:
            return True
        except (PermissionError, ValueError, OverflowError, TypeError):
            return False
    return False


#: a claim whose heartbeat is older than this is stale (its process is gone or hung)
CLAIM_TTL_S = 60.0


#: how often a live run refreshes its claim
HEARTBEAT_S = 10.0


@dataclass
class Claim:
    """An exclusive, heartbeated claim of an output directory by one live run.

    ``_surge/CLAIM`` holds the run, host, pid and a random token, and is never rewritten;
    the holder's heartbeat is the time written in its own ``_surge/.heartbeat-<token>``,
    so refreshing it can never overwrite another run's claim. :meth:`acquire` creates
    the claim exclusively; a claim whose process is gone (same host, pid not alive) or
    whose heartbeat is older than :data:`CLAIM_TTL_S` is stale and is taken over
    (:meth:`_take_over`: of several processes taking it over, one wins). While held, a
    daemon thread refreshes the heartbeat and notices a lost claim (:attr:`lost`);
    :meth:`release` removes the claim if it is still ours.

    Examples
    --------
    >>> import tempfile, fsspec
    >>> fs, root = fsspec.filesystem("file"), tempfile.mkdtemp()
    >>> claim = Claim.acquire(fs, root, "0123456789abcdef", heartbeat=False)
    >>> Claim.acquire(fs, root, "fedcba9876543210", heartbeat=False)
    Traceback (most recent call last):
    ...
    dask_surge.errors.SurgeOutputError: output=... is being written by another run (...
    >>> claim.release(); Claim.holder(fs, root) is None
    True
    """

    fs: Any
    root: str
    run_id: str
    token: str
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)
    lost: bool = False

    @staticmethod
    def path(root: str) -> str:
        return f"{root}/{META_DIR}/CLAIM"

    @staticmethod
    def _beat_path(root: str, token: str) -> str:
        return f"{root}/{META_DIR}/.heartbeat-{token}"

    @staticmethod
    def holder(fs, root: str) -> dict | None:
        """What the claim of ``root`` says, with its last ``heartbeat`` (None: unclaimed; a torn
        claim reads as stale)."""
        try:
            info = _read_json(fs, Claim.path(root))
        except SurgeOutputError:
            return {"heartbeat": 0.0, "host": "?", "pid": 0, "run": "?", "token": "?"}
        if info is None:
            return None
        token = str(info.get("token", ""))
        if re.fullmatch(r"[0-9a-f]{32}", token):
            with contextlib.suppress(FileNotFoundError, ValueError):  # no beat yet: the time the claim was made
                info["heartbeat"] = float(fs.cat_file(Claim._beat_path(root, token)).decode())
        info.setdefault("heartbeat", info.get("started", 0.0))
        return info

    @staticmethod
    def _stale(fs, root: str, info: dict, path: str | None = None) -> bool:
        """Whether the holder ``info`` is gone, its heartbeat file's (or ``path``'s) age read on the
        store's clock (:func:`store_age`)."""
        token = str(info.get("token", ""))
        if path is None:
            path = Claim._beat_path(root, token) if re.fullmatch(r"[0-9a-f]{32}", token) else Claim.path(root)
        age = store_age(fs, root, path)
        if age is None and path != Claim.path(root):  # no beat yet: the claim's own time
            age = store_age(fs, root, Claim.path(root))
        return stale(info, CLAIM_TTL_S, beat="heartbeat", age=age)

    @staticmethod
    def alive(fs, root: str, info: dict) -> bool:
        """True while the holder ``info`` of ``root``'s claim (:meth:`holder`) is a live process:
        its heartbeat is fresh on the store's clock, and, on this host, its process exists."""
        return not Claim._stale(fs, root, info)

    def _body(self) -> bytes:
        info = holder_info(run=self.run_id, token=self.token)
        info["started"] = info.pop("time")
        return json.dumps(info, sort_keys=True).encode()

    def _beat_once(self) -> None:
        write_bytes_atomic(self.fs, Claim._beat_path(self.root, self.token), repr(time.time()).encode())

    @classmethod
    def acquire(cls, fs, root: str, run_id: str, *, heartbeat: bool = True) -> Claim:
        """Claim ``root`` for ``run_id`` or raise :class:`SurgeOutputError` naming the live holder."""
        claim = cls(fs, root, run_id, uuid.uuid4().hex)
        meta = f"{root}/{META_DIR}"
        try:
            fs.makedirs(meta, exist_ok=True)
            for _ in range(5):
                if create_exclusive(fs, cls.path(root), claim._body()):
                    break
                info = cls.holder(fs, root)
                if info is None:
                    continue  # released meanwhile
                if not cls._stale(fs, root, info):
                    age = store_age(fs, root, cls._beat_path(root, str(info.get("token", ""))))
                    age = time.time() - float(info.get("heartbeat", 0)) if age is None else age
                    raise SurgeOutputError(
                        f"output={root!r} is being written by another run (run {info.get('run')}, pid "
                        f"{info.get('pid')} on {info.get('host')}, last heartbeat {age:.0f} s ago). Nothing "
                        "was written. Fix: wait for it to finish, or write to another directory; a claim "
                        f"whose process died is taken over at once on the same host, else after "
                        f"{CLAIM_TTL_S:.0f} s without a heartbeat."
                    )
                claim._take_over(info)
            else:
                raise SurgeOutputError(f"output={root!r}: could not claim it after 5 tries (another run "
                                       "keeps claiming it). Fix: rerun when the other run is done.")
        except SurgeOutputError:
            raise  # our own refusal (an OSError subclass): not a filesystem failure
        except OSError as err:
            raise SurgeOutputError(
                f"output={root!r} is not writable ({type(err).__name__}: {err}). Nothing was encoded. "
                "Fix: choose a directory you can create and write to."
            ) from err
        for name in _ls(fs, meta):  # what takeovers of stale claims left
            if name.startswith((".stale-claim-", ".takeover-")):
                with contextlib.suppress(OSError):
                    discard(fs, root, f"{meta}/{name}")
        with contextlib.suppress(OSError):
            claim._beat_once()
        if heartbeat:
            claim._thread = threading.Thread(target=claim._beat, name="dask-surge-claim", daemon=True)
            claim._thread.start()
        return claim

    def _take_over(self, stale: dict) -> None:
        """Remove the stale claim ``stale`` so that :meth:`acquire` may create its own.

        Of several processes taking over one stale claim, only the one that creates the
        takeover marker ``.takeover-<its token>-<k>`` exclusively removes it, and only if
        the claim still carries that token; the others are refused while that process lives
        (a marker of a dead one is passed over by the next ``k``). So a takeover never has
        two winners: a process that did not remove the stale claim can only win by creating
        ``CLAIM`` exclusively, which fails once any other process has.
        """
        fs, root = self.fs, self.root
        old = str(stale.get("token", ""))
        token = old if re.fullmatch(r"[0-9a-f]{32}", old) else "0" * 32
        for k in range(8):
            marker = f"{root}/{META_DIR}/.takeover-{token}-{k}"
            if create_exclusive(fs, marker, self._body()):
                break
            try:
                taker = _read_json(fs, marker)
            except SurgeOutputError:
                taker = None  # torn: its writer died while writing it
            if taker is not None and not self._stale(fs, root, {**taker, "heartbeat": taker.get("started", 0.0)},
                                                     marker):
                raise SurgeOutputError(
                    f"output={root!r} is being claimed by another run (pid {taker.get('pid')} on "
                    f"{taker.get('host')} is taking over the stale claim of run {stale.get('run')}). Nothing "
                    "was written. Fix: wait for that run to finish, or write to another directory."
                )
        else:
            raise SurgeOutputError(f"output={root!r}: its stale claim could not be taken over (8 takeovers "
                                   "died). Fix: remove _surge/CLAIM and _surge/.takeover-* by hand, then rerun.")
        info = Claim.holder(fs, root)
        if info is not None and str(info.get("token", "")) == old:
            discard(fs, root, Claim.path(root))
        if token == old:
            discard(fs, root, Claim._beat_path(root, old))

    def held(self) -> bool:
        """True while the claim file still carries our token."""
        info = Claim.holder(self.fs, self.root)
        return info is not None and info.get("token") == self.token

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if not self.held():
                    self.lost = True
                    return
                self._beat_once()  # our own file: a claim taken over meanwhile is never overwritten
            except OSError:  # a full disk: the next beat tries again; the claim goes stale if it persists
                continue

    def release(self) -> None:
        """Stop the heartbeat and remove the claim if it is still ours (idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            if self.held():
                discard(self.fs, self.root, Claim.path(self.root))
        with contextlib.suppress(OSError):
            discard(self.fs, self.root, Claim._beat_path(self.root, self.token))

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
