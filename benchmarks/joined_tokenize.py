"""Joined against text-by-text tokenizing: the host side of one window, side by side, in one process.

Usage::

    python -m benchmarks.joined_tokenize [--n 16384] [--rounds 6] [--group 16 64 256]
                                         [--out benchmarks/results/joined_tokenize.json]

On ``--n`` real texts (docstring paragraphs, ``_realtext.py``), with the packaged all-MiniLM-L6-v2
tokenizer as the fast engine holds it (truncation at the model's 256 tokens, padding off), each
arm turns the texts into one packed window (:meth:`~dask_surge.engine.tokenizing.TextPacker.pack`) and
frees what it made:

- ``per_text``: the Rust tokenizer's ``encode_batch`` of the texts (one ``Encoding`` per text, the
  collector paused as the engine pauses it), packed by gathering each one's ids;
- ``joined[g]``: :class:`~dask_surge.engine.joined.JoinedTokenizer` with groups of ``g`` texts (at
  most; ``auto`` is the engine's own choice), packed with NumPy.

Every arm must pack the same ids (checked each round). Reported per text, medians over rounds (the
arms alternate, in reversed order every other round): the calling thread's CPU time (about the GIL
it held: the tokenizer releases it while its own threads work), the whole process's CPU time (the
tokenizer's threads included) and wall time. The figures are ratios of arms measured in the same
rounds; the absolute times depend on the machine's load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

from . import _results

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def measure(fn: Callable[[], object]) -> tuple[tuple[float, float, float], object]:
    """``(wall, thread CPU, process CPU)`` seconds of ``fn()``, and its result."""
    w0, t0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
    out = fn()
    return (time.perf_counter() - w0, time.thread_time() - t0, time.process_time() - p0), out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=16_384)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument(
        "--group",
        nargs="*",
        default=["16", "64", "256", "auto"],
        help="texts joined at most per group, per joined arm ('auto': the engine's choice)",
    )
    parser.add_argument("--out", default=str(_results.RESULTS / "joined_tokenize.json"))
    args = parser.parse_args(argv)

    import numpy as np
    from transformers import AutoTokenizer

    from dask_surge.engine import joined as joined_module
    from dask_surge.engine.tokenizing import StageClock, TextPacker, gc_paused
    from dask_surge.engine.tokenpool import TokenizedBlock
    from dask_surge.testing import packaged_model_dir

    from ._realtext import docstring_paragraphs

    texts = docstring_paragraphs(args.n)
    hf = AutoTokenizer.from_pretrained(str(packaged_model_dir()))
    packer = TextPacker(hf, 256, clock=StageClock())
    joined = packer._joined
    assert joined is not None, "the packaged model's tokenizer should take joined texts"
    max_tokens = 2048

    def per_text() -> np.ndarray:
        with gc_paused():
            encodings = packer._encode_batch(texts)
            ids = packer.pack(encodings, 0, max_tokens=max_tokens).ids
            del encodings
        return ids

    def joined_arm(group: str) -> Callable[[], np.ndarray]:
        def run() -> np.ndarray:
            size = None if group == "auto" else int(group)
            found = joined._tokenize(*joined.groups(texts, size=size))
            assert found is not None
            return packer.pack(TokenizedBlock(*joined._cut(*found)), 0, max_tokens=max_tokens).ids

        return run

    arms: dict[str, Callable[[], np.ndarray]] = {"per_text": per_text}
    arms.update({f"joined[{g}]": joined_arm(g) for g in args.group})
    rows: dict[str, list[tuple[float, float, float]]] = {name: [] for name in arms}
    reference = per_text()
    for r in range(args.rounds):
        order = list(arms) if r % 2 == 0 else list(reversed(arms))
        for name in order:
            times, ids = measure(arms[name])
            if not np.array_equal(ids, reference):
                raise AssertionError(f"{name} packed other ids than per_text")
            rows[name].append(times)
    n = len(texts)
    report = _results.new_report(__spec__.name, argv, args)
    report["results"] = [
        {
            "arm": name,
            "texts": n,
            "rounds": len(v),
            "wall_us_per_text": statistics.median(x[0] for x in v) * 1e6 / n,
            "thread_cpu_us_per_text": statistics.median(x[1] for x in v) * 1e6 / n,
            "process_cpu_us_per_text": statistics.median(x[2] for x in v) * 1e6 / n,
        }
        for name, v in rows.items()
    ]
    by = {r["arm"]: r for r in report["results"]}
    base = by["per_text"]
    report["summary"] = {
        "texts": n,
        "mean_chars": sum(map(len, texts)) / n,
        "threads": joined_module._threads(),
        "auto_group_texts": joined.groups(texts)[0][0][1],
        "thread_cpu_over_per_text": {
            k: v["thread_cpu_us_per_text"] / base["thread_cpu_us_per_text"] for k, v in by.items()
        },
        "process_cpu_over_per_text": {
            k: v["process_cpu_us_per_text"] / base["process_cpu_us_per_text"] for k, v in by.items()
        },
        "wall_over_per_text": {k: v["wall_us_per_text"] / base["wall_us_per_text"] for k, v in by.items()},
    }
    out = _results.save(report, args.out)
    for row in report["results"]:
        print(
            f"{row['arm']:>12}  thread {row['thread_cpu_us_per_text']:6.2f}  process "
            f"{row['process_cpu_us_per_text']:6.2f}  wall {row['wall_us_per_text']:6.2f} us/text"
        )
    print(f"saved {args.out}")
    return report


if __name__ == "__main__":
    main()
