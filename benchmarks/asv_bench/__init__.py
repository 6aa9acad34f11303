"""dask-surge's asv suite (configuration: ``benchmarks/asv.conf.json``; run asv from ``benchmarks/``).

Modules by what they measure: ``engine`` (texts/s of ``dask_surge.Encoder``), ``planning``
(Parquet footers per file, the SuperBatch policy over 10^5 partitions), ``write`` (Parquet
bytes of a SuperBatch), ``run`` (time to first output and peak memory of a local encode).
Inputs shared by several modules are built once per run by ``_fixtures.setup_cache``.
"""
