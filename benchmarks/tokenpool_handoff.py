"""Tokenize in this process or hand texts to a spawned helper process through shared memory: the caller's GIL per text.

Usage::

    python -m benchmarks.tokenpool_handoff [--n 65536] [--rounds 4] [--out benchmarks/results/tokenpool_handoff.json]

Issue 27 item 4 offers two ways to cut a worker's GIL-holding Python per text: vectorize in
the worker, or move tokenize-and-pack into a small pool of processes that hand back int32 ids
through shared memory. This measures both host paths on the same ``--n`` real texts (docstring
paragraphs, ``_realtext.py``), alternating per round (ABBA), with the packaged
all-MiniLM-L6-v2 tokenizer (truncation 256):

- ``inprocess``: what the engine does (:meth:`dask_surge.engine.tokenizing.TextPacker.tokenize`,
  collector paused; lengths; ids into one int32 array; the encodings freed);
- ``helper``: the caller puts the texts in shared memory as an Arrow string array (offsets and
  bytes), a helper process started with ``spawn`` (a Dask worker is multithreaded: no fork)
  rebuilds the strings, tokenizes as above and writes lengths and ids into shared memory the
  caller reads without a copy.

Reported per text: the calling thread's CPU time (its GIL-holding time: all of it is Python or
runs under the GIL, but for the Rust tokenizer's own threads, which run without it), wall time,
and the process's CPU time (the helper's own CPU added for ``helper``), which is what a
2-core machine pays in throughput. Both paths must give the same ids (checked).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from multiprocessing import get_context, shared_memory

from . import _results

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

_TOKENIZER = None


def _helper_init(tokenizer_json: str, max_length: int) -> None:
    """In the helper: the tokenizer, as the engine sets it (no padding, truncation)."""
    global _TOKENIZER
    from tokenizers import Tokenizer

    _TOKENIZER = Tokenizer.from_str(tokenizer_json)
    _TOKENIZER.no_padding()
    _TOKENIZER.enable_truncation(max_length)


def _helper_tokenize(
    texts_shm: str, n: int, offsets_bytes: int, data_bytes: int, out_shm: str, out_capacity: int
) -> tuple[int, float]:
    """In the helper: texts from shared memory, their lengths then ids into ``out_shm``; (tokens, CPU s)."""
    import numpy as np
    import pyarrow as pa

    from dask_surge.engine.joined import flat_ids

    c0 = time.process_time()
    shm = shared_memory.SharedMemory(texts_shm)
    out = shared_memory.SharedMemory(out_shm)
    try:
        buf = shm.buf
        offsets = pa.py_buffer(buf[:offsets_bytes])
        data = pa.py_buffer(buf[offsets_bytes : offsets_bytes + data_bytes])
        texts = pa.Array.from_buffers(pa.large_string(), n, [None, offsets, data]).to_pylist()
        del offsets, data, buf
        gc.disable()
        try:
            encodings = _TOKENIZER.encode_batch_fast(texts)  # type: ignore[union-attr]
            lengths = np.fromiter(map(len, encodings), dtype=np.int32, count=n)
            total = int(lengths.sum())
            if 4 * (n + total) > out_capacity:
                raise ValueError(f"{total} tokens do not fit the {out_capacity:,}-byte output block")
            view = np.ndarray((n + total,), dtype=np.int32, buffer=out.buf)
            view[:n] = lengths
            view[n:] = flat_ids(encodings, total)
            del view, encodings
        finally:
            gc.enable()
        return total, time.process_time() - c0
    finally:
        shm.close()
        out.close()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=65_536)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default=str(_results.RESULTS / "tokenpool_handoff.json"))
    args = parser.parse_args(argv)

    from concurrent.futures import ProcessPoolExecutor

    import numpy as np
    import pyarrow as pa
    from transformers import AutoTokenizer

    from dask_surge.engine.joined import flat_ids
    from dask_surge.engine.tokenizing import StageClock, TextPacker, gc_paused
    from dask_surge.testing import packaged_model_dir

    from ._realtext import read_texts, small_files

    data, layout = small_files(args.n, max(1, args.n // 100))
    texts = read_texts(data)
    n = len(texts)
    hf = AutoTokenizer.from_pretrained(str(packaged_model_dir()))
    packer = TextPacker(hf, 256, clock=StageClock())

    def inprocess() -> tuple[np.ndarray, np.ndarray, float]:
        with gc_paused():
            encodings = packer._encode_batch(texts)  # text by text, as when this was measured (not joined)
            lengths = np.fromiter(map(len, encodings), dtype=np.int32, count=n)
            ids = flat_ids(encodings, int(lengths.sum()))
            del encodings
        return lengths, ids, 0.0

    pool = ProcessPoolExecutor(
        1,
        mp_context=get_context("spawn"),
        initializer=_helper_init,
        initargs=(packer._tokenizer.to_str(), 256),
    )
    capacity = 4 * (n + n * 256)
    out_shm = shared_memory.SharedMemory(create=True, size=capacity)
    in_shm = shared_memory.SharedMemory(
        create=True, size=16 * 1024 * 1024 + 8 * (n + 1) + sum(map(len, texts)) * 4
    )

    def helper() -> tuple[np.ndarray, np.ndarray, float]:
        array = pa.array(texts, pa.large_string())
        _, offsets, body = array.buffers()
        start = array.offset * 8
        offsets_bytes, data_bytes = 8 * (n + 1), body.size if body is not None else 0
        dst = np.frombuffer(in_shm.buf, dtype=np.uint8)
        dst[:offsets_bytes] = np.frombuffer(offsets, dtype=np.uint8)[start : start + offsets_bytes]
        if data_bytes:
            dst[offsets_bytes : offsets_bytes + data_bytes] = np.frombuffer(body, dtype=np.uint8)
        del dst
        total, cpu = pool.submit(
            _helper_tokenize, in_shm.name, n, offsets_bytes, data_bytes, out_shm.name, capacity
        ).result()
        view = np.ndarray((n + total,), dtype=np.int32, buffer=out_shm.buf)
        return view[:n], view[n:], cpu

    try:
        pool.submit(int).result()  # the helper is up before the clock
        ref_lengths, ref_ids, _ = inprocess()
        lengths, ids, _ = helper()
        assert np.array_equal(lengths, ref_lengths) and np.array_equal(ids, ref_ids), (
            "the helper's ids differ"
        )
        del lengths, ids
        runs: dict[str, list[dict[str, float]]] = {"inprocess": [], "helper": []}
        for r in range(args.rounds):
            for name in ("inprocess", "helper") if r % 2 == 0 else ("helper", "inprocess"):
                fn = inprocess if name == "inprocess" else helper
                c0, p0, t0 = time.thread_time(), time.process_time(), time.perf_counter()
                _, _, helper_cpu = fn()
                runs[name].append(
                    {
                        "thread_cpu_us": (time.thread_time() - c0) * 1e6 / n,
                        "wall_us": (time.perf_counter() - t0) * 1e6 / n,
                        "total_cpu_us": (time.process_time() - p0 + helper_cpu) * 1e6 / n,
                    }
                )
    finally:
        pool.shutdown()
        for shm in (in_shm, out_shm):
            shm.close()
            shm.unlink()
    medians = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
    report = _results.new_report(__spec__.name, argv, args)
    report["results"] = [
        {"path": k, "round": i, "texts": n, **r} for k, v in runs.items() for i, r in enumerate(v)
    ]
    report["summary"] = {
        "layout": layout,
        "per_text_median": medians,
        "caller_thread_helper_over_inprocess": medians["helper"]["thread_cpu_us"]
        / medians["inprocess"]["thread_cpu_us"],
        "note": "thread_cpu_us: the caller's thread (its GIL time); total_cpu_us: this process plus "
        "the helper's CPU; the Rust tokenizer's threads count in both",
    }
    _results.save(report, args.out)
    for k, m in medians.items():
        print(
            f"{k:10s} caller thread {m['thread_cpu_us']:6.2f} us/text   wall {m['wall_us']:6.2f}   "
            f"total cpu {m['total_cpu_us']:6.2f}"
        )
    return report


if __name__ == "__main__":
    main()
