"""Smoke run of the host-ceiling benchmark at a tiny size (what it writes, never how fast).

The other benchmarks' smoke runs are in ``tests/test_benchmarks_smoke.py``; this one stays a
script run as a file, as the GPU session runs it.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_host_ceiling_writes_its_ratio(tmp_path):
    out = tmp_path / "h.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "host_ceiling.py"),
            "--n",
            "2000",
            "--files",
            "20",
            "--repeats",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=str(ROOT),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["b_runs"][0]["rows"] == 2000 and report["ratio_b_over_a"] > 0 and "met" in report
    cpu = report["cpu"]  # both arms spent CPU on the texts, and kept part of the machine busy
    assert cpu["a_cpu_us_per_text"] > 0 and cpu["b_cpu_us_per_text"] > cpu["b_client_cpu_us_per_text"] > 0
    assert 0 < cpu["b_busy"] and 0 < cpu["a_busy"]


def test_cpu_split_factors_the_ratio_into_cpu_per_text_and_the_busy_share():
    module = _host_ceiling_module()
    # (a): 10 s and 11 s of wall, 19 and 21 CPU-s; (b): 12 s and 13 s, with 18 + 2 and 19 + 2 CPU-s, 2 cores
    split = module.cpu_split(
        [10.0, 11.0],
        [19.0, 21.0],
        [12.0, 13.0],
        [{"workers": 18.0, "client": 2.0}, {"workers": 19.0, "client": 2.0}],
        1000,
        cores=2,
    )
    assert split["a_cpu_us_per_text"] == 20000.0 and split["b_cpu_us_per_text"] == 20500.0
    assert split["b_client_cpu_us_per_text"] == 2000.0
    assert split["cpu_ratio"] == round(20000 / 20500, 4)
    a_busy = (19 / 20 + 21 / 22) / 2
    b_busy = (20 / 24 + 21 / 26) / 2
    assert split["busy_ratio"] == round(b_busy / a_busy, 4)
    # the product is the texts/s ratio, up to the medians (here 10.5 / 12.5 = 0.84)
    assert abs(split["cpu_ratio"] * split["busy_ratio"] - 10.5 / 12.5) < 0.01


def _host_ceiling_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("host_ceiling", ROOT / "benchmarks" / "host_ceiling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gil_profile_says_where_the_samples_fall():
    """py-spy's raw lines (``frame;frame count``, the root a thread with ``--threads``) summed per thread,
    leaf frame and frame."""
    module = _host_ceiling_module()
    raw = "\n".join(
        [
            "thread (0x1);run (a.py:1);pack (t.py:9) 3",
            "thread (0x1);run (a.py:1);free (t.py:12) 2",
            "<module> (<string>:1);loop (b.py:4) 1",
            "not a sample line",
        ]
    )
    profile = module.gil_profile(raw)
    assert profile["samples"] == 6
    assert profile["threads"] == [("thread (0x1)", 5), ("<module> (<string>:1)", 1)]
    assert profile["self"][0] == ("pack (t.py:9)", 3)
    assert dict(profile["inclusive"])["run (a.py:1)"] == 5
    assert profile["self_by_thread"] == {
        "thread (0x1)": [("pack (t.py:9)", 3), ("free (t.py:12)", 2)],
        "<module> (<string>:1)": [("loop (b.py:4)", 1)],
    }
    named = module.gil_profile(
        "thread (9574): MainThread;<module> (<string>:7) 4\n"
        "thread (9616): Dask-Default-Threads-9616-0;run (a.py:1) 2"
    )
    assert named["threads"] == [("MainThread", 4), ("Dask-Default-Threads", 2)]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux /proc")
def test_thread_cpu_names_python_threads_and_counts_the_rest_as_native():
    import threading

    module = _host_ceiling_module()

    busy, stop = threading.Event(), threading.Event()

    def spin():  # burns 0.05 s of its own CPU, then spins on until the snapshot is taken
        end = module.time.thread_time() + 0.05
        while module.time.thread_time() < end:
            pass
        busy.set()
        while not stop.is_set():
            pass

    worker = threading.Thread(target=spin, name="Busy-12")
    worker.start()
    try:
        assert busy.wait(60)
        during = module.thread_cpu()  # the thread is alive and has run (process-wide CPU ended it too early)
    finally:
        stop.set()
        worker.join()
    assert "Busy" in during and "MainThread" in during and all(v >= 0 for v in during.values())


def test_tokenpool_summary_gives_the_event_loop_per_second_and_the_task_thread_per_text():
    """A loop cost that follows the seconds and a task cost that follows the texts: the summary's
    per-second loop figure is the same at both sizes, its per-text task figure too."""
    module = _host_ceiling_module()
    runs = []
    for size, seconds in ((1000, 2.0), (3000, 4.0)):
        for arm in ("off", "on"):
            runs.append(
                {
                    "size": size,
                    "arm": arm,
                    "a_seconds": seconds / 2,
                    "b_seconds": seconds,
                    "ratio_b_over_a": 0.5,
                    "gil_s": 0.0,
                    "workers_cpu_s": 1.0,
                    "helpers_cpu_s": 0.0,
                    # 2 workers: 30 ms of loop GIL per second each; 4 us of task GIL per text
                    "gil_s_by_thread": {
                        "MainThread": 2 * 0.030 * seconds,
                        "Dask-Default-Threads": 4e-6 * size,
                    },
                }
            )
    out = module.tokenpool_summary(runs, [1000, 3000], workers=2)
    for size in ("1000", "3000"):
        per = out["per_size"][size]["on"]
        assert per["gil_ms_per_s_event_loop_per_worker"] == pytest.approx(30.0)
        assert per["gil_us_per_text_task_thread"] == pytest.approx(4.0)
    # per text, the loop's figure falls as the texts per second grow
    assert (
        out["per_size"]["3000"]["on"]["gil_us_per_text_event_loop"]
        < out["per_size"]["1000"]["on"]["gil_us_per_text_event_loop"]
    )


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or not Path("/proc/self/task").is_dir(),
    reason="sets Linux CPU affinity",
)
def test_pin_process_pins_every_thread_and_new_threads_inherit_it():
    """``--pin``'s mechanism: every live thread of the process gets the cores, and a thread started
    afterwards inherits them (so a worker's later task threads stay on its core)."""
    import threading

    module = _host_ceiling_module()
    every = os.sched_getaffinity(0)
    ready, stop = threading.Event(), threading.Event()
    seen: dict[str, set[int]] = {}

    def body(name: str) -> None:
        ready.set()
        stop.wait(10)
        seen[name] = os.sched_getaffinity(0)

    before = threading.Thread(target=body, args=("before",))
    before.start()
    ready.wait(10)
    one = {min(every)}
    try:
        module.pin_process(one)
        after = threading.Thread(target=body, args=("after",))
        after.start()
        assert os.sched_getaffinity(0) == one
        stop.set()
        before.join(10)
        after.join(10)
        assert seen == {"before": one, "after": one}
    finally:
        module.pin_process(every)
    assert os.sched_getaffinity(0) == every


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads Linux /proc")
def test_process_cpu_counts_threads_that_ended():
    """The whole process's CPU, unlike :func:`thread_cpu`'s live threads: a thread that burned CPU and
    ended still counts."""
    import threading
    import time

    module = _host_ceiling_module()
    before = module.process_cpu()

    def burn() -> None:
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass

    t = threading.Thread(target=burn)
    t.start()
    t.join()
    assert module.process_cpu() - before >= 0.25
    assert module.process_cpu(os.getpid()) >= module.process_cpu() - 0.05
