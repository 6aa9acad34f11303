"""Publishing committed files on an object store from the process that holds the run's claim."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from ..io.manifest import Manifest

__all__ = ["Publisher"]

logger = logging.getLogger(__name__)


class Publisher:
    """Publishes committed SuperBatch files on an object store as their commits reach the
    client (announced, or in a unit's reports), on one thread so that the client's event loop
    never waits on the store; the end of the run publishes whatever is left.

    ``first`` is the wall-clock time the first file became readable (None before).
    """

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self.first: float | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dask-surge-publish")
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def submit(self, sb: str, file: str) -> None:
        """Publish ``file`` of SuperBatch ``sb`` soon (once per SuperBatch)."""
        with self._lock:
            if sb in self._seen:
                return
            self._seen.add(sb)
        with contextlib.suppress(RuntimeError):  # closed: the end of the run publishes it
            self._pool.submit(self._publish, sb, file)

    def _publish(self, sb: str, file: str) -> None:
        try:
            self.manifest.publish_file(sb, file)
        except Exception as err:  # noqa: BLE001 - the end of the run (or a rerun) publishes it, or says why
            logger.warning("dask-surge: publishing %s waits for the end of the run: %s", file, err)
            return
        if self.first is None:
            self.first = time.time()

    def close(self) -> None:
        """Wait for the files submitted so far."""
        self._pool.shutdown(wait=True)
