"""dask-surge on a real SLURM: jobs submitted, cancelled mid-run, and the run resumed.

Run with ``pytest -m slurm tests/test_slurm.py`` (the default run deselects the marker).
The module fixture ``slurm`` starts a one-node SLURM as root: ``munged``, ``slurmctld``
and ``slurmd``, configured under a temporary directory (2 CPUs, ``select/cons_tres``,
one ``debug`` partition, a GRES ``gpu`` that is no GPU). It installs nothing: ``.ci/run``
installs the Debian packages (``apt-get install slurm-wlm munge``). Without them, or
when the daemons do not come up, every test here is skipped with the reason.

Workers run in SLURM jobs, in processes of their own, so the model must be importable
there: it lives in a module written to a temporary directory that every job puts on its
``PYTHONPATH`` (workers cannot import this test module).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("dask_jobqueue", reason="HPC tests need the [jobqueue] extra (dask-jobqueue)")

import dask
import dask.dataframe as dd
from distributed import Client

import dask_surge
from dask_surge.execution.hpc import jobqueue_cluster

pytestmark = pytest.mark.slurm

PROGRAMS = ("munged", "slurmctld", "slurmd", "sinfo", "squeue", "sbatch", "scancel", "scontrol")
UP_WITHIN_S = 60  # how long the daemons may take to show the node idle before the tests skip
ROWS, FILES = 2_000, 40
REPO = Path(__file__).resolve().parents[1]


def _which(name: str) -> str | None:
    # the daemons live in /usr/sbin, which a non-login PATH may lack
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Slurm:
    """A one-node SLURM started by this test module; every process it started, by PID."""

    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: list[subprocess.Popen] = []
        self.node = socket.gethostname().split(".")[0]

    # -- set-up -------------------------------------------------------------------------------
    def write_config(self) -> None:
        r = self.root
        for d in ("state", "spool", "log", "run", "munge"):
            (r / d).mkdir(mode=0o700)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        import psutil

        mem_mb = int(psutil.virtual_memory().total / 2**20 * 0.9)
        self.conf.write_text(
            textwrap.dedent(f"""\
            ClusterName=surgetest
            SlurmctldHost={self.node}(127.0.0.1)
            SlurmctldPort={_free_port()}
            SlurmdPort={_free_port()}
            CommunicationParameters=NoInAddrAny
            SlurmUser=root
            SlurmdUser=root
            AuthType=auth/munge
            CredType=cred/munge
            AuthInfo=socket={r}/munge/sock
            StateSaveLocation={r}/state
            SlurmdSpoolDir={r}/spool
            SlurmctldPidFile={r}/run/slurmctld.pid
            SlurmdPidFile={r}/run/slurmd.pid
            SlurmctldLogFile={r}/log/slurmctld.log
            SlurmdLogFile={r}/log/slurmd.log
            ProctrackType=proctrack/linuxproc
            TaskPlugin=task/none
            JobAcctGatherType=jobacct_gather/none
            AccountingStorageType=accounting_storage/none
            JobCompType=jobcomp/none
            MpiDefault=none
            ReturnToService=2
            SchedulerType=sched/backfill
            SelectType=select/cons_tres
            SelectTypeParameters=CR_Core
            MinJobAge=300
            KillWait=5
            GresTypes=gpu
            NodeName={self.node} NodeAddr=127.0.0.1 CPUs=2 RealMemory={mem_mb} Gres=gpu:1 State=UNKNOWN
            PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
            """)
        )
        # A GPU GRES with no GPU behind it. Slurm 22.05 drops a GPU GRES without File=
        # ("Removing file-less GPU"), so /dev/null stands in for the device.
        (r / "gres.conf").write_text(
            f"AutoDetect=off\nNodeName={self.node} Name=gpu Count=1 File=/dev/null\n"
        )

    def _start(self, name: str, *args: str) -> subprocess.Popen:
        with open(self.root / "log" / f"{name}.out", "wb") as out:
            proc = subprocess.Popen(
                [_which(name), *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.root,
            )
        self.procs.append(proc)
        return proc

    def start(self) -> str | None:
        """Start munged, slurmctld, slurmd (in the foreground, so their PIDs are ours).
        Returns None once the node is idle, else why not."""
        r = self.root
        self._start(
            "munged",
            "-F",
            "--force",
            f"--socket={r}/munge/sock",
            f"--key-file={r}/munge/munge.key",
            f"--log-file={r}/log/munged.log",
            f"--pid-file={r}/run/munged.pid",
            f"--seed-file={r}/munge/seed",
        )
        if not self._wait(lambda: (r / "munge" / "sock").exists(), 20):
            return self.exited() or "munged did not create its socket within 20 s"
        self._start("slurmctld", "-D", "-i")
        self._start("slurmd", "-D", "-N", self.node)
        if not self._wait(lambda: self.node_state() == "idle", UP_WITHIN_S):
            return self.exited() or (
                f"the node is {self.node_state()!r}, not idle, {UP_WITHIN_S} s after starting the daemons"
            )
        return None

    def exited(self) -> str | None:
        """Which daemon we started has exited, with its code (None while all run)."""
        for p in self.procs:
            if p.poll() is not None:
                return f"{Path(p.args[0]).name} exited with code {p.returncode}"
        return None

    def _wait(self, ready, within_s: float) -> bool:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if self.exited():
                return False
            if ready():
                return True
            time.sleep(0.25)
        return False

    # -- queries --------------------------------------------------------------------------------
    def run(self, *cmd: str, check: bool = True, input: str | None = None) -> str:
        res = subprocess.run(
            [_which(cmd[0]), *cmd[1:]],
            env=self.env,
            capture_output=True,
            text=True,
            input=input,
            timeout=60,
            check=False,
        )
        if check and res.returncode:
            raise RuntimeError(f"{' '.join(cmd)} exited {res.returncode}: {res.stderr.strip()}")
        return res.stdout.strip()

    def node_state(self) -> str:
        return self.run("sinfo", "-h", "-N", "-o", "%t", check=False)

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -d`` as a dict (kept MinJobAge=300 s after the job ends)."""
        text = self.run("scontrol", "show", "job", "-d", "-o", job_id)
        return dict(f.split("=", 1) for f in text.split() if "=" in f)

    def wait_job(self, job_id: str, states: set[str], within_s: float = 120) -> dict[str, str]:
        deadline = time.monotonic() + within_s
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states or time.monotonic() > deadline:
                return info
            time.sleep(0.25)

    def jobs(self) -> list[str]:
        return self.run("squeue", "-h", "-o", "%i", check=False).split()

    def logs(self) -> str:
        tails = []
        for f in sorted((self.root / "log").glob("*")):
            lines = f.read_text(errors="replace").splitlines()[-8:]
            tails.append(f"--- {f.name}\n" + "\n".join(lines))
        return "\n".join(tails)

    # -- tear-down ------------------------------------------------------------------------------
    def stop(self) -> None:
        """Cancel every job, then stop the daemons we started, by PID, newest first."""
        if self.procs and all(p.poll() is None for p in self.procs):
            for job_id in self.jobs():
                self.run("scancel", job_id, check=False)
            self._wait(lambda: not self.jobs(), 30)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)


@pytest.fixture(scope="module")
def slurm():
    """A running one-node SLURM (``SLURM_CONF`` set for this module), stopped at the end."""
    missing = [p for p in PROGRAMS if _which(p) is None]
    if missing:
        pytest.skip(
            f"SLURM is not installed ({', '.join(missing)} not found). "
            "Fix: apt-get install slurm-wlm munge (as .ci/run does)"
        )
    if os.geteuid() != 0:
        pytest.skip("slurmd and munged run as root here; these tests need root (CI runs them as root)")
    root = Path(tempfile.mkdtemp(prefix="surge-slurm-"))
    cluster = Slurm(root)
    cluster.write_config()
    try:
        why = cluster.start()
        if why is not None:
            logs = cluster.logs()
            cluster.stop()
            pytest.skip(f"SLURM did not come up: {why}.\n{logs}")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SLURM_CONF", str(cluster.conf))  # dask-jobqueue runs sbatch/scancel with our env
            yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


MODEL_SOURCE = '''
import os
import time
import zlib

import numpy as np


class SlowHash:
    """A deterministic model: each text's vector is seeded by its CRC-32, so it does not
    depend on the batch, the worker or the run. A worker whose environment sets
    SURGE_SLURM_DELAY sleeps that many seconds per SuperBatch call (a call of more than
    one text), so a run lasts long enough to be interrupted; the model itself (and so the
    run's fingerprint) is the same with or without it."""

    def __init__(self, dim=8):
        self.dim = int(dim)

    def __call__(self, texts):
        if len(texts) > 1:
            time.sleep(float(os.environ.get("SURGE_SLURM_DELAY", "0")))
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        for i, t in enumerate(texts):
            out[i] = np.random.default_rng(zlib.crc32(t.encode("utf-8", "surrogatepass"))).standard_normal(self.dim)
        return out
'''


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A directory holding ``surge_slurm_model.py``, on this process's ``sys.path``."""
    d = tmp_path_factory.mktemp("slurm-model")
    (d / "surge_slurm_model.py").write_text(MODEL_SOURCE)
    sys.path.insert(0, str(d))
    yield d
    sys.path.remove(str(d))
    sys.modules.pop("surge_slurm_model", None)


def _model():
    import surge_slurm_model

    return surge_slurm_model.SlowHash()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """2,000 short texts in 40 Parquet files of 50 rows."""
    d = tmp_path_factory.mktemp("slurm-data")
    rng = np.random.default_rng(0)
    words = np.array(
        [
            "alpha",
            "beta",
            "gamma",
            "delta",
            "epsilon",
            "zeta",
            "eta",
            "theta",
            "iota",
            "kappa",
            "lambda",
            "mu",
        ]
    )
    for f in range(FILES):
        n = ROWS // FILES
        texts = [" ".join(rng.choice(words, size=rng.integers(2, 12))) + f" {f}-{i}" for i in range(n)]
        pd.DataFrame({"text": texts}).to_parquet(d / f"part-{f:03d}.parquet")
    return d


def _cluster(model_dir: Path, tmp: Path, delay: float = 0.0, **kwargs):
    """CPU jobs of one core each, scheduler and workers on loopback, logs under ``tmp``;
    the model sleeps ``delay`` s per SuperBatch in these jobs."""
    prologue = [f"export PYTHONPATH={model_dir}", f"export SURGE_SLURM_DELAY={delay}"]
    opts = {
        "gpus": 0,
        "cores": 1,
        "memory": "2GB",
        "walltime": None,
        "interface": "lo",
        "scheduler_options": {"dashboard_address": "127.0.0.1:0"},
        "log_directory": str(tmp / "logs"),
        "job_script_prologue": prologue,
    }
    opts.update(kwargs)
    return jobqueue_cluster("slurm", **opts)


def _encode(data: Path, output: Path, client):
    ddf = dd.read_parquet(str(data))
    return ddf.surge.encode("text", output=str(output), model=_model(), scheduler=client, progress=False)


def _read(output: Path) -> pd.DataFrame:
    df = dask_surge.read_embeddings(str(output)).compute()
    return df.sort_values(["partition", "row"]).reset_index(drop=True)


def _job_ids(cluster) -> list[str]:
    return [str(job.job_id) for job in cluster.workers.values() if getattr(job, "job_id", None)]


# -- the tests ---------------------------------------------------------------------------------------


def test_the_node_has_two_cpus_and_a_gpu_gres(slurm):
    line = slurm.run("sinfo", "-h", "-N", "-o", "%N %c %G %P %t")
    assert line.split() == [slurm.node, "2", "gpu:1", "debug*", "idle"]


def test_a_gpu_job_script_is_accepted_and_scheduled_on_a_gres_node(slurm, tmp_path):
    """The GPU form's job script (``--gres=gpu:1``, a dask-cuda worker) is accepted by
    SLURM and scheduled on the node that declares a GPU GRES, with the GRES allocated.
    Its worker then fails: this node has no CUDA (and, here, no dask-cuda), which is
    expected and is what the log shows."""
    with jobqueue_cluster(
        "slurm",
        gpus=1,
        cores=1,
        memory="1GB",
        walltime=None,
        interface="lo",
        scheduler_options={"dashboard_address": "127.0.0.1:0"},
        log_directory=str(tmp_path / "logs"),
    ) as cluster:
        script = cluster.job_script()
        assert "#SBATCH --gres=gpu:1" in script and "-m dask_cuda.cli" in script
        job_id = slurm.run("sbatch", "--parsable", input=script).split(";")[0]
        info = slurm.wait_job(job_id, {"FAILED", "COMPLETED", "CANCELLED", "TIMEOUT", "NODE_FAIL"})
    assert info["JobState"] == "FAILED", info  # scheduled and started; its worker then died
    assert info["NodeList"] == slurm.node
    assert info["JOB_GRES"] == "gpu:1", info  # the node's GPU GRES was allocated to it
    err = (tmp_path / "logs" / f"dask-worker-{job_id}.err").read_text()
    assert "dask_cuda" in err or "CUDA" in err, err[-2000:]


@pytest.fixture(scope="module")
def undisturbed(slurm, model_dir, dataset, tmp_path_factory):
    """One run over 2 CPU jobs, nothing cancelled: its output directory, result and logs."""
    tmp = tmp_path_factory.mktemp("undisturbed")
    with _cluster(model_dir, tmp) as cluster, Client(cluster) as client:
        t0 = time.perf_counter()
        cluster.scale(jobs=2)
        client.wait_for_workers(2, timeout=120)
        workers_up_s = time.perf_counter() - t0
        result = _encode(dataset, tmp / "emb", client)
        done_s = time.perf_counter() - t0
        ttfo_from_scale_s = done_s - (result.seconds - result.ttfo_s)  # the first commit, on this clock
        jobs = _job_ids(cluster)
    print(
        f"\n2 SLURM jobs: workers up {workers_up_s:.1f} s after scale(); first SuperBatch committed "
        f"{ttfo_from_scale_s:.1f} s after scale(); encode() returned {done_s:.1f} s after scale()"
    )
    return {"output": tmp / "emb", "result": result, "logs": tmp / "logs", "jobs": jobs}


def test_two_jobs_write_every_row_exactly_once(undisturbed):
    df = _read(undisturbed["output"])
    assert len(df) == ROWS and undisturbed["result"].rows == ROWS
    assert not df.duplicated(["partition", "row"]).any()
    per_file = df.groupby("partition")["row"].agg(["min", "max", "count"])
    assert len(per_file) == FILES
    assert (per_file["min"] == 0).all() and (per_file["max"] == ROWS // FILES - 1).all()
    assert (per_file["count"] == ROWS // FILES).all()
    assert undisturbed["result"].superbatches > 2  # both jobs had work to share


def test_worker_logs_land_in_log_directory(undisturbed):
    assert len(undisturbed["jobs"]) == 2
    for job_id in undisturbed["jobs"]:
        err = undisturbed["logs"] / f"dask-worker-{job_id}.err"
        assert "Starting established connection" in err.read_text() or "Registered to" in err.read_text(), err


def _cancel_mid_run(slurm, cluster, client, data: Path, output: Path, victims: int) -> tuple[dict, int]:
    """Start the run, ``scancel`` ``victims`` of the cluster's jobs once a SuperBatch is
    committed, and wait for the run to end. Returns ({"result"} or {"error"}, SuperBatches
    committed when the jobs were cancelled)."""
    outcome: dict = {}

    def run():
        try:
            outcome["result"] = _encode(data, output, client)
        except Exception as err:  # noqa: BLE001 - the test checks it
            outcome["error"] = err

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    while runner.is_alive() and dask_surge.status(str(output)).get("superbatches_committed", 0) < 1:
        time.sleep(0.1)
    committed = dask_surge.status(str(output)).get("superbatches_committed", 0)
    cancelled = _job_ids(cluster)[:victims]
    for job_id in cancelled:
        slurm.run("scancel", job_id)
    runner.join(300)
    assert not runner.is_alive(), "the run neither finished nor stopped within 300 s of the scancel"
    for job_id in cancelled:
        assert slurm.wait_job(job_id, {"CANCELLED"})["JobState"] == "CANCELLED"
    print(
        f"\nscancel {victims} job(s) after {committed} committed SuperBatch(es): "
        f"{'stopped: ' + repr(outcome['error']) if 'error' in outcome else 'finished'}"
    )
    return outcome, committed


def _rerun_on_one_job(model_dir: Path, tmp: Path, data: Path, output: Path):
    with _cluster(model_dir, tmp) as cluster, Client(cluster) as client:
        cluster.scale(jobs=1)
        client.wait_for_workers(1, timeout=120)
        return _encode(data, output, client)


def _assert_identical(output: Path, reference: Path) -> None:
    got, want = _read(output), _read(reference)
    assert got[["partition", "row"]].equals(want[["partition", "row"]])
    assert np.array_equal(np.stack(got["embedding"]), np.stack(want["embedding"]))


def test_preempted_job_then_resume_on_a_different_number_of_jobs(
    slurm, model_dir, dataset, undisturbed, tmp_path
):
    """``scancel`` one of two jobs after the first commit. The run either finishes on the
    other worker or stops with a message that says how to resume. Rerunning on 1 job
    resumes and writes output identical to the undisturbed run."""
    output = tmp_path / "emb"
    with _cluster(model_dir, tmp_path, delay=1.0) as cluster, Client(cluster) as client:
        cluster.scale(jobs=2)
        client.wait_for_workers(2, timeout=120)
        outcome, committed = _cancel_mid_run(slurm, cluster, client, dataset, output, victims=1)
    if "error" in outcome:
        assert "rerun" in str(outcome["error"]).lower(), outcome["error"]
    else:
        assert outcome["result"].rows == ROWS
    again = _rerun_on_one_job(model_dir, tmp_path / "rerun", dataset, output)
    assert again.resumed and again.skipped_superbatches >= committed
    _assert_identical(output, undisturbed["output"])


def test_every_job_lost_stops_the_run_then_one_job_resumes_it(
    slurm, model_dir, dataset, undisturbed, tmp_path
):
    """Both jobs cancelled after the first commit. With ``no-workers-timeout`` set the
    scheduler gives up on the SuperBatches left (by default it waits for workers); the
    run stops, keeps its commits, and a rerun on 1 job encodes only the rest, into output
    identical to the undisturbed run. The error must say how to resume."""
    output = tmp_path / "emb"
    with (
        dask.config.set({"distributed.scheduler.no-workers-timeout": "10s"}),
        _cluster(model_dir, tmp_path, delay=1.0) as cluster,
        Client(cluster) as client,
    ):
        cluster.scale(jobs=2)
        client.wait_for_workers(2, timeout=120)
        outcome, committed = _cancel_mid_run(slurm, cluster, client, dataset, output, victims=2)
    assert "error" in outcome, "the run finished although every job was cancelled"
    stopped = dask_surge.status(str(output))
    assert stopped["state"] == "incomplete" and stopped["superbatches_committed"] >= committed >= 1
    again = _rerun_on_one_job(model_dir, tmp_path / "rerun", dataset, output)
    assert again.resumed and again.skipped_superbatches == stopped["superbatches_committed"]
    assert again.superbatches - again.skipped_superbatches >= 1  # the rerun did the rest
    _assert_identical(output, undisturbed["output"])
    assert "rerun" in str(outcome["error"]).lower(), (
        f"the error does not say how to resume: {outcome['error']!r}"
    )


def test_an_adaptive_cluster_replaces_a_preempted_job(slurm, model_dir, tmp_path):
    """``cluster.adapt(minimum_jobs=2)`` submits a new job when one is cancelled (what the
    README suggests so that a run outlives preemptions)."""
    with _cluster(model_dir, tmp_path) as cluster, Client(cluster) as client:
        cluster.adapt(minimum_jobs=2, maximum_jobs=2)
        client.wait_for_workers(2, timeout=120)
        first = _job_ids(cluster)
        slurm.run("scancel", first[0])
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not set(_job_ids(cluster)) - set(first):
            time.sleep(0.5)
        replaced = set(_job_ids(cluster)) - set(first)
        assert replaced, f"no job replaced {first[0]} within 120 s (jobs: {_job_ids(cluster)})"
        client.wait_for_workers(2, timeout=120)
    assert first[1] not in replaced and first[0] not in replaced


def test_the_example_runs_as_documented(slurm, dataset, tmp_path):
    """``examples/slurm_encode.py`` with its CPU flag, as the README shows it."""
    cmd = [
        sys.executable,
        str(REPO / "examples" / "slurm_encode.py"),
        str(dataset),
        str(tmp_path / "emb"),
        "--cpu",
        "--jobs",
        "1",
        "--cores",
        "1",
        "--memory",
        "2GB",
        "--log-directory",
        str(tmp_path / "logs"),
    ]
    res = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=480,
        cwd=tmp_path,
        check=False,
        env={**os.environ, "SLURM_CONF": str(slurm.conf)},
    )
    print("\n" + res.stdout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "first SuperBatch committed" in res.stdout
    assert len(_read(tmp_path / "emb")) == ROWS
    assert list((tmp_path / "logs").glob("dask-worker-*.err")), "no worker log where --log-directory says"
