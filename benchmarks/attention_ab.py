"""The CPU attention of the fast engine, side by side: keys padded to a multiple of 16 against stock SDPA.

Usage::

    python -m benchmarks.attention_ab [--n 20000] [--minilm-n 1500] [--rounds 6]
                                      [--out benchmarks/results/attention_ab.json]

torch's CPU flash-attention kernel computes each row's softmax 16 floats at a time and the
rest of the row one float at a time, so a key length just short of a multiple of 16 costs
up to twice the aligned one (see :data:`dask_surge.engine.forward.CPU_KEY_MULTIPLE`). The
engine runs its CPU copy of the encoder through ``_padded_sdpa``, which pads the keys with
masked-out zeros. This script builds one engine per model, with one torch thread (as a Dask
worker on a CPU runs), and encodes the same real texts (docstring paragraphs,
``_realtext.py``) in calls of 2,857 texts (the SuperBatch size ``e2e_small_files`` sees),
alternating two arms in one process, in a rotating order each round:

- ``stock``: the engine's copy of the encoder set back to transformers' ``sdpa``;
- ``padded``: as the engine builds it.

For the narrow test encoder (``tiny``: 2 layers, 2 heads of 16, where attention is ~45% of
the forward pass) and the packaged all-MiniLM-L6-v2 (``--minilm-n`` texts; 0 skips it). Each
result holds the encode seconds and the engine's ``device`` seconds (the forward passes);
the summary gives medians, the median of the paired ratios stock/padded, and the largest
difference between the arms' embeddings.
"""

from __future__ import annotations

import argparse
import statistics
import time

from . import _results

ARMS = ("stock", "padded")
#: Texts per encode call: e2e_small_files' 60,000 texts over its 21 SuperBatches.
CALL_TEXTS = 2857


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=20_000, help="texts for the tiny encoder")
    parser.add_argument("--minilm-n", type=int, default=1500, help="texts for MiniLM (0: skip it)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", default=str(_results.RESULTS / "attention_ab.json"))
    args = parser.parse_args(argv)

    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    from dask_surge.engine import forward as device
    from dask_surge.engine.transformer import TransformerEngine
    from dask_surge.testing import packaged_model_dir

    from ._realtext import docstring_paragraphs, tiny_model

    torch.set_num_threads(1)
    tiny = tiny_model()
    suites = {"tiny": (tiny, args.n)}
    if args.minilm_n:
        suites["minilm"] = (packaged_model_dir(), args.minilm_n)
    report = _results.new_report(__spec__.name, argv, args)
    for name, (path, n) in suites.items():
        texts = docstring_paragraphs(n)
        engine = TransformerEngine.from_sentence_transformer(SentenceTransformer(str(path), device="cpu"))
        config = engine.runner.hf.config
        if config._attn_implementation != device._PADDED_SDPA:
            raise SystemExit(
                f"{name}: the engine did not take the padded attention "
                f"({config._attn_implementation!r}); nothing to compare"
            )
        implementation = {"stock": "sdpa", "padded": device._PADDED_SDPA}

        def encode(arm: str) -> tuple[np.ndarray, float, float]:
            config._attn_implementation = implementation[arm]
            forward = engine.stats["device"]
            t0 = time.perf_counter()
            out = np.concatenate([engine.encode(texts[i : i + CALL_TEXTS]) for i in range(0, n, CALL_TEXTS)])
            return out, time.perf_counter() - t0, engine.stats["device"] - forward

        outputs = {arm: encode(arm)[0] for arm in ARMS}  # warm-up, and the outputs compared
        seconds: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for r in range(args.rounds):
            for arm in ARMS[r % 2 :] + ARMS[: r % 2]:
                _, s, forward_s = encode(arm)
                seconds[arm].append(s)
                report["results"].append(
                    {"encoder": name, "arm": arm, "round": r, "n": n, "seconds": s, "device_s": forward_s}
                )
                print(
                    f"{name:6s} {arm:6s} {n / s:9,.0f} texts/s  ({s:.2f} s; forward {forward_s:.2f} s)",
                    flush=True,
                )
        paired = [a / b for a, b in zip(seconds["stock"], seconds["padded"])]
        report["summary"][name] = {
            "n": n,
            "median_seconds": {arm: statistics.median(v) for arm, v in seconds.items()},
            "paired_ratios_stock_over_padded": [round(x, 3) for x in paired],
            "speedup_padded": statistics.median(paired),
            "max_abs_difference": float(np.abs(outputs["stock"] - outputs["padded"]).max()),
        }
        print(
            f"{name:6s} padded keys: {statistics.median(paired):.2f}x stock SDPA (paired median)", flush=True
        )
    return _results.save(report, args.out)


if __name__ == "__main__":
    main()
