"""One ModelLayout per model: the plain rule is the same for a model's files and for the loaded model."""

from __future__ import annotations

import json

import pytest

from dask_surge.engine.layout import layout_of_model, plain_reason, read_layout
from dask_surge.engine.loading import direct_reason
from dask_surge.testing import make_tiny_model


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(make_tiny_model(tmp_path_factory.mktemp("layout") / "tiny"), device="cpu")


def _variants(base):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling

    transformer = base[0]
    return {
        "mean": [transformer, Pooling(32)],
        "cls+normalize": [transformer, Pooling(32, pooling_mode="cls"), Normalize()],
        "mean+max": [transformer, Pooling(32, pooling_mode=["mean", "max"])],
        "lasttoken": [transformer, Pooling(32, pooling_mode="lasttoken")],
        "weightedmean": [transformer, Pooling(32, pooling_mode="weightedmean")],
        "dense": [transformer, Pooling(32), Dense(32, 24)],
        "no-pooling": [transformer],
    }, SentenceTransformer


@pytest.mark.parametrize(
    "name, plain",
    [
        ("mean", True),
        ("cls+normalize", True),
        ("mean+max", True),
        ("lasttoken", True),
        ("weightedmean", False),
        ("dense", False),
        ("no-pooling", False),
    ],
)
def test_the_files_and_the_loaded_model_are_judged_by_one_rule(base, tmp_path, name, plain):
    variants, SentenceTransformer = _variants(base)
    model = SentenceTransformer(modules=variants[name], device="cpu")
    model.save(str(tmp_path / "m"))
    from_files, loaded = read_layout(tmp_path / "m"), layout_of_model(model)
    assert from_files.plain == loaded.plain == plain, (from_files.reason, loaded.reason)
    assert from_files.modules == loaded.modules and from_files.pooling == loaded.pooling
    if name != "no-pooling":  # a Transformer alone gives token embeddings, not one per text
        assert from_files.dimension == model.encode(["x"]).shape[1]
    if plain:  # several pooling modes run on the fast engine once loaded, but are not loaded directly
        assert (direct_reason(from_files) is None) == (len(from_files.pooling) == 1), direct_reason(
            from_files
        )


def test_truncate_dim_is_not_plain_in_the_files_or_the_model(base, tmp_path):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(modules=list(base), device="cpu", truncate_dim=8)
    model.save(str(tmp_path / "m"))
    assert not read_layout(tmp_path / "m").plain and not layout_of_model(model).plain
    assert plain_reason(["Transformer", "Pooling"], ["mean"], truncate_dim=8) == "truncate_dim=8 is set"


def test_the_layout_is_read_once_and_again_when_a_file_changes(base, tmp_path):
    base.save(str(tmp_path / "m"))
    first = read_layout(tmp_path / "m")
    assert read_layout(tmp_path / "m") is first  # nothing changed: from memory
    pooling = next((tmp_path / "m").glob("*Pooling/config.json"))
    config = json.loads(pooling.read_text())
    config.update(pooling_mode="weightedmean")
    pooling.write_text(json.dumps(config, indent=1))
    again = read_layout(tmp_path / "m")
    assert again is not first and not again.plain and "weightedmean" in again.reason


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    from sentence_transformers import SentenceTransformer

    from dask_surge.testing import make_tiny_decoder_model

    return SentenceTransformer(
        make_tiny_decoder_model(tmp_path_factory.mktemp("layout") / "decoder"), device="cpu"
    )


@pytest.mark.parametrize(
    "modes, plain",
    [
        ("lasttoken", True),
        (["lasttoken", "mean"], True),
        ("weightedmean", False),
        ("mean_sqrt_len_tokens", False),
    ],
)
def test_a_rotary_decoder_is_judged_by_the_same_rule_from_files_and_loaded(decoder, tmp_path, modes, plain):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling

    model = SentenceTransformer(
        modules=[decoder[0], Pooling(32, pooling_mode=modes), Normalize()],
        device="cpu",
        prompts=dict(decoder.prompts),
    )
    model.save(str(tmp_path / "m"))
    from_files, loaded = read_layout(tmp_path / "m"), layout_of_model(model)
    assert from_files.plain == loaded.plain == plain, (from_files.reason, loaded.reason)
    assert from_files.reason == loaded.reason
    assert from_files.decoder and loaded.decoder and from_files.model_type == loaded.model_type == "qwen3"
    assert from_files.prompts == loaded.prompts and "query" in loaded.prompts
    assert from_files.dimension == model.encode(["x"]).shape[1]
    if plain:
        assert (direct_reason(from_files) is None) == isinstance(modes, str), direct_reason(from_files)
