"""Host ceiling: the whole SURGE path with a no-op forward, against the raw Rust tokenizer.

Usage::

    python benchmarks/host_ceiling.py [--n 100000] [--files 1000] [--workers 2] [--repeats 3]
                                      [--gil] [--out benchmarks/results/host_ceiling.json]
    python benchmarks/host_ceiling.py --tokenpool [--sizes 50000 150000] [--processes 1] [--repeats 2] [--pin]
                                      [--set max-tokens=65536 ...]
                                      [--out benchmarks/results/host_ceiling.json]

On the same texts (``--n`` docstring paragraphs of installed packages, in ``--files``
Parquet files of log-normal sizes, see ``_realtext.py``) and the same cores:

(a) ``tokenizers.Tokenizer.encode_batch`` of the packaged all-MiniLM-L6-v2 tokenizer
    (truncation at 256, as the model) over all texts, already in memory, in one call
    (the Rust thread pool uses every core); and (a') the same tokenizer through
    :class:`~dask_surge.engine.joined.JoinedTokenizer` (texts joined around ``[SEP]``, the same ids),
    as the pipeline tokenizes them: (b) / (a') is what the pipeline costs besides tokenizing;
(b) ``dd.read_parquet(dir).surge.encode("text", output=...)`` on a ``LocalCluster`` of
    ``--workers`` single-threaded workers, from the call to the last committed file, with
    the encoder's forward pass replaced by zeros of the right shape
    (``benchmarks/_noop_forward.py``: a worker plugin of this benchmark patches the forward pass
    in each worker). The model is loaded on the workers
    by a warm-up run before the clock starts.

Target: (b) >= 0.95 x (a) in texts/s (issue 27; issue 17 asked for 0.8). Runs alternate
(a, b, a, b, ...); medians are reported, with each worker's CPU per text by thread (the Dask
task thread, the event loop's ``MainThread``, ``native`` pools: :func:`thread_cpu`, which
holds up on a loaded machine), and the ratio split into the CPU each arm spends per text and
the share of the machine each keeps busy (:func:`cpu_split`). ``--gil`` also samples the workers with ``py-spy record --gil``
during one extra (b) run and reports the GIL-holding microseconds per text and where they fall
(:func:`gil_profile`); on a loaded machine a thread preempted while holding the GIL still counts.

``--tokenpool`` compares (b) with ``surge.tuning.tokenize-processes`` 0 (``off``: the worker tokenizes)
and ``--processes`` (``on``: helper processes tokenize, :mod:`dask_surge.engine.tokenpool`) side by
side: two clusters, one per setting, both warm, on the same texts, runs alternating (ABBA) with
(a) once per round, at each of ``--sizes`` texts. Every (b) run is sampled by py-spy ``--gil
--threads``: GIL-holding microseconds per text per worker by thread (the Dask task thread, the
event loop's ``MainThread``, others), and the slope between the sizes (the marginal GIL per text:
the event loop's cost is mostly per run and per second, not per text). The helpers' own CPU is
read from ``/proc`` and added to the workers' for the CPU per text each setting costs; each
worker's whole process CPU (``process_cpu``: threads that ended included) is read too.

``--pin`` (with ``--tokenpool``) runs worker ``i`` of each cluster on core ``i`` alone and
everything else (the helpers, the client and schedulers, py-spy) on the other cores, (a) on every
core as always: on a machine with few cores another process otherwise preempts a worker thread
that holds the GIL, and py-spy counts that wait as GIL time (on 2 cores with one helper busy,
py-spy's figure exceeded the worker's CPU). Pinned, only the worker's own threads can preempt it.
``--set KEY=VALUE`` sets ``surge.KEY`` in the workers. A GPU worker runs larger SuperBatches than a
CPU one (``b-min``/``b-max`` "auto": 100,000/400,000 rows against 4,096/16,384) and larger
micro-batches (``max-tokens``: up to 65,536 against 2,048 for MiniLM), and each SuperBatch and
micro-batch costs the worker's GIL the same whatever its size; ``--set b-min=100000 --set
b-max=400000 --set max-tokens=65536`` measures what feeding a GPU costs per text.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing
sys.path.insert(0, str(HERE))
from _ab import script_header  # noqa: E402 - the benchmarks folder, put on the path above

#: Issue 27's target for (b) / (a).
TARGET = 0.95

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def tokenizer_run(texts: list[str], *, joined: bool = False) -> float:
    """Seconds of one ``encode_batch`` over ``texts`` with the model's tokenizer and truncation; with
    ``joined``, of :class:`~dask_surge.engine.joined.JoinedTokenizer`'s ``encode`` (the same ids, texts
    joined around ``[SEP]``: the fastest this tokenizer gives them, as the pipeline tokenizes them)."""
    from tokenizers import Tokenizer

    from dask_surge.engine.joined import JoinedTokenizer
    from dask_surge.testing import packaged_model_dir

    tok = Tokenizer.from_file(str(packaged_model_dir() / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(256)
    encode = JoinedTokenizer.of(tok).encode if joined else tok.encode_batch  # type: ignore[union-attr]
    t0 = time.perf_counter()
    encode(texts)
    return time.perf_counter() - t0


def surge_run(data: Path, client, scratch: Path, model: str = "default") -> tuple[float, dict]:
    import dask.dataframe as dd

    out = scratch / f"out-{time.time_ns()}"
    t0 = time.perf_counter()
    res = dd.read_parquet(str(data)).surge.encode(
        "text", output=str(out), model=model, device="cpu", progress=False, scheduler=client
    )
    seconds = time.perf_counter() - t0
    facts = {
        "superbatches": res.superbatches,
        "ttfo_s": res.ttfo_s,
        "encode_s_sum": float(sum(r.encode_s for r in res.records)),
        "write_s_sum": float(sum(r.write_s for r in res.records)),
        "engine": sorted({r.engine for r in res.records}),
        "rows": int(sum(r.rows for r in res.records)),
    }
    shutil.rmtree(out, ignore_errors=True)
    return seconds, facts


def _engine_stats() -> list[dict]:
    """Seconds per engine stage in this worker (all runs, the warm-up included)."""
    from dask_surge.models import cache

    return [dict(v.engine.stats) for v in cache.loaded() if v.engine is not None]


def _thread_name(root: str) -> str:
    """``Dask-Default-Threads`` of py-spy's ``thread (1234): Dask-Default-Threads-1234-0`` (digits dropped, as
    :func:`thread_cpu` names threads)."""
    import re

    if "): " not in root:  # an older py-spy: the root as it is
        return root
    return re.sub(r"[-_]?\d+", "", root.split("): ", 1)[1]).strip("-_") or root


def gil_profile(raw: str, top: int | None = 40) -> dict:
    """Where the GIL samples of a ``py-spy record --format raw`` profile fall: per thread, and per
    function the samples it held the GIL in itself (``self``, the leaf frame) and under it (``inclusive``).
    With ``--threads`` the threads are named (:func:`_thread_name`); else the root frame tells them apart."""
    own: dict[str, int] = {}
    own_by_thread: dict[str, dict[str, int]] = {}
    under: dict[str, int] = {}
    threads: dict[str, int] = {}
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [f.strip() for f in stack.split(";")]
        if frames and frames[0].startswith("thread ("):  # py-spy --threads: the root names the thread
            name, frames = _thread_name(frames[0]), frames[1:]
        else:  # the root frame tells the threads apart (<module> runs a worker's event loop)
            name = frames[0] if frames else ""
        threads[name] = threads.get(name, 0) + n
        if frames:
            own[frames[-1]] = own.get(frames[-1], 0) + n
            mine = own_by_thread.setdefault(name, {})
            mine[frames[-1]] = mine.get(frames[-1], 0) + n
        for frame in set(frames):
            under[frame] = under.get(frame, 0) + n

    def ranked(d: dict[str, int]) -> list[tuple[str, int]]:
        return sorted(d.items(), key=lambda kv: -kv[1])[:top]

    return {
        "samples": total,
        "threads": ranked(threads),
        "self": ranked(own),
        "inclusive": ranked(under),
        "self_by_thread": {name: ranked(d)[:12] for name, d in own_by_thread.items()},
    }


def thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's live threads (Linux ``/proc``; ``{}`` elsewhere), summed by
    Python thread name with digits dropped (``Dask-Default-Threads-``); threads Python did not
    start (the Rust tokenizer's, Arrow's, torch's pools) count as ``native``.

    Unlike py-spy's GIL samples (a thread preempted while it holds the GIL still counts), this
    counts only time on a core, so it holds up on a shared, loaded machine; it includes work a
    thread does without the GIL (Arrow, torch kernels). Only threads alive at both readings
    count: since a unit's task secedes from the worker's pool while its last commit is
    written, the pool starts new task threads and the seceded ones end, so a run's
    ``Dask-Default-Threads`` figure can be short or missing; the process's CPU
    (``cpu_us_per_text_workers``) is whole.
    """
    import re
    import threading

    out: dict[str, float] = {}
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return out
    names = {t.native_id: re.sub(r"[-_]?\d+", "", t.name).strip("-_") for t in threading.enumerate()}
    ticks = os.sysconf("SC_CLK_TCK")
    for task in tasks.iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        name = names.get(int(task.name), "native")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
    return out


def thread_cpu_during(client, run) -> tuple[object, dict[str, dict[str, float]]]:
    """``run()``'s result and each worker's CPU seconds per thread name spent meanwhile."""
    before = client.run(thread_cpu)
    result = run()
    after = client.run(thread_cpu)
    return result, {
        w: {
            k: round(v - before[w].get(k, 0.0), 3)
            for k, v in after[w].items()
            if v - before[w].get(k, 0.0) > 0
        }
        for w in after
    }


def run_cpu(client, run) -> tuple[object, dict[str, float]]:
    """``run()``'s result and the CPU seconds it cost: the worker processes' (threads that ended
    included, :func:`process_cpu`) and this client process's (which runs a ``LocalCluster``'s
    scheduler, and the planning)."""
    before, c0 = client.run(process_cpu), time.process_time()
    result = run()
    after, client_s = client.run(process_cpu), time.process_time() - c0
    workers = sum(after[w] - before.get(w, after[w]) for w in after)
    return result, {"workers": round(workers, 3), "client": round(client_s, 3)}


def cpu_split(
    a_s: list[float],
    a_cpu: list[float],
    b_s: list[float],
    b_cpu: list[dict[str, float]],
    texts: int,
    cores: int | None = None,
) -> dict[str, float]:
    """The ratio (b)/(a) in texts/s split into two factors, each a median over the runs (their product
    is the ratio up to taking medians): the CPU each arm spends per text (``cpu_ratio``: (a)'s CPU per
    text over (b)'s, workers and client) and the share of the machine each keeps busy (``busy_ratio``:
    (b)'s over (a)'s; time the workers wait, for the planning or a last SuperBatch, lowers it). A
    neighbour on a shared machine moves the wall clock of both arms far more than their CPU per text,
    so the split says which of the two a change moved.

    Examples
    --------
    >>> split = cpu_split([10.0], [19.0], [11.0], [{"workers": 18.0, "client": 1.0}], 1000, cores=2)
    >>> split["cpu_ratio"], round(split["busy_ratio"], 3), round(split["cpu_ratio"] * split["busy_ratio"], 3)
    (1.0, 0.909, 0.909)
    """
    cores = cores or len(os.sched_getaffinity(0))
    b_total = [sum(c.values()) for c in b_cpu]
    a_busy = statistics.median(c / (s * cores) for c, s in zip(a_cpu, a_s))
    b_busy = statistics.median(c / (s * cores) for c, s in zip(b_total, b_s))
    a_us, b_us = statistics.median(a_cpu) * 1e6 / texts, statistics.median(b_total) * 1e6 / texts
    return {
        "a_cpu_us_per_text": round(a_us, 2),
        "b_cpu_us_per_text": round(b_us, 2),
        "b_client_cpu_us_per_text": round(statistics.median(c["client"] for c in b_cpu) * 1e6 / texts, 2),
        "a_busy": round(a_busy, 4),
        "b_busy": round(b_busy, 4),
        "cpu_ratio": round(a_us / b_us, 4),
        "busy_ratio": round(b_busy / a_busy, 4),
    }


def gil_seconds(
    client, run, *, native: bool = False, threads: bool = False, gil: bool = True, top: int | None = 40
) -> dict:
    """Run ``run()`` while py-spy samples every worker's GIL-holding thread; GIL seconds per worker,
    and where the samples fell (:func:`gil_profile`, per worker, its ``top`` frames, None: all;
    ``native`` adds C/Rust frames). ``gil=False`` samples every running thread instead: CPU
    seconds per worker, by thread."""
    pids = list(client.run(os.getpid).values())
    rate = 250
    tmp = Path(tempfile.mkdtemp())
    spies = []
    for pid in pids:
        out = tmp / f"{pid}.txt"
        spies.append(
            (
                pid,
                out,
                subprocess.Popen(
                    [
                        "py-spy",
                        "record",
                        "--pid",
                        str(pid),
                        *(["--gil"] if gil else []),
                        "--rate",
                        str(rate),
                        "--format",
                        "raw",
                        "--output",
                        str(out),
                        *(["--threads"] if threads else []),
                        *(["--native"] if native else ["--nonblocking"]),
                    ],  # native needs pauses
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                ),
            )
        )
    time.sleep(1.0)  # let py-spy attach
    result, cpu = thread_cpu_during(client, run)
    per_worker, profiles = {}, {}
    for pid, out, proc in spies:
        proc.send_signal(signal.SIGINT)  # py-spy writes its profile on SIGINT
        proc.wait(timeout=60)
        raw = out.read_text() if out.is_file() else ""
        profiles[str(pid)] = gil_profile(raw, top)
        per_worker[str(pid)] = profiles[str(pid)]["samples"] / rate
    shutil.rmtree(tmp, ignore_errors=True)
    return {
        "result": result,
        "gil_s_by_worker": per_worker,
        "rate_hz": rate,
        "profile_by_worker": profiles,
        "thread_cpu_s_by_worker": cpu,
    }


def _per_text_by_thread(runs: list[dict[str, dict[str, float]]], texts: int) -> dict[str, float]:
    """Median over runs of the workers' CPU microseconds per text, per thread name (workers summed)."""
    names = sorted({name for run in runs for worker in run.values() for name in worker})
    return {
        name: round(
            statistics.median(sum(w.get(name, 0.0) for w in run.values()) for run in runs) * 1e6 / texts, 2
        )
        for name in names
    }


def _helper_pids() -> list[int]:
    """Pids of the tokenizer helper processes of the engines loaded in this worker."""
    from dask_surge.models import cache

    pids: list[int] = []
    for loaded in list(cache.loaded()):
        pool = getattr(getattr(loaded.engine, "_packer", None), "_pool", None)
        pids.extend(pool.pids if pool is not None else ())
    return pids


def process_cpu(pid: int | None = None) -> float:
    """CPU seconds of process ``pid`` (this one by default), threads that ended included (Linux ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid or os.getpid()}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def helper_cpu() -> float:
    """CPU seconds of the tokenizer helper processes of the engines loaded in this worker (Linux ``/proc``)."""
    return sum(process_cpu(pid) for pid in _helper_pids())


def pin_process(cores: set[int], pid: int | None = None) -> None:
    """Let every thread of process ``pid`` (this one by default) run on ``cores`` only (Linux).

    Threads started later inherit the affinity of the thread that starts them."""
    pid = pid or os.getpid()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError, PermissionError):  # the thread ended meanwhile
            os.sched_setaffinity(int(tid), cores)


def pin_worker(core: int, others: list[int]) -> list[int]:
    """``--pin``, in a worker: its threads on ``core`` alone, its tokenizer helpers on ``others``;
    the helpers' pids."""
    pin_process({core})
    pids = _helper_pids()
    for pid in pids:
        pin_process(set(others), pid)
    return pids


def _set_config(key: str, value) -> object:
    """Set ``surge.<key>`` in this process's Dask config (a worker's, through ``client.run``); its value now."""
    import dask.config

    dask.config.set({f"surge.{key}": value})
    return dask.config.get(f"surge.{key}")


def gil_by_thread(gil: dict) -> dict[str, float]:
    """GIL seconds per thread name, the workers summed, from :func:`gil_seconds`'s result."""
    out: dict[str, float] = {}
    for prof in gil["profile_by_worker"].values():
        for name, samples in prof["threads"]:
            out[name] = out.get(name, 0.0) + samples / gil["rate_hz"]
    return out


def _slope(small: float, large: float, n_small: int, n_large: int) -> float:
    return (large - small) * 1e6 / (n_large - n_small)


def pin_all(clusters: dict[str, tuple], workers: int) -> set[int]:
    """``--pin``: worker ``i`` of every cluster on core ``i``, their helpers and this process (the
    client, the schedulers, py-spy) on the other cores; those other cores."""
    cores = os.cpu_count() or 1
    if cores <= workers:
        raise SystemExit(
            f"--pin needs more cores than --workers ({workers}); this machine has {cores}. "
            "Fix: run with fewer --workers, or without --pin."
        )
    others = list(range(workers, cores))
    for _cluster, client in clusters.values():
        for i, address in enumerate(sorted(client.scheduler_info()["workers"])):
            client.run(pin_worker, i, others, workers=[address])
    pin_process(set(others))
    return set(others)


def _key_value(text: str) -> tuple[str, object]:
    """``--set max-tokens=65536`` as ``("max-tokens", 65536)`` (the value read as YAML, as Dask reads config)."""
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE; Fix: e.g. --set max-tokens=65536")
    return key.removeprefix("surge."), yaml.safe_load(value)


def tokenpool_ab(args) -> dict:
    """``--tokenpool``: (b) with the helpers off and on, side by side (see the module docstring)."""
    from _noop_forward import register
    from _realtext import read_texts, small_files
    from distributed import Client, LocalCluster

    arms = {"off": 0, "on": args.processes}
    scratch = Path(tempfile.mkdtemp(prefix="host-ceiling-"))
    clusters: dict[str, tuple] = {}
    runs: list[dict] = []
    layouts: dict[str, dict] = {}
    header = script_header(None)
    try:
        for arm, value in arms.items():
            cluster = LocalCluster(
                n_workers=args.workers, threads_per_worker=1, processes=True, dashboard_address="127.0.0.1:0"
            )
            client = Client(cluster)
            clusters[arm] = (cluster, client)
            register(client)  # the forward pass replaced by zeros in each worker: benchmark only
            assert set(client.run(_set_config, "tuning.tokenize-processes", value).values()) == {value}
            for key, value in args.set:  # before the warm-up run loads the model
                assert set(client.run(_set_config, key, value).values()) == {value}
        for key, value in args.set:  # and here, where the run is planned (b-min, b-max)
            assert _set_config(key, value) == value
        warm = small_files(2000, 20, seed=1)[0]
        for arm in arms:  # the model loaded and (on) the helpers started on every worker before the clock
            surge_run(warm, clusters[arm][1], scratch)
        every = set(range(os.cpu_count() or 1))
        if args.pin:
            pinned = pin_all(clusters, args.workers)
            print(
                f"--pin: worker i on core i (both arms), helpers and this process on cores {sorted(pinned)}",
                flush=True,
            )
        for size in args.sizes:
            data, layouts[str(size)] = small_files(size, max(1, size // 100))
            texts = read_texts(data)
            for r in range(args.repeats):
                if args.pin:  # (a) on every core, as always; then this process back off the workers' cores
                    pin_process(every)
                a_s = tokenizer_run(texts)
                if args.pin:
                    pin_process(every - set(range(args.workers)))
                for arm in ("off", "on") if r % 2 == 0 else ("on", "off"):
                    client = clusters[arm][1]
                    h0, p0 = client.run(helper_cpu), client.run(process_cpu)
                    gil = gil_seconds(client, lambda c=client: surge_run(data, c, scratch), threads=True)
                    h1, p1 = client.run(helper_cpu), client.run(process_cpu)
                    seconds, facts = gil["result"]
                    cpu = gil["thread_cpu_s_by_worker"]
                    helpers = sum(h1[w] - h0.get(w, 0.0) for w in h1)
                    workers_cpu = sum(sum(v.values()) for v in cpu.values())
                    runs.append(
                        {
                            "size": size,
                            "round": r,
                            "arm": arm,
                            "tokenize_processes": arms[arm],
                            "loadavg": os.getloadavg(),
                            "a_seconds": a_s,
                            "b_seconds": seconds,
                            "ratio_b_over_a": a_s / seconds,
                            "rows": facts["rows"],
                            "superbatches": facts["superbatches"],
                            "gil_s_by_thread": gil_by_thread(gil),
                            "gil_s": sum(gil["gil_s_by_worker"].values()),
                            "thread_cpu_s": {
                                k: sum(w.get(k, 0.0) for w in cpu.values())
                                for k in sorted({k for w in cpu.values() for k in w})
                            },
                            "workers_cpu_s": workers_cpu,
                            "helpers_cpu_s": helpers,
                            "workers_process_cpu_s": sum(p1[w] - p0[w] for w in p1),
                            "gil_self_top": {w: p["self"][:8] for w, p in gil["profile_by_worker"].items()},
                            "gil_self_top_by_thread": {
                                w: p["self_by_thread"] for w, p in gil["profile_by_worker"].items()
                            },
                        }
                    )
                    last = runs[-1]
                    print(
                        f"n={size:>7,} r{r} {arm:3s} b/a {last['ratio_b_over_a']:.3f}  "
                        f"GIL {last['gil_s'] * 1e6 / size:5.2f} us/text "
                        f"(task {last['gil_s_by_thread'].get('Dask-Default-Threads', 0) * 1e6 / size:4.2f}, "
                        f"loop {last['gil_s_by_thread'].get('MainThread', 0) * 1e6 / size:4.2f})  "
                        f"cpu {(workers_cpu + helpers) * 1e6 / size:5.1f} us/text  load {last['loadavg'][0]:.1f}",
                        flush=True,
                    )
    finally:
        for cluster, client in clusters.values():
            client.close()
            cluster.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        **header,
        "layouts": layouts,
        "pinned": args.pin,
        "worker_config": dict(args.set),
        "workers": args.workers,
        "arms": arms,
        "runs": runs,
        "summary": tokenpool_summary(runs, args.sizes, args.workers, args.pin),
    }


def tokenpool_summary(runs: list[dict], sizes: list[int], workers: int = 1, pinned: bool = False) -> dict:
    """Medians per (size, arm) of the per-text figures; the slopes between the smallest and largest size.

    The event loop's GIL is also given per second of run and per worker
    (``gil_ms_per_s_event_loop_per_worker``): heartbeats and the system monitor cost time, not
    texts, so its per-text figure shrinks as a worker's texts/s grow (on a GPU, say); the task
    thread's per-text figure does not."""

    def med(arm: str, size: int, key) -> float:
        return statistics.median(key(r) for r in runs if r["arm"] == arm and r["size"] == size)

    def thread(name: str):
        return lambda r: r["gil_s_by_thread"].get(name, 0.0)

    out: dict = {"per_size": {}, "slope_us_per_text": {}}
    for size in sizes:
        per = out["per_size"][str(size)] = {}
        for arm in ("off", "on"):
            per[arm] = {
                "ratio_b_over_a": med(arm, size, lambda r: r["ratio_b_over_a"]),
                "b_texts_per_s": size / med(arm, size, lambda r: r["b_seconds"]),
                "gil_us_per_text": med(arm, size, lambda r: r["gil_s"]) * 1e6 / size,
                "gil_us_per_text_task_thread": med(arm, size, thread("Dask-Default-Threads")) * 1e6 / size,
                "gil_us_per_text_event_loop": med(arm, size, thread("MainThread")) * 1e6 / size,
                "gil_ms_per_s_event_loop_per_worker": med(
                    arm, size, lambda r: thread("MainThread")(r) / r["b_seconds"]
                )
                * 1e3
                / workers,
                "cpu_us_per_text_workers": med(arm, size, lambda r: r["workers_cpu_s"]) * 1e6 / size,
                "cpu_us_per_text_helpers": med(arm, size, lambda r: r["helpers_cpu_s"]) * 1e6 / size,
                "process_cpu_us_per_text_workers": med(
                    arm, size, lambda r: r.get("workers_process_cpu_s", 0.0)
                )
                * 1e6
                / size,
            }
        per["on_over_off_b_seconds"] = med("on", size, lambda r: r["b_seconds"]) / med(
            "off", size, lambda r: r["b_seconds"]
        )
    lo, hi = min(sizes), max(sizes)
    if hi > lo:
        for arm in ("off", "on"):
            out["slope_us_per_text"][arm] = {
                "gil_all_threads": _slope(
                    med(arm, lo, lambda r: r["gil_s"]), med(arm, hi, lambda r: r["gil_s"]), lo, hi
                ),
                "gil_task_thread": _slope(
                    med(arm, lo, thread("Dask-Default-Threads")),
                    med(arm, hi, thread("Dask-Default-Threads")),
                    lo,
                    hi,
                ),
                "gil_event_loop": _slope(
                    med(arm, lo, thread("MainThread")), med(arm, hi, thread("MainThread")), lo, hi
                ),
                "process_cpu_workers": _slope(
                    med(arm, lo, lambda r: r.get("workers_process_cpu_s", 0.0)),
                    med(arm, hi, lambda r: r.get("workers_process_cpu_s", 0.0)),
                    lo,
                    hi,
                ),
                "cpu_workers_plus_helpers": _slope(
                    med(arm, lo, lambda r: r["workers_cpu_s"] + r["helpers_cpu_s"]),
                    med(arm, hi, lambda r: r["workers_cpu_s"] + r["helpers_cpu_s"]),
                    lo,
                    hi,
                ),
            }
        # throughput past the per-run costs (planning, the first SuperBatches, the tail): the extra
        # texts over the extra seconds, (b) against (a) on the same texts
        a_extra = med("off", hi, lambda r: r["a_seconds"]) - med("off", lo, lambda r: r["a_seconds"])
        out["marginal_ratio_b_over_a"] = {
            arm: a_extra / (med(arm, hi, lambda r: r["b_seconds"]) - med(arm, lo, lambda r: r["b_seconds"]))
            for arm in ("off", "on")
        }
    out["target_gil_us_per_text"] = 4.0
    out["note"] = (
        "GIL figures are py-spy --gil samples (250 Hz) of the workers, summed over workers; a thread "
        "preempted while it holds the GIL still counts. "
        + (
            "Pinned (--pin): each worker ran on a core of its own, so only its own threads could preempt it. "
            if pinned
            else "The machine is shared: other processes preempt it too. "
        )
        + "process_cpu: the workers' whole CPU (threads that ended included). Slopes: marginal "
        "seconds per text between the smallest and largest size, medians of the runs."
    )
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gil", action="store_true", help="also sample the workers' GIL with py-spy")
    parser.add_argument(
        "--native",
        action="store_true",
        help="with --gil: C and Rust frames too (py-spy then pauses the workers to sample)",
    )
    parser.add_argument(
        "--tokenpool",
        action="store_true",
        help="(b) with surge.tuning.tokenize-processes 0 and --processes side by side, at --sizes",
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[50_000, 150_000])
    parser.add_argument(
        "--processes", type=int, default=1, help="with --tokenpool: helper processes per worker"
    )
    parser.add_argument(
        "--set",
        type=_key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --tokenpool: surge.KEY in the workers, e.g. --set max-tokens=65536 (repeatable)",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="with --tokenpool: each worker on a core of its own, everything else on the other "
        "cores, so no other process preempts a worker thread that holds the GIL",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.tokenpool:
        out = tokenpool_ab(args)
        path = Path(args.out or HERE / "results" / "host_ceiling.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2, default=str) + "\n")
        print(json.dumps(out["summary"], indent=1))
        return out
    args.out = args.out or str(HERE / "results" / "host_ceiling.json")

    from _noop_forward import register
    from _realtext import read_texts, small_files
    from distributed import Client, LocalCluster

    data, layout = small_files(args.n, args.files)
    texts = read_texts(data)
    scratch = Path(tempfile.mkdtemp(prefix="host-ceiling-"))
    cluster = LocalCluster(
        n_workers=args.workers, threads_per_worker=1, processes=True, dashboard_address="127.0.0.1:0"
    )
    client = Client(cluster)
    try:
        register(client)  # the forward pass replaced by zeros in each worker: benchmark only
        warm = small_files(2000, 20, seed=1)[0]
        surge_run(warm, client, scratch)  # load the model on every worker before the clock
        tok_s, surge_s, facts, tok_cpu, surge_cpu, joined_s = [], [], [], [], [], []
        for _ in range(args.repeats):
            c0 = time.process_time()  # the Rust pool's threads are this process's
            tok_s.append(tokenizer_run(texts))
            tok_cpu.append(time.process_time() - c0)
            joined_s.append(tokenizer_run(texts, joined=True))
            ((s, f), cpu), spent = run_cpu(
                client, lambda: thread_cpu_during(client, lambda: surge_run(data, client, scratch))
            )
            surge_s.append(s)
            surge_cpu.append(spent)
            facts.append({**f, "thread_cpu_s_by_worker": cpu, "cpu_s": spent})
        gil = (
            gil_seconds(client, lambda: surge_run(data, client, scratch), native=args.native)
            if args.gil
            else None
        )
        stages = client.run(_engine_stats)
    finally:
        client.close()
        cluster.close()
        shutil.rmtree(scratch, ignore_errors=True)
    a = args.n / statistics.median(tok_s)
    b = args.n / statistics.median(surge_s)
    out = {
        **script_header(argv),
        "layout": layout,
        "workers": args.workers,
        "a_tokenizer_texts_per_s": a,
        "a_seconds": tok_s,
        "b_surge_noop_texts_per_s": b,
        "b_seconds": surge_s,
        "b_runs": facts,
        "ratio_b_over_a": b / a,
        "target_ratio": TARGET,
        "met": b / a >= TARGET,
        "a_joined_texts_per_s": args.n / statistics.median(joined_s),
        "a_joined_seconds": joined_s,
        "ratio_b_over_a_joined": b / (args.n / statistics.median(joined_s)),
        "b_thread_cpu_us_per_text": _per_text_by_thread([f["thread_cpu_s_by_worker"] for f in facts], args.n),
        "cpu": cpu_split(tok_s, tok_cpu, surge_s, surge_cpu, args.n),
        "engine_stage_seconds_by_worker": stages,
    }
    if gil is not None:
        gil_total = sum(gil["gil_s_by_worker"].values())
        out["gil"] = {
            **gil,
            "gil_us_per_text": gil_total * 1e6 / args.n,
            "note": "py-spy --gil samples of the workers during one extra (b) run (run seconds: "
            f"{gil['result'][0]:.2f}); samples / rate = seconds a worker thread held the GIL",
        }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(
        f"(a) tokenizer {a:,.0f} texts/s   (b) SURGE no-op forward {b:,.0f} texts/s   "
        f"ratio {b / a:.3f} (target >= {TARGET})"
    )
    print(
        f"(a') tokenizer, texts joined (JoinedTokenizer, as the pipeline tokenizes) {out['a_joined_texts_per_s']:,.0f} "
        f"texts/s   ratio (b) / (a') {out['ratio_b_over_a_joined']:.3f}"
    )
    split = out["cpu"]
    print(
        f"CPU us per text: (a) {split['a_cpu_us_per_text']:.1f}, (b) {split['b_cpu_us_per_text']:.1f} "
        f"(workers and client); machine busy: (a) {split['a_busy']:.0%}, (b) {split['b_busy']:.0%}; "
        f"ratio = CPU {split['cpu_ratio']:.3f} x busy {split['busy_ratio']:.3f}"
    )
    print(
        "worker CPU us per text by thread (median of the (b) runs, workers summed): "
        + ", ".join(
            f"{k} {v:.1f}" for k, v in sorted(out["b_thread_cpu_us_per_text"].items(), key=lambda kv: -kv[1])
        )
    )
    if gil is not None:
        print(f"GIL-holding us per text (workers, summed): {out['gil']['gil_us_per_text']:.1f}")
    return out


if __name__ == "__main__":
    main()
