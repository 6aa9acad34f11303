"""GPU verification: dask-surge Parquet -> Parquet on a LocalCUDACluster against
sentence-transformers ``encode``, for random-weight MiniLM-L6 and BERT-base models.

Usage on the H200 GPU machine (set up as ``../shared/gpu/README.md`` says, with the
models built by ``.gpu/arch_model.py``; throughput does not depend on weight values)::

    python benchmarks/gpu_encode.py --models minilm-l6=/tmp/minilm,bert-base=/tmp/bert \\
        --out $OUT/gpu_encode.json

Try it on a CPU first (tiny sizes, a CPU LocalCluster, fp32)::

    python benchmarks/gpu_encode.py --device cpu --rows 1500 --st-rows 500 --out /tmp/gpu_encode.json

For each model, in one run: (1) ``ddf.surge.encode`` of ``--rows`` texts in log-normal
Parquet partitions (sigma 1.72) on ``dask_surge.execution.cluster.local_cluster()`` (one dask-cuda
worker per GPU), after a warm-up run that loads the model into the workers, with per-SuperBatch
encode/write seconds and worker facts (CPU affinity, backend, ``max_tokens``, weight dtype);
(2) the fast engine alone in this process on ``--st-rows`` texts, loaded as the workers load it
(``loaded_by``: dask-surge's native BERT loader for these models); (3)
``SentenceTransformer.encode`` on the same texts (fp32, and fp16 on CUDA) at
``--st-batch-size`` (1024, its best on the H200); (4) the cosine between dask-surge's output
and ST fp32 on a sample of the texts. Reported: texts/s, tokens/s
(real, unpadded tokens), the workers' peak GPU memory, TTFO, and ratios against ST in the
same run. The JSON is rewritten after every stage, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _parse_models(text: str, device: str) -> dict[str, str]:
    """``name=path,...``; without it (CPU try-out) the tiny local model."""
    if text:
        return dict(item.split("=", 1) for item in text.split(","))
    from dask_surge.testing import make_tiny_model

    return {"tiny": str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))}


def _tokens(model_path: str, texts: list[str]) -> int:
    """Real (unpadded, truncated) tokens of ``texts`` under the model's tokenizer."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(model_path, device="cpu")
    enc = st.tokenizer(texts, truncation=True, max_length=st.max_seq_length)
    return int(sum(len(ids) for ids in enc["input_ids"]))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_in_process(path: str, texts: list[str], device: str, st_batch_size: int = 1024) -> dict:
    """The fast engine alone, loaded as a Dask worker loads it (an ``Encoder`` of the path: a plain BERT
    by dask-surge's native loader), then ST encode (fp32; fp16 on CUDA) at ``st_batch_size``, in this process."""
    import torch
    from sentence_transformers import SentenceTransformer

    from dask_surge import Encoder

    out = {"st_batch_size": st_batch_size}
    with Encoder(path, device=device) as enc:
        engine = enc.engine
        out["engine_loaded_by"] = getattr(enc._loaded().impl, "loaded_by", None)
        run = engine.encode if engine is not None else enc.encode  # the fallback, where the engine refused it
        run(texts[:1024])  # warm-up (allocator, tokenizer thread pool)
        _sync(device)
        out["engine_s"] = _timed(lambda: (run(texts), _sync(device)))
        out["engine_max_tokens"] = engine.max_tokens if engine is not None else None
        engine = None  # closing the Encoder frees the half-precision copy before ST runs
    st = SentenceTransformer(path, device=device)
    st.encode(texts[:256], batch_size=st_batch_size)  # warm-up
    _sync(device)
    out["st_fp32_s"] = _timed(
        lambda: (st.encode(texts, batch_size=st_batch_size, convert_to_numpy=True), _sync(device))
    )
    if device.startswith("cuda"):
        st16 = SentenceTransformer(path, device=device, model_kwargs={"torch_dtype": torch.float16})
        st16.encode(texts[:256], batch_size=st_batch_size)
        _sync(device)
        out["st_fp16_s"] = _timed(
            lambda: (st16.encode(texts, batch_size=st_batch_size, convert_to_numpy=True), _sync(device))
        )
        del st16
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def bench_surge(path: str, data: str, rows: int, device: str, work: Path, warm: str) -> dict:
    """``ddf.surge.encode`` Parquet -> Parquet on local_cluster(); warm-up run first."""
    import dask.dataframe as dd
    from distributed import Client

    from dask_surge.execution.cluster import local_cluster

    opts = {} if device.startswith("cuda") else {"n_workers": 2, "threads_per_worker": 1}
    with local_cluster(**opts) as cluster, Client(cluster) as client:
        workers = len(client.scheduler_info(n_workers=-1)["workers"])
        kw = {"model": path, "device": device, "progress": False, "keep": ["doc_id"]}
        dd.read_parquet(warm).surge.encode("text", str(work / "warm"), **kw)  # loads the model in each worker

        def reset():
            import torch

            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()

        def peak():
            import torch

            return int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else 0

        def facts():
            import os as _os

            from dask_surge.models import cache

            engines = [v.engine for v in cache.loaded() if v.engine is not None]
            return {
                "cpu_affinity": sorted(_os.sched_getaffinity(0))
                if hasattr(_os, "sched_getaffinity")
                else None,
                "backends": sorted({v.backend for v in cache.loaded()}),
                "loaded_by": sorted({str(getattr(v.impl, "loaded_by", None)) for v in cache.loaded()}),
                "max_tokens": [e.max_tokens for e in engines],
                "devices": [str(e.device) for e in engines],
                "weights_dtype": [str(next(e.runner.hf.parameters()).dtype) for e in engines],
                "mask4d": [e.runner.mask4d for e in engines],
                "engine_stage_seconds": [dict(e.stats) for e in engines],
            }

        client.run(reset)
        res = dd.read_parquet(data).surge.encode("text", str(work / "out"), **kw)
        peaks = client.run(peak)
        worker_facts = client.run(facts)
    assert res.rows == rows, (res.rows, rows)
    return {
        "workers": workers,
        "cluster": type(cluster).__name__,
        "surge_s": res.seconds,
        "ttfo_s": res.ttfo_s,
        "superbatches": res.superbatches,
        "b_min": res.b_min,
        "b_max": res.b_max,
        "gpu_peak_bytes_per_worker": sorted(peaks.values()),
        "worker_facts": worker_facts,
        "per_superbatch": [
            {k: getattr(r, k) for k in ("sb", "rows", "encode_s", "write_s", "bytes", "engine")}
            for r in res.records
        ],
    }


def check_cosine(
    path: str, out_dir: Path, texts_by_doc: dict[int, str], device: str, sample: int = 2000
) -> float:
    """Min cosine of dask-surge's output against ST fp32 on CPU for a sample of rows."""
    from sentence_transformers import SentenceTransformer

    import dask_surge

    emb = dask_surge.read_embeddings(str(out_dir)).compute()
    rows = emb.sample(min(sample, len(emb)), random_state=0)
    st = SentenceTransformer(path, device="cpu")
    texts = [texts_by_doc[int(d)] for d in rows["doc_id"]]
    ref = st.encode(texts, batch_size=64, convert_to_numpy=True)
    got = np.stack(rows["embedding"].to_numpy()).astype(np.float32)
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    return float(cos.min())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models", default="", help="name=path,... (random-weight models built by arch_model.py)"
    )
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu to try the script")
    parser.add_argument("--rows", type=int, default=2_000_000, help="texts dask-surge encodes")
    parser.add_argument(
        "--st-rows", type=int, default=200_000, help="texts for the in-process ST/engine runs"
    )
    parser.add_argument(
        "--st-batch-size",
        type=int,
        default=1024,
        help="SentenceTransformer.encode batch_size (1024: its best on the H200)",
    )
    parser.add_argument("--partitions", type=int, default=None, help="default rows / 200")
    parser.add_argument("--sigma", type=float, default=1.72)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    from dask_surge.testing import lognormal_sizes, make_texts, write_partitioned_parquet

    work = Path(tempfile.mkdtemp(prefix="surge-gpu-"))
    partitions = args.partitions or max(20, args.rows // 200)
    sizes = lognormal_sizes(args.rows, partitions, sigma=args.sigma, seed=args.seed)
    t0 = time.perf_counter()
    write_partitioned_parquet(work / "data", sizes, seed=args.seed)
    write_partitioned_parquet(work / "warm", sizes[: min(20, len(sizes))], seed=args.seed + 1)
    import pandas as pd

    table = pd.read_parquet(work / "data")
    texts_by_doc = dict(zip(table["doc_id"].tolist(), table["text"].tolist()))
    st_texts = make_texts(args.st_rows, seed=args.seed + 7)
    report = {
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "device": args.device},
        "rows": args.rows,
        "partitions": partitions,
        "sigma": args.sigma,
        "st_rows": args.st_rows,
        "data_seconds": time.perf_counter() - t0,
        "models": {},
    }
    try:
        import torch

        report["machine"]["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        report["machine"]["torch"] = torch.__version__
    except Exception:  # noqa: BLE001 - facts only
        pass

    def save():
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2, default=str))

    for name, path in _parse_models(args.models, args.device).items():
        entry = report["models"].setdefault(name, {"path": path})
        try:
            entry["tokens_per_text_data"] = _tokens(path, table["text"].tolist()[:20_000]) / min(
                20_000, len(table)
            )
            entry["tokens_per_text_st"] = _tokens(path, st_texts[:20_000]) / min(20_000, len(st_texts))
            entry.update(
                bench_surge(path, str(work / "data"), args.rows, args.device, work / name, str(work / "warm"))
            )
            save()
            entry.update(bench_in_process(path, st_texts, args.device, args.st_batch_size))
            save()
            entry["min_cosine_vs_st_fp32"] = check_cosine(
                path, work / name / "out", texts_by_doc, args.device
            )
        except Exception:  # noqa: BLE001 - keep what was measured, say what failed
            entry["error"] = traceback.format_exc()
        for key in ("st_fp32_s", "st_fp16_s", "engine_s"):
            if key in entry:
                entry[key.replace("_s", "_texts_per_s")] = args.st_rows / entry[key]
        if "surge_s" in entry:
            entry["surge_texts_per_s"] = args.rows / entry["surge_s"]
            entry["surge_tokens_per_s"] = entry["surge_texts_per_s"] * entry["tokens_per_text_data"]
            for key in ("st_fp32", "st_fp16"):
                if f"{key}_texts_per_s" in entry:
                    entry[f"surge_vs_{key}"] = entry["surge_texts_per_s"] / entry[f"{key}_texts_per_s"]
        save()
        print(json.dumps({name: {k: v for k, v in entry.items() if k != "error"}}, indent=1, default=str))
        if "error" in entry:
            print(entry["error"], file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
