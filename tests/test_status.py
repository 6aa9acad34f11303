"""``dask-surge status``: a short table for people, ``--json`` for scripts (issue 26)."""

from __future__ import annotations

import json
import time

import pytest

import dask_surge
from dask_surge.cli import format_status, main
from dask_surge.testing import CountingEncoder, InterruptAfter, make_partitioned_frame

#: the fields `dask-surge status` printed as JSON before it had a table: scripts read them
JSON_FIELDS = {
    "output",
    "run",
    "state",
    "mode",
    "b_min",
    "b_max",
    "partitions_planned",
    "partitions_committed",
    "superbatches_committed",
    "superbatches_planned",
    "rows_committed",
    "rows_planned",
    "nulls_skipped",
    "last_commit",
}


@pytest.fixture
def complete_run(tmp_path):
    out = str(tmp_path / "o")
    ddf = make_partitioned_frame([5, 7, 3])
    dask_surge.encode(
        ddf, "text", out, b_min=4, b_max=8, scheduler="sync", model=CountingEncoder(), progress=False
    )
    return out


def _table(text: str) -> dict[str, str]:
    rows = {}
    for line in text.splitlines():
        key, _, value = line.partition("  ")
        if key.strip():
            rows[key.strip()] = value.strip()
    return rows


def test_status_is_a_table_for_people(complete_run, capsys):
    assert main(["status", complete_run]) == 0
    out = capsys.readouterr().out
    with pytest.raises(json.JSONDecodeError):
        json.loads(out)
    table = _table(out)
    info = dask_surge.status(complete_run)
    assert table["run"].startswith(info["run"]) and "streaming" in table["run"]
    assert table["model"] == "in-memory dask_surge.testing.CountingEncoder (digest " + table["model"][-13:]
    assert table["thresholds"] == "b_min=4, b_max=8"
    assert table["partitions"] == "3 of 3 committed"
    assert (
        table["SuperBatches"]
        == f"{info['superbatches_committed']} of {info['superbatches_committed']} committed"
    )
    assert table["rows"] == "15 of 15 committed"
    assert table["nulls skipped"] == "0"
    local = time.strftime("%Y-%m-%d %H:%M", time.localtime(info["last_commit"]))
    assert table["last commit"].startswith(local)
    assert table["last commit"].endswith(("ago)", "(just now)"))
    assert table["state"] == "complete"


def test_status_json_keeps_the_fields_scripts_read(complete_run, capsys):
    assert main(["status", complete_run, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert set(info) >= JSON_FIELDS
    assert (
        info["state"] == "complete"
        and info["rows_committed"] == 15
        and isinstance(info["last_commit_epoch"], float)
    )
    assert isinstance(info["last_commit"], str) and info["last_commit"][:2] == "20"  # ISO 8601
    assert main(["status", complete_run, "--json", "--verify"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["verified"] is True and info["problems"] == []
    assert main(["status", complete_run, "--verify"]) == 0
    assert _table(capsys.readouterr().out)["verified"] == "every committed file matches its sha256"


def test_incomplete_status_says_how_to_resume_and_exits_1(tmp_path, capsys):
    out = str(tmp_path / "o")
    ddf = make_partitioned_frame([4] * 6)
    with pytest.raises(KeyboardInterrupt):
        dask_surge.encode(
            ddf, "text", out, b_min=8, b_max=8, scheduler="sync", model=InterruptAfter(3), progress=False
        )
    assert main(["status", out]) == 1
    table = _table(capsys.readouterr().out)
    assert table["state"].startswith("incomplete") and "rerun the same encode" in table["state"]
    assert table["rows"] == "16 (total known once complete) committed"
    assert table["SuperBatches"].startswith("2 ")
    assert main(["status", out, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["state"] == "incomplete"


def test_empty_output(tmp_path, capsys):
    (tmp_path / "none").mkdir()
    assert main(["status", str(tmp_path / "none")]) == 1
    assert "no dask-surge run here yet" in capsys.readouterr().out
    assert main(["status", str(tmp_path / "none"), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["state"] == "empty"
    assert main(["status", str(tmp_path / "missing")]) == 2  # a path that does not exist says so
    assert "does not exist" in capsys.readouterr().err


def test_last_commit_in_words():
    info = {
        "output": "o",
        "run": "r",
        "state": "complete",
        "mode": "planned",
        "b_min": 10,
        "b_max": 20,
        "partitions_planned": 2,
        "partitions_committed": 2,
        "superbatches_committed": 1,
        "superbatches_planned": 1,
        "rows_committed": 1000,
        "rows_planned": 1002,
        "nulls_skipped": 2,
        "last_commit": 1_000_000.0,
        "model": None,
    }
    table = _table(format_status(info, now=1_000_000.0 + 5 * 60 + 3))
    assert table["last commit"].endswith("(5 minutes ago)")
    assert (
        table["rows"] == "1,002 of 1,002 committed (skipped nulls included)" and table["nulls skipped"] == "2"
    )
    assert "model" not in table
