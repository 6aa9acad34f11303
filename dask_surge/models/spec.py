"""What an :class:`~dask_surge.Encoder` is, as a value: a hashable, picklable spec that holds no weights.

The spec is the key of the process-wide cache of loaded models (:mod:`dask_surge.models.cache`)
and what a pickled encoder carries. ``model_kwargs`` is held frozen (:func:`freeze`), so
two encoders given equal dicts are equal, and never shown with its credentials.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import SurgeValueError
from ..fingerprint import is_secret_key, redact
from ..options import option

__all__ = ["EncoderSpec", "freeze", "thaw"]


def freeze(value: Any, key: Any = None) -> Any:
    """A hashable, order-independent copy of ``model_kwargs`` (dicts become sorted item tuples).

    Raises
    ------
    SurgeValueError
        A value that cannot be hashed (credentials shown as ``***``).

    Examples
    --------
    >>> freeze({"b": [1, 2], "a": {"c": "x"}})
    (('a', (('c', 'x'),)), ('b', (1, 2)))
    >>> thaw(freeze({"b": 1, "a": {"c": "x"}}))
    {'a': {'c': 'x'}, 'b': 1}
    """
    if isinstance(value, dict):
        return tuple(sorted((str(k), freeze(v, k)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v, key) for v in value)
    try:
        hash(value)
    except TypeError:
        shown = "***" if is_secret_key(key) else repr(value)
        raise SurgeValueError(
            f"model_kwargs holds {shown} ({type(value).__name__}), which cannot be part of a model's "
            "identity. Fix: pass plain values (str, int, float, bool, torch.dtype, lists or dicts of them)."
        ) from None
    return value


def thaw(value: Any) -> Any:
    """The dict :func:`freeze` made ``value`` from (nested ones too); anything else as it is."""
    if (
        isinstance(value, tuple)
        and all(isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str) for v in value)
        and value
    ):
        return {k: thaw(v) for k, v in value}
    return value


@dataclass(frozen=True)
class EncoderSpec:
    """Hashable, picklable description of what to load (no weights).

    Examples
    --------
    >>> spec = EncoderSpec("path", "/models/minilm", model_kwargs=freeze({"token": "hf_secret"}))
    >>> "hf_secret" in repr(spec), spec.kwargs
    (False, {'token': 'hf_secret'})
    """

    kind: str  # "path" | "object"
    source: str  # resolved path, or registry token
    # the options' defaults are declared in dask_surge.options (model_kwargs frozen to a tuple)
    device: str | None = option("device").default
    dtype: str = option("dtype").default
    engine: str = option("engine").default
    batch_size: int = option("batch_size").default
    max_tokens: int | None = option("max_tokens").default
    prompt: str | None = option("prompt").default
    prompt_name: str | None = option("prompt_name").default
    trust_remote_code: bool = option("trust_remote_code").default
    model_kwargs: tuple = field(default=())
    repo_id: str | None = None  # Hub models: the repo id and the commit every worker loads
    commit: str | None = None

    @property
    def kwargs(self) -> dict[str, Any] | None:
        """``model_kwargs`` as the dict it was given as; None when none were given."""
        kwargs = thaw(self.model_kwargs)
        return dict(kwargs) if isinstance(kwargs, Mapping) and kwargs else None

    def __repr__(self) -> str:  # model_kwargs may hold credentials (token=...): never shown
        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        shown["model_kwargs"] = redact(thaw(self.model_kwargs)) if self.model_kwargs else ()
        return f"EncoderSpec({', '.join(f'{k}={v!r}' for k, v in shown.items())})"
