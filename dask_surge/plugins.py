"""Dask worker plugins: load the encoder once per worker process."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading

from distributed.diagnostics.plugin import WorkerPlugin

from .encoders import Encoder, install_object

__all__ = ["EncoderPlugin", "register_encoder"]

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

    Examples
    --------
    >>> from distributed import Client                          # doctest: +SKIP
    >>> client.register_plugin(EncoderPlugin(Encoder("default")))  # doctest: +SKIP
    """

    def __init__(self, encoder: Encoder, *, preload: bool = True, background: bool = False) -> None:
        self.encoder = encoder
        self.obj = encoder.source_object
        self.preload = preload
        self.background = background
        self.name = "dask-surge-encoder-" + hashlib.sha1(repr(encoder.spec).encode()).hexdigest()[:12]

    async def setup(self, worker) -> None:
        """Install an in-memory model in this worker process and, with ``preload``, load the model.

        Loading runs in a thread: it takes seconds (12-16 s seen on a loaded machine), during
        which a worker whose event loop were blocked would miss heartbeats and look dead.
        """
        if self.obj is not None:
            install_object(self.encoder.spec.source, self.obj)
        if not self.preload:
            return
        if self.background:
            threading.Thread(target=self._load, args=(worker.address, False), name="surge-preload",
                             daemon=True).start()
        else:
            await asyncio.to_thread(self._load, worker.address, True)

    def _load(self, address: str, strict: bool) -> None:
        try:
            self.encoder.load()
        except Exception as err:
            if strict:
                raise
            # measured: loading MiniLM took 6.5 s of a cold 2-core worker; the first task loads again
            logger.warning("dask-surge: preloading %r on %s failed (%s: %s); the first SuperBatch "
                           "that needs it loads it again and reports the error", self.encoder, address,
                           type(err).__name__, err)
            return
        logger.info("dask-surge: %r loaded on %s", self.encoder, address)


def register_encoder(client, encoder: Encoder, *, preload: bool = True, background: bool = False) -> None:
    """Register :class:`EncoderPlugin` for ``encoder`` on ``client``'s workers (idempotent)."""
    client.register_plugin(EncoderPlugin(encoder, preload=preload, background=background))
