"""The engine: what runs a model once it is loaded, on the host and on the device.

Two halves, kept apart by an import-linter contract (``pyproject.toml``): the host side
tokenizes and never imports torch (:mod:`~dask_surge.engine.batching`, the micro-batching
rule; :mod:`~dask_surge.engine.tokenizing`, :mod:`~dask_surge.engine.joined`,
:mod:`~dask_surge.engine.tokenpool`, :mod:`~dask_surge.engine.bert_tokenizer`,
:mod:`~dask_surge.engine.long_texts`, :mod:`~dask_surge.engine.prompts`); the device side
runs the forward pass (:mod:`~dask_surge.engine.forward`, :mod:`~dask_surge.engine.bert`,
:mod:`~dask_surge.engine.placement`). :mod:`~dask_surge.engine.loading` loads a plain
model from its files, :mod:`~dask_surge.engine.transformer` joins the two halves, and
:mod:`~dask_surge.engine.backends` puts every way of encoding behind one protocol.

What a user names and holds (the :class:`~dask_surge.Encoder` handle, Hub resolution, model
identity) is in :mod:`dask_surge.models`, one layer up.
"""
