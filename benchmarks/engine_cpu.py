"""Time ``TransformerEngine.encode`` against ``SentenceTransformer.encode`` on the same texts.

Usage::

    python -m benchmarks.engine_cpu [--n 3000] [--model packaged|tiny] [--real] [--repeats 3]
                                    [--max-tokens 2048[,4096,...]] [--threads N]
                                    [--out benchmarks/results/engine_cpu.json]

``--real`` encodes real text (docstring paragraphs of installed packages, ``_realtext.py``)
instead of :func:`dask_surge.testing.make_texts`. Runs are interleaved (ST, engine(s), ST,
engine(s), ...) and the median of the repeats is reported. Several ``--max-tokens`` values tune the micro-batch budget
in one run. The JSON holds the machine facts and the exact command line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dask_surge.engine.transformer import TransformerEngine
from dask_surge.testing import make_texts, make_tiny_model, packaged_model_dir

from . import _results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=3000, help="number of texts (default 3000)")
    parser.add_argument("--model", choices=("packaged", "tiny"), default="packaged")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="SentenceTransformer.encode batch_size")
    parser.add_argument(
        "--max-tokens", default="auto", help="engine token budget(s), comma-separated, or 'auto'"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--real", action="store_true", help="real text (docstring paragraphs) instead of make_texts"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--out", default="benchmarks/results/engine_cpu.json")
    args = parser.parse_args(argv)

    from sentence_transformers import SentenceTransformer

    if args.threads:
        torch.set_num_threads(args.threads)

    path = (
        packaged_model_dir()
        if args.model == "packaged"
        else make_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
    )
    model = SentenceTransformer(str(path), device="cpu")
    budgets = [None if b == "auto" else int(b) for b in args.max_tokens.split(",")]
    engines = {}
    for b in budgets:
        engine = TransformerEngine.from_sentence_transformer(model, max_tokens=b)
        engines[f"engine[max_tokens={engine.max_tokens}]"] = engine
    if args.real:
        from ._realtext import docstring_paragraphs

        texts = docstring_paragraphs(args.n)
    else:
        texts = make_texts(args.n, seed=args.seed)
    runners = {"st": lambda t: model.encode(t, batch_size=args.batch_size, convert_to_numpy=True)}
    runners |= {name: e.encode for name, e in engines.items()}

    for run in runners.values():  # warm up allocators and thread pools
        run(texts[:64])
    load_before = os.getloadavg()
    seconds = {name: [] for name in runners}
    outputs = {}
    for _ in range(args.repeats):
        for name, run in runners.items():
            t0 = time.perf_counter()
            outputs[name] = run(texts)
            seconds[name].append(time.perf_counter() - t0)

    ref = outputs["st"]
    report = _results.new_report(__spec__.name, argv, args)
    report["machine"].update(torch_threads=torch.get_num_threads(), loadavg_start=list(load_before))
    report["summary"] = {
        "model": args.model,
        "n_texts": len(texts),
        "n_tokens": int(next(iter(engines.values())).count_tokens(texts).sum()),
    }
    st_rate = len(texts) / statistics.median(seconds["st"])
    for name, secs in seconds.items():
        rate = len(texts) / statistics.median(secs)
        emb = outputs[name]
        cos = (ref * emb).sum(1) / (np.linalg.norm(ref, axis=1) * np.linalg.norm(emb, axis=1))
        report["results"].append(
            {
                "runner": name,
                "seconds": secs,
                "texts_per_s": rate,
                "speedup_vs_st": rate / st_rate,
                "paired_speedups": [st / s for st, s in zip(seconds["st"], secs)],
                "min_cosine_vs_st": float(cos.min()),
            }
        )
        print(f"{name:28s} {rate:9.1f} texts/s  x{rate / st_rate:5.2f}  min cos {cos.min():.7f}")
    print(f"wrote {args.out}")
    return _results.save(report, args.out)


if __name__ == "__main__":
    main()
