"""Running on Dask: the SuperBatch graph, the run loop and its units, writing and committing SuperBatches, worker plugins, clusters (local, HPC) and calibration."""
