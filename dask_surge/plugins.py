"""Dask worker plugins: load the encoder once per worker process."""

from __future__ import annotations

import hashlib
import logging

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

    Examples
    --------
    >>> from distributed import Client                          # doctest: +SKIP
    >>> client.register_plugin(EncoderPlugin(Encoder("default")))  # doctest: +SKIP
    """

    def __init__(self, encoder: Encoder, *, preload: bool = True) -> None:
        self.encoder = encoder
        self.obj = encoder.source_object
        self.preload = preload
        self.name = "dask-surge-encoder-" + hashlib.sha1(repr(encoder.spec).encode()).hexdigest()[:12]

    async def setup(self, worker) -> None:
        """Install an in-memory model in this worker process and, with ``preload``, load the model.

        Loading runs in a thread: it takes seconds (12-16 s seen on a loaded machine), during
        which a worker whose event loop were blocked would miss heartbeats and look dead.
        """
        if self.obj is not None:
            install_object(self.encoder.spec.source, self.obj)
        if self.preload:
            import asyncio

            await asyncio.to_thread(self.encoder.load)
            logger.info("dask-surge: %r loaded on %s", self.encoder, worker.address)


def register_encoder(client, encoder: Encoder, *, preload: bool = True) -> None:
    """Register :class:`EncoderPlugin` for ``encoder`` on ``client``'s workers (idempotent)."""
    client.register_plugin(EncoderPlugin(encoder, preload=preload))
