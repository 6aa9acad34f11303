"""Models as users name and hold them: the :class:`~dask_surge.Encoder` handle, Hub resolution,
the process-wide cache and object registry, and model identity.

The machinery that runs a loaded model is in :mod:`dask_surge.engine`.
"""
