"""What a run says when it stops: the error a user reads for what stopped it (what is kept, and
how to go on), and the words of an interrupted run."""

from __future__ import annotations

import logging

from ..engine.tokenizing import LONE_SURROGATE
from ..errors import SurgeError, SurgeInputError
from ..io.manifest import Manifest
from .scheduling import NoWorkersLeft

__all__ = ["stopped_error", "not_utf8", "interrupted"]

logger = logging.getLogger(__name__)


def stopped_error(err: BaseException, manifest: Manifest, column: str) -> BaseException | None:
    """The error to raise for a run that stopped on ``err``: what is kept and how to go on
    (``None``: raise ``err`` as it is)."""
    kept = f"{len(manifest.committed())} SuperBatches are committed and kept"
    if isinstance(err, (UnicodeDecodeError, UnicodeEncodeError)):
        return not_utf8(column, err, kept)
    if isinstance(err, SurgeInputError) and "on_null=" in str(err):  # a null text (superbatch.texts_of)
        return SurgeInputError(
            f"{err} {kept}: a rerun with on_null='empty' or on_null='skip' resumes from them (on_null is not "
            "part of the run's identity); a cleaned column is another input, a new run (write it to a new "
            "output, or pass overwrite=True)."
        )
    if isinstance(err, NoWorkersLeft):
        return SurgeError(
            f"{err}: workers were killed or exited (jobs preempted, cancelled or out of walltime; a crash, "
            "e.g. out of memory), or closed because they could not unpickle a task (their logs then say "
            "'Failed to deserialize', e.g. ModuleNotFoundError: a function of the input defined in a module "
            f"the workers cannot import). {kept}. Fix: see the workers' logs; move such functions into a "
            "module installed on the workers; start workers again (cluster.scale(n), or cluster.adapt(...) "
            "to replace lost jobs), then rerun the same call to resume (surge.no-workers-timeout=None "
            "waits for workers instead)."
        )
    if type(err).__name__ in ("NoWorkerError", "NoValidWorkerError"):
        return SurgeError(
            f"no worker was left to run the SuperBatches ({err}): jobs preempted, cancelled or out of "
            f"walltime, for longer than distributed.scheduler.no-workers-timeout. {kept}. Fix: start "
            "workers again (e.g. cluster.scale(jobs=n), or cluster.adapt(...) to replace lost jobs), then "
            "rerun the same call to resume."
        )
    if type(err).__name__ == "KilledWorker":
        return SurgeError(
            f"a SuperBatch task killed its worker repeatedly ({err}); the usual cause is running "
            f"out of memory. {kept}. Fix: lower b_min/b_max (or max_bytes for huge texts, or max_tokens), "
            "give workers more memory, then rerun the same call to resume."
        )
    return None


def not_utf8(column: str, err: UnicodeDecodeError | UnicodeEncodeError, kept: str) -> SurgeInputError:
    """The error for a text column that is not UTF-8: bytes that do not decode, or (converting
    Python strings to Arrow) a str with a lone surrogate, which has no UTF-8 form."""
    if isinstance(err, UnicodeEncodeError):
        return SurgeInputError(
            f"the text column {column!r} holds a str with a lone surrogate ({err}), {LONE_SURROGATE} "
            f"{kept}; rerun once it is fixed."
        )
    return SurgeInputError(
        f"the text column {column!r} holds bytes that are not valid UTF-8 ({err}). {kept}. Fix: decode "
        "the column yourself first, e.g. .map(lambda b: b.decode('utf-8', errors='replace')), then rerun."
    )


def interrupted(manifest: Manifest, output: str, planned: int | None) -> None:
    of = f" of {planned}" if planned is not None else ""
    logger.warning(
        "dask-surge: interrupted; %d%s SuperBatches are committed in %s and kept. "
        "Rerun the same call to resume from there.",
        len(manifest.committed()),
        of,
        output,
    )
