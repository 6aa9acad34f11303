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
from typing import Any

from ..errors import SurgeOutputError
from .directory import META_DIR, discard, read_json
from .store import OutputStore

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


def store_age(store: OutputStore, path: str) -> float | None:
    """Seconds since ``path`` (below the output's root) was last written, on the clock of the
    filesystem or store that holds it: its modification time against that of a file written now
    in the output's ``_surge/`` (then deleted). Hosts whose clocks disagree agree on this. None
    when the store gives no times or ``path`` is gone.

    Examples
    --------
    >>> import tempfile
    >>> store = OutputStore.open(tempfile.mkdtemp())
    >>> store.makedirs(f"{store.root}/_surge")
    >>> store.write(f"{store.root}/_surge/CLAIM", b"1")
    True
    >>> 0 <= store_age(store, f"{store.root}/_surge/CLAIM") < 60
    True
    """
    clock = f"{store.root}/{META_DIR}/.clock-{uuid.uuid4().hex}"
    try:
        then = store.mtime(path)
        store.write(clock, b"")
        try:
            now = store.mtime(clock)
        finally:
            with contextlib.suppress(OSError):
                discard(store, clock)
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
    >>> import tempfile
    >>> store = OutputStore.open(tempfile.mkdtemp())
    >>> claim = Claim.acquire(store, "0123456789abcdef", heartbeat=False)
    >>> Claim.acquire(store, "fedcba9876543210", heartbeat=False)
    Traceback (most recent call last):
    ...
    dask_surge.errors.SurgeOutputError: output=... is being written by another run (...
    >>> claim.release(); Claim.holder(store) is None
    True
    """

    store: OutputStore
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
    def holder(store: OutputStore) -> dict | None:
        """What the claim of the output says, with its last ``heartbeat`` (None: unclaimed; a torn
        claim reads as stale)."""
        root = store.root
        try:
            info = read_json(store, Claim.path(root))
        except SurgeOutputError:
            return {"heartbeat": 0.0, "host": "?", "pid": 0, "run": "?", "token": "?"}
        if info is None:
            return None
        token = str(info.get("token", ""))
        if re.fullmatch(r"[0-9a-f]{32}", token):
            with contextlib.suppress(
                FileNotFoundError, ValueError
            ):  # no beat yet: the time the claim was made
                info["heartbeat"] = float(store.read(Claim._beat_path(root, token)).decode())
        info.setdefault("heartbeat", info.get("started", 0.0))
        return info

    @staticmethod
    def _stale(store: OutputStore, info: dict, path: str | None = None) -> bool:
        """Whether the holder ``info`` is gone, its heartbeat file's (or ``path``'s) age read on the
        store's clock (:func:`store_age`)."""
        root = store.root
        token = str(info.get("token", ""))
        if path is None:
            path = Claim._beat_path(root, token) if re.fullmatch(r"[0-9a-f]{32}", token) else Claim.path(root)
        age = store_age(store, path)
        if age is None and path != Claim.path(root):  # no beat yet: the claim's own time
            age = store_age(store, Claim.path(root))
        return stale(info, CLAIM_TTL_S, beat="heartbeat", age=age)

    @staticmethod
    def alive(store: OutputStore, info: dict) -> bool:
        """True while the holder ``info`` of the output's claim (:meth:`holder`) is a live process:
        its heartbeat is fresh on the store's clock, and, on this host, its process exists."""
        return not Claim._stale(store, info)

    def _body(self) -> bytes:
        info = holder_info(run=self.run_id, token=self.token)
        info["started"] = info.pop("time")
        return json.dumps(info, sort_keys=True).encode()

    @property
    def root(self) -> str:
        return self.store.root

    def _beat_once(self) -> None:
        self.store.write(Claim._beat_path(self.root, self.token), repr(time.time()).encode())

    @classmethod
    def acquire(cls, store: OutputStore, run_id: str, *, heartbeat: bool = True) -> Claim:
        """Claim the output for ``run_id`` or raise :class:`SurgeOutputError` naming the live holder."""
        claim = cls(store, run_id, uuid.uuid4().hex)
        root = store.root
        meta = f"{root}/{META_DIR}"
        try:
            store.makedirs(meta)
            for _ in range(5):
                if store.write(cls.path(root), claim._body(), exclusive=True):
                    break
                info = cls.holder(store)
                if info is None:
                    continue  # released meanwhile
                if not cls._stale(store, info):
                    age = store_age(store, cls._beat_path(root, str(info.get("token", ""))))
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
                raise SurgeOutputError(
                    f"output={root!r}: could not claim it after 5 tries (another run "
                    "keeps claiming it). Fix: rerun when the other run is done."
                )
        except SurgeOutputError:
            raise  # our own refusal (an OSError subclass): not a filesystem failure
        except OSError as err:
            raise SurgeOutputError(
                f"output={root!r} is not writable ({type(err).__name__}: {err}). Nothing was encoded. "
                "Fix: choose a directory you can create and write to."
            ) from err
        for name in store.listdir(meta):  # what takeovers of stale claims left
            if name.startswith((".stale-claim-", ".takeover-")):
                with contextlib.suppress(OSError):
                    discard(store, f"{meta}/{name}")
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
        store, root = self.store, self.root
        old = str(stale.get("token", ""))
        token = old if re.fullmatch(r"[0-9a-f]{32}", old) else "0" * 32
        for k in range(8):
            marker = f"{root}/{META_DIR}/.takeover-{token}-{k}"
            if store.write(marker, self._body(), exclusive=True):
                break
            try:
                taker = read_json(store, marker)
            except SurgeOutputError:
                taker = None  # torn: its writer died while writing it
            if taker is not None and not self._stale(
                store, {**taker, "heartbeat": taker.get("started", 0.0)}, marker
            ):
                raise SurgeOutputError(
                    f"output={root!r} is being claimed by another run (pid {taker.get('pid')} on "
                    f"{taker.get('host')} is taking over the stale claim of run {stale.get('run')}). Nothing "
                    "was written. Fix: wait for that run to finish, or write to another directory."
                )
        else:
            raise SurgeOutputError(
                f"output={root!r}: its stale claim could not be taken over (8 takeovers "
                "died). Fix: remove _surge/CLAIM and _surge/.takeover-* by hand, then rerun."
            )
        info = Claim.holder(store)
        if info is not None and str(info.get("token", "")) == old:
            discard(store, Claim.path(root))
        if token == old:
            discard(store, Claim._beat_path(root, old))

    def held(self) -> bool:
        """True while the claim file still carries our token."""
        info = Claim.holder(self.store)
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
                discard(self.store, Claim.path(self.root))
        with contextlib.suppress(OSError):
            discard(self.store, Claim._beat_path(self.root, self.token))

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
