"""Benchmark suite: SURGE vs PBP, FB and PB-PBP-LB (and a single-process reference).

Usage::

    python -m benchmarks.paper.run           # full CPU suite (~30 min on 2 cores)
    python -m benchmarks.paper.run --quick   # CI smoke run (< 3 min): tiny encoder, small N
    python -m benchmarks.paper.run --gpu     # same suite on a CUDA box (device="cuda")
    python -m benchmarks.paper.run --suites main,scaling --n 1000000 --partitions 4000

from the repository root.

Suites (each a list of measurements, see ``benchmarks/paper/_methods.py`` for the methods):

``main``     every method on one workload (N texts over P Parquet files, sigma 1.72),
             plus the single-process sentence-transformers reference (``st``) at
             ``min(N, --st-max-n)`` texts.                              -> Fig. 5
``sigma``    ``--sigma-methods`` at the other sigmas (1.0, 2.5).         -> Fig. 5b
``bmin``     SURGE at ``--bmin-n`` texts for each ``--bmin-values``.     -> Fig. 8
``scaling``  SURGE and FB for each ``--scaling-n`` (P = N / mean size).  -> Fig. 1, 10
``minilm``   every method with the packaged all-MiniLM-L6-v2 at small N. -> Fig. 5

Every measurement runs in a fresh process with a fresh 2-worker ``LocalCluster``
(1 thread each), the model loaded on every worker before the clock starts. Peak
memory is the summed RSS of the measuring process and all its descendants
(scheduler, nannies, workers), sampled every 50 ms. Results: one JSON file in the schema
of ``benchmarks/_results.py`` (machine facts, the exact command, one record per (method,
encoder, workload) in ``results``, the ratios against the targets in ``summary``), PNG
figures in a folder of the same name; the run ends by printing every record and the ratios
against the paper's targets as markdown tables (``docs/performance.md`` quotes them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from .. import _results

BENCH = Path(__file__).resolve().parents[1]  # benchmarks/: results/
ROOT = BENCH.parent

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REQUIRED = (
    "method",
    "encoder",
    "n",
    "partitions",
    "sigma",
    "texts_per_s",
    "tokens_per_s",
    "peak_rss_bytes",
    "ttfo_s",
    "calls",
)
LABELS = {"surge": "SURGE", "pbp": "PBP", "fb": "FB", "pbplb": "PB-PBP-LB", "st": "ST (1 process)"}


def _ints(s: str) -> list[int]:
    return [int(float(x)) for x in s.split(",") if x]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def parser() -> argparse.ArgumentParser:
    """The suite's one argument parser (defaults depend on --quick / --gpu, see ``defaults``)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--quick", action="store_true", help="CI smoke run: tiny encoder, small N, one shared cluster"
    )
    p.add_argument(
        "--gpu", action="store_true", help="device='cuda', dask-cuda LocalCUDACluster when importable"
    )
    p.add_argument(
        "--out", default=None, help="result JSON (default benchmarks/results/paper_run[_gpu][_quick].json)"
    )
    p.add_argument(
        "--workdir", default=None, help="datasets, models and scratch output (default benchmarks/results/tmp)"
    )
    p.add_argument("--suites", default="main,sigma,bmin,scaling,minilm")
    p.add_argument("--methods", default="surge,pbp,fb,pbplb,st", help="methods of the main/minilm suites")
    p.add_argument("--n", type=int, default=None, help="texts in the main workload")
    p.add_argument("--partitions", type=int, default=None, help="partitions (files) in the main workload")
    p.add_argument("--sigma", type=float, default=1.72, help="log-normal sigma of the main workload")
    p.add_argument("--sigmas", type=_floats, default=[1.0, 1.72, 2.5], help="sigma suite")
    p.add_argument("--sigma-methods", default="surge")
    p.add_argument("--b-min", type=int, default=None, help="SURGE flush threshold (rows)")
    p.add_argument("--b-max", type=int, default=None, help="SURGE cap (rows; default 4 * b_min)")
    p.add_argument("--fb-batch", type=int, default=None, help="FB fixed batch size B (default b_min)")
    p.add_argument(
        "--k", type=int, default=None, help="PB-PBP-LB partitions per group (default b_min / mean size)"
    )
    p.add_argument(
        "--st-batch", type=int, default=32, help="batch_size of the sentence-transformers reference"
    )
    p.add_argument("--st-max-n", type=int, default=None, help="largest N for the single-process reference")
    p.add_argument("--bmin-n", type=int, default=None)
    p.add_argument("--bmin-values", type=_ints, default=None)
    p.add_argument("--scaling-n", type=_ints, default=None)
    p.add_argument("--minilm-n", type=int, default=None)
    p.add_argument("--minilm-partitions", type=int, default=None)
    p.add_argument("--minilm-b-min", type=int, default=None)
    p.add_argument("--workers", type=int, default=None, help="Dask workers (default 2 on CPU, one per GPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-timeout", type=int, default=1800, help="seconds per measurement process")
    p.add_argument("--no-plots", action="store_true")
    return p


def defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the size defaults of the chosen mode."""
    if args.quick:
        d = dict(
            n=6000,
            partitions=60,
            b_min=1500,
            st_max_n=6000,
            bmin_n=6000,
            bmin_values=[500, 1500, 3000],
            scaling_n=[3000, 6000],
            minilm_n=300,
            minilm_partitions=10,
            minilm_b_min=100,
        )
        if "minilm" in args.suites.split(",") and "--suites" not in sys.argv:
            args.suites = "main,sigma,bmin,scaling"
    elif args.gpu:
        d = dict(
            n=2_000_000,
            partitions=8000,
            b_min=100_000,
            st_max_n=500_000,
            bmin_n=1_000_000,
            bmin_values=[25_000, 50_000, 100_000, 250_000, 500_000],
            scaling_n=[250_000, 500_000, 1_000_000, 2_000_000],
            minilm_n=1_000_000,
            minilm_partitions=4000,
            minilm_b_min=100_000,
        )
    else:
        d = dict(
            n=500_000,
            partitions=2000,
            b_min=20_000,
            st_max_n=100_000,
            bmin_n=125_000,
            bmin_values=[5_000, 10_000, 20_000, 50_000],
            scaling_n=[62_500, 125_000, 250_000, 500_000],
            minilm_n=2000,
            minilm_partitions=20,
            minilm_b_min=500,
        )
    for k, v in d.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if args.workers is None:
        args.workers = _gpu_count() if args.gpu else 2
    args.out = args.out or str(
        BENCH / "results" / f"paper_run{'_gpu' if args.gpu else ''}{'_quick' if args.quick else ''}.json"
    )
    args.workdir = args.workdir or str(BENCH / "results" / "tmp")
    return args


def _gpu_count() -> int:
    try:
        import torch

        return max(1, torch.cuda.device_count())
    except Exception:
        return 1


# --------------------------------------------------------------------------- workloads
def model_path(encoder: str, workdir: Path) -> str:
    from dask_surge.testing import make_tiny_model, packaged_model_dir

    if encoder == "tiny":
        return make_tiny_model(workdir / "models" / "tiny")
    return str(packaged_model_dir())


def workload(workdir: Path, n: int, partitions: int, sigma: float, seed: int) -> str:
    """Parquet dataset (one file per partition) for this workload, written once and cached."""
    from dask_surge.testing import lognormal_sizes, write_partitioned_parquet

    path = workdir / "data" / f"n{n}-p{partitions}-s{sigma:g}-seed{seed}"
    if not (path / "_DONE").exists():
        sizes = lognormal_sizes(n, partitions, sigma=sigma, seed=seed)
        write_partitioned_parquet(path, sizes, seed=seed)
        (path / "_DONE").write_text(
            json.dumps({"n_max": int(sizes.max()), "cv": float(sizes.std() / sizes.mean())})
        )
    return str(path)


def workload_facts(path: str) -> dict:
    return json.loads((Path(path) / "_DONE").read_text())


def count_tokens(workdir: Path, encoder: str, mpath: str, n: int, seed: int) -> int:
    """Tokens (with special tokens, truncated as the model truncates) of the workload's texts."""
    cache = workdir / "tokens" / f"{encoder}-n{n}-seed{seed}.json"
    if cache.exists():
        return json.loads(cache.read_text())["tokens"]
    from sentence_transformers import SentenceTransformer

    from dask_surge.testing import make_texts

    model = SentenceTransformer(mpath, device="cpu", local_files_only=True)
    tok, max_len = model.tokenizer, model.max_seq_length
    texts = make_texts(n, seed=seed)  # the texts write_partitioned_parquet wrote, whatever the sizes
    total = 0
    for i in range(0, n, 20_000):
        ids = tok(texts[i : i + 20_000], truncation=True, max_length=max_len)["input_ids"]
        total += sum(len(x) for x in ids)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"tokens": total}))
    return total


# --------------------------------------------------------------------------- plan
def plan(args) -> list[dict]:
    """All measurements, de-duplicated by key; each lists the suites it belongs to."""
    suites = args.suites.split(",")
    methods = [m for m in args.methods.split(",") if m]
    specs: dict[str, dict] = {}
    mean = args.n / args.partitions

    def add(suite, method, encoder, n, partitions, sigma, b_min, b_max=None, fb_batch=None, k=None):
        b_max = b_max or (args.b_max if b_min == args.b_min and args.b_max else 4 * b_min)
        k = k or args.k or max(1, round(b_min / (n / partitions)))
        fb_batch = fb_batch or args.fb_batch or b_min
        key = f"{method}|{encoder}|n{n}|p{partitions}|s{sigma:g}"
        if method == "surge":
            key += f"|bmin{b_min}|bmax{b_max}"
        elif method == "fb":
            key += f"|B{fb_batch}"
        elif method == "pbplb":
            key += f"|k{k}"
        if key in specs:
            specs[key]["suites"].append(suite)
            return
        specs[key] = dict(
            key=key,
            suites=[suite],
            method=method,
            encoder=encoder,
            n=n,
            partitions=partitions,
            sigma=sigma,
            b_min=b_min,
            b_max=b_max,
            fb_batch=fb_batch,
            k=k,
            st_batch=args.st_batch,
            workers=args.workers,
            gpu=args.gpu,
            device="cuda" if args.gpu else "cpu",
        )

    if "main" in suites:
        for m in methods:
            if m == "st":
                n_st = min(args.n, args.st_max_n)
                add("main", "st", "tiny", n_st, max(1, round(n_st / mean)), args.sigma, args.b_min)
            else:
                add("main", m, "tiny", args.n, args.partitions, args.sigma, args.b_min)
    if "sigma" in suites:
        for s in args.sigmas:
            for m in args.sigma_methods.split(","):
                add("sigma", m, "tiny", args.n, args.partitions, s, args.b_min)
    if "bmin" in suites:
        p = max(1, round(args.bmin_n / mean))
        for b in args.bmin_values:
            add("bmin", "surge", "tiny", args.bmin_n, p, args.sigma, b)
    if "scaling" in suites:
        for n in args.scaling_n:
            p = max(1, round(n / mean))
            for m in ("surge", "fb"):
                add("scaling", m, "tiny", n, p, args.sigma, args.b_min)
    if "minilm" in suites:
        n, p, b = args.minilm_n, args.minilm_partitions, args.minilm_b_min
        for m in methods:
            add("minilm", m, "minilm", min(n, args.st_max_n) if m == "st" else n, p, args.sigma, b)
    # st last (it loads the model in the measuring process); otherwise by size
    return sorted(specs.values(), key=lambda s: (s["method"] == "st", s["encoder"] != "tiny", s["n"]))


# --------------------------------------------------------------------------- execution
def _run_process(specs: list[dict] | dict, timeout: int) -> list[dict]:
    cmd = [sys.executable, "-m", f"{__spec__.parent}._methods", json.dumps(specs)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
    except subprocess.TimeoutExpired as err:
        keys = [s["key"] for s in (specs if isinstance(specs, list) else [specs])]
        return (
            [{"key": k, "error": f"timed out after {timeout} s"} for k in keys]
            if not err.stdout
            else [
                json.loads(l[7:])
                for l in (err.stdout.decode() if isinstance(err.stdout, bytes) else err.stdout).splitlines()
                if l.startswith("RESULT ")
            ]
        )
    out = [json.loads(l[7:]) for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not out:
        tail = proc.stderr[-2000:]
        keys = [s["key"] for s in (specs if isinstance(specs, list) else [specs])]
        got = {r.get("key") for r in out}
        out += [{"key": k, "error": f"exit {proc.returncode}: {tail}"} for k in keys if k not in got]
    return out


def machine_facts() -> dict:
    import dask
    import distributed
    import numpy
    import pandas
    import pyarrow
    import torch

    import dask_surge

    facts = _results.machine()
    facts.update(
        {
            "processor": platform.processor(),
            "versions": {
                **facts["versions"],
                "dask_surge": dask_surge.__version__,
                "dask": dask.__version__,
                "distributed": distributed.__version__,
                "torch": torch.__version__,
                "pyarrow": pyarrow.__version__,
                "pandas": pandas.__version__,
                "numpy": numpy.__version__,
            },
            "cuda": torch.cuda.is_available(),
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available()
            else [],
        }
    )
    try:
        import sentence_transformers

        facts["versions"]["sentence_transformers"] = sentence_transformers.__version__
    except Exception:
        pass
    return facts


def main(argv: list[str] | None = None) -> dict:
    args = defaults(parser().parse_args(argv))
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    specs = plan(args)
    t_start = time.perf_counter()
    report = _results.new_report(__spec__.name, argv, args)
    report["machine"] = machine_facts()
    # workloads, models and token counts first (not on the measured path)
    paths = {e: model_path(e, workdir) for e in {s["encoder"] for s in specs}}
    for s in specs:
        s["model_path"] = paths[s["encoder"]]
        s["data_dir"] = workload(workdir, s["n"], s["partitions"], s["sigma"], args.seed)
        s["tokens"] = count_tokens(workdir, s["encoder"], s["model_path"], s["n"], args.seed)
        s["out_dir"] = str(workdir / "out" / "run")
    print(f"prepared {len(specs)} measurements in {time.perf_counter() - t_start:.0f} s", flush=True)

    by_key = {s["key"]: s for s in specs}
    records: list[dict] = []
    if args.quick:  # one process, one shared cluster: keeps the smoke run under 3 minutes
        results = _run_process([s for s in specs if s["method"] != "st"], args.run_timeout)
        for s in specs:  # the single-process reference never shares a process with a cluster
            if s["method"] == "st":
                results += _run_process(s, args.run_timeout)
    else:
        results = []
        for s in specs:
            results += _run_process(s, args.run_timeout)
            _progress(results[-1])
    for r in results:
        s = by_key.get(r.get("key"), {})
        rec = {k: s.get(k) for k in ("method", "encoder", "n", "partitions", "sigma")}
        rec.update({k: None for k in REQUIRED if k not in rec})
        rec.update(r)
        rec["suites"] = s.get("suites", [])
        if s.get("data_dir"):
            rec.update({f"workload_{k}": v for k, v in workload_facts(s["data_dir"]).items()})
        if args.quick:
            _progress(rec)
        records.append(rec)
    report["results"] = records
    report["summary"] = summarize(records, args)
    report["summary"]["benchmark_seconds"] = time.perf_counter() - t_start
    out = Path(args.out)
    report = _results.save(report, out)
    print(f"wrote {out}", flush=True)
    if not args.no_plots:
        report["summary"]["figures"] = plots(records, args, out.with_suffix(""))
        report = _results.save(report, out)
    print(table(report), flush=True)
    return report


def _progress(r: dict) -> None:
    if r.get("error"):
        print(f"  {r.get('key')}: ERROR {r['error'][:300]}", flush=True)
    else:
        print(
            f"  {r['key']}: {r['texts_per_s']:,.0f} texts/s, peak {r['peak_rss_bytes'] / 2**30:.2f} GiB, "
            f"TTFO {r['ttfo_s']:.2f} s, {r['calls']} calls",
            flush=True,
        )


# --------------------------------------------------------------------------- summary
def _find(records, **kw):
    return [r for r in records if not r.get("error") and all(r.get(k) == v for k, v in kw.items())]


def _ratio(a, b):
    return a / b if a is not None and b else None


def summarize(records: list[dict], args) -> dict:
    """Ratios for the targets of the issue (None where a measurement is missing)."""
    main = {r["method"]: r for r in records if "main" in r.get("suites", []) and not r.get("error")}
    s, f, p, lb = (main.get(m) for m in ("surge", "fb", "pbp", "pbplb"))
    g = lambda r, k: r.get(k) if r else None  # noqa: E731
    out: dict = {
        "workload": {
            "n": args.n,
            "partitions": args.partitions,
            "sigma": args.sigma,
            "b_min": args.b_min,
            "encoder": "tiny",
        }
    }
    out["surge_over_fb_throughput"] = _ratio(g(s, "texts_per_s"), g(f, "texts_per_s"))
    out["surge_over_pbp_throughput"] = _ratio(g(s, "texts_per_s"), g(p, "texts_per_s"))
    out["surge_over_pbplb_throughput"] = _ratio(g(s, "texts_per_s"), g(lb, "texts_per_s"))
    out["surge_over_st_throughput"] = _ratio(g(s, "texts_per_s"), g(main.get("st"), "texts_per_s"))
    out["surge_over_fb_peak_memory"] = _ratio(g(s, "peak_rss_bytes"), g(f, "peak_rss_bytes"))
    out["surge_over_fb_peak_over_baseline"] = _ratio(
        g(s, "peak_over_baseline_bytes"), g(f, "peak_over_baseline_bytes")
    )
    out["fb_over_surge_ttfo"] = _ratio(g(f, "ttfo_s"), g(s, "ttfo_s"))
    scal = sorted(
        _find([r for r in records if "scaling" in r.get("suites", [])], method="surge"), key=lambda r: r["n"]
    )
    fbs = sorted(
        _find([r for r in records if "scaling" in r.get("suites", [])], method="fb"), key=lambda r: r["n"]
    )
    if len(scal) >= 2:
        mem = [r["peak_rss_bytes"] for r in scal]
        out["surge_peak_memory_vs_n"] = {r["n"]: r["peak_rss_bytes"] for r in scal}
        out["surge_peak_memory_spread"] = max(mem) / min(mem) - 1
    if len(fbs) >= 2:
        out["fb_peak_memory_vs_n"] = {r["n"]: r["peak_rss_bytes"] for r in fbs}
        out["fb_peak_memory_growth"] = fbs[-1]["peak_rss_bytes"] / fbs[0]["peak_rss_bytes"] - 1
    sig = [
        r
        for r in records
        if r.get("method") == "surge"
        and r.get("encoder") == "tiny"
        and not r.get("error")
        and r["n"] == args.n
        and r["partitions"] == args.partitions
        and r.get("b_min") == args.b_min
    ]
    if len({r["sigma"] for r in sig}) >= 2:
        tp = {r["sigma"]: r["texts_per_s"] for r in sig}
        mid = sum(tp.values()) / len(tp)
        out["surge_throughput_by_sigma"] = tp
        out["surge_sigma_max_deviation"] = max(abs(v / mid - 1) for v in tp.values())
    t = out
    out["targets"] = {
        "surge >= 0.95x fb throughput": _met(t["surge_over_fb_throughput"], lambda v: v >= 0.95),
        "surge >= 3x pbp throughput": _met(t["surge_over_pbp_throughput"], lambda v: v >= 3),
        "surge peak memory <= 1/5 fb": _met(t["surge_over_fb_peak_memory"], lambda v: v <= 0.2),
        "surge peak memory flat within 20% over N": _met(
            t.get("surge_peak_memory_spread"), lambda v: v <= 0.2
        ),
        "fb peak memory grows with N": _met(t.get("fb_peak_memory_growth"), lambda v: v > 0.2),
        "surge TTFO >= 10x shorter than fb": _met(t["fb_over_surge_ttfo"], lambda v: v >= 10),
        "surge throughput within 5% across sigma": _met(
            t.get("surge_sigma_max_deviation"), lambda v: v <= 0.05
        ),
    }
    return out


def _met(value, pred):
    return None if value is None else bool(pred(value))


# --------------------------------------------------------------------------- figures
def plots(records: list[dict], args, folder: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no figures (pip install matplotlib)", flush=True)
        return []
    folder.mkdir(parents=True, exist_ok=True)
    ok = [r for r in records if not r.get("error")]
    files = []
    colors = {"surge": "C0", "pbp": "C1", "fb": "C2", "pbplb": "C3", "st": "C7"}
    gib = 2**30

    def save(fig, name):
        path = folder / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(str(path))

    scal = [r for r in ok if "scaling" in r["suites"]]
    if scal:  # Fig. 1: memory and TTFO vs N
        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        for m in ("surge", "fb"):
            rs = sorted((r for r in scal if r["method"] == m), key=lambda r: r["n"])
            if rs:
                ax[0].plot(
                    [r["n"] for r in rs],
                    [r["peak_rss_bytes"] / gib for r in rs],
                    "o-",
                    color=colors[m],
                    label=LABELS[m],
                )
                ax[0].plot(
                    [r["n"] for r in rs],
                    [r["peak_over_baseline_bytes"] / gib for r in rs],
                    "o--",
                    color=colors[m],
                    alpha=0.5,
                    label=f"{LABELS[m]} (above idle cluster)",
                )
                ax[1].plot(
                    [r["n"] for r in rs], [r["ttfo_s"] for r in rs], "o-", color=colors[m], label=LABELS[m]
                )
        ax[0].set(xlabel="N texts", ylabel="peak RSS, all processes (GiB)", title="Peak memory vs N")
        ax[1].set(xlabel="N texts", ylabel="time to first output (s)", title="TTFO vs N", yscale="log")
        for a in ax:
            a.set_xscale("log")
            a.legend(fontsize=8)
        save(fig, "fig1_memory_ttfo_vs_n.png")

        fig, ax = plt.subplots(1, 3, figsize=(13, 4))  # Fig. 10: scaling
        for m in ("surge", "fb"):
            rs = sorted((r for r in scal if r["method"] == m), key=lambda r: r["n"])
            ax[0].plot(
                [r["n"] for r in rs], [r["texts_per_s"] for r in rs], "o-", color=colors[m], label=LABELS[m]
            )
        s = {r["n"]: r for r in scal if r["method"] == "surge"}
        f = {r["n"]: r for r in scal if r["method"] == "fb"}
        common = sorted(set(s) & set(f))
        ax[1].plot(
            common, [f[n]["peak_rss_bytes"] / s[n]["peak_rss_bytes"] for n in common], "o-", label="total RSS"
        )
        ax[1].plot(
            common,
            [f[n]["peak_over_baseline_bytes"] / max(1, s[n]["peak_over_baseline_bytes"]) for n in common],
            "o--",
            label="above idle cluster",
        )
        ax[2].plot(common, [f[n]["ttfo_s"] / s[n]["ttfo_s"] for n in common], "o-")
        ax[0].set(xlabel="N texts", ylabel="texts/s", title="Throughput vs N")
        ax[1].set(xlabel="N texts", ylabel="FB / SURGE", title="Peak memory ratio")
        ax[2].set(xlabel="N texts", ylabel="FB / SURGE", title="TTFO ratio")
        for a in ax:
            a.set_xscale("log")
        ax[0].legend(fontsize=8)
        ax[1].legend(fontsize=8)
        save(fig, "fig10_scaling.png")

    groups = [("main", "tiny"), ("minilm", "minilm")]
    panels = [(sname, enc) for sname, enc in groups if any(sname in r["suites"] for r in ok)]
    sig = sorted({r["sigma"] for r in ok if "sigma" in r["suites"]})
    if panels or sig:  # Fig. 5: throughput by method (and by sigma)
        fig, ax = plt.subplots(
            1, len(panels) + (1 if sig else 0), figsize=(5 * (len(panels) + bool(sig)), 4), squeeze=False
        )
        for i, (sname, enc) in enumerate(panels):
            rs = [r for r in ok if sname in r["suites"]]
            rs.sort(key=lambda r: list(LABELS).index(r["method"]))
            bars = ax[0][i].bar(
                [LABELS[r["method"]] for r in rs],
                [r["texts_per_s"] for r in rs],
                color=[colors[r["method"]] for r in rs],
            )
            for b, r in zip(bars, rs):
                ax[0][i].annotate(
                    f"{r['texts_per_s']:,.0f}\n{r['calls']} calls",
                    (b.get_x() + b.get_width() / 2, b.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
            n = max(r["n"] for r in rs)
            ax[0][i].set(ylabel="texts/s", title=f"{enc}: N={n:,} (ST: N={min(n, args.st_max_n):,})")
            ax[0][i].tick_params(axis="x", labelsize=8, rotation=15)
        if sig:
            a = ax[0][-1]
            rs = [r for r in ok if "sigma" in r["suites"]]
            methods = sorted({r["method"] for r in rs}, key=list(LABELS).index)
            w = 0.8 / len(methods)
            for j, m in enumerate(methods):
                vals = [
                    next((r["texts_per_s"] for r in rs if r["method"] == m and r["sigma"] == s_), 0)
                    for s_ in sig
                ]
                a.bar([x + j * w for x in range(len(sig))], vals, w, color=colors[m], label=LABELS[m])
            a.set_xticks(
                [x + w * (len(methods) - 1) / 2 for x in range(len(sig))], [f"sigma={s_:g}" for s_ in sig]
            )
            a.set(ylabel="texts/s", title="Throughput across sigma")
            a.legend(fontsize=8)
        save(fig, "fig5_throughput_by_method.png")

    bm = sorted((r for r in ok if "bmin" in r["suites"]), key=lambda r: r["b_min"])
    if bm:  # Fig. 8: b_min sweep
        fig, ax = plt.subplots(1, 3, figsize=(13, 4))
        x = [r["b_min"] for r in bm]
        ax[0].plot(x, [r["texts_per_s"] for r in bm], "o-")
        ax[1].plot(x, [r["peak_rss_bytes"] / gib for r in bm], "o-", label="total")
        ax[1].plot(x, [r["peak_over_baseline_bytes"] / gib for r in bm], "o--", label="above idle cluster")
        ax[2].plot(x, [r["ttfo_s"] for r in bm], "o-")
        for r in bm:
            ax[0].annotate(f"{r['calls']} SBs", (r["b_min"], r["texts_per_s"]), fontsize=7)
        ax[0].set(xlabel="b_min", ylabel="texts/s", title=f"SURGE throughput (N={bm[0]['n']:,})")
        ax[1].set(xlabel="b_min", ylabel="GiB", title="Peak memory")
        ax[2].set(xlabel="b_min", ylabel="s", title="TTFO")
        ax[1].legend(fontsize=8)
        for a in ax:
            a.set_xscale("log")
        save(fig, "fig8_bmin.png")
    return files


# --------------------------------------------------------------------------- the printed tables
def table(report: dict) -> str:
    rows = [
        "| suite | method | encoder | N | P | sigma | b_min | texts/s | tokens/s | peak RSS (GiB) | "
        "above idle (GiB) | TTFO (s) | calls |",
        "|" + "---|" * 13,
    ]
    for r in sorted(
        report["results"],
        key=lambda r: (
            ",".join(r.get("suites", [])),
            r.get("encoder") or "",
            r.get("n") or 0,
            r.get("sigma") or 0,
            list(LABELS).index(r["method"]) if r.get("method") in LABELS else 9,
            r.get("b_min") or 0,
        ),
    ):
        if r.get("error"):
            rows.append(
                f"| {','.join(r['suites'])} | {r.get('method')} | {r.get('encoder')} | {r.get('n')} | "
                f"{r.get('partitions')} | {r.get('sigma')} | | error: {r['error'][:60]} | | | | | |"
            )
            continue
        rows.append(
            f"| {','.join(r['suites'])} | {LABELS.get(r['method'], r['method'])} | {r['encoder']} | {r['n']:,} | "
            f"{r['partitions']:,} | {r['sigma']:g} | {'' if r.get('b_min') is None else format(r['b_min'], ',')} | "
            f"{r['texts_per_s']:,.0f} | {r['tokens_per_s']:,.0f} | {r['peak_rss_bytes'] / 2**30:.2f} | "
            f"{r['peak_over_baseline_bytes'] / 2**30:.2f} | {r['ttfo_s']:.2f} | {r['calls']:,} |"
        )
    s = report["summary"]
    fmt = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
    lines = [
        f"Command: `{report['command']}`  ",
        f"Machine: {report['machine']['platform']}, {report['machine']['cpus']} CPUs, "
        f"load {report['machine']['loadavg_start'][0]:.1f} before / {report['machine']['loadavg_end'][0]:.1f} after; "
        f"{s['benchmark_seconds'] / 60:.0f} min; git {report['git']}.",
        "",
        "| ratio | value | target | met |",
        "|---|---|---|---|",
        f"| SURGE / FB throughput | {fmt(s['surge_over_fb_throughput'])} | >= 0.95 | {s['targets']['surge >= 0.95x fb throughput']} |",
        f"| SURGE / PBP throughput | {fmt(s['surge_over_pbp_throughput'])} | >= 3 | {s['targets']['surge >= 3x pbp throughput']} |",
        f"| SURGE / PB-PBP-LB throughput | {fmt(s['surge_over_pbplb_throughput'])} | | |",
        f"| SURGE / FB peak RSS (all processes) | {fmt(s['surge_over_fb_peak_memory'])} | <= 0.2 | {s['targets']['surge peak memory <= 1/5 fb']} |",
        f"| SURGE / FB peak RSS above idle cluster | {fmt(s['surge_over_fb_peak_over_baseline'])} | | |",
        f"| SURGE peak RSS spread over N | {fmt(s.get('surge_peak_memory_spread'))} | <= 0.2 | {s['targets']['surge peak memory flat within 20% over N']} |",
        f"| FB peak RSS growth over N | {fmt(s.get('fb_peak_memory_growth'))} | > 0 | {s['targets']['fb peak memory grows with N']} |",
        f"| FB / SURGE TTFO | {fmt(s['fb_over_surge_ttfo'])} | >= 10 | {s['targets']['surge TTFO >= 10x shorter than fb']} |",
        f"| SURGE max deviation across sigma | {fmt(s.get('surge_sigma_max_deviation'))} | <= 0.05 | {s['targets']['surge throughput within 5% across sigma']} |",
        "",
    ]
    return "\n".join(lines + rows)


if __name__ == "__main__":
    main()
