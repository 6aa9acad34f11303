"""Where a worker's GIL goes, per text: each host stage of one SuperBatch timed in one process.

Usage::

    python -m benchmarks.gil_stages [--n 65536] [--rounds 4] [--out benchmarks/results/gil_stages.json]

On ``--n`` real texts (docstring paragraphs, ``_realtext.py``, read back from Parquet as a worker
reads them), with the encoder's forward replaced by zeros (``benchmarks/_noop_forward.py``),
times each step a SuperBatch task takes, in this process: the read, ``texts_of`` (the list of
str), ``text_hashes``, the engine's ``encode_long`` (tokenize, pack, no-op device) split into
its parts, the output frame and the Parquet bytes. Each step reports microseconds per text of
wall time and of this thread's CPU time; for the steps that run Python (all but the Rust
tokenizer's own threads, Arrow's Parquet writer, torch's kernels) the thread's CPU time is
about the time it held the GIL. The engine's host path (tokenize, pack, free the encodings) runs
with the cyclic collector paused as the engine does and not paused, in ABBA order per round.
Rounds repeat the whole list, so every step sees the same load; medians are reported.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Callable

from . import _results

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def timed(fn: Callable[[], object]) -> tuple[float, float, object]:
    """Wall and thread-CPU seconds of ``fn()``, and its result."""
    c0, t0 = time.thread_time(), time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, time.thread_time() - c0, out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=65_536)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default=str(_results.RESULTS / "gil_stages.json"))
    args = parser.parse_args(argv)

    from ._noop_forward import patch

    patch()  # this process builds the engine: its forward pass replaced by zeros
    import dask

    # this process stands for a CPU worker, where the plugin turns the collector pause on (docs/tuning.md)
    dask.config.set({"surge.tuning.gc-pause": True})
    import numpy as np
    import pyarrow.parquet as pq

    from dask_surge.engine.joined import flat_ids
    from dask_surge.execution.superbatch import texts_of
    from dask_surge.io.hashing import text_hashes
    from dask_surge.io.partfiles import parquet_bytes, table_of
    from dask_surge.models.encoders import Encoder

    from ._realtext import small_files

    data, layout = small_files(args.n, max(1, args.n // 100))
    encoder = Encoder("default", device="cpu").load()
    engine = encoder.engine
    assert engine is not None, "the packaged model should run on the fast engine"
    packer = engine.packer
    rows: dict[str, list[tuple[float, float]]] = {}

    def note(name: str, wall: float, cpu: float) -> None:
        rows.setdefault(name, []).append((wall, cpu))

    import distributed  # noqa: F401 - a worker's heap: the collector walks it
    import pandas as pd
    import torch

    torch.set_num_threads(1)  # as in a worker (the nanny sets OMP_NUM_THREADS=1)

    from dask_surge.engine.tokenizing import gc_paused
    from dask_surge.io.arrow import embedding_array
    from dask_surge.io.hashing import hash_column
    from dask_surge.io.layout import TEXT_HASH

    def host_path(paused: bool) -> None:
        """The engine's host side of one window, with the collector paused as the engine does, or not."""
        pause = gc_paused if paused else contextlib.nullcontext
        with pause():
            w, c, enc = timed(lambda: packer._encode_batch(texts))  # text by text (not joined)
        note(f"tokenize_encode_batch[{'gc_paused' if paused else 'gc_on'}]", w, c)
        with pause():
            w, c, _ = timed(lambda: packer.pack(enc, 0, max_tokens=engine.max_tokens))  # type: ignore[arg-type]
            note(f"pack[{'gc_paused' if paused else 'gc_on'}]", w, c)
            w, c, _ = timed(lambda: enc.clear())  # type: ignore[union-attr]
            note(f"free_encodings[{'gc_paused' if paused else 'gc_on'}]", w, c)

    texts: list[str] = []
    for r in range(args.rounds):
        w, c, frame = timed(lambda: pq.read_table(str(data), columns=["text"]).to_pandas())
        note("read_parquet_to_pandas", w, c)
        w, c, got = timed(lambda: texts_of(frame["text"], 0, 0, "error"))
        note("texts_of", w, c)
        texts = got[0]  # type: ignore[index]
        w, c, hashes = timed(lambda: text_hashes(texts))
        note("text_hashes", w, c)
        for paused in (False, True) if r % 2 == 0 else (True, False):  # ABBA
            host_path(paused)
        w, c, window = timed(
            lambda: packer.tokenize(texts)
        )  # texts joined (JoinedTokenizer), as the engine does
        note("tokenize_joined", w, c)
        w, c, _ = timed(lambda: packer.pack(window, 0, max_tokens=engine.max_tokens))
        note("pack_joined", w, c)
        del window
        enc = packer._encode_batch(texts)
        w, c, _ = timed(lambda: packer.overflowed(enc))
        note("overflowed", w, c)
        lengths = np.fromiter(map(len, enc), dtype=np.int32, count=len(enc))
        w, c, _ = timed(lambda: flat_ids(enc, int(lengths.sum())))
        note("flat_ids_input_order", w, c)
        enc = []  # the encodings go before the engine runs
        w, c, long = timed(lambda: engine.encode_long(texts))
        note("engine_encode_long_total", w, c)
        emb = long.embeddings  # type: ignore[union-attr]

        def frame_of() -> pd.DataFrame:
            out = pd.DataFrame({"partition": np.zeros(len(texts), np.int64), "row": np.arange(len(texts))})
            out[TEXT_HASH] = pd.arrays.ArrowExtensionArray(hash_column(hashes))
            out["embedding"] = pd.arrays.ArrowExtensionArray(embedding_array(emb, "float32"))
            return out

        w, c, out_frame = timed(frame_of)
        note("output_frame", w, c)
        w, c, _ = timed(lambda: parquet_bytes(table_of(out_frame), np.array([len(texts)]), None))  # type: ignore[arg-type]
        note("parquet_bytes (releases the GIL in Arrow)", w, c)
    n = args.n
    import gc

    report = _results.new_report(__spec__.name, argv, args)
    report["results"] = [
        {
            "stage": name,
            "texts": n,
            "wall_us_per_text": statistics.median(x[0] for x in v) * 1e6 / n,
            "thread_cpu_us_per_text": statistics.median(x[1] for x in v) * 1e6 / n,
        }
        for name, v in rows.items()
    ]
    by = {r["stage"]: r["thread_cpu_us_per_text"] for r in report["results"]}
    paths = {
        k: sum(by[f"{s}[{k}]"] for s in ("tokenize_encode_batch", "pack", "free_encodings"))
        for k in ("gc_on", "gc_paused")
    }
    report["summary"] = {
        "layout": layout,
        "gc_tracked_objects": len(gc.get_objects()),
        "torch_threads": torch.get_num_threads(),
        "host_path_thread_cpu_us_per_text": paths,
        "host_path_paused_over_on": paths["gc_paused"] / paths["gc_on"],
    }
    out = _results.save(report, args.out)
    for r in report["results"]:
        print(
            f"{r['stage']:42s} wall {r['wall_us_per_text']:7.2f} us/text   thread cpu "
            f"{r['thread_cpu_us_per_text']:7.2f} us/text"
        )
    print(
        f"host path (tokenize + pack + free), thread CPU: {paths['gc_on']:.2f} us/text with the collector on, "
        f"{paths['gc_paused']:.2f} paused"
    )
    return out


if __name__ == "__main__":
    main()
