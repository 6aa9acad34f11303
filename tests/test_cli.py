import json
import sys

import pandas as pd
import pytest

import dask_surge
from dask_surge.cli import main
from dask_surge.testing import make_texts, write_partitioned_parquet


@pytest.mark.parametrize("fmt", ["parquet", "csv", "jsonl", "csv glob"])
def test_encode_each_format(tmp_path, tiny_model, fmt, capsys):
    """A directory of each format, and a glob of CSV files (each file one partition)."""
    src = tmp_path / "in"
    src.mkdir()
    sizes = [4, 0, 9, 1] if fmt == "parquet" else [4, 9, 1]
    if fmt == "parquet":
        write_partitioned_parquet(src, sizes)
    else:
        texts, start = make_texts(sum(sizes), seed=2), 0
        for i, n in enumerate(sizes):
            df = pd.DataFrame({"text": texts[start : start + n], "doc_id": range(start, start + n)})
            start += n
            if fmt.startswith("csv"):
                df.to_csv(src / f"p{i}.csv", index=False)
            else:
                df.to_json(src / f"p{i}.jsonl", orient="records", lines=True)
    out = tmp_path / "emb"
    code = main(
        [
            "encode",
            str(src / "p*.csv") if fmt == "csv glob" else str(src),
            "--text-column",
            "text",
            "--output",
            str(out),
            "--keep",
            "doc_id",
            "--model",
            tiny_model,
            "--b-min",
            "5",
            "--b-max",
            "10",
            "--device",
            "cpu",
            "--scheduler",
            "sync",
            "--no-progress",
            "--json",
        ]
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["rows"] == sum(sizes)
    back = dask_surge.read_embeddings(str(out)).compute()
    assert sorted(back.doc_id) == list(range(sum(sizes)))
    assert main(["status", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows_committed"] == sum(sizes)


def test_cli_errors_are_one_line(tmp_path, capsys):
    write_partitioned_parquet(tmp_path / "in", [2])
    code = main(
        [
            "encode",
            str(tmp_path / "in"),
            "--text-column",
            "nope",
            "--output",
            str(tmp_path / "o"),
            "--scheduler",
            "sync",
        ]
    )
    assert code == 2
    assert "text column 'nope' is not in the DataFrame" in capsys.readouterr().err
    assert main(["encode", str(tmp_path / "missing.parquet"), "--text-column", "t", "--output", "x"]) == 2


def test_demo_small(tmp_path, tiny_model, capsys):
    code = main(
        [
            "demo",
            "--rows",
            "300",
            "--partitions",
            "30",
            "--dir",
            str(tmp_path / "demo"),
            "--model",
            tiny_model,
            "--device",
            "cpu",
            "--scheduler",
            "sync",
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "read back 300 rows, 300 distinct (partition, row) of 300 input rows: OK" in out


def test_plan_command(tmp_path, capsys):
    write_partitioned_parquet(tmp_path / "in", [3, 4, 20, 1])
    assert main(["plan", str(tmp_path / "in"), "--text-column", "text", "--b-min", "5", "--b-max", "8"]) == 0
    out = capsys.readouterr().out
    assert "28 rows in 4 partitions -> 5 SuperBatches of 1-8 rows" in out and "metadata" in out


def _junk_model(tmp_path):
    d = tmp_path / "junk-model"
    d.mkdir()
    (d / "notes.txt").write_text("not a model")
    return str(d)


@pytest.mark.parametrize(
    "extra,data,match",
    [
        (["--b-min", "10", "--b-max", "5"], None, "--b-min 10 is larger than --b-max 5"),
        (["--b-min", "0"], None, "--b-min 0 must be a positive int"),
        (["--max-bytes", "lots"], None, "--max-bytes lots must be a positive int of bytes"),
        (["--model", "/does/not/exist"], None, "does not exist"),
        (["--model", "JUNK"], None, "not a sentence-transformers or Hugging Face text encoder"),
        ([], {"text": [1, 2, 3]}, "holds (a int|int64 values) .* only strings can be encoded"),
        ([], {"text": ["a", None]}, "1 null value.*partition 0, first at row 1.*--on-null skip"),
        ([], {"body": ["a"]}, "text column 'text' is not in the DataFrame"),
    ]
    + ([] if __import__("torch").cuda.is_available() else [(["--device", "cuda"], None, "asks for a GPU")]),
)
def test_bad_input_from_the_cli_is_one_clear_line_and_writes_nothing(tmp_path, capsys, extra, data, match):
    src = tmp_path / "in"
    if data is None:
        write_partitioned_parquet(src, [3, 2])
    else:
        src.mkdir()
        pd.DataFrame(data).to_parquet(src / "p0.parquet")
    extra = [_junk_model(tmp_path) if x == "JUNK" else x for x in extra]
    out = tmp_path / "o"
    code = main(
        [
            "encode",
            str(src),
            "--text-column",
            "text",
            "--output",
            str(out),
            "--scheduler",
            "sync",
            "--no-progress",
            "--device",
            "cpu",
            *extra,
        ]
    )
    # the error is the last line of stderr (earlier tests may have left model-loading bars on)
    err = capsys.readouterr().err.rsplit("\r", 1)[-1].strip().splitlines()[-1]
    assert code == 2 and err.startswith("dask-surge: error: "), err
    assert __import__("re").search(match, err), err
    assert "Fix: " in err  # and says what to do
    assert not list(out.glob("part-*.parquet"))  # nothing that could look like output


def test_the_cli_adds_one_console_handler_that_follows_stderr(tmp_path, capsys):
    """Called twice in one process (a notebook, a test), the CLI logs each message once, to the
    stderr of the moment (a handler holding an old, closed stream once broke later logging)."""
    import logging

    from dask_surge.cli import main

    package = logging.getLogger("dask_surge")
    main(["status", str(tmp_path / "none")])
    main(["status", str(tmp_path / "none")])
    mine = [h for h in package.handlers if type(h).__name__ == "_StderrHandler"]
    assert len(mine) == 1 and mine[0].stream is sys.stderr
    capsys.readouterr()
    package.warning("once")
    assert capsys.readouterr().err.count("once") == 1


def _encode_cli(inputs, out, *extra):
    return main(
        [
            "encode",
            *inputs,
            "--text-column",
            "text",
            "--output",
            str(out),
            "--scheduler",
            "sync",
            "--no-progress",
            "--device",
            "cpu",
            "--model",
            "default",
            *extra,
        ]
    )


def _last_error(capsys) -> str:
    return capsys.readouterr().err.rsplit("\r", 1)[-1].strip().splitlines()[-1]


def test_a_file_that_is_not_parquet_is_one_clear_line(tmp_path, capsys):
    """A text file named .parquet, alone or among real Parquet files: exit 2 naming the file, not
    pyarrow's traceback (exit 1), and nothing written."""
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "fake.parquet").write_text("hello, I am text\n")
    mixed = tmp_path / "mixed"
    write_partitioned_parquet(mixed, [3, 4])
    (mixed / "part-00009.parquet").write_bytes(b"PAR1 and then no footer")
    for given, bad in (
        ([str(alone / "fake.parquet")], alone / "fake.parquet"),
        ([str(mixed)], mixed / "part-00009.parquet"),
        ([str(mixed / "*.parquet")], mixed / "part-00009.parquet"),
    ):
        out = tmp_path / f"o{len(list(tmp_path.iterdir()))}"
        assert _encode_cli(given, out) == 2
        err = _last_error(capsys)
        assert err.startswith("dask-surge: error: ") and f"{str(bad)!r} is not a Parquet file" in err, err
        assert "Fix: " in err and not out.exists()
        assert main(["plan", *given, "--text-column", "text"]) == 2
        assert "is not a Parquet file" in _last_error(capsys)


def test_a_missing_input_says_it_does_not_exist(tmp_path, capsys):
    for given in (
        [str(tmp_path / "nope")],
        [str(tmp_path / "nope.parquet")],
        [str(tmp_path / "nope" / "*.csv")],
    ):
        assert _encode_cli(given, tmp_path / "o") == 2
        err = _last_error(capsys)
        assert "does not exist" in err or "matches no file" in err, err
        assert "cannot tell the format" not in err and "Fix: " in err


def test_a_json_text_column_of_mixed_values_stops_the_run(tmp_path, capsys):
    """Under Dask's default dataframe.convert-string, an object column read from JSON lines was turned into
    the strings '5', '3.5': the CLI reads JSON and CSV as the file holds them, and refuses the number."""
    import dask

    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps({"text": t}) for t in ["a", 5, 3.5]) + "\n")
    assert dask.config.get("dataframe.convert-string") is not False
    out = tmp_path / "o"
    assert _encode_cli([str(src)], out) == 2
    err = _last_error(capsys)
    assert "holds a int (5) in partition 0, row 1" in err and "only strings can be encoded" in err, err
    assert not list(out.glob("part-*.parquet"))
    csv = tmp_path / "in.csv"
    pd.DataFrame({"text": ["a", "b"], "doc_id": [1, 2]}).to_csv(csv, index=False)
    assert _encode_cli([str(csv)], tmp_path / "ok", "--json") == 0  # strings still encode
    assert json.loads(capsys.readouterr().out)["rows"] == 2


def _one_error_line(capsys) -> str:
    """The whole of stderr, which must be one ``dask-surge: error:`` line with a Fix (no traceback)."""
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("dask-surge: error: ") and "Fix: " in err, err
    assert "Traceback" not in err
    return err


def test_a_bad_scheduler_address_is_one_line(tmp_path, capsys):
    write_partitioned_parquet(tmp_path / "in", [2])
    assert (
        main(
            [
                "encode",
                str(tmp_path / "in"),
                "--text-column",
                "text",
                "--output",
                str(tmp_path / "o"),
                "--scheduler",
                "bogus",
                "--no-progress",
            ]
        )
        == 2
    )
    err = _one_error_line(capsys)
    assert "--scheduler bogus" in err and "tcp://host:port" in err
    assert main(["plan", str(tmp_path / "in"), "--text-column", "text", "--scheduler", "bogus"]) == 2
    assert "--scheduler bogus" in _one_error_line(capsys)


def test_an_unreachable_scheduler_is_one_line(tmp_path, capsys):
    import socket

    import dask

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    write_partitioned_parquet(tmp_path / "in", [2])
    with dask.config.set({"distributed.comm.timeouts.connect": "1s"}):
        assert (
            main(
                [
                    "encode",
                    str(tmp_path / "in"),
                    "--text-column",
                    "text",
                    "--output",
                    str(tmp_path / "o"),
                    "--scheduler",
                    f"tcp://127.0.0.1:{port}",
                    "--no-progress",
                ]
            )
            == 2
        )
    err = _one_error_line(capsys)
    assert f"--scheduler tcp://127.0.0.1:{port}: no Dask scheduler answered there within 1s" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--rows", "-1"], "--rows -1"),
        (["--rows", "0"], "--rows 0"),
        (["--partitions", "0"], "--partitions 0"),
    ],
)
def test_demo_refuses_a_size_that_is_not_positive(tmp_path, capsys, flags, named):
    """--rows 0 once ran the 6,000-row default, and --rows -1 was numpy's traceback."""
    assert main(["demo", *flags, "--dir", str(tmp_path / "d"), "--scheduler", "sync", "--no-progress"]) == 2
    err = _one_error_line(capsys)
    assert f"{named}: must be a positive number" in err
    assert not (tmp_path / "d").exists()


def test_a_different_run_is_refused_in_cli_spelling(tmp_path, tiny_model, capsys):
    """The library's advice (``pass overwrite=True``) reads as the flag to pass from the CLI."""
    write_partitioned_parquet(tmp_path / "a", [3, 2])
    write_partitioned_parquet(tmp_path / "b", [4], seed=5)
    out = tmp_path / "o"
    assert _encode_cli([str(tmp_path / "a")], out, "--model", tiny_model) == 0
    capsys.readouterr()
    assert _encode_cli([str(tmp_path / "b")], out, "--model", tiny_model) == 2
    err = _last_error(capsys)
    assert "--overwrite" in err and "overwrite=True" not in err, err


def test_status_of_a_missing_path_says_it_does_not_exist(tmp_path, capsys):
    assert main(["status", str(tmp_path / "nosuch")]) == 2
    err = _one_error_line(capsys)
    assert f"{str(tmp_path / 'nosuch')!r} does not exist" in err
    (tmp_path / "empty").mkdir()
    assert main(["status", str(tmp_path / "empty")]) == 1
    assert "no dask-surge run here yet" in capsys.readouterr().out


def test_verify_names_a_foreign_part_file_that_globs_would_read(tmp_path, tiny_model, capsys):
    write_partitioned_parquet(tmp_path / "in", [3, 2])
    out = tmp_path / "o"
    assert _encode_cli([str(tmp_path / "in")], out, "--model", tiny_model) == 0
    assert main(["status", str(out), "--verify"]) == 0
    capsys.readouterr()
    pd.DataFrame({"x": [1]}).to_parquet(out / "part-extra.parquet")
    assert main(["status", str(out), "--verify"]) == 1
    text = capsys.readouterr().out
    assert "part-extra.parquet: a file dask-surge did not write" in text and "move it out" in text, text
    assert main(["status", str(out), "--verify", "--json"]) == 1
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert len(problems) == 1 and "part-extra.parquet" in problems[0]


def test_status_names_the_default_model_and_an_iso_time(tmp_path, capsys):
    """status said "local model directory (sha256 ecabb2c97cd3)" for --model default and gave
    last_commit in --json as an epoch number."""
    from datetime import datetime

    write_partitioned_parquet(tmp_path / "in", [3, 2])
    out = tmp_path / "o"
    assert _encode_cli([str(tmp_path / "in")], out) == 0
    capsys.readouterr()
    assert main(["status", str(out)]) == 0
    assert "all-MiniLM-L6-v2 (packaged, the default" in capsys.readouterr().out
    assert main(["status", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["model"].startswith("all-MiniLM-L6-v2") and isinstance(info["last_commit"], str)
    assert abs(datetime.fromisoformat(info["last_commit"]).timestamp() - __import__("time").time()) < 3600


def test_ctrl_c_prints_one_message(tmp_path, tiny_model):
    """Ctrl-C printed two different messages (the run's, then the CLI's own): now the run's alone,
    which says what is kept, in CLI words."""
    import os
    import signal
    import subprocess
    import time
    from pathlib import Path

    write_partitioned_parquet(tmp_path / "in", [40] * 400)
    out = tmp_path / "o"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), TQDM_DISABLE="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dask_surge.cli",
            "encode",
            str(tmp_path / "in"),
            "--text-column",
            "text",
            "--output",
            str(out),
            "--model",
            tiny_model,
            "--device",
            "cpu",
            "--scheduler",
            "sync",
            "--b-min",
            "40",
            "--b-max",
            "40",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (out.is_dir() and any(out.glob("part-*.parquet"))) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    said = [line for line in err.splitlines() if "interrupted" in line]
    assert len(said) == 1, err
    assert "committed" in said[0] and "Rerun the same command" in said[0] and "same call" not in said[0]


# -- a --scheduler address where something else listens (issue 67, d) ---------------------------


def _serve_in_thread(handler_of_connection):
    """A TCP server on 127.0.0.1 (a free port) whose accepted connections each get
    ``handler_of_connection(sock)`` in a thread; returns ``(port, stop)``."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stopped = threading.Event()
    conns = []

    def loop():
        while not stopped.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            conns.append(conn)
            threading.Thread(target=handler_of_connection, args=(conn,), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()

    def stop():
        stopped.set()
        server.close()
        for c in conns:
            c.close()

    return server.getsockname()[1], stop


def _http_server():
    import http.server
    import threading

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()

    def stop():
        httpd.shutdown()
        httpd.server_close()

    return httpd.server_address[1], stop


def _ssh_like_server():
    import time

    def greet(conn):
        try:
            conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
            time.sleep(30)
        except OSError:
            pass

    return _serve_in_thread(greet)


@pytest.mark.parametrize(
    "server,what",
    [(_http_server, r"(an HTTP server|sent nothing)"), (_ssh_like_server, r"sent b'SSH-2\.0-OpenSSH")],
)
def test_a_scheduler_address_that_is_not_a_dask_scheduler_is_one_line_at_once(tmp_path, server, what):
    """``--scheduler`` at a port that accepts TCP but is no Dask scheduler (an HTTP server such as the
    dashboard, an SSH server): refused within seconds in one line naming the address, what answers
    and the fix; it used to hang with no output (the handshake read has no timeout in distributed), or
    end in a traceback allocating 3 EiB (the reply's first 8 bytes read as a frame length)."""
    import re
    import subprocess
    import time

    write_partitioned_parquet(tmp_path / "in", [2])
    port, stop = server()
    address = f"tcp://127.0.0.1:{port}"
    code = (
        "import sys; from dask_surge.cli import main; "
        f"sys.exit(main(['encode', {str(tmp_path / 'in')!r}, '--text-column', 'text', '--output', "
        f"{str(tmp_path / 'o')!r}, '--scheduler', {address!r}, '--no-progress']))"
    )
    try:
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        took = time.perf_counter() - t0
    except subprocess.TimeoutExpired:
        pytest.fail(f"--scheduler {address} (not a Dask scheduler) still running after 60 s")
    finally:
        stop()
    err = done.stderr.strip()
    assert done.returncode == 2, err[-3000:]
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err[-3000:]
    assert re.search(rf"--scheduler {re.escape(address)}: not a Dask scheduler: .*{what}.*Fix: ", err), err
    assert took < 30, took
    assert not (tmp_path / "o").exists()


def test_a_dashboard_url_as_scheduler_is_one_line(tmp_path, capsys):
    """The dashboard's ``http://host:8787`` pasted as --scheduler was distributed's ValueError traceback
    (unknown address scheme 'http')."""
    write_partitioned_parquet(tmp_path / "in", [2])
    argv = ["encode", str(tmp_path / "in"), "--text-column", "text", "--output", str(tmp_path / "o")]
    assert main([*argv, "--scheduler", "http://127.0.0.1:8787", "--no-progress"]) == 2
    err = _one_error_line(capsys)
    assert "--scheduler http://127.0.0.1:8787: not a Dask scheduler's address" in err and "'http'" in err
    assert not (tmp_path / "o").exists()
