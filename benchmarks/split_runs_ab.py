"""Micro-batches cut where the sorted length changes (issue 27 item 5), against the greedy cut.

Usage::

    python benchmarks/split_runs_ab.py [--n 4000] [--rounds 5] [--threads 1] [--max-tokens 2048]
                                       [--out benchmarks/results/split_runs_ab.json]

One process, one engine, the same texts (``--n`` docstring paragraphs of installed
packages, ``_realtext.py``): ``TransformerEngine.encode`` with ``split_runs=True`` (the
default: one-length micro-batches, no padding, no attention mask) and ``split_runs=False``
(the greedy cut: full micro-batches, padded, masked), alternated for ``--rounds`` rounds
after a warm-up of each. Reported: median seconds, texts/s and the ratio, with the plans'
forward passes, padded tokens and the share of micro-batches (and of texts) that run
unmasked; the embeddings of both are compared (min cosine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from _ab import script_header  # noqa: E402 - the benchmarks folder, put on the path above

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def plan_facts(lengths, max_tokens: int, split_runs: bool) -> dict:
    """Forward passes, padded tokens and unmasked share of the windows the engine plans."""
    import numpy as np

    from dask_surge.engine.batching import BLOCK_TEXTS, plan_batches

    forwards = padded = real = uniform_batches = uniform_texts = 0
    for start in range(0, len(lengths), BLOCK_TEXTS):
        plan = plan_batches(lengths[start : start + BLOCK_TEXTS], max_tokens, split_runs=split_runs)
        same = plan.uniform if split_runs else np.zeros(plan.forwards, dtype=bool)
        forwards += plan.forwards
        padded += plan.padded_tokens
        real += plan.real_tokens
        uniform_batches += int(same.sum())
        uniform_texts += int(np.diff(plan.bounds)[same].sum())
    return {
        "forwards": forwards,
        "padded_tokens": padded,
        "real_tokens": real,
        "padding_ratio": padded / real,
        "unmasked_batch_share": uniform_batches / max(forwards, 1),
        "unmasked_text_share": uniform_texts / len(lengths),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--max-tokens", type=int, default=None, help="default: the engine's (2048 on CPU)")
    parser.add_argument("--model", default=None, help="default: the packaged all-MiniLM-L6-v2")
    parser.add_argument("--out", default=str(HERE / "results" / "split_runs_ab.json"))
    args = parser.parse_args(argv)

    import numpy as np
    import torch
    from _realtext import docstring_paragraphs
    from sentence_transformers import SentenceTransformer

    from dask_surge.engine.transformer import TransformerEngine
    from dask_surge.testing import min_cosine, packaged_model_dir

    torch.set_num_threads(args.threads)
    texts = docstring_paragraphs(args.n)
    model = SentenceTransformer(args.model or str(packaged_model_dir()), device="cpu")
    engine = TransformerEngine.from_sentence_transformer(model, max_tokens=args.max_tokens)
    lengths = engine.count_tokens(texts)
    arms = {"split": True, "greedy": False}
    seconds: dict[str, list[float]] = {k: [] for k in arms}
    out: dict[str, np.ndarray] = {}
    for name, split in arms.items():  # warm-up
        engine.split_runs = split
        out[name] = engine.encode(texts[:500])
    for _ in range(args.rounds):
        for name, split in arms.items():
            engine.split_runs = split
            t0 = time.perf_counter()
            out[name] = engine.encode(texts)
            seconds[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    report = {
        **script_header(argv),
        "texts": len(texts),
        "tokens_per_text": float(lengths.mean()),
        "max_tokens": engine.max_tokens,
        "torch_threads": args.threads,
        "rounds": args.rounds,
        "seconds": seconds,
        "median_s": med,
        "texts_per_s": {k: len(texts) / v for k, v in med.items()},
        "ratio_split_over_greedy": med["greedy"] / med["split"],
        "paired_ratios": [g / s for g, s in zip(seconds["greedy"], seconds["split"])],
        "plans": {k: plan_facts(lengths, engine.max_tokens, split) for k, split in arms.items()},
        "min_cosine_split_vs_greedy": min_cosine(out["split"], out["greedy"]),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(
        json.dumps(
            {
                k: report[k]
                for k in (
                    "texts_per_s",
                    "ratio_split_over_greedy",
                    "paired_ratios",
                    "plans",
                    "min_cosine_split_vs_greedy",
                )
            },
            indent=1,
        )
    )
    return report


if __name__ == "__main__":
    main()
