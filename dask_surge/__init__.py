"""dask-surge: SuperBatch embedding of Dask DataFrame text columns.

Importing the package registers the ``.surge`` accessor on Dask DataFrames::

    import dask_surge
    ddf.surge.encode("text", output="emb/")
"""

from . import (
    accessor,  # noqa: F401  (registers the .surge accessor)
    config,  # noqa: F401  (registers surge.* defaults in dask.config)
)
from ._version import __version__
from .api import EncodeResult, SurgePlan, encode, plan, read_embeddings, skipped_rows, status
from .errors import SurgeError, SurgeInputError, SurgeModelError, SurgeOutputError, SurgeValueError
from .models.encoders import Encoder
from .planning.policy import OnlinePlanner, SuperBatch, plan_superbatches

__all__ = [
    "__version__", "encode", "plan", "read_embeddings", "skipped_rows", "status", "Encoder", "EncodeResult", "SurgePlan",
    "OnlinePlanner", "SuperBatch", "plan_superbatches",
    "SurgeError", "SurgeInputError", "SurgeModelError", "SurgeOutputError", "SurgeValueError",
]
