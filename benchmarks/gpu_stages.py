"""The stages of the one-shot GPU session (issue 27), each in a forked child with its own timeout.

Run by ``benchmarks/gpu_session.sh``, which names the stages and their timeouts::

    python3 benchmarks/gpu_stages.py --stages preflight:15,data:30,... --results $OUT/results.jsonl \\
        --work /tmp/surge-gpu --minilm /tmp/minilm --bert /tmp/bert [--try]

The parent imports the heavy modules once (torch, transformers, sentence-transformers,
Dask; never CUDA) and forks one child per stage, in its own process group: a stage
that outlives its timeout is killed with everything it started (Dask workers too),
a ``timeout`` line is written for it, and the next stage runs. Every stage appends
JSON lines to ``--results`` as it measures (``status`` ``partial``), then one line
with ``status`` ``ok``, ``skipped`` (with a ``reason``) or ``error``; the parent adds
``timeout`` or ``crashed`` lines for a child that did not finish. Longer details
(per-SuperBatch records, pytest's report) go to files under ``--work/detail``, which
the shell script archives. A failed ``preflight`` stops the session with one line.

``--try`` is the CPU dry run: the same stages and the same file layout, tiny random
models, a few thousand texts, Dask workers as threads, and the timeouts scaled by
``--scale`` (the test suite runs it; see ``tests/test_gpu_session.py``).

Stages (in the order gpu_session.sh runs them: what matters most first)
------
preflight  versions, CUDA visible, free memory, fast engine chosen and which loader loaded
           the model (as a worker loads it), its mask path, pinned staging buffer in use
           (stops the session if anything is off)
data       Parquet input: log-normal partition sizes in many small files (sets A and B)
surge_minilm / surge_bert   dask-surge end to end, random-weight MiniLM-L6 on set A and
           BERT-base on set B, after a warm-up that loads the model into the workers
busy       GPU-busy fraction: CUDA events around every forward of one encode call
host       inside one Dask worker: the raw tokenizer's rate on set B's texts, and
           dask-surge end to end with a no-op forward (the host ceiling) on set B, with
           surge.tuning.tokenize-processes=2 (the token pool's arm), then 0 (the default: tokenizing
           in the worker), then with the settings measured only on a CPU forced on (CPU_TUNING; "auto" is off on a GPU)
engine     the engine alone in this process, loaded as the workers load it (length-split
           micro-batches); the model forward alone on the same
           micro-batches, pre-tokenized (the ceiling the engine is measured against); pinned
           host memory before and after more calls (bounded by the staging buffer);
           SentenceTransformer.encode (fp16, batch 1024) on the same texts; BERT-base's
           engine and forward alone
cosine     real MiniLM weights against CPU fp32 embeddings (made by gpu_prepare.py): the headline is fp16 loaded as the
           workers load it; bf16, and the engine built on sentence-transformers' load, beside it
pytest     the gpu-marked tests, on the carried fp16 MiniLM copy

Every stage's final line has ``loaded_by``: what loaded the model it timed (``"dask-surge"``,
the native BERT loader the Dask workers use for these models; ``"transformers"``;
``"sentence-transformers"``), or null for a stage that loads none (data, pytest).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault(
    "PYTORCH_NVML_BASED_CUDA_CHECK", "1"
)  # the parent must not initialise CUDA before forking

#: Texts per set at full scale (the H200) and in the dry run; set B is set A's first files.
SIZES = {
    "full": {
        "rows_a": 1_000_000,
        "b_fraction": 0.25,
        "engine_texts": 200_000,
        "st_texts": 40_000,
        "bert_texts": 40_000,
    },
    "try": {
        "rows_a": 3_000,
        "b_fraction": 0.4,
        "engine_texts": 400,
        "st_texts": 200,
        "bert_texts": 200,
    },
}

#: The model forward alone on pre-tokenized, length-sorted ids, one H200 in fp16, synthetic English-like
#: texts of about 27 tokens (the design notes' measured anchors): what the ``engine`` stage's
#: ``forward_only`` figures compare with.
FORWARD_CEILING_TEXTS_PER_S = {"minilm": 119_119, "bert": 38_307}


class Session:
    """What every stage needs: options, paths and the one results file."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.trying = args.try_run
        self.device = "cpu" if self.trying else "cuda"
        self.sizes = SIZES["try" if self.trying else "full"]
        self.work = Path(args.work)
        self.detail = self.work / "detail"
        self.detail.mkdir(parents=True, exist_ok=True)
        self.results = Path(args.results)
        self.stage = ""
        #: What loaded the model this stage times (see :func:`_encoder`); its final line says it.
        self.loaded_by: str | None = None

    def emit(self, status: str = "partial", **fields) -> None:
        """Append one JSON line for the current stage (one write: lines of stages never interleave)."""
        if status not in ("partial", "timeout", "crashed"):
            fields.setdefault(
                "loaded_by", self.loaded_by
            )  # every stage's final line says what loaded its model
        line = json.dumps(
            {"stage": self.stage, "status": status, "t": round(time.time(), 3), **fields}, default=str
        )
        fd = os.open(self.results, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        print(f"[{self.stage}] {status}: {line[:400]}", flush=True)

    def save_detail(self, name: str, obj) -> None:
        (self.detail / name).write_text(json.dumps(obj, indent=1, default=str))

    # -- models and data ----------------------------------------------------------------------------
    def model(self, which: str) -> str:
        """Path of the random-weight model for ``which`` ("minilm" or "bert"); tiny models in the dry run."""
        if self.trying:
            from dask_surge.testing import make_tiny_model

            path = self.work / f"tiny-{which}"
            if not (path / "modules.json").is_file():
                make_tiny_model(
                    path, hidden_size=32 if which == "minilm" else 48, seed=1 if which == "bert" else 0
                )
            return str(path)
        return self.args.minilm if which == "minilm" else self.args.bert

    def files(self, which: str) -> list[str]:
        listing = json.loads((self.work / "data.json").read_text())
        return listing["a"] if which == "a" else listing["b"]

    def cluster(self, threads: int | None = None, env: dict | None = None):
        """The cluster dask-surge uses by default (one dask-cuda worker per GPU); threads in the dry run."""
        from dask_surge.execution.cluster import local_cluster

        if env:
            os.environ.update(env)  # spawned workers inherit it; this child's own environment only
        if self.trying and not self.args.processes:
            return local_cluster(
                n_workers=1, threads_per_worker=threads or 2, processes=False, protocol="tcp"
            )
        if self.trying:
            return local_cluster(n_workers=1, threads_per_worker=threads or 2)
        return local_cluster(**({"threads_per_worker": threads} if threads else {}))


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _host_pinned() -> dict:
    """torch's pinned (host) caching allocator: bytes in use and reserved, where this torch reports them."""
    import torch

    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or not torch.cuda.is_available():
        return {}
    s = stats()
    return {
        k: s.get(k)
        for k in (
            "allocated_bytes.current",
            "reserved_bytes.current",
            "allocated_bytes.peak",
            "reserved_bytes.peak",
        )
        if k in s
    }


# -- stages -------------------------------------------------------------------------------------------
def stage_preflight(s: Session) -> None:
    """Fail fast, with one line, on anything that would make the session inconclusive."""
    import _noop_forward  # benchmarks/, on the path as this script's folder
    import torch

    from benchmarks._results import machine  # the checkout's root is on the path (above)

    facts: dict = {
        **machine(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }
    if Path(
        "/dev/shm"
    ).is_dir():  # the tokenizing helpers hand ids back through it (a small one: they fall back)
        facts["dev_shm_free_bytes"] = shutil.disk_usage("/dev/shm").free
    problems = []
    facts["cuda_available"] = torch.cuda.is_available()
    if s.device == "cuda":
        if not facts["cuda_available"]:
            problems.append("torch sees no CUDA device")
        else:
            free, total = torch.cuda.mem_get_info()
            facts.update(gpu=torch.cuda.get_device_name(0), gpu_free_bytes=free, gpu_total_bytes=total)
            if free < 8 << 30:
                problems.append(f"only {free / 2**30:.1f} GiB free on the GPU")
    for name in ("dask", "distributed") + (() if s.trying else ("dask-cuda",)):
        if facts["versions"].get(name) is None:
            problems.append(f"{name} is not importable (install the carried wheels)")
    s.emit(**facts)
    if problems:
        s.emit("error", reason="; ".join(problems))
        raise SystemExit(3)
    engines = {}
    if not Path(s.model("bert"), "modules.json").is_file():
        problems.append(f"no BERT-base model at {s.model('bert')} (arch_model.py did not run?)")
    for which in ("minilm",):  # one model keeps the preflight short; BERT's engine is checked by its stage
        path = s.model(which)
        if not Path(path, "modules.json").is_file():
            problems.append(f"no model at {path} (arch_model.py did not run?)")
            continue
        enc, engine, loaded = _encoder(s, which)
        if engine is None:
            problems.append(
                f"the fast engine refused {which} ({loaded['backend_reason']}): "
                "the run would measure sentence-transformers"
            )
            enc.close()
            continue
        out = engine.encode(["a preflight text", "", "two words"] * 50)
        if not (out.shape == (150, engine.dimension) and bool((out == out).all())):
            problems.append(f"{which}: bad output {out.shape}")
        engines[which] = {
            **loaded,
            "mask4d": engine.runner.mask4d,
            "max_tokens": engine.max_tokens,
            "feeder": engine.use_feeder,
            "weights_dtype": str(next(engine.runner.hf.parameters()).dtype),
            "staging_pinned": bool(engine.runner.staging is not None and engine.runner.staging.is_pinned()),
            "async_finish": engine.runner.side_stream is not None,
            "noop": _noop_forward.is_patched(),
            # the tokenizing helpers (surge.tuning.tokenize-processes; 0 by default): started, or why not
            "tokenize_processes": engine.packer.processes,
            "tokenize_pool_started": engine.packer._pool is not None,
            "tokenize_pool_failure": engine.packer._pool_failure,
        }
        if _noop_forward.is_patched():
            problems.append(
                "the forward pass is the benchmark's no-op (benchmarks/_noop_forward.py): "
                "every embedding would be zero"
            )
        if s.device == "cuda" and not engines[which]["staging_pinned"]:
            problems.append("results did not go through the pinned staging buffer")
        enc.close()
        del enc, engine
    if s.device == "cuda":
        engines["host_pinned"] = _host_pinned()
    if problems:
        s.emit("error", reason="; ".join(problems), engines=engines)
        raise SystemExit(3)
    s.emit("ok", engines=engines)


def stage_data(s: Session) -> None:
    from dask_surge.testing import lognormal_sizes, write_partitioned_parquet

    rows = s.sizes["rows_a"]
    parts = max(20, rows // 200)
    sizes = lognormal_sizes(rows, parts, sigma=1.72, seed=0)
    t0 = time.perf_counter()
    files = [str(f) for f in write_partitioned_parquet(s.work / "data", sizes, seed=0)]
    warm = [str(f) for f in write_partitioned_parquet(s.work / "warm", sizes[:20], seed=1)]
    k = max(1, int(len(files) * s.sizes["b_fraction"]))
    b_rows = int(sum(sizes[:k]))
    (s.work / "data.json").write_text(
        json.dumps({"a": files, "b": files[:k], "warm": warm, "rows_a": rows, "rows_b": b_rows})
    )
    s.emit("ok", rows_a=rows, files_a=len(files), rows_b=b_rows, files_b=k, seconds=time.perf_counter() - t0)


def _rows(s: Session, which: str) -> int:
    return int(json.loads((s.work / "data.json").read_text())["rows_" + which])


def _watch(s: Session, out: Path, stop, every: float) -> None:
    """Emit the rows committed under ``out`` every ``every`` seconds (a run cut short keeps its rate)."""
    import pyarrow.parquet as pq

    seen: dict[str, int] = {}
    t0 = time.perf_counter()
    while not stop.wait(every):
        for f in out.rglob("*.parquet"):
            if str(f) not in seen:
                try:
                    seen[str(f)] = pq.read_metadata(f).num_rows
                except Exception:  # noqa: BLE001 - a file being written: next time
                    continue
        rows = sum(seen.values())
        s.emit(
            progress_rows=rows,
            progress_s=time.perf_counter() - t0,
            progress_texts_per_s=rows / (time.perf_counter() - t0),
        )


def _surge(s: Session, client, model: str, files: list[str], name: str) -> dict:
    import threading

    import dask
    import dask.dataframe as dd

    out = s.work / f"out-{name}-{time.time_ns()}"
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(s, out, stop, 1.0 if s.trying else 10.0), daemon=True)
    if name != "warm":
        watcher.start()
    try:  # surge.keep-model: the warm-up run leaves the model loaded for the timed one, its facts readable
        with dask.config.set({"surge.keep-model": True}):
            res = dd.read_parquet(files).surge.encode(
                "text", str(out), model=model, device=s.device, progress=False, keep=["doc_id"]
            )
    finally:
        stop.set()
    recs = res.records
    return {
        "rows": res.rows,
        "seconds": res.seconds,
        "texts_per_s": res.rows / res.seconds,
        "ttfo_s": res.ttfo_s,
        "superbatches": res.superbatches,
        "encode_s_sum": float(sum(r.encode_s for r in recs)),
        "write_s_sum": float(sum(r.write_s for r in recs)),
        "engine": sorted({r.engine for r in recs}),
        "_records": [r.as_dict() for r in recs],
    }


def _worker_facts() -> dict:
    import pyarrow as pa

    from dask_surge.models import cache

    engines = [v.engine for v in cache.loaded() if v.engine is not None]
    out = {
        "backends": sorted({v.backend for v in cache.loaded()}),
        "loaded_by": sorted({str(getattr(v.impl, "loaded_by", None)) for v in cache.loaded()}),
        "backend_reasons": sorted({v.reason for v in cache.loaded()}),
        "weights_dtype": sorted({str(next(e.runner.hf.parameters()).dtype) for e in engines}),
        "max_tokens": [e.max_tokens for e in engines],
        "tokenize_processes": [e.packer.processes for e in engines],
        "mask4d": [e.runner.mask4d for e in engines],
        "stage_seconds": [dict(e.stats) for e in engines],
        "tokenizers_parallelism": os.environ.get("TOKENIZERS_PARALLELISM"),
        "arrow_cpu_count": pa.cpu_count(),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["gpu_peak_bytes"] = int(torch.cuda.max_memory_allocated())
            out["host_pinned"] = _host_pinned()
    except Exception as err:  # noqa: BLE001 - facts only
        out["facts_error"] = repr(err)
    return out


def _warm(s: Session, client, model: str) -> float:
    """A short run that loads the model into the workers; sets ``s.loaded_by`` from what loaded it there."""
    t0 = time.perf_counter()
    _surge(s, client, model, json.loads((s.work / "data.json").read_text())["warm"], "warm")
    seconds = time.perf_counter() - t0
    loaders = sorted({x for facts in client.run(_worker_loaders).values() for x in facts})
    s.loaded_by = ",".join(loaders) or None
    s.emit(loaded_by=s.loaded_by, warm_s=seconds)  # said before the timed run: a timeout keeps it
    return seconds


def _worker_loaders() -> list[str]:
    """In a worker: what loaded each of its models (see :func:`_encoder`)."""
    from dask_surge.models import cache

    return sorted({str(getattr(v.impl, "loaded_by", None)) for v in cache.loaded()})


def stage_host(s: Session) -> None:
    """Host ceiling: the raw tokenizer inside a worker, and dask-surge with a no-op forward, on set B."""
    from _noop_forward import register, unregister  # benchmarks/, on the path as this script's folder
    from distributed import Client

    files, model = s.files("b"), s.model("minilm")
    t0 = time.perf_counter()
    with s.cluster() as cluster, Client(cluster) as client:
        register(client)  # the forward pass replaced by zeros in each worker (a benchmark-side plugin)
        s.emit(cluster_start_s=time.perf_counter() - t0)

        def tokenize_in_worker(paths, model_dir):
            import pyarrow.parquet as pq
            from tokenizers import Tokenizer

            texts = pq.ParquetDataset(paths).read(columns=["text"]).column("text").to_pylist()
            tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
            tok.no_padding()
            tok.enable_truncation(256)
            tok.encode_batch(texts[:1000])
            t = time.perf_counter()
            enc = tok.encode_batch(texts)
            return {
                "texts": len(texts),
                "seconds": time.perf_counter() - t,
                "tokens": int(sum(len(e.ids) for e in enc)),
            }

        (tok,) = client.run(tokenize_in_worker, files, model).values()
        tok["texts_per_s"] = tok["texts"] / tok["seconds"]
        s.emit(tokenizer_in_worker=tok)
        warm_s = _warm(s, client, model)
        # surge.tuning.tokenize-processes=2 (the token pool's arm: off by default until a GPU run shows it helps)
        client.run(_set_tokenize_processes, 2)
        noop = _surge(s, client, model, files, "noop")
        noop.pop("_records")
        (facts,) = client.run(_worker_facts).values()
        s.emit(surge_noop=noop, worker=facts)
        # the same run tokenizing in the worker process (no helper processes): what the helpers buy here
        client.run(_set_tokenize_processes, 0)
        in_worker = _surge(s, client, model, files, "noop_in_worker")
        in_worker.pop("_records")
        client.run(_set_tokenize_processes, "auto")
        # the arm of the settings measured only on a CPU (docs/tuning.md): forced on in the worker, against
        # the same run with "auto" (off on a GPU) above; a setting goes on for GPUs once this shows it helps
        s.emit(surge_noop_tokenize_in_worker=in_worker)
        client.run(_set_tuning, True)
        cpu_tuned = _surge(s, client, model, files, "noop_cpu_tuning")
        cpu_tuned.pop("_records")
        client.run(_set_tuning, "auto")
        unregister(client)  # a dry run's worker shares this process: the real forward again
    s.emit(
        "ok",
        tokenizer_in_worker=tok,
        warm_s=warm_s,
        surge_noop=noop,
        worker=facts,
        ratio_noop_over_tokenizer=noop["texts_per_s"] / tok["texts_per_s"],
        surge_noop_tokenize_in_worker=in_worker,
        ratio_helpers_over_in_worker=noop["texts_per_s"] / in_worker["texts_per_s"],
        surge_noop_cpu_tuning=cpu_tuned,
        cpu_tuning=list(CPU_TUNING),
        ratio_cpu_tuning_over_auto=cpu_tuned["texts_per_s"] / in_worker["texts_per_s"],
    )


#: The host-side settings measured only on a CPU, off on a GPU under "auto" (dask_surge/engine/tuning.py);
#: cpu-kernels is left out: it only changes a forward pass on a CPU.
CPU_TUNING = ("allocator", "gc-pause", "rayon-threads", "pause-profiler", "joined-tokenizing")


def _set_tuning(value: bool | str) -> None:
    """In a worker: every setting of :data:`CPU_TUNING` forced to ``value`` (or back to ``"auto"``); the
    plugin applies the process ones again when the next run registers it."""
    import dask

    dask.config.set({f"surge.tuning.{name}": value for name in CPU_TUNING})


def _set_tokenize_processes(value: int | str) -> None:
    """In a worker: ``surge.tuning.tokenize-processes`` for the engine's next calls (it reads the key per call)."""
    import dask

    dask.config.set({"surge.tuning.tokenize-processes": value})


def _stage_surge(s: Session, which: str, files_set: str, threads: int | None = None, tag: str = "") -> dict:
    from distributed import Client

    model = s.model(which)
    t0 = time.perf_counter()
    with s.cluster(threads=threads) as cluster, Client(cluster) as client:
        start = time.perf_counter() - t0
        warm_s = _warm(s, client, model)
        s.emit(model=which, threads=threads, cluster_start_s=start, warm_s=warm_s)

        def reset():
            import torch

            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.reset_peak_memory_stats()

        client.run(reset)
        from dask_surge.execution.scheduling import task_resources

        resources = task_resources(client)  # what each SuperBatch task claims, as encode computes it
        run = _surge(s, client, model, s.files(files_set), which + tag)
        (facts,) = client.run(_worker_facts).values()
    s.save_detail(f"{s.stage}{tag}_superbatches.json", run.pop("_records"))
    return {
        "model": which,
        "set": files_set,
        "threads": threads,
        "cluster_start_s": start,
        "warm_s": warm_s,
        **run,
        "task_resources": resources,
        "worker": facts,
    }


def stage_surge_minilm(s: Session) -> None:
    s.emit("ok", **_stage_surge(s, "minilm", "a"))


def stage_surge_bert(s: Session) -> None:
    s.emit("ok", **_stage_surge(s, "bert", "b"))


def _encoder(s: Session, which: str = "minilm"):
    """The model loaded as a Dask worker loads it: an ``Encoder`` of its path with the run's defaults
    (dtype "auto": float16 on CUDA for these float32 checkpoints), so a plain BERT goes through
    dask-surge's native loader, not sentence-transformers. Returns the Encoder (close it), its fast
    engine (None when the fallback encodes) and what loaded it; sets ``s.loaded_by``."""
    from dask_surge import Encoder

    enc = Encoder(s.model(which), device=s.device)
    impl = enc._loaded().impl
    engine = enc.engine
    loaded = {
        "backend": enc.backend,
        "backend_reason": enc.backend_reason,
        "loaded_by": getattr(impl, "loaded_by", None),
        "weights_dtype": str(next(engine.runner.hf.parameters()).dtype) if engine is not None else None,
    }
    s.loaded_by = loaded["loaded_by"]
    return enc, engine, loaded


def _forward_only(s: Session, engine, texts: list[str], which: str) -> dict:
    """The model forward alone on pre-tokenized ids, in the batch shapes the engine runs.

    One ``engine.encode(texts)`` records every micro-batch it hands the model (ids and
    validity mask, on the device: length-sorted, cut by the engine's token budget, the
    one-length ones unmasked); then those micro-batches run again through the same forward
    (encoder and pooling), back to back, with no tokenizing, packing, copying or waiting
    between them (the faster of two passes): texts/s of the forward alone, the engine's ceiling
    on this device.
    """
    import torch

    batches: list = []
    own = engine.__dict__.get("_forward")
    forward = engine._forward

    def record(ids, valid):
        batches.append((ids.clone(), None if valid is None else valid.clone()))
        return forward(ids, valid)

    engine._forward = record
    try:
        engine.encode(texts)
    finally:
        if own is None:
            del engine._forward
        else:
            engine._forward = own
    _sync(s.device)
    run = engine.runner.forward
    rows = sum(int(ids.shape[0]) for ids, _ in batches)
    padded = sum(int(ids.numel()) for ids, _ in batches)
    real = sum(int(ids.numel()) if valid is None else int(valid.sum()) for ids, valid in batches)
    with torch.inference_mode():
        for ids, valid in batches[:4]:  # warm (kernels for these shapes were chosen by the encode above)
            run(ids, valid)
        _sync(s.device)
        runs = []
        for _ in range(2):  # the faster of two passes: a first pass may still pay one-time costs
            t = time.perf_counter()
            for ids, valid in batches:
                run(ids, valid)
            _sync(s.device)
            runs.append(time.perf_counter() - t)
    seconds = min(runs)
    rate = rows / seconds
    ceiling = None if s.trying else FORWARD_CEILING_TEXTS_PER_S.get(which)
    return {
        "texts": rows,
        "micro_batches": len(batches),
        "seconds": seconds,
        "seconds_each": runs,
        "texts_per_s": rate,
        "tokens_per_s": real / seconds,
        "tokens_per_text": real / max(rows, 1),
        "padding_share": 1 - real / max(padded, 1),
        "masked_batches": sum(v is not None for _, v in batches),
        "ceiling_texts_per_s": ceiling,
        "over_ceiling": rate / ceiling if ceiling else None,
    }


def _engine_rate(s: Session, engine, texts: list[str]) -> dict:
    """One warm-up call, then ``engine.encode(texts)`` timed."""
    engine.encode(texts[:1024])
    _sync(s.device)
    t = time.perf_counter()
    engine.encode(texts)
    _sync(s.device)
    seconds = time.perf_counter() - t
    return {
        "engine_s": seconds,
        "engine_texts_per_s": len(texts) / seconds,
        "max_tokens": engine.max_tokens,
        "mask4d": engine.runner.mask4d,
    }


def stage_engine(s: Session) -> None:
    """The engine alone, loaded as the workers load it; the forward alone on its micro-batches; pinned host memory over more calls (bounded?); ST fp16 at batch 1024; BERT-base's engine and forward."""
    import torch
    from sentence_transformers import SentenceTransformer

    from dask_surge.testing import make_texts

    texts = make_texts(s.sizes["engine_texts"], seed=7)
    enc, engine, loaded = _encoder(s, "minilm")
    before = _host_pinned()
    out = {"model": "minilm", **loaded, "texts": len(texts), **_engine_rate(s, engine, texts)}
    s.emit(**out)
    forward = _forward_only(s, engine, texts, "minilm")
    out.update(
        forward_only=forward,
        forward_only_texts_per_s=forward["texts_per_s"],
        engine_over_forward_only=out["engine_texts_per_s"] / forward["texts_per_s"],
    )
    s.emit(**out)
    for _ in range(3):  # more calls must not grow the pinned memory
        engine.encode(texts[: len(texts) // 4])
    out.update(
        stage_seconds=dict(engine.stats),
        host_pinned_before=before,
        host_pinned_after_more_calls=_host_pinned(),
    )
    s.emit(**out)
    enc.close()
    del engine, enc

    # sentence-transformers on the same model and texts: loaded by it, fp16 on CUDA, batch 1024
    st_texts = texts[: s.sizes["st_texts"]]
    model = SentenceTransformer(s.model("minilm"), device=s.device)
    st16 = model.to(torch.float16) if s.device == "cuda" else model
    st16.encode(st_texts[:256], batch_size=1024)
    _sync(s.device)
    t = time.perf_counter()
    st16.encode(st_texts, batch_size=1024, convert_to_numpy=True)
    _sync(s.device)
    st_s = time.perf_counter() - t
    out.update(
        st_loaded_by="sentence-transformers",
        st_texts=len(st_texts),
        st_texts_per_s=len(st_texts) / st_s,
        engine_over_st=out["engine_texts_per_s"] / (len(st_texts) / st_s),
    )
    s.emit(**out)
    del model, st16
    if s.device == "cuda":
        torch.cuda.empty_cache()

    # BERT-base: its engine and its forward alone, loaded as the workers load it
    bert_texts = texts[: s.sizes["bert_texts"]]
    enc, engine, bert_loaded = _encoder(s, "bert")
    s.loaded_by = loaded["loaded_by"]  # the stage's headline figures are MiniLM's
    bert = {**bert_loaded, "texts": len(bert_texts), **_engine_rate(s, engine, bert_texts)}
    bert["forward_only"] = _forward_only(s, engine, bert_texts, "bert")
    bert["engine_over_forward_only"] = bert["engine_texts_per_s"] / bert["forward_only"]["texts_per_s"]
    enc.close()
    out["bert"] = bert
    s.emit("ok", **out)


class _ForwardTimeline:
    """Start and end of every forward of an engine: CUDA events on the stream the forward runs on (device
    time, read once everything is done) on a GPU, ``perf_counter`` in the CPU dry run. Wraps the engine's
    ``_forward`` (an instance attribute, the hook the tests use too)."""

    def __init__(self, engine, cuda: bool) -> None:
        import torch

        self.spans: list = []  # (start, end): events or seconds
        forward = engine._forward

        def timed(ids, valid):
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                out = forward(ids, valid)
                b.record()
            else:
                a = time.perf_counter()
                out = forward(ids, valid)
                b = time.perf_counter()
            self.spans.append((a, b))
            return out

        self.cuda = cuda
        engine._forward = timed

    def summary(self) -> dict:
        """The forwards' count, their summed time and the largest idle gap between two of them (ms)."""
        if not self.spans:
            return {"forwards": 0}
        zero = self.spans[0][0]
        if self.cuda:
            rows = sorted((zero.elapsed_time(a), zero.elapsed_time(b)) for a, b in self.spans)
        else:
            rows = sorted(((a - zero) * 1e3, (b - zero) * 1e3) for a, b in self.spans)
        gaps = [max(rows[i + 1][0] - rows[i][1], 0.0) for i in range(len(rows) - 1)]
        return {
            "forwards": len(rows),
            "span_ms": rows[-1][1] - rows[0][0],
            "forward_ms": float(sum(b - a for a, b in rows)),
            "max_gap_ms": max(gaps, default=0.0),
        }


def stage_busy(s: Session) -> None:
    """GPU-busy fraction of one encode call: CUDA events around every forward, against the call's wall time
    (the feeder thread and the asynchronous finish on, as on CUDA by default)."""
    from dask_surge.testing import make_texts

    texts = make_texts(s.sizes["engine_texts"], seed=8)
    enc, engine, loaded = _encoder(s)
    engine.use_feeder = True  # the CUDA default; on the CPU dry run too, so the same path runs
    engine.encode(texts[:1024])
    _sync(s.device)
    cuda = s.device == "cuda"
    timeline = _ForwardTimeline(engine, cuda)
    t = time.perf_counter()
    engine.encode(texts)
    _sync(s.device)
    wall = time.perf_counter() - t
    one = timeline.summary()
    busy = one.get("forward_ms", 0.0) / 1e3
    enc.close()
    s.emit(
        "ok",
        **loaded,
        texts=len(texts),
        forwards=one["forwards"],
        wall_s=wall,
        forward_s=busy,
        busy_fraction=busy / wall,
        one_call=one,
        clock="cuda events" if cuda else "perf_counter (CPU dry run)",
    )


def _cosines(model_dir: Path, ref: Path, device: str, out: Path) -> dict:
    """Minimum and median cosine of the engine's embeddings of the reference texts against the CPU fp32
    ones (issue 17's target: >= 0.9999), per compute dtype (float16 and bfloat16 on CUDA, float32 on a
    CPU), twice: the engine built on the model sentence-transformers loaded (``<dtype>``), and
    ``dask_surge.Encoder`` loading the directory itself as a Dask worker does (``<dtype> via Encoder``,
    with what loaded it). Written to ``out`` after each dtype, so a timeout keeps what was measured."""
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    from dask_surge import Encoder
    from dask_surge.engine.transformer import TransformerEngine

    texts, expected = json.loads(ref.read_text())["texts"], np.load(ref.with_suffix(".npy"))
    model = SentenceTransformer(str(model_dir), device=device)
    model.to(torch.float32)  # stored in fp16 to fit the transfer; the engine casts what it needs
    report: dict = {"texts": len(texts), "device": device, "dtypes": {}}

    def cosines(got, engine) -> dict:
        cos = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
        weights = str(next(engine.runner.hf.parameters()).dtype) if engine is not None else None
        return {
            "min_cosine": float(cos.min()),
            "median_cosine": float(np.median(cos)),
            "weights_dtype": weights,
        }

    for dtype in ["float16", "bfloat16"] if device == "cuda" else ["float32"]:
        engine = TransformerEngine.from_sentence_transformer(model, dtype=dtype)
        report["dtypes"][dtype] = {
            **cosines(engine.encode(texts), engine),
            "loaded_by": "sentence-transformers",
        }
        engine.close()
        with Encoder(str(model_dir), device=device, dtype=dtype) as enc:
            impl = enc._loaded().impl
            loaded = {"loaded_by": getattr(impl, "loaded_by", None)}
            report["dtypes"][f"{dtype} via Encoder"] = {**cosines(enc.encode(texts), enc.engine), **loaded}
        out.write_text(json.dumps(report, indent=1))
    return report


def stage_cosine(s: Session) -> None:
    import numpy as np

    real, ref = Path(s.args.real), Path(s.args.ref)
    if s.trying or not (real / "modules.json").is_file() or not ref.is_file():
        if not s.trying:
            s.emit(
                "skipped",
                reason=f"no real MiniLM weights at {real} or no reference {ref}: run "
                "benchmarks/gpu_prepare.py on the CPU machine before the session",
            )
            return
        # dry run: the tiny model, its own CPU fp32 output as the reference (exercises the code path), even
        # where .gpu/ holds the real weights: MiniLM in fp16 and bf16 on a CPU outlasts the halved timeout
        from sentence_transformers import SentenceTransformer

        from dask_surge.testing import make_texts

        texts = make_texts(200, seed=3)
        np.save(s.work / "tiny-ref.npy", SentenceTransformer(s.model("minilm"), device="cpu").encode(texts))
        (s.work / "tiny-ref.json").write_text(json.dumps({"texts": texts}))
        real, ref = Path(s.model("minilm")), s.work / "tiny-ref.json"
    report = _cosines(real, ref, s.device, s.detail / "cosine.json")
    # the headline: fp16 (what the workers compute in on CUDA; float32 in the dry run), loaded as the
    # workers load the model ("via Encoder"); bf16 and the engine on sentence-transformers' load beside it
    dtypes = report["dtypes"]
    head = "float16" if s.device == "cuda" else "float32"
    main = dtypes.get(f"{head} via Encoder") or dtypes[head]
    bf16 = dtypes.get("bfloat16 via Encoder") or dtypes.get("bfloat16") or {}
    s.loaded_by = main.get("loaded_by")
    s.emit(
        "ok",
        headline_dtype=head,
        min_cosine=main["min_cosine"],
        median_cosine=main["median_cosine"],
        met_0_9999=main["min_cosine"] >= 0.9999,
        min_cosine_bf16=bf16.get("min_cosine"),
        median_cosine_bf16=bf16.get("median_cosine"),
        met_0_9999_bf16=None if not bf16 else bf16["min_cosine"] >= 0.9999,
        min_cosine_any=min(d["min_cosine"] for d in dtypes.values()),
        **report,
    )


def stage_pytest(s: Session) -> None:
    import pytest

    real = Path(s.args.real)
    if (real / "modules.json").is_file():
        os.environ["SURGE_GPU_MODEL"] = str(real.resolve())
    counts: dict = {}

    class Count:
        def pytest_runtest_logreport(self, report):
            if report.when == "call" or report.outcome != "passed":
                key = report.outcome
                counts[key] = counts.get(key, 0) + 1
                if report.outcome != "passed":
                    counts.setdefault("not_passed", []).append(
                        [report.nodeid, report.when, str(report.longrepr)[-300:]]
                    )

    os.chdir(ROOT)
    # the parent imported pytest's plugins' modules already (anyio): their rewrite warning is no failure
    rc = pytest.main(
        [
            "-q",
            "-p",
            "no:cacheprovider",
            "-W",
            "ignore::pytest.PytestAssertRewriteWarning",
            "-m",
            "gpu",
            "--junitxml",
            str(s.detail / "pytest_gpu.xml"),
            "tests/test_devices.py",
            "tests/test_engine.py",
            "tests/test_device_finish.py",
        ],
        plugins=[Count()],
    )
    s.emit(
        "ok" if int(rc) in (0, 5) else "error", rc=int(rc), model=os.environ.get("SURGE_GPU_MODEL"), **counts
    )


STAGES = {name[len("stage_") :]: fn for name, fn in globals().items() if name.startswith("stage_")}


def _child(s: Session, name: str) -> None:
    os.setpgid(0, 0)  # its own process group: a timeout kills the stage and the workers it started
    s.stage = name
    code = 0
    try:
        STAGES[name](s)
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported, then the next stage runs
        s.emit("error", error=traceback.format_exc()[-4000:])
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(s: Session, plan: list[tuple[str, float]]) -> int:
    """Run each stage in a forked child under its timeout; 3 when preflight failed, else 0."""
    for name, limit in plan:
        s.stage = name
        t0 = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            _child(s, name)
        with contextlib.suppress(OSError):  # the child may have done it first
            os.setpgid(pid, pid)
        status = None
        while time.perf_counter() - t0 < limit:
            done, code = os.waitpid(pid, os.WNOHANG)
            if done:
                status = code
                break
            time.sleep(0.05)
        seconds = time.perf_counter() - t0
        if status is None:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            s.emit("timeout", timeout_s=limit, seconds=seconds)
        else:
            code = os.waitstatus_to_exitcode(status)
            if name == "preflight" and code != 0:
                print(
                    f"PREFLIGHT FAILED: stopping the session; see the preflight lines of {s.results}",
                    flush=True,
                )
                return 3
            if code != 0 and not _has_final(s, name):
                s.emit("crashed", exit_code=code, seconds=seconds)
        with_kill = 0
        try:  # whatever the stage left behind in its group (Dask workers) goes with it
            os.killpg(pid, signal.SIGKILL)
            with_kill = 1
        except ProcessLookupError:
            pass
        print(
            f"== stage {name}: {seconds:.1f} s (limit {limit:.0f} s){' (group cleaned)' if with_kill else ''}",
            flush=True,
        )
    return 0


def _has_final(s: Session, name: str) -> bool:
    if not s.results.is_file():
        return False
    for line in s.results.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("stage") == name and rec.get("status") != "partial":
            return True
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stages", required=True, help="name:timeout_s,... in order")
    parser.add_argument("--results", required=True, help="the JSON lines file every stage appends to")
    parser.add_argument("--work", default=tempfile.mkdtemp(prefix="surge-gpu-"))
    parser.add_argument("--minilm", default="/tmp/minilm")
    parser.add_argument("--bert", default="/tmp/bert")
    parser.add_argument("--real", default=".gpu/minilm-real-fp16")
    parser.add_argument("--ref", default=".gpu/minilm-ref.json")
    parser.add_argument(
        "--try", dest="try_run", action="store_true", help="CPU dry run: tiny models and sizes"
    )
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every timeout by this")
    parser.add_argument(
        "--processes",
        action="store_true",
        help="with --try: Dask workers in processes of their own, as on the GPU (slower to start)",
    )
    args = parser.parse_args(argv)
    plan = []
    for item in args.stages.split(","):
        name, _, limit = item.partition(":")
        if name not in STAGES:
            parser.error(f"unknown stage {name!r}; known: {', '.join(STAGES)}")
        plan.append((name, float(limit) * args.scale))
    # heavy imports once, before forking (no CUDA: PYTORCH_NVML_BASED_CUDA_CHECK, nothing allocated)
    import dask.dataframe  # noqa: F401
    import distributed  # noqa: F401
    import pyarrow.parquet  # noqa: F401
    import sentence_transformers  # noqa: F401
    import torch

    import dask_surge  # noqa: F401
    from dask_surge.engine import transformer as engine  # noqa: F401

    if torch.cuda.is_initialized():  # a forked child could not use CUDA then
        print("PREFLIGHT FAILED: CUDA was initialised before forking the stages", flush=True)
        return 3
    return run(Session(args), plan)


if __name__ == "__main__":
    sys.exit(main())
