"""A model's output family, the one rule: what one text becomes, read from the model's files or object.

sentence-transformers saves the class a model is meant for in ``config_sentence_transformers.json``
(``"model_type"``): ``SparseEncoder`` (SPLADE: vocabulary weights, written as ``indices`` and
``values``), ``MultiVectorEncoder`` (late interaction, ColBERT: a vector per token, written as
``vectors`` and ``tokens``), else a dense model (a vector per text, ``embedding``). See
:mod:`dask_surge.families` for the families and :mod:`dask_surge.io.layout` for their columns.
Nothing here imports torch or sentence-transformers: a loaded object is recognised by the classes of the module it was made with.

Examples
--------
>>> from dask_surge.testing import packaged_model_dir
>>> family_of_files(packaged_model_dir())
'dense'
>>> family_of_object(lambda texts: [[0.0]] * len(texts))
'dense'
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ..families import DENSE, MULTIVECTOR, SPARSE
from .layout import read_layout

__all__ = ["MODEL_TYPES", "family_of_files", "family_of_object"]

#: sentence-transformers' model class (``model_type`` in ``config_sentence_transformers.json``) -> output family
MODEL_TYPES: dict[str, str] = {
    "SentenceTransformer": DENSE,
    "SparseEncoder": SPARSE,
    "MultiVectorEncoder": MULTIVECTOR,
}


def family_of_files(path: str | os.PathLike) -> str:
    """The output family of the model directory ``path``, from its ``config_sentence_transformers.json``
    (read once, see :func:`~dask_surge.engine.layout.read_layout`); ``"dense"`` when it names none.

    Examples
    --------
    >>> import json, tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "modules.json").write_text("[]")
    >>> _ = (d / "config_sentence_transformers.json").write_text(json.dumps({"model_type": "SparseEncoder"}))
    >>> family_of_files(d)
    'sparse'
    """
    model_type = read_layout(path).model_settings.get("model_type")
    return MODEL_TYPES.get(model_type, DENSE) if isinstance(model_type, str) else DENSE


def family_of_object(obj: Any) -> str:
    """The output family of a loaded model: a ``SparseEncoder`` or ``MultiVectorEncoder`` of
    sentence-transformers (or a subclass), else ``"dense"``.

    Examples
    --------
    >>> import tempfile
    >>> from sentence_transformers import SparseEncoder
    >>> from dask_surge.testing import make_tiny_sparse_model
    >>> family_of_object(SparseEncoder(make_tiny_sparse_model(tempfile.mkdtemp()), device="cpu"))
    'sparse'
    """
    st = sys.modules.get("sentence_transformers")  # an instance of its classes means it is imported
    if st is None:
        return DENSE
    for name, family in MODEL_TYPES.items():
        cls = getattr(st, name, None)
        if family != DENSE and isinstance(cls, type) and isinstance(obj, cls):
            return family
    return DENSE
