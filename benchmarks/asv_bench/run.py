"""A small local run, end to end: ``dask_surge.encode`` of Parquet files to Parquet output
with the tiny model and ``scheduler="threads"`` (no cluster): time to first output
(``EncodeResult.ttfo_s``, the first committed SuperBatch), the whole run (4,000 texts:
texts/s = 4,000 / time), and the peak memory of a process that loads the model and runs it.
"""

from __future__ import annotations

import shutil
import tempfile

import dask.dataframe as dd

import dask_surge

# internal names in one place (see _fixtures)
from dask_surge.testing import make_texts

from ._fixtures import RUN_ROWS, setup_cache  # noqa: F401 - asv reads setup_cache from this module

B_MIN, B_MAX = 500, 2_000  # ~6 SuperBatches of the 4,000 rows in 40 files


class _Run:
    """Each call writes a fresh output directory under a scratch folder."""

    warm = True

    def setup(self, paths):
        self.input = paths["run-input"]
        self.scratch = tempfile.mkdtemp(prefix="surge-asv-")
        self.calls = 0
        self.encoder = dask_surge.Encoder(paths["tiny"], device="cpu")
        if self.warm:  # load the model into this process and warm torch up, untimed
            self.encoder.encode(make_texts(16, seed=99))

    def teardown(self, paths):
        shutil.rmtree(self.scratch, ignore_errors=True)

    def encode(self) -> dask_surge.EncodeResult:
        self.calls += 1
        result = dask_surge.encode(
            dd.read_parquet(self.input),
            "text",
            f"{self.scratch}/out-{self.calls}",
            model=self.encoder,
            b_min=B_MIN,
            b_max=B_MAX,
            scheduler="threads",
            progress=False,
        )
        assert result.rows == RUN_ROWS, result
        return result


class LocalRun(_Run):
    """``encode`` of 4,000 texts in 40 files, model loaded and warm."""

    number = 1
    repeat = (1, 5, 30.0)
    timeout = 180

    def time_encode(self, paths):
        self.encode()

    def track_ttfo_s(self, paths):
        return self.encode().ttfo_s

    track_ttfo_s.unit = "s"


class LocalRunMemory(_Run):
    """Peak resident memory of a fresh process (dask_surge imported) that loads the model
    and runs one ``encode``."""

    warm = False
    timeout = 180

    def peakmem_encode(self, paths):
        self.encode()
