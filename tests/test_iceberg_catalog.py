"""The Iceberg catalog named as pyiceberg users name it: ``iceberg_catalog="prod"`` (a catalog of
``.pyiceberg.yaml`` or ``PYICEBERG_CATALOG__PROD__*``), a dict of its properties, or a pyiceberg
``Catalog`` object, which stays in the calling process (never in dask.config, never on a worker); on
the command line ``--iceberg-catalog``/``--iceberg-table``; a value that cannot be used is one line."""

from __future__ import annotations

import os

import dask
import pytest

from dask_surge.cli import main
from dask_surge.errors import SurgeValueError
from dask_surge.testing import numbered_frame, table_encode

pyiceberg = pytest.importorskip("pyiceberg")
pytest.importorskip("sqlalchemy")

ROWS, PARTS = 300, 3


def _props(tmp_path) -> dict:
    return {"type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db", "warehouse": f"file://{tmp_path}/wh"}


@pytest.fixture
def no_catalog(tmp_path, monkeypatch):
    """No catalog configured anywhere: no surge.iceberg-catalog, no ~/.pyiceberg.yaml, no PYICEBERG_* variable
    (pyiceberg reads its configuration once, at import: it is read again here)."""
    import pyiceberg.catalog
    from pyiceberg.utils.config import Config

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(home)
    for key in [k for k in os.environ if k.startswith("PYICEBERG_")]:
        monkeypatch.delenv(key)

    def reread() -> None:
        monkeypatch.setattr(pyiceberg.catalog, "_ENV_CONFIG", Config())

    reread()
    with dask.config.set({"surge.iceberg-catalog": None, "surge.iceberg-table": None}):
        yield reread


@pytest.fixture
def prod(tmp_path, no_catalog, monkeypatch):
    """A catalog named ``prod`` in ``$PYICEBERG_HOME/.pyiceberg.yaml``, as pyiceberg users configure one."""
    from pyiceberg.catalog import load_catalog

    conf = tmp_path / "conf"
    conf.mkdir()
    props = _props(tmp_path)
    (conf / ".pyiceberg.yaml").write_text(
        "catalog:\n  prod:\n" + "".join(f"    {k}: {v}\n" for k, v in props.items())
    )
    monkeypatch.setenv("PYICEBERG_HOME", str(conf))
    no_catalog()
    return load_catalog("prod")


def _doc_ids(catalog, name: str) -> list[int]:
    return sorted(catalog.load_table(name).scan().to_pandas().doc_id.tolist())


def _encode(out, **kw):
    return table_encode(out, "iceberg", numbered_frame(ROWS, PARTS), **kw)


def test_a_catalog_name_from_pyiceberg_yaml(tmp_path, prod):
    _encode(tmp_path / "emb.iceberg", iceberg_catalog="prod")
    assert _doc_ids(prod, "default.emb") == list(range(ROWS))


def test_a_catalog_name_from_pyiceberg_environment_variables(tmp_path, no_catalog, monkeypatch):
    from pyiceberg.catalog import load_catalog

    for key, value in _props(tmp_path).items():
        monkeypatch.setenv(f"PYICEBERG_CATALOG__STAGING__{key.upper()}", value)
    no_catalog()
    _encode(tmp_path / "emb.iceberg", iceberg_catalog="staging", iceberg_table="search.docs")
    assert _doc_ids(load_catalog("staging"), "search.docs") == list(range(ROWS))


def test_a_dict_of_properties_as_an_argument(tmp_path, no_catalog):
    from pyiceberg.catalog import load_catalog

    _encode(tmp_path / "emb.iceberg", iceberg_catalog={"name": "mine", **_props(tmp_path)})
    assert _doc_ids(load_catalog("mine", **_props(tmp_path)), "default.emb") == list(range(ROWS))


def test_the_argument_wins_over_the_config(tmp_path, prod):
    with dask.config.set(
        {"surge.iceberg-catalog": {"name": "other", "type": "sql", "uri": "sqlite:///nowhere/x.db"}}
    ):
        _encode(tmp_path / "emb.iceberg", iceberg_catalog="prod")
    assert _doc_ids(prod, "default.emb") == list(range(ROWS))


def test_a_catalog_name_in_the_config(tmp_path, prod):
    with dask.config.set({"surge.iceberg-catalog": "prod"}):
        _encode(tmp_path / "emb.iceberg")
    assert _doc_ids(prod, "default.emb") == list(range(ROWS))


def test_a_catalog_object_in_this_process(tmp_path, no_catalog):
    from pyiceberg.catalog import load_catalog

    catalog = load_catalog("obj", **_props(tmp_path))
    res = _encode(tmp_path / "emb.iceberg", iceberg_catalog=catalog)
    assert _doc_ids(catalog, "default.emb") == list(range(ROWS))
    assert dask.config.get("surge.iceberg-catalog") is None  # never put in the config
    assert _encode(tmp_path / "emb.iceberg", iceberg_catalog=catalog).run_id == res.run_id


def test_a_catalog_object_on_a_process_cluster(tmp_path, no_catalog):
    """The Catalog (its SQLite engine does not pickle) stays in the client: workers write data files only."""
    from distributed import Client, LocalCluster
    from pyiceberg.catalog import load_catalog

    catalog = load_catalog("obj", **_props(tmp_path))
    with (
        LocalCluster(processes=True, n_workers=1, threads_per_worker=2, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        res = _encode(tmp_path / "emb.iceberg", iceberg_catalog=catalog, scheduler=client)
    assert res.rows == ROWS
    assert _doc_ids(catalog, "default.emb") == list(range(ROWS))


def _one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


def test_a_value_that_is_not_a_catalog_is_one_line(tmp_path, no_catalog):
    with pytest.raises(SurgeValueError) as err:
        _encode(tmp_path / "emb.iceberg", iceberg_catalog=42)
    assert "iceberg_catalog=42" in _one_line(err) and "Fix:" in _one_line(err)
    with pytest.raises(SurgeValueError) as err:
        _encode(tmp_path / "emb.iceberg", iceberg_catalog="prod", iceberg_table="docs")
    assert "iceberg_table='docs'" in _one_line(err) and "namespace" in _one_line(err)
    assert not (tmp_path / "emb.iceberg").exists()


def test_a_name_pyiceberg_does_not_know_is_one_line(tmp_path, no_catalog):
    with pytest.raises(SurgeValueError) as err:
        _encode(tmp_path / "emb.iceberg", iceberg_catalog="nope")
    text = _one_line(err)
    assert "'nope'" in text and ".pyiceberg.yaml" in text and "PYICEBERG_CATALOG__NOPE__URI" in text


def test_a_catalog_object_in_the_config_is_one_line_before_any_worker(tmp_path, no_catalog):
    from pyiceberg.catalog import load_catalog

    catalog = load_catalog("obj", **_props(tmp_path))
    with dask.config.set({"surge.iceberg-catalog": catalog}), pytest.raises(SurgeValueError) as err:
        _encode(tmp_path / "emb.iceberg", scheduler=None)  # would start a process cluster
    text = _one_line(err)
    assert "surge.iceberg-catalog" in text and "iceberg_catalog=" in text
    with dask.config.set({"surge.iceberg-catalog": catalog}), pytest.raises(SurgeValueError) as err:
        _encode(tmp_path / "emb.iceberg", scheduler=None, iceberg_catalog=catalog)  # the config still ships
    assert "surge.iceberg-catalog" in _one_line(err)
    assert not (tmp_path / "emb.iceberg").exists()


def test_a_catalog_for_another_format_is_refused(tmp_path, prod):
    with pytest.raises(SurgeValueError) as err:
        table_encode(tmp_path / "emb", "parquet", numbered_frame(ROWS, PARTS), iceberg_catalog="prod")
    assert "format='iceberg'" in _one_line(err)


def _cli_encode(tmp_path, *flags: str) -> int:
    from dask_surge.testing import write_partitioned_parquet

    src = tmp_path / "in"
    if not src.exists():
        src.mkdir()
        write_partitioned_parquet(src, [40, 30, 30])
    return main(
        [
            "encode",
            str(src),
            "--text-column",
            "text",
            "--output",
            str(tmp_path / "emb.iceberg"),
            "--device",
            "cpu",
            "--output-format",
            "iceberg",
            "--b-min",
            "20",
            "--b-max",
            "50",
            "--scheduler",
            "sync",
            "--no-progress",
            *flags,
        ]
    )


def test_the_command_line_flags_and_the_status_exit_code(tmp_path, prod, tiny_model, capsys):
    out = str(tmp_path / "emb.iceberg")
    code = _cli_encode(
        tmp_path, "--model", tiny_model, "--iceberg-catalog", "prod", "--iceberg-table", "search.docs"
    )
    assert code == 0, capsys.readouterr().err
    assert len(prod.load_table("search.docs").scan().to_arrow()) == 100
    capsys.readouterr()
    # status without the catalog: it cannot read the table, so it is an error, in one line that says the fix
    assert main(["status", out]) == 2
    err = capsys.readouterr().err
    assert "--iceberg-catalog" in err and "Traceback" not in err
    # the catalog without the identifier: the table at the path is not the one it names, an error too
    assert main(["status", out, "--iceberg-catalog", "prod"]) == 2
    assert "'default.emb'" in capsys.readouterr().err
    assert main(["status", out, "--iceberg-catalog", "prod", "--iceberg-table", "search.docs"]) == 0
    assert "100 rows" in capsys.readouterr().out


def test_a_bad_catalog_on_the_command_line_is_one_line(tmp_path, no_catalog, tiny_model, capsys):
    assert _cli_encode(tmp_path, "--model", tiny_model, "--iceberg-catalog", "nope") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'nope'" in err and "Traceback" not in err
