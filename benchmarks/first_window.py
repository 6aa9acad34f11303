"""A call's first window: how soon the device can start, and what the window plans cost in padding.

Usage::

    python -m benchmarks.first_window [--n 100000] [--rounds 4] [--out benchmarks/results/first_window.json]

On ``--n`` real texts (docstring paragraphs, ``_realtext.py``) tokenized with the packaged
all-MiniLM-L6-v2 tokenizer (truncation 256), for calls of 3,500 (a CPU SuperBatch of the host
ceiling run), 16,384 and 65,536 texts:

- padding ratio (padded tokens / real tokens, :func:`dask_surge.engine.batching.plan_batches`)
  at token budgets 2,048 (CPU), 16,384 and 65,536 (CUDA) for these window plans:
  ``full`` (windows of ``BLOCK_TEXTS``), ``first_then_full`` (what the engine does where the
  device overlaps tokenizing: :func:`dask_surge.engine.batching.blocks` with
  ``first=FIRST_BLOCK_TEXTS``), ``geometric_x2`` / ``x4`` / ``x8`` (2,048 texts, growing by the
  factor up to ``BLOCK_TEXTS``);
- seconds until the device can start: the engine tokenizer's time for the first window of a
  65,536-text call, ``FIRST_BLOCK_TEXTS`` texts against a full window, alternating (ABBA), on
  this machine's cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from . import _results

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def geometric(n: int, first: int, growth: int, window: int) -> list[int]:
    """Window starts: ``first`` texts, then ``growth`` times more each window, at most ``window``."""
    starts, size, at = [], first, 0
    while at < n:
        starts.append(at)
        at += min(size, window)
        size *= growth
    return starts


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default=str(_results.RESULTS / "first_window.json"))
    args = parser.parse_args(argv)

    import numpy as np
    from transformers import AutoTokenizer

    from dask_surge.engine.batching import BLOCK_TEXTS, FIRST_BLOCK_TEXTS, blocks, plan_batches
    from dask_surge.engine.tokenizing import StageClock, TextPacker
    from dask_surge.testing import packaged_model_dir

    from ._realtext import read_texts, small_files

    data, layout = small_files(args.n, max(1, args.n // 100))
    texts = read_texts(data)
    packer = TextPacker(AutoTokenizer.from_pretrained(str(packaged_model_dir())), 256, clock=StageClock())
    lengths = packer.count_tokens(texts).astype(np.int64)
    plans = {
        "full": lambda n: blocks(n),
        "first_then_full": lambda n: blocks(n, first=FIRST_BLOCK_TEXTS),
        **{
            f"geometric_x{g}": (lambda n, g=g: geometric(n, FIRST_BLOCK_TEXTS, g, BLOCK_TEXTS))
            for g in (2, 4, 8)
        },
    }
    padding: dict[str, dict[str, dict[str, float]]] = {}
    for call in [c for c in (3500, 16_384, 65_536) if c <= len(lengths)]:  # a call size needs that many texts
        for budget in (2048, 16_384, 65_536):
            row = {}
            for name, plan in plans.items():
                padded = real = 0
                for at in range(0, len(lengths) - call + 1, call):
                    x = lengths[at : at + call]
                    starts = plan(call)
                    for a, b in zip(starts, [*starts[1:], call]):
                        padded += plan_batches(x[a:b], budget).padded_tokens
                    real += int(x.sum())
                row[name] = padded / real
            padding.setdefault(str(call), {})[str(budget)] = row
    call = texts[:BLOCK_TEXTS]
    seconds: dict[str, list[float]] = {"first_window": [], "full_window": []}
    for r in range(args.rounds):
        for name in ("first_window", "full_window") if r % 2 == 0 else ("full_window", "first_window"):
            size = FIRST_BLOCK_TEXTS if name == "first_window" else BLOCK_TEXTS
            t0 = time.perf_counter()
            packer.tokenize(call[:size])
            seconds[name].append(time.perf_counter() - t0)
    start = {k: statistics.median(v) for k, v in seconds.items()}
    report = _results.new_report(__spec__.name, argv, args)
    report["results"] = [
        {"call_texts": int(call_n), "budget_tokens": int(budget), "plan": name, "padding_ratio": ratio}
        for call_n, by_budget in padding.items()
        for budget, row in by_budget.items()
        for name, ratio in row.items()
    ]
    report["summary"] = {
        "layout": layout,
        "first_window_texts": FIRST_BLOCK_TEXTS,
        "window_texts": BLOCK_TEXTS,
        "device_start_s": {
            "median": start,
            "runs": seconds,
            "ratio_first_over_full": start["first_window"] / start["full_window"],
        },
    }
    out = _results.save(report, args.out)
    for call_n, by_budget in padding.items():
        for budget, row in by_budget.items():
            print(
                f"call {call_n:>6} budget {budget:>6}: " + "  ".join(f"{k} {v:.4f}" for k, v in row.items())
            )
    print(
        f"device can start after {start['first_window']:.3f} s (first window) vs {start['full_window']:.3f} s "
        f"(full window): ratio {out['summary']['device_start_s']['ratio_first_over_full']:.3f}"
    )
    return out


if __name__ == "__main__":
    main()
