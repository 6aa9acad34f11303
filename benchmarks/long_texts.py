"""Long texts (issue 24): chunk mode's speed against truncate mode on the same tokens, and peak memory
of one huge document in chunk mode.

Usage::

    python -m benchmarks.long_texts [--docs 30] [--repeats 3] [--sizes-mb 1 10 50]
                                    [--out benchmarks/results/long_texts.json]

Speed, side by side in one process, alternating (ABAB...), with the packaged all-MiniLM-L6-v2
on the CPU: ``--docs`` real documents (README texts of installed packages,
:func:`dask_surge.testing.package_documents`, at least 2,000 characters) encoded with
``long_texts="chunk"`` (one tokenization, windows cut on the token ids), against the
windows' own texts (``text[char_start:char_end]``, each within the window) encoded with
``long_texts="truncate"``: the same tokens through the same engine, so the ratio of tokens/s
is what chunking costs (target: within 10%); then the same with a no-op forward, the host sides alone.

Memory, each size in a fresh process: one document of ``--sizes-mb`` MB (the same real texts,
repeated) in one partition, ``dask_surge.encode(..., long_texts="chunk", scheduler="sync")``
with MiniLM's forward replaced by zeros (``benchmarks/_noop_forward.py``: the host side,
whose memory this is about; the forward's working set is the same per micro-batch); reported
is the process's peak RSS while it encodes (sampled every 10 ms) above its RSS just before (imports,
model, a warm-up encode and the input itself already in memory), beside the
same for 16,384 short texts (a CPU SuperBatch of ordinary rows at the default b_max). Bounded means flat in the
document's size.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from . import _results


def _documents(n: int) -> list[str]:
    from dask_surge.testing import package_documents

    return package_documents(n, min_chars=2000)


def chunk_throughput(
    engine: Any, docs: Sequence[str], *, chunk_overlap: int = 32
) -> dict[str, float]:  # 32: the default
    """Chunk mode's tokens/s against truncate mode's on the same tokens, in this process.

    Runs ``engine.encode_long(docs, long_texts="chunk")``, then ``engine.encode`` on the
    windows' texts (``doc[char_start:char_end]``, each within the window, so truncate mode
    runs the same tokens through the model). Tokens count what the model runs: each
    window's content, special and prompt tokens. Build the engine with
    ``benchmarks/_noop_forward.py`` patched in to compare the host sides alone (tokenize, cut, pack).

    Returns
    -------
    dict
        ``windows``, ``tokens``; ``chunk_s``, ``truncate_s`` (wall seconds),
        ``chunk_tokens_per_s``, ``truncate_tokens_per_s``, ``ratio`` (chunk over truncate);
        ``chunk_host_s``, ``truncate_host_s`` (the engine's tokenize + pack seconds).

    Examples
    --------
    >>> from dask_surge.engine.transformer import TransformerEngine
    >>> from sentence_transformers import SentenceTransformer
    >>> from dask_surge.testing import packaged_model_dir
    >>> engine = TransformerEngine.from_sentence_transformer(
    ...     SentenceTransformer(str(packaged_model_dir()), device="cpu"))
    >>> r = chunk_throughput(engine, ["a dog " * 300, "a cat"])
    >>> r["windows"], r["tokens"] > 600, r["ratio"] > 0
    (4, True, True)
    """
    docs = list(docs)

    def host() -> float:
        return engine.stats["tokenize"] + engine.stats["pack"]

    h0, t0 = host(), time.perf_counter()
    out = engine.encode_long(docs, long_texts="chunk", chunk_overlap=chunk_overlap)
    chunk_s, chunk_host = time.perf_counter() - t0, host() - h0
    w = out.windows
    assert w is not None
    spans = [docs[t][a:b] for t, a, b in zip(w.text.tolist(), w.char_start.tolist(), w.char_end.tolist())]
    cutter = engine.cutter()
    tokens = int(w.tokens.sum()) + len(w) * (len(cutter.head) + len(cutter.tail))
    h0, t0 = host(), time.perf_counter()
    engine.encode(spans)
    truncate_s, truncate_host = time.perf_counter() - t0, host() - h0
    return {
        "windows": len(w),
        "tokens": tokens,
        "chunk_s": chunk_s,
        "truncate_s": truncate_s,
        "chunk_tokens_per_s": tokens / chunk_s,
        "truncate_tokens_per_s": tokens / truncate_s,
        "ratio": truncate_s / chunk_s,
        "chunk_host_s": chunk_host,
        "truncate_host_s": truncate_host,
    }


def speed(docs: list[str], repeats: int, *, noop: bool) -> dict:
    """:func:`chunk_throughput` ``repeats`` times (each: chunk, then truncate on the
    same windows' texts); medians. ``noop``: the forward replaced by zeros, so the host sides alone."""
    import numpy as np
    from sentence_transformers import SentenceTransformer

    from dask_surge.engine.transformer import TransformerEngine
    from dask_surge.testing import packaged_model_dir

    from ._noop_forward import patch, unpatch

    engine = TransformerEngine.from_sentence_transformer(
        SentenceTransformer(str(packaged_model_dir()), device="cpu")
    )
    if noop:
        patch()
    try:
        chunk_throughput(engine, docs[:4])  # warm-up
        runs = [chunk_throughput(engine, docs) for _ in range(repeats)]
    finally:
        if noop:
            unpatch()
    med = {
        k: float(np.median([r[k] for r in runs]))
        for k in ("chunk_s", "truncate_s", "chunk_host_s", "truncate_host_s")
    }
    tokens = runs[0]["tokens"]
    return {
        "forward": "no-op" if noop else "MiniLM",
        "documents": len(docs),
        "windows": runs[0]["windows"],
        "tokens": tokens,
        **med,
        "chunk_tokens_per_s": tokens / med["chunk_s"],
        "truncate_tokens_per_s": tokens / med["truncate_s"],
        "chunk_over_truncate": med["truncate_s"] / med["chunk_s"],
        "runs": runs,
    }


_CHILD = r"""
import json, os, sys, tempfile, threading, time
import pandas as pd, dask.dataframe as dd, psutil
from benchmarks._noop_forward import patch
patch()  # the forward pass replaced by zeros: the host side, tokenize, cut, pack, frame, write
import dask_surge
from dask_surge.testing import package_documents

size_mb, kind = float(sys.argv[1]), sys.argv[2]
tmp = tempfile.mkdtemp()
docs = package_documents(200, min_chars=2000)
opts = dict(model="default", device="cpu", scheduler="sync", progress=False)
warm = dd.from_pandas(pd.DataFrame({"text": docs[:20]}), npartitions=1)
dask_surge.encode(warm, "text", output=tmp + "/warm", long_texts="chunk", **opts)
if kind == "document":
    blob, i = [], 0
    while sum(map(len, blob)) < size_mb * 1e6:
        blob.append(docs[i % len(docs)]); i += 1
    texts = ["\n\n".join(blob)[: int(size_mb * 1e6)]]
else:
    texts = [p for d in docs for p in d.split("\n\n") if len(p) > 40][:16384]  # a CPU SuperBatch (b_max)
frame = dd.from_pandas(pd.DataFrame({"text": texts}), npartitions=1)
base = psutil.Process().memory_info().rss  # the input is built: what the run adds is measured
peak, done = base, threading.Event()

def sample():
    global peak
    proc = psutil.Process()
    while not done.is_set():
        peak = max(peak, proc.memory_info().rss)
        time.sleep(0.01)

sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
t0 = time.perf_counter()
res = dask_surge.encode(frame, "text", output=tmp + "/out", long_texts="chunk", **opts)
seconds = time.perf_counter() - t0
done.set(); sampler.join()
print(json.dumps({"kind": kind, "size_mb": size_mb, "chars": sum(map(len, texts)), "texts": len(texts),
                  "windows": res.output_rows, "seconds": seconds, "rss_before": base,
                  "peak_rss": peak, "peak_above_warmup": peak - base}))
"""


def memory(size_mb: float, kind: str) -> dict:
    """Run one memory case in a fresh process and return its record."""
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(size_mb), kind],
        capture_output=True,
        text=True,
        check=False,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"memory case {kind} {size_mb} MB failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--docs", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 10, 50])
    parser.add_argument("--out", default="benchmarks/results/long_texts.json")
    args = parser.parse_args(argv)
    report = _results.new_report(__spec__.name, argv, args)
    docs = _documents(args.docs)
    speeds = {}
    for noop in (False, True):
        s = speeds[noop] = speed(docs, args.repeats, noop=noop)
        report["results"].append({"measure": "speed", **s})
        print(
            f"{s['forward']} forward: chunk {s['chunk_tokens_per_s']:,.0f} tokens/s, truncate on the same windows "
            f"{s['truncate_tokens_per_s']:,.0f} tokens/s: ratio {s['chunk_over_truncate']:.3f} "
            f"({s['windows']:,} windows of {s['documents']} documents)",
            flush=True,
        )
    short = memory(0, "short")
    report["results"].append({"measure": "memory", **short})
    print(
        f"short texts: {short['texts']:,} texts, peak +{short['peak_above_warmup'] / 2**20:.0f} MiB",
        flush=True,
    )
    for size in args.sizes_mb:
        r = memory(size, "document")
        report["results"].append({"measure": "memory", **r})
        print(
            f"one {size:g} MB document: {r['windows']:,} windows in {r['seconds']:.1f} s, "
            f"peak +{r['peak_above_warmup'] / 2**20:.0f} MiB",
            flush=True,
        )
    docs = [r for r in report["results"] if r.get("kind") == "document"]
    report["summary"] = {
        "chunk_over_truncate_tokens_per_s": speeds[False]["chunk_over_truncate"],
        "chunk_over_truncate_host_only": speeds[True]["chunk_over_truncate"],
        "target_within_10_percent": speeds[False]["chunk_over_truncate"] >= 0.9,
        "peak_above_warmup_mib": {
            f"{r['size_mb']:g} MB": round(r["peak_above_warmup"] / 2**20, 1) for r in docs
        },
        "short_texts_peak_above_warmup_mib": round(short["peak_above_warmup"] / 2**20, 1),
    }
    return _results.save(report, args.out)


if __name__ == "__main__":
    main()
