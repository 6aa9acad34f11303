"""The paper's figure scripts: ``python -m benchmarks.paper.run`` (SURGE against the baselines,
Fig. 1, 5, 8, 10; methods in ``_methods``) and ``python -m benchmarks.paper.costmodel_accuracy``.
"""
