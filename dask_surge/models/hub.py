"""Hugging Face Hub names: resolve ``org/name`` to one snapshot of the Hub cache.

A model named as sentence-transformers users name it (``"BAAI/bge-small-en-v1.5"``,
optionally with ``revision=``) is resolved the way ``huggingface_hub`` resolves it:

* the cache is ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
  ``$XDG_CACHE_HOME/huggingface/hub`` or ``~/.cache/huggingface/hub``, read when the
  call runs (so a Dask worker started with another environment uses its own);
* the revision (default ``main``) is turned into a commit hash once, by
  :func:`huggingface_hub.resolve_revision`: online it asks the Hub, offline
  (``HF_HUB_OFFLINE=1``) it reads the cache's ``refs/`` folder;
* online, the snapshot of that commit is downloaded once (weights of other
  frameworks such as ONNX, OpenVINO, TensorFlow or Flax are skipped); a commit
  already in the cache is served from it without a download;
* offline, a model that is not in the cache raises :class:`SurgeModelError`
  naming the cache searched and how to fill it.

The commit hash is what pins the model: the encoder carries it to every
worker, which loads exactly that snapshot (from a shared cache, or downloading
it into its own), and it goes into the run's fingerprint.

Examples
--------
>>> looks_like_repo_id("BAAI/bge-small-en-v1.5"), looks_like_repo_id("./models/bge")
(True, False)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import SurgeModelError

__all__ = [
    "HubSnapshot",
    "cached_snapshot",
    "hub_cache_dir",
    "hub_offline",
    "looks_like_repo_id",
    "resolve_hub_model",
]

#: ``org/name`` as the Hub spells repo ids (one slash; letters, digits, ``-``, ``_``, ``.``).
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
#: Files a PyTorch sentence-transformers model never reads: other frameworks' weights.
_FOREIGN_WEIGHTS = (
    "onnx/*",
    "openvino/*",
    "*.onnx",
    "*.onnx_data",
    "*.h5",
    "*.msgpack",
    "*.ot",
    "*.tflite",
    "tf_model*",
    "flax_model*",
    "rust_model*",
    "coreml/*",
    "*.mlmodel",
    "*.gguf",
)
_TRUE = {"1", "ON", "YES", "TRUE"}


@dataclass(frozen=True)
class HubSnapshot:
    """One commit of a Hub model in the local cache.

    Attributes
    ----------
    repo_id : str
        ``org/name``.
    commit : str
        The 40-hex commit hash the requested revision resolved to.
    path : str
        The snapshot folder, ``<cache>/models--org--name/snapshots/<commit>``.
    """

    repo_id: str
    commit: str
    path: str


def hub_cache_dir() -> Path:
    """The Hugging Face Hub cache that ``huggingface_hub`` uses, read from the environment now.

    ``HF_HUB_CACHE`` (or the legacy ``HUGGINGFACE_HUB_CACHE``), else ``HF_HOME/hub``,
    else ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``.

    Examples
    --------
    >>> import os
    >>> from unittest import mock
    >>> with mock.patch.dict(os.environ, HF_HUB_CACHE="/shared/hf"):
    ...     str(hub_cache_dir())
    '/shared/hf'
    """
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
    )
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` is set (now, or when ``huggingface_hub`` was imported).

    Examples
    --------
    >>> import os
    >>> from unittest import mock
    >>> with mock.patch.dict(os.environ, HF_HUB_OFFLINE="1"):
    ...     hub_offline()
    True
    """
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE:
        return True
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def looks_like_repo_id(name: str) -> bool:
    """True when ``name`` is spelled like a Hub repo id, ``org/name`` (it may still not exist).

    Examples
    --------
    >>> looks_like_repo_id("intfloat/e5-small-v2"), looks_like_repo_id("/abs/path"), looks_like_repo_id("a/b/c")
    (True, False, False)
    """
    return bool(_REPO_ID.match(name)) and not name.startswith(".") and ".." not in name


def _repo_folder(cache: Path, repo_id: str) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--"))


def _is_model_folder(path: Path) -> bool:
    return any((path / name).is_file() for name in ("modules.json", "config.json"))


def cached_snapshot(
    repo_id: str, revision: str | None = None, *, cache: Path | None = None
) -> HubSnapshot | None:
    """The snapshot of ``repo_id`` at ``revision`` if the cache holds it, else None; never uses the network.

    Parameters
    ----------
    repo_id : str
    revision : str, optional
        A branch, tag or commit hash; default ``main``.
    cache : pathlib.Path, optional
        Default :func:`hub_cache_dir`.

    Returns
    -------
    HubSnapshot or None

    Examples
    --------
    >>> import tempfile, pathlib
    >>> cached_snapshot("org/absent", cache=pathlib.Path(tempfile.mkdtemp())) is None
    True
    """
    cache = hub_cache_dir() if cache is None else cache
    folder = _repo_folder(cache, repo_id)
    if revision is not None and _COMMIT.match(revision):
        commit = revision
    else:
        ref = folder / "refs" / (revision or "main")
        try:
            commit = ref.read_text().strip()
        except OSError:
            return None
    snapshot = folder / "snapshots" / commit
    return HubSnapshot(repo_id, commit, str(snapshot)) if _is_model_folder(snapshot) else None


def resolve_hub_model(repo_id: str, revision: str | None = None) -> HubSnapshot:
    """Resolve ``repo_id`` at ``revision`` to a snapshot in the local Hub cache, downloading it once if online.

    Parameters
    ----------
    repo_id : str
        ``org/name``, as on the Hub.
    revision : str, optional
        Branch, tag or commit hash (default: the repo's default branch, ``main``).

    Returns
    -------
    HubSnapshot

    Raises
    ------
    SurgeModelError
        Offline with the model (or that revision) absent from the cache; the repo
        or revision does not exist on the Hub; or the download failed.

    Examples
    --------
    >>> import os, tempfile
    >>> from unittest import mock
    >>> with mock.patch.dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=tempfile.mkdtemp()):
    ...     resolve_hub_model("org/absent")
    Traceback (most recent call last):
    ...
    dask_surge.errors.SurgeModelError: model='org/absent' is not in the Hugging Face cache ...
    """
    from huggingface_hub.errors import (
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = hub_cache_dir()
    offline = hub_offline()
    try:
        commit = _resolve_commit(repo_id, revision, cache, offline)
    except (RepositoryNotFoundError, RevisionNotFoundError) as err:
        what = f"revision {revision!r} of" if isinstance(err, RevisionNotFoundError) else "repository"
        raise SurgeModelError(
            f"model={repo_id!r}: the Hub has no {what} {repo_id!r} (or it is private or gated and no token "
            f"is set) ({type(err).__name__}). Fix: check the name on https://huggingface.co/{repo_id}, log in "
            "with `hf auth login` for a gated model, or pass a local model directory."
        ) from err
    except LookupError:
        raise _absent(repo_id, revision, cache, offline) from None
    snapshot = _repo_folder(cache, repo_id) / "snapshots" / commit
    if offline and not _is_model_folder(snapshot):
        raise _absent(repo_id, revision, cache, offline)
    if offline or (_is_model_folder(snapshot) and _has_weights(snapshot)):  # a cached commit: no download
        return HubSnapshot(repo_id, commit, str(snapshot))
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(
            repo_id,
            revision=commit,
            cache_dir=str(cache),
            ignore_patterns=list(_FOREIGN_WEIGHTS),
            library_name="dask-surge",
        )
    except LocalEntryNotFoundError:
        raise _absent(repo_id, revision, cache, True) from None
    except Exception as err:
        raise SurgeModelError(
            f"model={repo_id!r} (commit {commit}) could not be downloaded into the Hugging Face cache {cache} "
            f"({type(err).__name__}: {err}). Fix: check the network and that {cache} is writable (set "
            "HF_HOME or HF_HUB_CACHE to move it), or download it once with `hf download "
            f"{repo_id}` and run with HF_HUB_OFFLINE=1."
        ) from err
    return HubSnapshot(repo_id, commit, str(Path(path)))


def _has_weights(snapshot: Path) -> bool:
    return (
        any(snapshot.glob("*.safetensors"))
        or any(snapshot.glob("*.bin"))
        or any(snapshot.glob("*/*.safetensors"))
    )


def _resolve_commit(repo_id: str, revision: str | None, cache: Path, offline: bool) -> str:
    """The commit hash of ``revision``; LookupError when neither the Hub nor the cache can say."""
    if revision is not None and _COMMIT.match(revision):
        return revision
    try:
        from huggingface_hub import resolve_revision
        from huggingface_hub.errors import RevisionResolutionError
    except ImportError:  # pragma: no cover - huggingface_hub < 1.x: read the cache's refs ourselves
        found = cached_snapshot(repo_id, revision, cache=cache)
        if found is None:
            raise LookupError(repo_id) from None
        return found.commit
    try:
        return str(
            resolve_revision(
                repo_id, revision=revision, cache_dir=str(cache), local_files_only=offline
            ).resolved
        )
    except RevisionResolutionError:
        raise LookupError(repo_id) from None


def _absent(repo_id: str, revision: str | None, cache: Path, offline: bool) -> SurgeModelError:
    at = "" if revision is None else f" at revision {revision!r}"
    why = "HF_HUB_OFFLINE is set" if offline else "the Hub could not be reached"
    return SurgeModelError(
        f"model={repo_id!r}{at} is not in the Hugging Face cache {cache} (searched "
        f"{_repo_folder(cache, repo_id)}) and {why}, so it cannot be downloaded. Fix: download it once where "
        f"the machine is online (`hf download {repo_id}`, or SentenceTransformer({repo_id!r})) into this cache, "
        "or point HF_HOME / HF_HUB_CACHE at the cache that holds it (a shared filesystem on a cluster), or pass "
        "a local model directory."
    )
