"""Where a table output lives, as the table libraries want it.

The one seam between dask-surge's ``(location, storage_options)`` (fsspec style, as every
other output takes them) and the object-store options of Lance (and delta-rs), which speak
the Rust ``object_store`` crate's keys. Nothing else in :mod:`dask_surge.io.tables` reads
``storage_options``; the manifest beside the table lives in the output's
:class:`~dask_surge.io.store.OutputStore`, which this location is made from (:meth:`TableLocation.of`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ...errors import SurgeValueError
from ..store import OutputStore

__all__ = ["TableLocation", "object_store_options"]

#: fsspec/s3fs keys -> object_store keys (AWS)
_S3_KEYS = {
    "key": "aws_access_key_id",
    "secret": "aws_secret_access_key",
    "token": "aws_session_token",
    "endpoint_url": "aws_endpoint",
    "region_name": "aws_region",
}
#: environment variables object_store reads itself; named so an error can say what is missing
_SCHEMES = ("s3", "s3a", "file", "memory", "gs", "az", "abfs")


def object_store_options(url: str, storage_options: dict | None) -> dict[str, str]:
    """The ``object_store`` options (Lance's and delta-rs's ``storage_options``) for ``url``.

    Parameters
    ----------
    url : str
        The table's location: a local path or an ``s3://`` URL.
    storage_options : dict or None
        fsspec (s3fs) options: ``key``, ``secret``, ``token``, ``endpoint_url``,
        ``client_kwargs={"endpoint_url": ..., "region_name": ...}``, ``anon``.

    Returns
    -------
    dict of str to str
        Empty for a local path; for S3 the AWS keys, ``allow_http`` for an ``http://``
        endpoint, and the region (``AWS_DEFAULT_REGION``, else ``us-east-1``) when none is given.

    Examples
    --------
    >>> object_store_options("s3://b/t.lance", {"key": "k", "secret": "s",
    ...                      "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}})["allow_http"]
    'true'
    >>> object_store_options("/data/t.lance", None)
    {}
    """
    scheme = url.split("://", 1)[0] if "://" in url else "file"
    if scheme not in ("s3", "s3a"):
        return {}
    opts = dict(storage_options or {})
    flat: dict[str, Any] = {k: v for k, v in opts.items() if k != "client_kwargs"}
    flat.update(opts.get("client_kwargs") or {})
    out = {_S3_KEYS[k]: str(v) for k, v in flat.items() if k in _S3_KEYS and v is not None}
    if flat.get("anon"):
        out["aws_skip_signature"] = "true"
    endpoint = out.get("aws_endpoint") or os.environ.get("AWS_ENDPOINT_URL") or ""
    if endpoint.startswith("http://"):
        out["allow_http"] = "true"
    out.setdefault(
        "aws_region", os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    )
    return out


@dataclass(frozen=True)
class TableLocation:
    """A table output's location: the URI the table library opens, and its store options.

    Attributes
    ----------
    url : str
        As the user gave it (a local path made absolute, or ``s3://bucket/prefix``).
    storage_options : dict
        The fsspec options as given (for the manifest's filesystem).
    """

    url: str
    storage_options: dict = field(default_factory=dict, hash=False, compare=False, repr=False)

    @classmethod
    def of(cls, store: OutputStore) -> TableLocation:
        """The location of the output ``store`` (its normalised root, with its ``storage_options``)."""
        url = store.url(store.root)
        scheme = url.split("://", 1)[0] if "://" in url else "file"
        if scheme not in _SCHEMES:
            raise SurgeValueError(
                f"output={store.location!r}: a table output lives on a local or shared filesystem or on S3 "
                f"(s3://bucket/prefix); {scheme!r} is not one of them. Fix: pass a path or an s3:// URL."
            )
        return cls(url.rstrip("/") or url, dict(store.storage_options))

    def store(self) -> OutputStore:
        """The table's location as a store object (where a worker writes its data files)."""
        return OutputStore.open(self.url, self.storage_options)

    @property
    def uri(self) -> str:
        """What the table library opens (``s3a://`` spelled ``s3://``)."""
        return "s3://" + self.url.split("://", 1)[1] if self.url.startswith("s3a://") else self.url

    @property
    def options(self) -> dict[str, str]:
        """:func:`object_store_options` of this location."""
        return object_store_options(self.url, self.storage_options)

    def __reduce__(self):  # a worker gets the options it needs to write; they are never in a repr
        return (TableLocation, (self.url, self.storage_options))
