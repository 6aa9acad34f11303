"""dask-surge's benchmarks, a package so that scripts import their siblings without touching
``sys.path``: run them from the repository root as modules, ``python -m benchmarks.<name>``
(the paper's figure scripts: ``python -m benchmarks.paper.<name>``). Every script saves its
JSON through ``benchmarks._results`` (one schema); the asv suite lives in ``asv_bench/``.
"""
