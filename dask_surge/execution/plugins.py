"""Dask worker plugins: load the encoder once per worker process, and set its thread pools.

A guest on the user's cluster: what a plugin changes in a worker process (``TOKENIZERS_PARALLELISM``,
``RAYON_NUM_THREADS``, Arrow's thread pools, the tuning flags the garbage collector and profiler
pauses read) is restored when the last of dask-surge's plugins leaves that process, and a written run
ends by unregistering its plugin (:func:`registered`) unless ``surge.keep-model`` keeps the model
loaded (``docs/tuning.md``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import socket
import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

from dask.base import tokenize
from distributed.comm import get_address_host
from distributed.diagnostics.plugin import WorkerPlugin

from .. import config
from ..engine import tuning
from ..engine.placement import default_device
from ..models.encoders import Encoder
from ..models.registry import install_object, uninstall_object

__all__ = [
    "EncoderPlugin",
    "configure_worker_threads",
    "finish_run",
    "hold_worker_settings",
    "register_encoder",
    "registered",
    "release_encoders",
    "release_worker_settings",
    "plugin_name",
    "models_ready",
    "share_tokenizer_cores",
    "tokenizer_threads",
    "workers_by_host",
]

logger = logging.getLogger(__name__)


class EncoderPlugin(WorkerPlugin):
    """Ship an encoder to every worker once and load it in ``setup``.

    A path-based encoder travels as its path; an in-memory model (a loaded
    ``SentenceTransformer`` or a callable) is pickled once per worker here,
    never once per task.

    Parameters
    ----------
    encoder : Encoder
    preload : bool
        Load the model during ``setup`` so the first SuperBatch does not pay for it.
    background : bool
        Preload in a thread of its own and return from ``setup`` at once, so the
        client goes on planning (reading footers, building the graph) while every
        worker loads; a task that needs the model meanwhile waits for that load, and
        a load that fails is retried, and its error raised, by the first task.
        False (default) returns once the model is loaded.
    host_workers : dict of str to int, optional
        Worker processes per host (:func:`workers_by_host`, counted by the client when it
        registers the plugin). Can be a mapping, or None to leave the Rust tokenizer's
        thread pool at every core. A worker that encodes on the CPU, in a process of
        its own, sizes that pool to its share of its host's cores before it loads
        (:func:`share_tokenizer_cores`).

    Examples
    --------
    >>> from distributed import Client                          # doctest: +SKIP
    >>> client.register_plugin(EncoderPlugin(Encoder("default")))  # doctest: +SKIP
    """

    def __init__(
        self,
        encoder: Encoder,
        *,
        preload: bool = True,
        background: bool = False,
        host_workers: Mapping[str, int] | None = None,
    ) -> None:
        self.encoder = encoder
        self.obj = encoder.source_object
        self.preload = preload
        self.background = background
        self.host_workers = dict(host_workers or {})
        # a worker in the client's own process shares the user's thread pools: left alone
        self.client_process = (socket.gethostname(), os.getpid())
        # the spec's repr hides credentials; its token does not (two tokens: two plugins)
        self.name = plugin_name(encoder)

    async def setup(self, worker) -> None:
        """Install an in-memory model in this worker process and, with ``preload``, load the model.

        First, in a worker process of its own only, the thread pools (:func:`hold_worker_settings`,
        restored when the last plugin leaves this process) and the process-wide tuning settings for
        the worker's device (``surge.tuning.*``, :mod:`dask_surge.engine.tuning`).
        Loading runs in a thread: it takes seconds, during which a worker whose event loop were
        blocked would miss heartbeats and look dead.
        """
        if self._own_process():  # the user's own process (an in-process worker) keeps its pools
            hold_worker_settings((id(worker), self.name))
        self._tune()
        if self.obj is not None:
            install_object(self.encoder.spec.source, self.obj)
        if not self.preload:
            return
        self._share_cores(worker.address)  # before the load: no task can tokenize before the model is there
        if self.background:
            threading.Thread(
                target=self._load, args=(worker.address, False), name="surge-preload", daemon=True
            ).start()
        else:
            await asyncio.to_thread(self._load, worker.address, True)

    def teardown(self, worker) -> None:
        """Restore what this plugin changed in the process (:func:`release_worker_settings`, at once)
        and release the model it loaded, unless the same plugin is registered again.

        Releasing closes the encoder (:meth:`Encoder.close`: the engine's feeder thread, its
        pinned staging buffer, the model's weights, torch's CUDA cache) and, in a worker
        process the model was shipped to, forgets the in-memory model this plugin installed
        (in the client's own process it is the caller's object, and stays).

        Registering a plugin under a name already taken tears the old one down first, and
        every ``ddf.surge.encode`` registers its encoder: so the release waits one turn of
        the worker's event loop and is skipped when a plugin of this name is back by then
        (the next run keeps the loaded model).
        """
        release_worker_settings((id(worker), self.name))
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # called outside an event loop: nothing can replace it
            self._release(worker)
            return
        loop.call_soon(self._release_unless_replaced, worker)

    def _release_unless_replaced(self, worker) -> None:
        if self.name in getattr(worker, "plugins", {}):
            return
        self._release(worker)
        logger.info("dask-surge: %r released on %s", self.encoder, getattr(worker, "address", "?"))

    def _release(self, worker) -> None:
        self.encoder.close()
        token = self.encoder.spec.source
        # a token names the process that made it (obj-<pid>-...): elsewhere the object came with a plugin,
        # and goes when no plugin still registered here (another option set of the same model) needs it
        others = [
            p
            for p in getattr(worker, "plugins", {}).values()
            if isinstance(p, EncoderPlugin) and p is not self and p.encoder.spec.source == token
        ]
        if self.obj is not None and not others and not token.startswith(f"obj-{os.getpid()}-"):
            uninstall_object(token)

    def _load(self, address: str, strict: bool) -> None:
        try:
            self.encoder.load()
        except Exception as err:
            if strict:
                raise
            logger.warning(
                "dask-surge: preloading %r on %s failed (%s: %s); the first SuperBatch "
                "that needs it loads it again and reports the error",
                self.encoder,
                address,
                type(err).__name__,
                err,
            )
            return
        logger.info("dask-surge: %r loaded on %s", self.encoder, address)

    def _own_process(self) -> bool:
        """True in a worker process of its own; False in the client's (a user's process keeps its state)."""
        return (socket.gethostname(), os.getpid()) != self.client_process

    def _tune(self) -> None:
        """Apply the process-wide tuning settings (:func:`dask_surge.engine.tuning.apply_worker`) for this
        worker's device, in a worker process of its own only."""
        if self._own_process():
            applied = tuning.apply_worker(self.encoder.spec.device or default_device())
            logger.debug("dask-surge: tuning settings applied in this worker: %s", applied)

    def _share_cores(self, address: str) -> None:
        """:func:`share_tokenizer_cores` in a worker process of its own where ``surge.tuning.rayon-threads``
        is on (a CPU worker, unless forced)."""
        if not self.host_workers or not self._own_process() or not tuning.active("rayon-threads"):
            return
        workers = self.host_workers.get(get_address_host(address), 0)
        threads = share_tokenizer_cores(workers)  # None for a host of one worker, or one not counted
        if threads is not None:
            logger.info(
                "dask-surge: the tokenizer's thread pool on %s: %d threads (%d workers on its host)",
                address,
                threads,
                workers,
            )


def plugin_name(encoder: Encoder) -> str:
    """The name :class:`EncoderPlugin` registers ``encoder`` under on every worker."""
    return "dask-surge-encoder-" + hashlib.sha1(tokenize(encoder.spec).encode()).hexdigest()[:12]


def _model_loaded(name: str, dask_worker=None) -> bool:
    """On a worker (through ``Client.run``): is the model of plugin ``name`` loaded in this process?"""
    plugin = getattr(dask_worker, "plugins", {}).get(name)
    return isinstance(plugin, EncoderPlugin) and plugin.encoder.is_loaded


def models_ready(client, encoder: Encoder) -> tuple[int, int]:
    """``(workers whose model of `encoder` is loaded, workers)`` on ``client``'s cluster.

    The plugin loads in the background (see :class:`EncoderPlugin`); the client's
    progress asks this every half second until every worker is ready.
    """
    states = client.run(_model_loaded, plugin_name(encoder), on_error="return")
    return sum(1 for v in states.values() if v is True), len(states)


def _affinity_cores() -> int:
    """The cores this process may run on (its CPU affinity; the machine's cores where there is none).

    Examples
    --------
    >>> _affinity_cores() >= 1
    True
    """
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def configure_worker_threads(*, cpus: int | None = None) -> dict:
    """Set the tokenizer's and Arrow's thread pools of this (worker) process explicitly.

    A Dask nanny starts its worker with ``OMP_NUM_THREADS=1``, which Arrow reads as its
    CPU thread count, so Parquet decoding in a worker ran on one thread; and the Rust
    tokenizer turns its parallelism off for good in a process forked after it ran in
    parallel, unless ``TOKENIZERS_PARALLELISM`` is set. This sets
    ``TOKENIZERS_PARALLELISM=true`` unless the user set it, Arrow's CPU pool to the
    cores this process may run on, and Arrow's I/O pool to at least 8 threads (Arrow's
    own default). torch's thread count is left to the cluster (one per worker on CPU).

    Parameters
    ----------
    cpus : int, optional
        Arrow CPU threads; default: the cores in this process's CPU affinity.

    Returns
    -------
    dict
        What the process now uses: ``tokenizers_parallelism``, ``arrow_cpu_count``,
        ``arrow_io_thread_count``.

    Examples
    --------
    >>> configure_worker_threads()  # in a worker: EncoderPlugin.setup calls it  # doctest: +SKIP
    {'tokenizers_parallelism': 'true', 'arrow_cpu_count': 16, 'arrow_io_thread_count': 16}
    """
    import pyarrow as pa

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    if cpus is None:
        cpus = _affinity_cores()
    cpus = max(1, int(cpus))
    pa.set_cpu_count(cpus)
    pa.set_io_thread_count(max(8, cpus))
    return {
        "tokenizers_parallelism": os.environ["TOKENIZERS_PARALLELISM"],
        "arrow_cpu_count": pa.cpu_count(),
        "arrow_io_thread_count": pa.io_thread_count(),
    }


#: the environment variables a plugin may set in its worker process, restored when the last one leaves
_ENV = ("TOKENIZERS_PARALLELISM", "RAYON_NUM_THREADS")
_settings_lock = threading.Lock()
#: (id(worker), plugin name) of the plugins of this process that hold its settings
_holders: set[tuple[int, str]] = set()
#: the process's settings before the first of them changed any: restored when the last one leaves
_before: dict[str, Any] = {}


def _arrow_pools() -> tuple[int, int]:
    import pyarrow as pa

    return pa.cpu_count(), pa.io_thread_count()


def hold_worker_settings(holder: tuple[int, str]) -> dict:
    """Set this process's thread pools for a worker plugin (:func:`configure_worker_threads`), saving
    first, when no other plugin holds them, what they were: :func:`release_worker_settings` restores them.

    Parameters
    ----------
    holder : tuple
        ``(id(worker), plugin name)``: each plugin on each worker of the process holds them once.

    Returns
    -------
    dict
        What :func:`configure_worker_threads` set.
    """
    with _settings_lock:
        if not _holders:
            _before.clear()
            _before.update(env={k: os.environ.get(k) for k in _ENV}, arrow=_arrow_pools())
        _holders.add(holder)
        return configure_worker_threads()


def release_worker_settings(holder: tuple[int, str]) -> bool:
    """Let go of what ``holder`` holds (:func:`hold_worker_settings`); the last holder of the process
    puts its environment variables and Arrow's thread pools back as they were, and turns off the
    tuning settings the plugin recorded (:func:`dask_surge.engine.tuning.release_worker`; the
    allocator, which cannot be undone, applies only on dedicated workers).

    Returns
    -------
    bool
        True when this restored the process's settings (``holder`` was the last).

    Examples
    --------
    >>> saved = os.environ.pop("TOKENIZERS_PARALLELISM", None)
    >>> _ = hold_worker_settings((0, "a")), hold_worker_settings((0, "b"))
    >>> os.environ["TOKENIZERS_PARALLELISM"]
    'true'
    >>> release_worker_settings((0, "a")), release_worker_settings((0, "b")), release_worker_settings((0, "b"))
    (False, True, False)
    >>> "TOKENIZERS_PARALLELISM" in os.environ
    False
    >>> os.environ.update({"TOKENIZERS_PARALLELISM": saved} if saved is not None else {})
    """
    with _settings_lock:
        if holder not in _holders:
            return False
        _holders.discard(holder)
        if _holders or not _before:
            return False
        for key, value in _before["env"].items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        import pyarrow as pa

        cpu, io = _before["arrow"]
        pa.set_cpu_count(cpu)
        pa.set_io_thread_count(io)
        _before.clear()
        tuning.release_worker()
        return True


def tokenizer_threads(cores: int, workers: int) -> int:
    """Threads of the Rust tokenizer's pool for one of ``workers`` worker processes sharing ``cores`` cores.

    Each process's pool otherwise starts a thread per core: two workers on two cores would run
    four tokenizer threads, more CPU per text for no more texts/s (``docs/ab_studies.md``, "The
    Rust tokenizer's thread share").

    Examples
    --------
    >>> tokenizer_threads(2, 2), tokenizer_threads(16, 3), tokenizer_threads(4, 8)
    (1, 5, 1)
    """
    return max(1, int(cores) // max(1, int(workers)))


def share_tokenizer_cores(workers: int, *, cores: int | None = None) -> int | None:
    """Size this process's Rust tokenizer pool (``RAYON_NUM_THREADS``) to its share of the host's cores.

    The pool is made on the first parallel tokenization and keeps its size, so this must
    run before it; :class:`EncoderPlugin` calls it before the model loads, where the tuning
    setting ``surge.tuning.rayon-threads`` is on (a CPU worker, unless forced). A value the user
    set is kept, and so is the default when the share is every core. Other Rust libraries
    in the process that use rayon's global pool read the same variable (as Dask's nanny
    sets ``OMP_NUM_THREADS=1`` for every OpenMP library in its worker).

    Parameters
    ----------
    workers : int
        Worker processes on this host (:func:`workers_by_host`).
    cores : int, optional
        The host's cores; default: the cores in this process's CPU affinity.

    Returns
    -------
    int or None
        The threads set, or None when nothing was set.

    Examples
    --------
    >>> saved = os.environ.pop("RAYON_NUM_THREADS", None)
    >>> share_tokenizer_cores(2, cores=2), os.environ["RAYON_NUM_THREADS"]  # two workers on two cores
    (1, '1')
    >>> share_tokenizer_cores(4, cores=16)  # set already (by the user, or before): kept
    >>> os.environ["RAYON_NUM_THREADS"]
    '1'
    >>> del os.environ["RAYON_NUM_THREADS"]
    >>> share_tokenizer_cores(1, cores=16)  # one worker: every core, the default
    >>> "RAYON_NUM_THREADS" in os.environ
    False
    >>> os.environ.update({"RAYON_NUM_THREADS": saved} if saved is not None else {})
    """
    if cores is None:
        cores = _affinity_cores()
    threads = tokenizer_threads(cores, workers)
    if "RAYON_NUM_THREADS" in os.environ or threads >= cores:
        return None
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    return threads


def workers_by_host(client) -> dict[str, int]:
    """Worker processes per host on ``client``'s cluster now (workers that join later are not counted).

    Examples
    --------
    >>> workers_by_host(client)  # two local worker processes  # doctest: +SKIP
    {'127.0.0.1': 2}
    """
    hosts = Counter(w.get("host") for w in client.scheduler_info(n_workers=-1).get("workers", {}).values())
    return {h: n for h, n in hosts.items() if h}


#: (id(client), plugin name) -> the runs of this process using that plugin now (:func:`registered`)
_runs: Counter[tuple[int, str]] = Counter()
_runs_lock = threading.Lock()


def register_encoder(client, encoder: Encoder, *, preload: bool = True, background: bool = False) -> None:
    """Register :class:`EncoderPlugin` for ``encoder`` on ``client``'s workers (idempotent)."""
    client.register_plugin(
        EncoderPlugin(encoder, preload=preload, background=background, host_workers=workers_by_host(client))
    )


@contextlib.contextmanager
def registered(
    client, encoder: Encoder, *, background: bool = False, keep: bool | None = None
) -> Iterator[None]:
    """:func:`register_encoder` for the ``with`` block (a written run), then :func:`finish_run`: the
    workers are left as they were, and the model unloaded unless kept.

    Two runs of one model at once on one client share the plugin: the last to end finishes it.

    Parameters
    ----------
    keep : bool, optional
        Keep the model loaded on the workers once the block ends; None: ``surge.keep-model``.
    """
    name = plugin_name(encoder)
    with _runs_lock:
        _runs[(id(client), name)] += 1
    try:
        register_encoder(client, encoder, background=background)
        yield
    finally:
        with _runs_lock:
            _runs[(id(client), name)] -= 1
            last = _runs[(id(client), name)] <= 0
            if last:
                del _runs[(id(client), name)]
        if last:
            finish_run(client, encoder, keep=keep)


def _restore_settings(name: str, dask_worker=None) -> bool:
    """On a worker (through ``Client.run``): restore what plugin ``name`` changed in its process."""
    return release_worker_settings((id(dask_worker), name))


def finish_run(client, encoder: Encoder, *, keep: bool | None = None) -> None:
    """End a run of ``encoder`` on ``client``'s workers as a guest: each worker's environment
    variables, Arrow thread pools and tuning flags go back as they were, and unless ``keep`` the
    plugin is unregistered, so every worker closes the model (its weights, torch's CUDA cache) and a
    worker that joins later loads nothing.

    A cluster that is gone or failing leaves nothing to restore: its error is logged, not raised
    over the run's own outcome.

    Parameters
    ----------
    keep : bool, optional
        True keeps the plugin, and so the loaded model, for the next run; None: ``surge.keep-model``
        (shipped False: a GPU's memory goes back to the next step, a cuDF or cuML one, say).
    """
    keep = bool(config.get("keep-model", keep))
    name = plugin_name(encoder)
    try:
        if keep:
            client.run(_restore_settings, name, on_error="return")
        else:
            client.unregister_worker_plugin(name)
    except Exception as err:  # noqa: BLE001 - the run's own result or error is what the caller gets
        logger.warning(
            "dask-surge: could not %s on the workers (%s: %s)",
            "restore the settings" if keep else "unload the model",
            type(err).__name__,
            err,
        )


def _encoder_plugins(dask_worker=None) -> list[str]:
    """On a worker (through ``Client.run``): the names of dask-surge's encoder plugins there."""
    return [n for n, p in getattr(dask_worker, "plugins", {}).items() if isinstance(p, EncoderPlugin)]


def release_encoders(client) -> list[str]:
    """Unregister every dask-surge encoder plugin on ``client``'s workers: their models are closed and
    their settings restored. For what a written run does not end itself: a lazy frame
    (``ddf.surge.encode(column)`` with no output) keeps its model loaded for when it is computed, and a
    run with ``surge.keep-model`` keeps it for the next one.

    Returns
    -------
    list of str
        The plugin names unregistered.

    Examples
    --------
    >>> release_encoders(client)  # doctest: +SKIP
    ['dask-surge-encoder-1b2c3d4e5f60']
    """
    found = client.run(_encoder_plugins, on_error="return")
    names = sorted({n for names in found.values() if isinstance(names, list) for n in names})
    for name in names:
        client.unregister_worker_plugin(name)
    return names
