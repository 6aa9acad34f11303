"""Before any work: every worker sees the output the client sees.

A cluster whose workers do not share the output path (a local ``/data/out`` on each
machine) or lack the store's credentials would commit where the client cannot see, so a
run proves the opposite first: the client writes a probe file under the output's
``_surge/``, each worker reads it back (the same bytes) and writes one of its own, and the
client reads those. One round trip to the workers (``Client.run``), seconds at most; the
probe files are deleted whatever the outcome.

Examples
--------
>>> import tempfile
>>> from dask_surge.io.store import OutputStore
>>> worker_sees(OutputStore.open(tempfile.mkdtemp()), "0" * 32, "tcp://127.0.0.1:1")  # no probe written
"FileNotFoundError: [Errno 2] No such file or directory: ..."
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import uuid
import zlib
from typing import Any

from ..errors import SurgeOutputError
from ..io.directory import META_DIR, current_path, discard
from ..io.store import OutputStore

__all__ = ["check_workers_see_output", "not_a_scheduler", "run_gone", "task_sees_run", "worker_sees"]


#: the runs whose ``run.json`` this process has read (store, run id): a SuperBatch task
#: proves it sees its run's output once per worker process and run (:func:`task_sees_run`). What
#: invalidates an entry: nothing needs to: a run replaced since makes the task's commit fail, which is
#: then diagnosed afresh (:func:`run_gone`)
_SEEN: set[tuple[OutputStore, str, float | None]] = set()
_SEEN_LOCK = threading.Lock()


def _probe(root: str, token: str) -> str:
    return f"{root}/{META_DIR}/.reach-{token}"


def _answer(root: str, token: str, address: str) -> str:
    return f"{_probe(root, token)}-{zlib.crc32(address.encode())}"


def worker_sees(store: OutputStore, token: str, address: str) -> str | None:
    """On a worker: read the client's probe and write this worker's answer; None when both
    worked, else what failed (the probe is written by :func:`check_workers_see_output`)."""
    probe = _probe(store.root, token)
    try:
        if store.read(probe) != token.encode():
            return f"{probe!r} holds other bytes than the client wrote"
        store.write(_answer(store.root, token, address), address.encode())
    except Exception as err:  # noqa: BLE001 - any failure is the answer: a missing file, no credentials, a read-only mount
        return f"{type(err).__name__}: {err}"
    return None


def _run_on_worker(store: OutputStore, token: str, dask_worker: Any = None) -> tuple[str, str | None]:
    address = dask_worker.address if dask_worker is not None else "?"
    return socket.gethostname(), worker_sees(store, token, address)


def _clean_on_worker(store: OutputStore, token: str, dask_worker: Any = None) -> None:
    address = dask_worker.address if dask_worker is not None else "?"
    with contextlib.suppress(Exception):
        discard(store, _answer(store.root, token, address))


def check_workers_see_output(client: Any, store: OutputStore) -> None:
    """Raise :class:`SurgeOutputError` unless every worker of ``client`` reads what the client
    wrote at the output and writes what the client reads there.

    Parameters
    ----------
    client : distributed.Client
        The run's client; its current workers are checked (a worker that joins later proves it
        in its first task: :func:`task_sees_run`).
    store : OutputStore
        The output.
    """
    root, output = store.root, store.location
    token = uuid.uuid4().hex
    probe = _probe(root, token)
    store.makedirs(f"{root}/{META_DIR}")
    store.write(probe, token.encode())
    failures: list[str] = []
    try:
        answers = client.run(_run_on_worker, store, token, on_error="return")
        for address, answer in sorted(answers.items()):
            if isinstance(answer, BaseException):
                failures.append(f"worker {address}: {type(answer).__name__}: {answer}")
                continue
            host, error = answer
            if error is None:
                try:
                    seen = store.read(_answer(root, token, address)) == address.encode()
                except FileNotFoundError:
                    seen = False
                if not seen:
                    error = f"the client cannot read back what it wrote ({_answer(root, token, address)!r})"
            else:
                error = f"it cannot read {probe!r}, which the client wrote ({error})"
            if error is not None:
                failures.append(f"worker {address} on host {host!r}: {error}")
    finally:
        if failures:
            with contextlib.suppress(Exception):
                client.run(_clean_on_worker, store, token, on_error="return")
        for address in client.scheduler_info().get("workers", {}):
            with contextlib.suppress(OSError):
                discard(store, _answer(root, token, address))
        with contextlib.suppress(OSError):
            discard(store, probe)
    if failures:
        raise SurgeOutputError(
            f"output={output!r}: {len(failures)} worker(s) do not see the output the client sees, so what they "
            f"commit would land where the client cannot read it: {'; '.join(failures[:3])}"
            f"{' ...' if len(failures) > 3 else ''}. Nothing was encoded. Fix: write to a path every worker mounts "
            "at the same place (NFS, Lustre, GPFS), or to an object-store URL (s3://bucket/prefix) with "
            "credentials every worker has (storage_options, or the same environment on every worker)."
        )


def _other_run(store: OutputStore, root: str, run_id: str) -> tuple[float | None, float | None]:
    """``(created, completed)`` of run ``run_id`` of the output as this process sees it (from its
    ``run.json`` and the time of its ``COMPLETE`` marker); None where it cannot tell."""
    created = completed = None
    run_dir = f"{root}/{META_DIR}/runs/{run_id}"
    with contextlib.suppress(Exception):
        value = json.loads(store.read(f"{run_dir}/run.json")).get("created")
        created = float(value) if isinstance(value, (int, float)) else None
    with contextlib.suppress(Exception):
        if store.exists(f"{run_dir}/COMPLETE"):
            completed = store.mtime(f"{run_dir}/COMPLETE") or created or 0.0
    return created, completed


def run_gone(manifest: Any, err: BaseException | None = None) -> SurgeOutputError:
    """Why a task does not find its run's directory, from what this worker sees at the output:

    - this run fenced off into ``retired/``, or another run that completed after this one was
      created named in ``CURRENT``: another run replaced it (only a completed run retires others);
    - another run named in ``CURRENT`` that has not completed, or completed before this run was
      created: a different run's output is at that path on this worker's disk (it does not share the
      client's output directory: a worker that joined after the start, with its own disk there), or
      another run holds it; either way none replaced this one;
    - no run at all: this worker does not see the output the client sees.
    """
    store, root = manifest.store, manifest.root
    host = socket.gethostname()
    current = None
    with contextlib.suppress(Exception):
        current = store.read(current_path(root)).decode(errors="replace").strip()
    retired = False
    with contextlib.suppress(Exception):
        retired = any(
            n.startswith(f"{manifest.run_id}-") for n in store.listdir(f"{root}/{META_DIR}/retired")
        )
    other = current if current and current != manifest.run_id else None
    replaced = retired
    if other is not None and not retired:
        _, completed = _other_run(store, root, other)
        mine = getattr(manifest, "created", None)
        replaced = completed is not None and (mine is None or completed >= mine)
        if not replaced:
            state, why = (
                ("complete", "it completed before this run was created")
                if completed is not None
                else ("not complete", "a run replaces another only once it completes")
            )
            return SurgeOutputError(
                f"a worker on host {host!r} sees a different run's output at {root!r}: run {other} ({state}), "
                f"not this run's directory {manifest.run_dir!r} (run {manifest.run_id}, which the client "
                f"created). Run {other} did not replace this one: {why}. Either the workers do not share the "
                "client's output directory (a worker that joined after the run started, an adaptive or "
                "replaced worker, has its own disk at that path), or another run holds it. Nothing of this "
                "task was written. Fix: mount the output at the same path on every worker (NFS, Lustre, GPFS) "
                "or write to an object-store URL (s3://bucket/prefix) every worker reaches, and give one "
                "output path to one run at a time; then rerun the same call to resume."
            )
    if replaced:
        by = f"run {current}" if other is not None else "its directory was retired"
        return SurgeOutputError(
            f"run {manifest.run_id} of {root!r} was replaced by another run ({by}) while this task ran: its "
            f"run's directory {manifest.run_dir!r} is gone. "
            "Nothing of this task was kept. Fix: nothing to do if the other run was meant to replace it (an "
            "overwrite); else rerun the call you want to keep."
        )
    why = f" ({type(err).__name__}: {err})" if err is not None else ""
    return SurgeOutputError(
        f"a worker on host {host!r} does not see the output {root!r} the client sees: its run's "
        f"{manifest.run_dir}/run.json, which the client wrote, is not there for it{why}. A worker that joined "
        "after the run started (an adaptive or replaced worker) without the shared path or the store's "
        "credentials would commit where the client cannot read. Nothing of this task was written. Fix: mount "
        "the output at the same path on every worker (NFS, Lustre, GPFS) or give every worker the store's "
        "credentials, then rerun the same call to resume."
    )


def task_sees_run(manifest: Any) -> None:
    """On a worker, before a SuperBatch task writes: raise :func:`run_gone`'s error unless this
    process reads its run's ``run.json``, and an error unless that ``run.json`` is the one the client
    created (another copy of the same run on this worker's own disk; checked once per worker process
    and run)."""
    created = getattr(manifest, "created", None)
    key = (manifest.store, manifest.run_id, created)
    if key in _SEEN:
        return
    try:
        data = manifest.store.read(f"{manifest.run_dir}/run.json")
    except (OSError, ValueError) as err:
        raise run_gone(manifest, err) from err
    seen = None
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        seen = json.loads(data).get("created")
    if created is not None and isinstance(seen, (int, float)) and seen != created:
        raise SurgeOutputError(
            f"a worker on host {socket.gethostname()!r} sees another copy of run {manifest.run_id} at "
            f"{manifest.root!r}: its run.json was created {_ago(seen)}, not when the client created it "
            f"({_ago(created)}). Either the workers do not share the client's output directory (a worker "
            "that joined after the run started has its own disk at that path, holding an earlier run of "
            "the same call), or the output was deleted and the run started afresh. Nothing of this task was "
            "written. Fix: mount the output at the same path on every worker (NFS, Lustre, GPFS) or write to "
            "an object-store URL (s3://bucket/prefix) every worker reaches; then rerun the same call to resume."
        )
    with _SEEN_LOCK:
        _SEEN.add(key)


def _ago(when: float) -> str:
    """``when`` (a POSIX time) as UTC and how long ago."""
    import time

    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(when))
    return f"{stamp}, {max(time.time() - when, 0):.0f} s ago"


#: the most bytes a Dask comm's greeting (its handshake: compression, Python and pickle versions) takes
_GREETING_MAX = 64 * 2**20


def not_a_scheduler(address: str, wait: float = 3.0) -> str | None:
    """What listens at the TCP ``address`` when it is not a Dask scheduler; None when it greets as one
    (or the address is not plain TCP, or nothing accepts: the caller's ``Client`` then says so).

    A Dask scheduler writes its handshake (a framed message: an 8-byte length, then the frames) to
    every connection it accepts, before it reads anything. ``distributed`` reads the reply without a
    timeout and takes its first 8 bytes for a frame length, so a client at a port where something else
    listens hangs (an HTTP server waits for a request) or allocates exabytes (``"HTTP/1.0"`` read as a
    length). Here nothing is sent: the peer's first bytes, read for at most ``wait`` seconds, tell.

    Examples
    --------
    >>> not_a_scheduler("inproc://x") is None  # not plain TCP: not probed
    True
    """
    from distributed.comm.addressing import parse_address, parse_host_port

    scheme, location = parse_address(address)
    if scheme != "tcp":
        return None
    host, port = parse_host_port(location)
    try:
        sock = socket.create_connection((host, port), timeout=max(wait, 1.0))
    except OSError:
        return None
    data, closed = b"", False
    try:
        sock.settimeout(wait)
        while len(data) < 16 and not closed:
            chunk = sock.recv(16 - len(data))
            closed = not chunk
            data += chunk
    except OSError:  # nothing more within `wait` (a timeout), or a reset
        pass
    finally:
        sock.close()
    if not data and closed:
        return "it accepted the connection and closed it without a word, where a Dask scheduler greets it"
    if not data:
        return (
            f"it accepted the connection and sent nothing within {wait:g} s, where a Dask scheduler greets "
            "each connection at once (an HTTP server, such as a Dask dashboard on port 8787, waits for a "
            "request)"
        )
    if data.startswith(b"HTTP/"):
        return f"an HTTP server answers there (it sent {data!r})"
    if len(data) >= 8:
        (total,) = struct.unpack("<Q", data[:8])
        nframes = struct.unpack("<Q", data[8:16])[0] if len(data) >= 16 else 1
        if 0 < total <= _GREETING_MAX and 0 < nframes <= 1024 and 8 * (nframes + 1) <= total:
            return None
    return f"it sent {data!r}, not a Dask handshake"
