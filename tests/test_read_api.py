"""The read API holds up to repeated use (issue 51, item 9): :func:`dask_surge.read_embeddings`."""

from __future__ import annotations

import dask_surge
from dask_surge.testing import checksum_model, make_partitioned_frame

SIZES = [4, 9, 2, 6, 5, 7, 3, 8]


def test_read_embeddings_computes_many_times_in_one_process(tmp_path):
    """Dask's pyarrow engine wrapped the types mapper once more at each partition read, in the
    options its plan cache shares across every read_parquet of the same files; past about 110
    wraps tokenizing the chain failed (TokenizationError), here by the 15th call (8 files a call).
    """
    out = str(tmp_path / "o")
    make_partitioned_frame(SIZES, seed=3).surge.encode(
        "text", out, model=checksum_model, keep=["doc_id"], b_min=2, b_max=9, scheduler="sync", progress=False
    )
    files = dask_surge.status(out)["superbatches_committed"]
    assert files >= 8  # reads of 8+ files a call: the old code failed before call 15
    calls = 40
    for _ in range(calls):
        back = dask_surge.read_embeddings(out).compute()
        assert sorted(back.doc_id) == list(range(sum(SIZES)))
    assert str(back.embedding.dtype).startswith("fixed_size_list")
    ddf = dask_surge.read_embeddings(out, columns=["partition", "row", "embedding"])
    for _ in range(calls):  # one frame, projected and computed again and again
        assert len(ddf[["row", "embedding"]].compute()) == sum(SIZES)


def test_read_embeddings_on_a_distributed_client(tmp_path, client):
    """The read options (a dict subclass of this package) travel to the workers pickled, and read there."""
    out = str(tmp_path / "o")
    make_partitioned_frame(SIZES[:4], seed=4).surge.encode(
        "text", out, model=checksum_model, b_min=2, b_max=9, scheduler="sync", progress=False
    )
    for _ in range(3):
        back = dask_surge.read_embeddings(out, columns=["partition", "row", "embedding"]).compute()
        assert len(back) == sum(SIZES[:4]) and str(back.embedding.dtype).startswith("fixed_size_list")
