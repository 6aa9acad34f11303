"""What a spec loads as: the backend that encodes with it and why, and what its files say without loading.

:func:`load` is the one place a model is loaded: an in-memory object is wrapped as it is;
a model directory of a plain layout loads straight onto the fast engine without importing
sentence-transformers (:func:`~dask_surge.engine.backends.direct_backend`), anything else
through the sentence-transformers class its files name (``SentenceTransformer``, ``SparseEncoder``
or ``MultiVectorEncoder``: :mod:`dask_surge.engine.family`). :func:`dimension_from_files`, :func:`stored_dtype` and :func:`configured_prompts` answer
from the model's files, so asking them loads nothing.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..engine.backends import Backend, choose_backend, direct_backend
from ..engine.family import MODEL_TYPES, family_of_files
from ..engine.layout import read_layout
from ..engine.placement import pick_device
from ..errors import SurgeModelError
from ..families import DENSE
from ..fingerprint import scrub
from .hub import resolve_hub_model
from .registry import installed, lookup
from .spec import EncoderSpec

__all__ = ["configured_prompts", "dimension_from_files", "load", "stored_dtype"]

logger = logging.getLogger(__name__)

#: output family -> the sentence-transformers class that loads a model of it
_MODEL_CLASSES = {family: name for name, family in MODEL_TYPES.items()}


def load(spec: EncoderSpec) -> tuple[Backend, str]:
    """The backend that encodes for ``spec`` in this process, and why that one.

    Raises
    ------
    SurgeModelError
        An in-memory model never shipped here, or a model sentence-transformers cannot load
        (credentials in ``model_kwargs`` scrubbed from the message).
    """
    if spec.kind == "object":
        return _wrap_object(lookup(spec.source), spec)
    device = pick_device(spec.device)
    source = spec.source
    if spec.repo_id is not None and not Path(source).is_dir():
        # a worker without the client's filesystem: the same commit, from (or into) its own cache
        source = resolve_hub_model(spec.repo_id, spec.commit).path
    kwargs = spec.kwargs
    family = family_of_files(source)
    direct = (
        _load_direct(spec, source, device)
        if kwargs is None and not spec.trust_remote_code and family == DENSE
        else None
    )
    if direct is not None:
        return direct
    import sentence_transformers

    cls = getattr(sentence_transformers, _MODEL_CLASSES[family], None)
    if cls is None:  # SparseEncoder came with sentence-transformers 5, MultiVectorEncoder with 6
        raise SurgeModelError(
            f"model={spec.repo_id or spec.source!r} is a {_MODEL_CLASSES[family]} ({family} output), which "
            f"sentence-transformers {sentence_transformers.__version__} does not have. Fix: pip install -U "
            f"'sentence-transformers>={'6' if family == 'multivector' else '5'}'."
        )
    try:
        model = cls(
            source,
            device=device,
            local_files_only=True,
            trust_remote_code=spec.trust_remote_code,
            model_kwargs=kwargs,
        )
    except Exception as err:
        hint = (
            ""
            if spec.trust_remote_code
            else " If the model ships its own code (auto_map in config.json), "
            "pass trust_remote_code=True, for a model you trust."
        )
        raise SurgeModelError(
            f"model={spec.repo_id or spec.source!r} could not be loaded as a sentence-transformers model "
            f"({type(err).__name__}: {scrub(str(err), kwargs)}). Fix: pass a Hub name, a directory written by "
            f"SentenceTransformer.save(), or model='default'.{hint}"
        ) from err
    return _wrap_object(model, spec)


def _load_direct(spec: EncoderSpec, source: str, device: str) -> tuple[Backend, str] | None:
    """The model of ``source`` on the fast engine, loaded without importing sentence-transformers when its
    files allow (see :func:`~dask_surge.engine.backends.direct_backend`); None to load it the usual way.

    A direct load that fails for any reason falls back to sentence-transformers (which raises the
    errors users know), so this only ever makes a load cheaper.
    """
    name = spec.repo_id or source
    try:
        return direct_backend(
            source,
            name=name,
            device=device,
            engine=spec.engine,
            dtype=spec.dtype,
            max_tokens=spec.max_tokens,
            prompt=spec.prompt,
            prompt_name=spec.prompt_name,
        )
    except Exception as err:  # noqa: BLE001 - any failure: the usual load decides, and reports its own error
        logger.info(
            "dask-surge: loading %s without sentence-transformers failed (%s: %s); loading it with "
            "sentence-transformers",
            name,
            type(err).__name__,
            scrub(str(err), spec.kwargs),
        )
        return None


def _wrap_object(obj: Any, spec: EncoderSpec) -> tuple[Backend, str]:
    """The backend that encodes with ``obj`` for ``spec``, and why (see :func:`~dask_surge.engine.backends.choose_backend`)."""
    name = spec.repo_id or (spec.source if spec.kind == "path" else type(obj).__name__)
    return choose_backend(
        obj,
        name=name,
        in_memory=spec.kind == "object",
        device=spec.device,
        engine=spec.engine,
        dtype=spec.dtype,
        max_tokens=spec.max_tokens,
        batch_size=spec.batch_size,
        prompt=spec.prompt,
        prompt_name=spec.prompt_name,
    )


def stored_dtype(spec: EncoderSpec) -> str | None:
    """The dtype a path model's weights load in, without loading it: ``model_kwargs``'s
    ``torch_dtype``/``dtype`` when it names one, else the checkpoint's ``config.json``.

    Examples
    --------
    >>> from dask_surge.testing import packaged_model_dir
    >>> from dask_surge.models.spec import freeze
    >>> stored_dtype(EncoderSpec("path", str(packaged_model_dir()))) is None   # its config.json names none
    True
    >>> stored_dtype(EncoderSpec("path", str(packaged_model_dir()), model_kwargs=freeze({"torch_dtype": "bfloat16"})))
    'bfloat16'
    """
    kwargs = spec.kwargs or {}
    for key in ("torch_dtype", "dtype"):
        asked = kwargs.get(key) if isinstance(kwargs, Mapping) else None
        if asked is not None and str(asked) != "auto":
            return str(asked).removeprefix("torch.")
    root = Path(spec.source)
    candidates = [root / "config.json", root / "_transformer" / "config.json"]
    try:
        modules = json.loads((root / "modules.json").read_text())
        for module in modules:
            if str(module.get("type", "")).endswith("Transformer"):
                where = root / module.get("path", "")
                candidates[:0] = [where / "config.json", where / "_transformer" / "config.json"]
                break
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    for path in candidates:
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        stored = config.get("torch_dtype") or config.get("dtype") if isinstance(config, dict) else None
        if stored is not None:
            return str(stored).removeprefix("torch.")
    return None


def configured_prompts(spec: EncoderSpec) -> tuple[dict[str, str], str | None] | None:
    """The model's ``(prompts, default_prompt_name)`` without loading it; None if unknown (a plain callable).

    A path model's from its ``config_sentence_transformers.json`` (none: no prompts), an in-memory
    model's from its ``prompts`` and ``default_prompt_name`` attributes.

    Examples
    --------
    >>> from dask_surge.testing import packaged_model_dir
    >>> configured_prompts(EncoderSpec("path", str(packaged_model_dir())))
    ({}, None)
    """
    if spec.kind == "path":
        try:
            config = json.loads((Path(spec.source) / "config_sentence_transformers.json").read_text())
        except (OSError, ValueError):
            config = {}
        prompts = config.get("prompts") if isinstance(config, dict) else None
        default = config.get("default_prompt_name") if isinstance(config, dict) else None
        return (dict(prompts) if isinstance(prompts, dict) else {}), default
    obj = installed(spec.source)
    if isinstance(getattr(obj, "prompts", None), dict):
        return dict(obj.prompts), getattr(obj, "default_prompt_name", None)
    return None


def dimension_from_files(path: str | os.PathLike) -> int | None:
    """Embedding size of a sentence-transformers model directory, from its config files only.

    The :attr:`~dask_surge.engine.layout.ModelLayout.dimension` of its layout, read once
    (:func:`~dask_surge.engine.layout.read_layout`): ``modules.json`` followed through a
    ``Transformer`` (``config.json``'s ``hidden_size``), ``Pooling`` (its dimension times its
    number of modes), ``Dense`` (``out_features``) and ``Normalize`` (no change). None for
    anything else (other modules, missing or unreadable files), and the caller loads the model.

    Examples
    --------
    >>> from dask_surge.testing import packaged_model_dir
    >>> dimension_from_files(packaged_model_dir())
    384
    >>> dimension_from_files("/nonexistent") is None
    True
    """
    return read_layout(path).dimension
