"""``dask-surge`` command line: encode, demo, plan, status."""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import re
import sys
import time
from pathlib import Path, PurePosixPath

from ._version import __version__
from .api import encode, plan, read_embeddings, status
from .config import check_argument, given
from .engine.placement import gpu_count
from .errors import SurgeError, SurgeInputError, SurgeValueError
from .execution.cluster import local_cluster
from .execution.preflight import say_in_process, small_files
from .execution.reach import not_a_scheduler
from .families import DENSE
from .io.layout import FAMILY_COLUMNS, PARTITION, ROW
from .io.tables import open_output, output_class, output_store
from .io.tables.pgvector import redact_uri
from .io.verify import repair, verify
from .models.modelid import directory_digest
from .models.resolve import packaged_dir
from .options import OPTIONS, add_arguments, from_arguments, option
from .synthetic import lognormal_sizes, write_partitioned_parquet

__all__ = ["main", "build_parser", "format_status"]

FORMATS = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".csv": "csv",
    ".jsonl": "json",
    ".json": "json",
    ".ndjson": "json",
}
#: the extensions of the files Dask reads as Parquet from a directory or glob (read_parquet's default)
PARQUET_EXTENSIONS = (".parq", ".parquet", ".pq")
#: a Parquet file's first and last four bytes (PARE: encrypted footer)
PARQUET_MAGIC = (b"PAR1", b"PARE")


def _add_encode_options(p: argparse.ArgumentParser) -> None:
    """The flags of :func:`dask_surge.encode`'s options, from :data:`dask_surge.options.OPTIONS`."""
    add_arguments(p, "encode")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dask-surge", description="SuperBatch embedding for Dask DataFrames."
    )
    parser.add_argument("--version", action="version", version=f"dask-surge {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    enc = sub.add_parser("encode", help="embed a text column of Parquet/CSV/JSON-lines files")
    enc.add_argument("inputs", nargs="+", help="input files, directories or globs")
    enc.add_argument("--text-column", required=True)
    enc.add_argument(
        "--output",
        required=True,
        help="where to write: a new or empty directory path or URL (or one a "
        "dask-surge run wrote); where it can live: docs/output.md, 'Where output can go'",
    )
    enc.add_argument(
        "--keep", nargs="*", default=[], help=option("keep").summary
    )  # its help from the option table
    enc.add_argument(
        "--format",
        dest="input_format",
        choices=["parquet", "csv", "json"],
        default=None,
        help="input format (default: from the file extension)",
    )
    _add_encode_options(enc)

    demo = sub.add_parser("demo", help="generate a log-normal partitioned dataset and encode it")
    demo.add_argument(
        "--rows",
        type=int,
        default=None,
        help="texts to generate (default: 200,000 with a GPU, 6,000 on a CPU)",
    )
    demo.add_argument("--partitions", type=int, default=None, help="default: rows / 100 (min 20)")
    demo.add_argument("--sigma", type=float, default=1.72, help="log-normal sigma of partition sizes")
    demo.add_argument("--dir", default="surge-demo", help="where to write the dataset and embeddings")
    demo.add_argument("--seed", type=int, default=0)
    _add_encode_options(demo)

    pl = sub.add_parser("plan", help="SuperBatch plan and (with --calibrate) predicted cost of each policy")
    pl.add_argument("inputs", nargs="+")
    pl.add_argument("--text-column", required=True)
    pl.add_argument("--format", dest="input_format", choices=["parquet", "csv", "json"], default=None)
    add_arguments(pl, "plan")  # the flags of plan()'s options, from dask_surge.options.OPTIONS

    st = sub.add_parser("status", help="progress of an output directory")
    st.add_argument("output")
    st.add_argument(
        "--verify",
        action="store_true",
        help="also check every committed file against its recorded sha256 (reads every file)",
    )
    st.add_argument(
        "--repair",
        action="store_true",
        help="bring a damaged manifest back to a state a rerun resumes from (run it when no "
        "encode is writing there), then show the status",
    )
    st.add_argument("--json", action="store_true", help="print the status as JSON (for scripts)")
    # an Iceberg output's table is read through its catalog; a pgvector output's is named by --table
    for name in ("iceberg_catalog", "iceberg_table", "table"):
        cli = option(name).cli
        assert cli is not None
        st.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=cli.type or str,
            metavar=cli.metavar,
            help=f"{cli.help or option(name).summary} (as the encode was given it)",
        )
    return parser


def _is_glob(item: str) -> bool:
    return any(ch in item for ch in "*?[")


def _files_of(item: str) -> list[str] | None:
    """The files of directory or glob ``item``, sorted (a local path or any fsspec URL, such as
    ``s3://bucket/data/``); None when ``item`` names a single file."""
    pattern = _is_glob(item)
    if "://" not in item:
        if pattern:
            return sorted(glob.glob(item))
        return sorted(str(p) for p in Path(item).iterdir()) if Path(item).is_dir() else None
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(item)
    if pattern:
        names = fs.glob(path)
    elif fs.isdir(path):
        names = fs.ls(path, detail=False)
    else:
        return None
    return sorted(fs.unstrip_protocol(name) for name in names)


def _format_of(name: str) -> str | None:
    return FORMATS.get(PurePosixPath(name).suffix)


def _detect_format(inputs: list[str]) -> str:
    for item in inputs:
        for name in _files_of(item) or [item]:
            if (fmt := _format_of(name)) is not None:
                return fmt
    raise SurgeError(
        f"cannot tell the format of {inputs}: no .parquet, .csv or .jsonl file found. "
        "Fix: pass --format parquet|csv|json."
    )


def read_input(inputs: list[str], fmt: str | None):
    """Open input files as a Dask DataFrame with one partition per file (the partition id).

    ``inputs`` are files, directories or globs, local or fsspec URLs (``s3://...``: the
    store's credentials and endpoint come from its usual environment, e.g. ``AWS_PROFILE``
    and ``AWS_ENDPOINT_URL``).
    """
    import dask
    import dask.dataframe as dd

    local = [i for i in inputs if "://" not in i]
    missing = [i for i in local if not _is_glob(i) and not os.path.exists(i)]
    if missing:
        raise SurgeInputError(
            (
                f"input {missing[0]!r} does not exist"
                if len(missing) == 1
                else f"inputs {missing} do not exist"
            )
            + ". Fix: check the paths."
        )
    empty = [i for i in local if _is_glob(i) and not glob.glob(i)]
    if empty:
        raise SurgeInputError(
            (
                f"input pattern {empty[0]!r} matches no file"
                if len(empty) == 1
                else f"input patterns {empty} match no file"
            )
            + ". Fix: check the paths and the pattern."
        )
    fmt = fmt or _detect_format(inputs)
    if fmt == "parquet":
        for item in local:
            for name in _files_of(item) or [item]:
                _check_parquet(name, given=name == item)
        paths = inputs[0] if len(inputs) == 1 else inputs
        return dd.read_parquet(paths)
    files = []  # directories and globs expand to their files of that format, sorted: partition i = file i
    for item in inputs:
        listed = _files_of(item)
        files += [item] if listed is None else [name for name in listed if _format_of(name) == fmt]
    if not files:
        raise SurgeError(f"no {fmt} file found in {inputs}. Fix: check the paths, or pass --format.")
    # columns as the files hold them: Dask's dataframe.convert-string would turn an object column of
    # mixed values (JSON's {"text": 5} beside strings) into the strings "5", ... that the run must refuse;
    # the readers already give Arrow strings for string columns
    with dask.config.set({"dataframe.convert-string": False}):
        return dd.from_map(_read_csv if fmt == "csv" else _read_jsonl, files, enforce_metadata=False)


def _check_parquet(path: str, *, given: bool) -> None:
    """Refuse a local file that Dask would read as Parquet but that is not one (no ``PAR1`` magic
    at its start and end), naming it: pyarrow's error is a traceback. ``given``: named as an
    input itself (read whatever its name); a directory's files are read by their extension."""
    if os.path.isdir(path) or not (given or PurePosixPath(path).suffix in PARQUET_EXTENSIONS):
        return
    with open(path, "rb") as f:
        head = f.read(4)
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - 4))
        tail = f.read(4)
    if size < 12 or head not in PARQUET_MAGIC or tail not in PARQUET_MAGIC:
        raise SurgeInputError(
            f"{path!r} is not a Parquet file: a Parquet file starts and ends with the bytes b'PAR1', this one "
            f"starts with {head!r} and ends with {tail!r} ({size:,} bytes). Fix: remove it from the input (or "
            "write it again if it was cut short), or pass --format csv|json if the inputs are CSV or JSON lines."
        )


def _read_csv(path: str):
    import pandas as pd

    return pd.read_csv(path, dtype_backend="pyarrow")


def _read_jsonl(path: str):
    import pandas as pd

    return pd.read_json(path, lines=True, dtype_backend="pyarrow")


def _scheduler(value):
    """``--scheduler``: ``threads``/``sync`` as they are, else a Client connected to the address
    (one line naming the address, the rule and the fix when it is not one or nothing answers)."""
    if value in (None, "threads", "sync"):
        return value
    import dask
    from distributed import Client
    from distributed.comm import parse_address

    rule = "a Dask scheduler's address (tcp://host:port, as `dask scheduler` prints it), 'threads' or 'sync'"
    fix = (
        "Fix: start a scheduler (`dask scheduler`) and pass the address it prints, e.g. "
        "--scheduler tcp://10.0.0.5:8786, or leave --scheduler out to start a local cluster."
    )
    try:
        from distributed.comm.registry import get_backend

        get_backend(parse_address(value)[0])  # http://host:8787 (a dashboard's) is no comm address
        from distributed.comm.addressing import parse_host_port

        parse_host_port(value.split("://", 1)[-1])
    except (ValueError, TypeError) as err:
        raise SurgeValueError(f"--scheduler {value}: not {rule} ({err}). {fix}") from None
    other = not_a_scheduler(value)  # distributed's handshake read has no timeout: it would hang, or worse
    if other is not None:
        raise SurgeValueError(
            f"--scheduler {value}: not a Dask scheduler: {other}. Fix: pass the address `dask scheduler` "
            "prints (tcp://host:8786 by default; a dashboard's http://host:8787 is not it), or leave "
            "--scheduler out to start a local cluster."
        )
    timeout = dask.config.get("distributed.comm.timeouts.connect")
    try:
        return Client(value, timeout=timeout)
    except (OSError, TimeoutError) as err:
        raise SurgeValueError(
            f"--scheduler {value}: no Dask scheduler answered there within {timeout} "
            f"({type(err).__name__}). {fix}"
        ) from None


def _options(args, taker: str = "encode") -> dict:
    """The keyword options of ``encode``/``plan`` given on the command line (a scheduler address connects)."""
    opts = from_arguments(args, taker)
    if "scheduler" in opts:
        opts["scheduler"] = _scheduler(opts["scheduler"])
    return opts


def _print_result(result, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result.as_dict(), indent=2, default=str))
    else:
        print(result)


def cmd_encode(args) -> int:
    ddf = read_input(args.inputs, args.input_format)
    opts = _options(args)
    if opts.get("scheduler") is None and _rows_unknown(args) and small_files(_input_paths(args.inputs)):
        say_in_process(-1)  # a few small CSV/JSON files: encoding them takes less than starting workers
        opts["scheduler"] = "threads"
    result = encode(ddf, args.text_column, args.output, keep=args.keep, **opts)
    _print_result(result, args.json)
    return 0


def _rows_unknown(args) -> bool:
    """Whether the input's rows are not known ahead (CSV, JSON lines: read_input's own readers);
    Parquet's come from its footers, and encode() judges those itself. The *input's* format
    (``--format``), never the output's (``--output-format``).

    Examples
    --------
    >>> argv = ["encode", "in.parquet", "--text-column", "t", "--output", "o", "--output-format", "lance"]
    >>> _rows_unknown(build_parser().parse_args(argv))
    False
    """
    fmt = args.input_format or _detect_format(args.inputs)
    return fmt != "parquet"


def _input_paths(inputs: list[str]) -> list[str]:
    """The files the inputs name (directories and globs expanded)."""
    return [name for item in inputs for name in (_files_of(item) or [item])]


def cmd_demo(args) -> int:
    import numpy as np

    _check_demo(args)
    args.rows = args.rows if args.rows is not None else (200_000 if gpu_count() else 6_000)
    args.partitions = args.partitions if args.partitions is not None else max(20, args.rows // 100)
    if args.b_min is None:  # show streaming: about 20 SuperBatches
        args.b_min = max(100, args.rows // 20)
    root = Path(args.dir)
    data = root / "input"
    sizes = lognormal_sizes(args.rows, args.partitions, sigma=args.sigma, seed=args.seed)
    t0 = time.perf_counter()
    write_partitioned_parquet(data, sizes, seed=args.seed)
    print(
        f"[dask-surge demo] wrote {args.rows:,} texts in {args.partitions:,} Parquet files to {data} "
        f"(log-normal sizes, sigma={args.sigma}: min {sizes.min()}, median {int(np.median(sizes))}, "
        f"max {sizes.max()}) in {time.perf_counter() - t0:.1f} s"
    )
    import dask.dataframe as dd

    ddf = dd.read_parquet(str(data))
    opts = _options(args)
    result = encode(ddf, "text", str(root / "embeddings"), keep=["doc_id"], **opts)
    _print_result(result, args.json)
    back = read_embeddings(str(root / "embeddings"), columns=[PARTITION, ROW]).compute()
    unique = len(back.drop_duplicates())
    print(
        f"[dask-surge demo] read back {len(back):,} rows, {unique:,} distinct (partition, row) of "
        f"{args.rows:,} input rows: {'OK' if unique == len(back) == args.rows else 'MISMATCH'}"
    )
    return 0 if unique == len(back) == args.rows else 1


def _check_demo(args) -> None:
    """Refuse a ``demo`` size that is not a positive count, in one line."""
    for flag, value in (("--rows", args.rows), ("--partitions", args.partitions)):
        if value is not None and value < 1:
            what = "texts to generate" if flag == "--rows" else "Parquet files to write"
            raise SurgeValueError(
                f"{flag} {value}: must be a positive number of {what}. Fix: pass {flag} 1 or more, or leave "
                f"{flag} out for the default ({'200,000 with a GPU, 6,000 on a CPU' if flag == '--rows' else 'rows / 100, at least 20'})."
            )
    if args.sigma is not None and not args.sigma >= 0:
        raise SurgeValueError(
            f"--sigma {args.sigma}: must be 0 or more (the log-normal spread of partition sizes). "
            "Fix: pass e.g. --sigma 1.72 (the default)."
        )


def cmd_plan(args) -> int:

    ddf = read_input(args.inputs, args.input_format)
    opts = _options(args, "plan")
    if opts["calibrate"]:
        from distributed import Client

        with local_cluster() as cluster, Client(cluster) as client:
            result = plan(ddf, args.text_column, **{**opts, "client": client})
    else:
        result = plan(ddf, args.text_column, **opts)
    print(result)
    return 0


def cmd_status(args) -> int:
    if "://" not in args.output and not os.path.exists(args.output):
        raise SurgeValueError(
            f"{args.output!r} does not exist, so it holds no dask-surge run. Fix: pass the "
            "directory given as --output (or output=) to the encode."
        )
    named = {  # an Iceberg output's catalog and table, as the encode named them (else the config's)
        "iceberg-catalog": check_argument("iceberg_catalog", args.iceberg_catalog),
        "iceberg-table": check_argument("iceberg_table", args.iceberg_table),
        "table": check_argument("table", args.table),  # a pgvector output's table (or the URI's #schema.name)
    }
    with given(named):
        info = _status(args)
        table = info.get("table") or {}
        if table and "error" not in table and not table.get("versions"):
            table.update(_not_found(args.output, table["format"]))
    print(json.dumps(info, indent=2, default=str) if args.json else format_status(info))
    if "error" in table:  # what it says of the run stands; that the table cannot be read is an error
        why = " ".join(str(table["error"]).split())
        raise SurgeValueError(
            f"the {table['format']} table of {redact_uri(args.output)!r} could not be read: {why}"
            + (
                _NAME_THE_CATALOG
                if output_class(table["format"]).catalogued and "iceberg_catalog='" not in why
                else ""
            )
        )
    return 0 if info["state"] == "complete" and not info.get("problems") else 1


#: how ``status`` is told where an Iceberg output's table is
_NAME_THE_CATALOG = (
    " (status reads it through the catalog and identifier the encode named: pass them as "
    "--iceberg-catalog NAME and --iceberg-table NAMESPACE.NAME)"
)


def _not_found(output: str, fmt: str) -> dict:
    """``{"error": ...}`` when ``output`` holds a ``fmt`` table its library does not find there (an Iceberg
    table that the catalog, as named, does not hold); else nothing (no table yet)."""
    try:
        open_output(fmt, output_store(output)).exists()
    except (SurgeError, OSError) as err:
        return {"error": str(err)}
    return {}


def _status(args) -> dict:
    """What ``status`` prints: :func:`dask_surge.status`, repaired and verified first where asked."""
    if args.repair:
        for line in repair(output_store(args.output)) or ["nothing to repair"]:
            print(f"repair: {line}", file=sys.stderr)
    info = status(args.output)
    if args.verify:
        problems = verify(output_store(args.output))
        info["verified"] = not problems
        info["problems"] = problems
    if info.get("model"):
        info["model"] = _model_words(info["model"])
    for where in (info, info.get("table") or {}):
        if args.json and isinstance(where.get("last_commit"), (int, float)):  # ISO 8601, not an epoch number
            where["last_commit_epoch"] = where["last_commit"]  # (and the number, for scripts that compute)
            where["last_commit"] = _iso(where["last_commit"])
    return info


def _iso(epoch: float) -> str:
    """An epoch time as ISO 8601 in local time with its offset.

    Examples
    --------
    >>> _iso(0.0).startswith(("1970-01-01T", "1969-12-31T"))
    True
    """
    from datetime import datetime

    return datetime.fromtimestamp(epoch).astimezone().isoformat(timespec="seconds")


def _model_words(name: str) -> str:
    """The model as the user named it: the packaged all-MiniLM-L6-v2 (``--model default``) by
    its name rather than as a local directory's digest."""
    m = re.fullmatch(r"local model directory \(sha256 ([0-9a-f]+)\)", name)
    if m is None:
        return name
    try:
        packaged = directory_digest(packaged_dir("default"))
    except (SurgeError, OSError):
        return name
    return (
        f"all-MiniLM-L6-v2 (packaged, the default; sha256 {m.group(1)})"
        if packaged.startswith(m.group(1))
        else name
    )


def _ago(seconds: float) -> str:
    """How long ago, in words.

    Examples
    --------
    >>> _ago(5), _ago(90), _ago(3 * 3600 + 60), _ago(3 * 86400)
    ('just now', '1 minute ago', '3 hours ago', '3 days ago')
    """
    if seconds < 45:
        return "just now"
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size:
            n = int(seconds // size)
            return f"{n} {unit}{'s' if n != 1 else ''} ago"
    return "1 minute ago"


def _of(done, planned) -> str:
    return f"{done:,} of {planned:,}" if planned is not None else f"{done:,} (total known once complete)"


def format_status(info: dict, now: float | None = None) -> str:
    """:func:`dask_surge.status` (and ``--verify``'s findings) as a short table for people.

    Examples
    --------
    >>> print(format_status({"output": "emb/", "state": "empty"}))
    emb/: no dask-surge run here yet
    """
    output = info["output"]
    if info["state"] == "empty":
        return f"{output}: no dask-surge run here yet"
    rows = [("output", output), ("run", f"{info['run']} ({info.get('mode') or 'unknown'} mode)")]
    if info.get("model"):
        rows.append(("model", info["model"]))
    if info.get("family", DENSE) != DENSE:
        rows.append(("output", f"{info['family']}: columns {', '.join(FAMILY_COLUMNS[info['family']])}"))
    rows += [
        (
            "thresholds",
            f"b_min={info['b_min']:,}, b_max={info['b_max']:,}"
            if info.get("b_min") is not None
            else "not recorded",
        ),
        ("partitions", _of(info["partitions_committed"], info["partitions_planned"]) + " committed"),
        ("SuperBatches", _of(info["superbatches_committed"], info["superbatches_planned"]) + " committed"),
        (
            "rows",
            _of(info["rows_committed"] + info["nulls_skipped"], info["rows_planned"])
            + " committed"
            + (" (skipped nulls included)" if info["nulls_skipped"] else ""),
        ),
        ("nulls skipped", f"{info['nulls_skipped']:,}"),
    ]
    mode = info.get("long_texts", "truncate")
    if mode == "chunk":
        rows.append(("long texts", f"chunk: {info.get('output_rows', 0):,} windows written"))
    elif mode == "mean":
        rows.append(("long texts", "mean of each text's token windows"))
    elif info.get("truncated", 0) < 0:
        rows.append(("truncated", "not known (the model has no tokenizer)"))
    elif "truncated" in info:
        rows.append(
            (
                "truncated",
                f"{info['truncated']:,} texts over the model's window were cut"
                + (
                    " (long_texts='chunk' or 'mean' encode every token)"
                    if info["truncated"] and info.get("family", DENSE) == DENSE
                    else ""
                ),
            )
        )
    if info.get("reused"):
        rows.append(
            (
                "reused",
                f"{info['reused']:,} texts copied from earlier outputs; "
                f"{info.get('encoded', 0):,} distinct texts encoded",
            )
        )
    last = info.get("last_commit")
    if last is not None:
        rows.append(("last commit", _when(last, now)))
    else:
        rows.append(("last commit", "none yet"))
    table = info.get("table")
    if table:
        rows.append(("table", _table_words(table, now)))
    if info["state"] == "complete":
        rows.append(("state", "complete"))
    else:
        rows.append(
            (
                "state",
                "incomplete: committed work is kept; rerun the same encode call or command to resume from it",
            )
        )
    if "verified" in info:
        problems = info.get("problems") or []
        if table:
            verdict = (
                f"every committed SuperBatch is in the {table['format']} table once; its rows and data files "
                "check out"
                if not problems
                else f"{len(problems)} problem(s) (each says its fix; a table is never repaired by --repair)"
            )
        else:
            verdict = (
                "every committed file matches its sha256"
                if not problems
                else f"{len(problems)} problem(s); `dask-surge status --repair` brings the manifest back "
                "to a state a rerun resumes from"
            )
        rows.append(("verified", verdict))
        rows += [("", f"- {p}") for p in problems]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}".rstrip() for k, v in rows)


def _when(epoch: float, now: float | None = None) -> str:
    """A commit time as the status table shows it: local date and time, and how long ago."""
    ago = _ago(max(0.0, (time.time() if now is None else now) - epoch))
    return f"{time.strftime('%Y-%m-%d %H:%M:%S %Z', time.localtime(epoch))} ({ago})"


def _table_words(table: dict, now: float | None = None) -> str:
    """A table output's ``table`` status in words.

    Examples
    --------
    >>> _table_words({"format": "lance", "versions": 3, "version": 3, "rows": 300, "run_versions": 2,
    ...               "last_commit": "2026-01-02T03:04:05+00:00"})
    'lance, 300 rows in version 3 (3 versions, 2 of this run); last table commit 2026-01-02T03:04:05+00:00'
    >>> _table_words({"format": "delta", "versions": 0, "version": None, "rows": 0, "run_versions": 0,
    ...               "last_commit": None})
    'delta: no table yet (a rerun of the same encode call commits what the manifest holds)'
    """
    fmt = table["format"]
    if "error" in table:
        return f"{fmt}: could not be read ({table['error']})"
    if not table.get("versions"):
        return f"{fmt}: no table yet (a rerun of the same encode call commits what the manifest holds)"
    last = table.get("last_commit")
    when = _when(last, now) if isinstance(last, (int, float)) else str(last)
    return (
        f"{fmt}, {table['rows']:,} rows in version {table['version']} ({table['versions']} version"
        f"{'s' if table['versions'] != 1 else ''}, {table['run_versions']} of this run); last table commit {when}"
    )


class _StderrHandler(logging.StreamHandler):
    """The CLI's console handler: writes to whatever ``sys.stderr`` is when a record is emitted
    (a notebook or a test swaps it; a handler holding the old stream would write to a closed file)."""

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it: the live sys.stderr is used instead
        pass


#: ``name=value`` in a message: an option in Python spelling (a quoted word, a number, True/False/None)
_PYTHON_OPTION = re.compile(
    r"""(?<![\w.])([a-z][a-z0-9_]*)=('[^']*'|"[^"]*"|True|False|None|-?\d[\d_]*(?:\.\d+)?)"""
)


def cli_spelling(message: str) -> str:
    """``message`` with the options it names in Python spelling written as their flags.

    Errors are raised by the library, which speaks Python (``pass overwrite=True``); from the
    command line the same advice reads as the flag to pass. Only options that have a flag are
    rewritten.

    Examples
    --------
    >>> cli_spelling("Fix: pass on_null='empty', or overwrite=True; device=None; b_min=10.")
    'Fix: pass --on-null empty, or --overwrite; leave --device out; --b-min 10.'
    >>> cli_spelling("ddf.rename(columns=str)")
    'ddf.rename(columns=str)'
    """
    flags = {o.name: o.cli for o in OPTIONS if o.cli is not None}

    def spelled(m: re.Match) -> str:
        name, value = m.group(1), m.group(2)
        cli = flags.get(name)
        if cli is None:
            return m.group(0)
        flag = cli.flag or "--" + name.replace("_", "-")
        if cli.action == "store_true":
            return flag if value == "True" else f"no {flag}"
        if cli.action == "store_false":
            return flag if value == "False" else f"no {flag}"
        if value == "None":
            return f"leave {flag} out"
        if value in ("True", "False"):
            return f"{flag} {value.lower()}"
        return f"{flag} {value.strip(chr(39) + chr(34))}"

    return _PYTHON_OPTION.sub(spelled, message)


class _CommandLineWords(logging.Filter):
    """On the package's log records while a command runs: the run's own Ctrl-C line (which says
    what is committed) is the one message of an interrupt, in CLI words; the advice of other
    records in CLI spelling."""

    def __init__(self) -> None:
        super().__init__()
        self.interrupt_said = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("dask-surge: interrupted"):
            self.interrupt_said = True
            message = message.replace("Rerun the same call", "Rerun the same command")
        spelled = cli_spelling(message)
        if spelled != record.getMessage():
            record.msg, record.args = spelled, None
        return True


def main(argv: list[str] | None = None) -> int:
    package = logging.getLogger("dask_surge")
    handler = next((h for h in package.handlers if isinstance(h, _StderrHandler)), None)
    if handler is None:  # once per process, not per call
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        package.addHandler(handler)
    # Hub names download once when online (HF_HUB_OFFLINE=1 keeps to the cache), as sentence-transformers does
    # quiet model loading in this process and in the local cluster's workers (they inherit it)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    args = build_parser().parse_args(argv)
    words = _CommandLineWords()
    handler.addFilter(words)  # on the handler: the package's modules log on child loggers
    try:
        commands = {"encode": cmd_encode, "demo": cmd_demo, "plan": cmd_plan, "status": cmd_status}
        return commands[args.command](args)
    except SurgeError as err:
        print(f"dask-surge: error: {cli_spelling(str(err))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if not words.interrupt_said:  # the run said what it kept: one message, not two
            print(
                "dask-surge: interrupted before anything was committed. Rerun the same command to start again.",
                file=sys.stderr,
            )
        return 130
    finally:
        handler.removeFilter(words)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
