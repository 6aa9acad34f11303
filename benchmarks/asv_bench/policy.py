"""The SuperBatch policy over 10^5 partitions (pure Python, no I/O): the whole plan at
once (``plan_superbatches``, with and without a byte cap) and the streaming planner."""

from __future__ import annotations

import numpy as np

import dask_surge


class Policy:
    """The pure SuperBatch policy over ``partitions`` log-normal sizes (mean 100 rows,
    sigma 1.72), b_min 20,000, b_max 80,000 (the CPU suite's thresholds)."""

    params = [100_000]
    param_names = ["partitions"]
    timeout = 120

    def setup(self, partitions):
        sizes = np.random.default_rng(0).lognormal(0.0, 1.72, partitions)
        self.sizes = [int(s) for s in np.maximum(1, np.round(sizes * 100 / sizes.mean()))]
        self.nbytes = [s * 120 for s in self.sizes]

    def time_plan_superbatches(self, partitions):
        dask_surge.plan_superbatches(self.sizes, 20_000, 80_000)

    def time_plan_superbatches_max_bytes(self, partitions):
        dask_surge.plan_superbatches(self.sizes, 20_000, 80_000, nbytes=self.nbytes, max_bytes=4_000_000)

    def time_online_planner(self, partitions):
        planner = dask_surge.OnlinePlanner(20_000, 80_000)
        for size in self.sizes:
            planner.push(size)
        planner.finish()

    def track_superbatches(self, partitions):
        return len(dask_surge.plan_superbatches(self.sizes, 20_000, 80_000))

    track_superbatches.unit = "SuperBatches"
