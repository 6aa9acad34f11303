"""Models as users name them (issue 14): Hub names through the HF cache, prompts, the
sentence-transformers fallback, map_partitions without meta, and model identity from
content (issue 16 item 4). Everything runs offline (HF_HUB_OFFLINE=1, set in conftest)
against caches laid out the way huggingface_hub lays them out."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
import torch
from sentence_transformers import SentenceTransformer

import dask_surge
from dask_surge import Encoder
from dask_surge.errors import SurgeModelError, SurgeValueError
from dask_surge.models import modelid
from dask_surge.models.resolve import PACKAGED_HUB_ID
from dask_surge.models.hub import hub_cache_dir, looks_like_repo_id
from dask_surge.testing import add_to_hub_cache, make_texts, make_tiny_model, min_cosine, packaged_model_dir

TEXTS = make_texts(40, seed=3) + ["", "x", " ".join(["word"] * 400)]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def commit_of(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def model_with_prompts(
    dst: Path,
    src: str | os.PathLike,
    prompts: dict,
    *,
    default: str | None = None,
    include_prompt: bool = True,
) -> str:
    """A copy of a model directory (weights linked) with prompts in its config and a Pooling setting."""
    shutil.copytree(
        src,
        dst,
        copy_function=os.link if Path(src).stat().st_dev == dst.parent.stat().st_dev else shutil.copy2,
    )
    config_file = dst / "config_sentence_transformers.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    config.update(prompts=prompts, default_prompt_name=default)
    config_file.unlink(missing_ok=True)  # a hard link: never write through to the source
    config_file.write_text(json.dumps(config))
    pooling = next(dst.glob("*_Pooling/config.json"))
    pooling_config = json.loads(pooling.read_text()) | {"include_prompt": include_prompt}
    pooling.unlink()
    pooling.write_text(json.dumps(pooling_config))
    return str(dst)


def make_tiny_decoder(path: Path, arch: str = "qwen2", seed: int = 0) -> str:
    """A random-weight Qwen2/Qwen3-shaped decoder embedder: last-token pooling, normalized."""
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import AutoTokenizer, Qwen2Config, Qwen2Model, Qwen3Config, Qwen3Model

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(str(packaged_model_dir()))
    tokenizer.padding_side = "left"  # as Qwen embedders ship
    shape = {
        "vocab_size": tokenizer.vocab_size,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
    }
    config, model_cls = (
        (Qwen2Config(**shape), Qwen2Model)
        if arch == "qwen2"
        else (Qwen3Config(head_dim=8, **shape), Qwen3Model)
    )
    base = path / "_decoder"
    model_cls(config).save_pretrained(str(base))
    tokenizer.save_pretrained(str(base))
    transformer = Transformer(str(base), max_seq_length=128)
    modules = [transformer, Pooling(32, pooling_mode="lasttoken"), Normalize()]
    SentenceTransformer(modules=modules, device="cpu", prompts={"query": "Instruct: retrieve\nQuery: "}).save(
        str(path)
    )
    return str(path)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


# -- Hub names -----------------------------------------------------------------------------


def test_repo_ids_are_told_from_paths():
    assert looks_like_repo_id("BAAI/bge-small-en-v1.5")
    assert not looks_like_repo_id("./models/bge")
    assert not looks_like_repo_id("a/b/c")
    assert not looks_like_repo_id("../x")


def test_cache_dir_follows_hf_home_and_hf_hub_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "explicit"))
    assert hub_cache_dir() == tmp_path / "explicit"


def test_hub_name_resolves_offline_to_its_snapshot(hub_cache, tiny_model):
    commit = commit_of("tiny v1")
    snapshot = add_to_hub_cache(hub_cache, "org/tiny", tiny_model, commit=commit)
    enc = Encoder("org/tiny", device="cpu")
    assert enc.spec.source == str(snapshot) and (enc.spec.repo_id, enc.spec.commit) == ("org/tiny", commit)
    assert enc.identity()["commit"] == commit
    reference = SentenceTransformer(tiny_model, device="cpu").encode(TEXTS)
    assert min_cosine(enc.encode(TEXTS), reference) >= 0.9999


def test_hf_home_is_searched_when_hf_hub_cache_is_unset(tmp_path, monkeypatch, tiny_model):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    add_to_hub_cache(tmp_path / "hf" / "hub", "org/tiny", tiny_model, commit=commit_of("home"))
    assert Encoder("org/tiny").spec.commit == commit_of("home")


def test_revision_picks_a_branch_tag_or_commit(hub_cache, tiny_model, tmp_path):
    old, new = commit_of("v1"), commit_of("v2")
    add_to_hub_cache(hub_cache, "org/tiny", tiny_model, commit=old, refs=("v1.0",))
    other = make_tiny_model(tmp_path / "other", seed=1)
    add_to_hub_cache(hub_cache, "org/tiny", other, commit=new, refs=("main",))
    assert Encoder("org/tiny").spec.commit == new
    assert Encoder("org/tiny", revision="v1.0").spec.commit == old
    assert Encoder("org/tiny", revision=old).spec.commit == old
    # different commits are different models for a run's fingerprint
    assert Encoder("org/tiny").identity() != Encoder("org/tiny", revision="v1.0").identity()


def test_absent_model_offline_names_the_cache_and_the_fix(hub_cache):
    with pytest.raises(SurgeModelError) as info:
        Encoder("org/not-downloaded")
    message = str(info.value)
    assert str(hub_cache) in message and "HF_HUB_OFFLINE" in message
    assert "hf download org/not-downloaded" in message and "HF_HOME" in message


def test_absent_revision_offline_raises(hub_cache, tiny_model):
    add_to_hub_cache(hub_cache, "org/tiny", tiny_model, commit=commit_of("x"))
    with pytest.raises(SurgeModelError, match=r"at revision 'v9'.*not in the Hugging Face cache"):
        Encoder("org/tiny", revision="v9")


def test_not_a_path_nor_a_hub_name(hub_cache):
    with pytest.raises(
        SurgeModelError, match=r"does not exist as a local path, and is not a Hugging Face Hub name"
    ):
        Encoder("/no/such/model/dir")


def test_revision_with_a_local_directory_raises(tiny_model):
    with pytest.raises(SurgeValueError, match=r"revision='main' was given with the local directory"):
        Encoder(tiny_model, revision="main")


def test_packaged_name_prefers_a_populated_cache(hub_cache, tmp_path):
    assert Encoder(PACKAGED_HUB_ID).spec.source == str(packaged_model_dir())  # empty cache: the packaged copy
    commit = commit_of("minilm")
    snapshot = add_to_hub_cache(hub_cache, PACKAGED_HUB_ID, packaged_model_dir(), commit=commit)
    enc = Encoder(PACKAGED_HUB_ID, device="cpu")
    assert (enc.spec.source, enc.spec.commit) == (str(snapshot), commit)
    assert Encoder("default").spec.source == str(
        packaged_model_dir()
    )  # "default" is always the packaged copy


def test_hub_model_end_to_end_on_workers(hub_cache, tiny_model, client, tmp_path):
    commit = commit_of("e2e")
    add_to_hub_cache(hub_cache, "org/tiny", tiny_model, commit=commit)
    ddf = dd.from_pandas(pd.DataFrame({"text": TEXTS}), npartitions=4)
    result = ddf.surge.encode(
        "text",
        str(tmp_path / "out"),
        model="org/tiny",
        device="cpu",
        b_min=10,
        b_max=30,
        scheduler=client,
        progress=False,
    )
    assert result.rows == len(TEXTS)
    back = dask_surge.read_embeddings(str(tmp_path / "out")).compute().sort_values(["partition", "row"])
    got = np.stack(back["embedding"].to_numpy())
    reference = SentenceTransformer(tiny_model, device="cpu").encode(TEXTS)
    assert min_cosine(got, reference) >= 0.9999


def test_trust_remote_code_and_model_kwargs_reach_sentence_transformers(tiny_model, monkeypatch):
    seen = {}
    real = SentenceTransformer.__init__

    def spy(self, *args, **kwargs):
        seen.update(kwargs)
        real(self, *args, **kwargs)

    monkeypatch.setattr(SentenceTransformer, "__init__", spy)
    enc = Encoder(
        tiny_model, device="cpu", trust_remote_code=True, model_kwargs={"attn_implementation": "eager"}
    )
    assert enc.load().dimension == 32  # dimension alone reads the files, so load to reach the constructor
    assert seen["trust_remote_code"] is True and seen["model_kwargs"] == {"attn_implementation": "eager"}
    assert Encoder(tiny_model).spec.trust_remote_code is False  # off by default


def test_bad_model_kwargs_raise(tiny_model):
    with pytest.raises(SurgeValueError, match=r"model_kwargs=\['x'\] must be a dict"):
        Encoder(tiny_model, model_kwargs=["x"])


# -- prompts ---------------------------------------------------------------------------------

PROMPTS = {"query": "query: ", "passage": "passage: ", "instruct": "Represent this sentence for searching: "}


@pytest.mark.parametrize("include_prompt", [True, False])
def test_prompt_name_matches_sentence_transformers(tmp_path, include_prompt, tiny_model):
    # one model directory and one sentence-transformers load for both prompt names, each run once, on the tiny
    # model with MiniLM's tokenizer (issue 70: on the packaged MiniLM these took 45 s, then 27 s, of the default
    # suite on 2 shared cores; test_explicit_prompt_matches_sentence_transformers keeps its real weights)
    path = model_with_prompts(tmp_path / "m", tiny_model, PROMPTS, include_prompt=include_prompt)
    model = SentenceTransformer(path, device="cpu")
    plain = model.encode(TEXTS)
    for prompt_name in ("query", "instruct"):
        enc = Encoder(path, device="cpu", prompt_name=prompt_name)
        assert enc.backend == "fast"  # prompts run in the fast engine, not by falling back
        assert enc.engine.prompt == PROMPTS[prompt_name]
        got = enc.encode(TEXTS)
        assert min_cosine(got, model.encode(TEXTS, prompt_name=prompt_name)) >= 0.9999, prompt_name
        assert min_cosine(got, plain) < 0.999, prompt_name  # and the prompt did change the vectors


def test_include_prompt_false_leaves_prompt_tokens_out_of_pooling(tmp_path, tiny_model):
    pooled = Encoder(
        model_with_prompts(tmp_path / "a", tiny_model, PROMPTS),
        device="cpu",
        prompt_name="instruct",
    )
    excluded = Encoder(
        model_with_prompts(tmp_path / "b", tiny_model, PROMPTS, include_prompt=False),
        device="cpu",
        prompt_name="instruct",
    )
    assert excluded.engine.prompt_length == 7 and pooled.engine.prompt_length == 0  # [CLS] + 6 prompt tokens
    assert min_cosine(pooled.encode(TEXTS), excluded.encode(TEXTS)) < 0.999


def test_default_prompt_applies_and_empty_prompt_turns_it_off(tmp_path, tiny_model):
    path = model_with_prompts(tmp_path / "m", tiny_model, PROMPTS, default="query")
    model = SentenceTransformer(path, device="cpu")
    assert min_cosine(Encoder(path, device="cpu").encode(TEXTS), model.encode(TEXTS)) >= 0.9999
    off = Encoder(path, device="cpu", prompt="")
    assert off.resolved_prompt() == "" and off.backend == "fast"
    assert min_cosine(off.encode(TEXTS), model.encode(TEXTS, prompt="")) >= 0.9999


def test_explicit_prompt_matches_sentence_transformers():
    enc = Encoder("default", device="cpu", prompt="passage: ")
    reference = SentenceTransformer(str(packaged_model_dir()), device="cpu").encode(TEXTS, prompt="passage: ")
    assert min_cosine(enc.encode(TEXTS), reference) >= 0.9999


def test_unknown_prompt_name_raises_before_loading(tmp_path):
    path = model_with_prompts(tmp_path / "m", packaged_model_dir(), PROMPTS)
    with pytest.raises(SurgeValueError, match=r"prompt_name='document' is not one of this model's prompts"):
        Encoder(path, prompt_name="document")


def test_prompts_are_part_of_the_identity(tmp_path):
    path = model_with_prompts(tmp_path / "m", packaged_model_dir(), PROMPTS)
    ids = {
        json.dumps(Encoder(path, **kw).identity(), sort_keys=True)
        for kw in ({}, {"prompt_name": "query"}, {"prompt_name": "passage"}, {"prompt": "query: "})
    }
    assert len(ids) == 4


def test_prompt_with_a_plain_callable_raises():
    enc = Encoder(lambda texts: np.ones((len(texts), 3)), prompt="query: ")
    with pytest.raises(SurgeValueError, match=r"prompt=/prompt_name= apply to sentence-transformers models"):
        enc.load()


# -- any sentence-transformers model runs ------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_decoder_embedder_runs_on_the_fast_engine_and_through_the_fallback(tmp_path, arch):
    path = make_tiny_decoder(tmp_path / arch, arch)
    reference = SentenceTransformer(path, device="cpu").encode(TEXTS, prompt_name="query")
    for engine, backend in (
        ("auto", "fast"),
        ("fast", "fast"),
        ("sentence-transformers", "sentence-transformers"),
    ):
        enc = Encoder(path, device="cpu", prompt_name="query", engine=engine)
        assert enc.backend == backend, enc.backend_reason
        assert min_cosine(enc.encode(TEXTS), reference) >= 0.9999


def test_decoder_embedder_end_to_end_from_the_hub_cache(hub_cache, tmp_path, client):
    path = make_tiny_decoder(tmp_path / "qwen2", "qwen2")
    add_to_hub_cache(hub_cache, "org/tiny-qwen", path, commit=commit_of("qwen"))
    ddf = dd.from_pandas(pd.DataFrame({"text": TEXTS}), npartitions=3)
    out = ddf.surge.encode(
        "text", model="org/tiny-qwen", prompt_name="query", device="cpu", b_min=8, b_max=20
    )
    got = out.compute(scheduler=client).sort_values(["partition", "row"])
    reference = SentenceTransformer(path, device="cpu").encode(TEXTS, prompt_name="query")
    assert min_cosine(np.stack(got["embedding"].to_numpy()), reference) >= 0.9999


# -- map_partitions ----------------------------------------------------------------------------


def test_map_partitions_without_meta(tiny_model):
    enc = Encoder(tiny_model, device="cpu")
    ddf = dd.from_pandas(pd.DataFrame({"text": TEXTS}), npartitions=3)
    lazy = ddf.text.map_partitions(enc)
    assert lazy.name == "embedding" and str(lazy.dtype).startswith("fixed_size_list")
    got = lazy.compute(scheduler="sync")
    assert got.index.tolist() == list(range(len(TEXTS)))
    reference = SentenceTransformer(tiny_model, device="cpu").encode(TEXTS)
    assert min_cosine(np.stack(got.to_numpy()), reference) >= 0.9999


def test_a_null_text_gives_a_null_embedding(tiny_model):
    got = Encoder(tiny_model, device="cpu")(pd.Series(["a", None, "b"], dtype="string"))
    assert got.isna().tolist() == [False, True, False]


# -- options with a ready Encoder --------------------------------------------------------------


def test_options_alongside_a_ready_encoder_raise(tiny_model):
    enc = Encoder(tiny_model)
    with pytest.raises(SurgeValueError, match=r"device='cpu'.*with_options\(device=...\)"):
        Encoder(enc, device="cpu")
    assert Encoder(enc).spec == enc.spec
    assert enc.with_options(device="cpu", prompt="q: ").spec.prompt == "q: "
    with pytest.raises(SurgeValueError, match=r"dtype='float64' is not a known compute dtype"):
        enc.with_options(dtype="float64")


def test_encode_refuses_options_with_a_ready_encoder(tiny_model):
    ddf = dd.from_pandas(pd.DataFrame({"text": ["a", "b"]}), npartitions=1)
    with pytest.raises(SurgeValueError, match=r"prompt_name='query'.*ready Encoder"):
        ddf.surge.encode("text", model=Encoder(tiny_model), prompt_name="query")


# -- identity from content ---------------------------------------------------------------------


def test_two_random_models_of_the_same_shape_differ(tmp_path):
    a = make_tiny_model(tmp_path / "a", seed=1)
    b = make_tiny_model(tmp_path / "b", seed=2)
    assert Encoder(a).identity() != Encoder(b).identity()
    in_a = SentenceTransformer(a, device="cpu")
    in_b = SentenceTransformer(b, device="cpu")
    assert Encoder(in_a).identity()["digest"] != Encoder(in_b).identity()["digest"]


def test_the_same_model_twice_is_the_same_identity(tmp_path, tiny_model):
    copy = tmp_path / "moved"
    shutil.copytree(tiny_model, copy)  # content, not location, identifies a model
    assert Encoder(tiny_model).identity() == Encoder(str(copy)).identity()
    model = SentenceTransformer(tiny_model, device="cpu")
    assert Encoder(model).identity()["digest"] == Encoder(model).identity()["digest"]


def test_identity_follows_an_in_place_weight_update(tiny_model):
    model = SentenceTransformer(tiny_model, device="cpu")
    before = Encoder(model).identity()["digest"]
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert Encoder(model).identity()["digest"] != before


def test_identity_is_hashed_once_then_cached(tmp_path, monkeypatch):
    path = make_tiny_model(tmp_path / "m", seed=5)
    calls = []
    real = modelid._hash_file
    monkeypatch.setattr(modelid, "_hash_file", lambda p: calls.append(p) or real(p))
    first = Encoder(path).identity()
    hashed = len(calls)
    assert hashed > 0
    monkeypatch.setattr(modelid, "_DIR_CACHE", {})  # a new process: only the on-disk cache is left
    assert Encoder(path).identity() == first and len(calls) == hashed
    weights = next(Path(path).rglob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert Encoder(path).identity() == first and len(calls) > hashed  # touched: hashed again, same content


def test_a_loaded_model_whose_directory_changed_is_loaded_again(tmp_path):
    # a long-lived process (a notebook) keeps models loaded by spec; a model directory rewritten behind its
    # back (new weights at the same path) must not be encoded with the old weights, which the run's
    # identity (the directory's digest) would no longer describe
    path = make_tiny_model(tmp_path / "m", seed=5)
    texts = make_texts(6, seed=1)
    encoder = Encoder(path, device="cpu")
    first = np.asarray(encoder.encode(texts))
    shutil.rmtree(path)
    make_tiny_model(tmp_path / "m", seed=6)  # other weights, same path
    again = np.asarray(Encoder(path, device="cpu").encode(texts))
    fresh = np.asarray(SentenceTransformer(path, device="cpu").encode(texts))
    assert not np.allclose(first, again)
    assert min_cosine(again, fresh) > 0.9999


# -- option vocabularies -----------------------------------------------------------------------


def test_vocabularies_are_defined_once():
    import yaml

    from dask_surge import cli, config, options
    from dask_surge.io import precision

    assert set(options.PRECISIONS) == set(precision.PRECISIONS)
    with open(Path(config.DEFAULTS_PATH).with_name("surge-schema.yaml")) as f:
        schema = yaml.safe_load(f)["properties"]["surge"]["properties"]
    for name, values in {
        "precision": options.PRECISIONS,
        "on-null": options.ON_NULLS,
        "dtype": options.DTYPES,
        "engine": options.ENGINES,
    }.items():
        assert config.OPTIONS[name].choices == values
        assert tuple(schema[name]["enum"]) == values
    encode = next(
        a
        for a in cli.build_parser()._subparsers._group_actions[0].choices["encode"]._actions
        if a.dest == "precision"
    )
    assert tuple(encode.choices) == options.PRECISIONS


def test_cli_takes_hub_names_and_prompts(hub_cache, tmp_path, capsys):
    from dask_surge.cli import main
    from dask_surge.testing import write_partitioned_parquet

    path = model_with_prompts(tmp_path / "m", make_tiny_model(tmp_path / "tiny", seed=3), PROMPTS)
    commit = commit_of("cli")
    add_to_hub_cache(hub_cache, "org/prompted", path, commit=commit)
    write_partitioned_parquet(tmp_path / "in", [4, 5])
    code = main(
        [
            "encode",
            str(tmp_path / "in"),
            "--text-column",
            "text",
            "--output",
            str(tmp_path / "out"),
            "--model",
            "org/prompted",
            "--revision",
            "main",
            "--prompt-name",
            "query",
            "--b-min",
            "4",
            "--b-max",
            "9",
            "--device",
            "cpu",
            "--engine",
            "fast",
            "--scheduler",
            "sync",
            "--no-progress",
            "--json",
        ]
    )
    assert code == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 9
    texts = pd.read_parquet(tmp_path / "in").text.tolist()
    back = dask_surge.read_embeddings(str(tmp_path / "out")).compute().sort_values(["partition", "row"])
    reference = SentenceTransformer(path, device="cpu").encode(texts, prompt_name="query")
    assert min_cosine(np.stack(back["embedding"].to_numpy()), reference) >= 0.9999
    assert (
        main(
            [
                "encode",
                str(tmp_path / "in"),
                "--text-column",
                "text",
                "--output",
                str(tmp_path / "o2"),
                "--model",
                "org/absent",
                "--scheduler",
                "sync",
                "--no-progress",
            ]
        )
        == 2
    )
    assert "is not in the Hugging Face cache" in capsys.readouterr().err


def test_accessor_shows_the_real_signature_and_docstring():
    import inspect

    from dask_surge import api

    ddf = dd.from_pandas(pd.DataFrame({"text": ["a"]}), npartitions=1)
    for name in ("encode", "plan"):
        bound, func = getattr(ddf.surge, name), getattr(api, name)
        assert bound.__doc__ == func.__doc__
        assert list(inspect.signature(bound).parameters) == list(inspect.signature(func).parameters)[1:]
    assert {"prompt", "prompt_name", "revision", "trust_remote_code", "model_kwargs"} <= set(
        inspect.signature(ddf.surge.encode).parameters
    )


def test_a_callable_is_identified_by_its_code_not_its_call_log():
    from dask_surge.testing import CountingEncoder

    counting = CountingEncoder()
    before = Encoder(counting).identity()
    Encoder(counting).encode(["a", "b"])  # its call log grows; it is still the same model
    assert Encoder(counting).identity() == before
    assert (
        Encoder(lambda t: np.ones((len(t), 2))).identity()
        != Encoder(lambda t: np.zeros((len(t), 2))).identity()
    )


def test_plan_takes_the_model_options_and_counts_the_prompt(tmp_path):
    from dask_surge.planning.tokens import token_counter

    path = model_with_prompts(tmp_path / "m", packaged_model_dir(), PROMPTS)
    ddf = dd.from_pandas(pd.DataFrame({"text": ["a b", "c"]}), npartitions=1)
    with pytest.raises(SurgeValueError, match=r"prompt_name='nope' is not one of this model's prompts"):
        ddf.surge.plan("text", model=path, prompt_name="nope")
    plain = token_counter(Encoder(path))(["a b", ""])
    prompted = token_counter(Encoder(path, prompt_name="query"))(["a b", ""])  # from tokenizer.json, no load
    assert (prompted - plain).tolist() == [2.0, 2.0]  # "query", ":"


def test_online_a_model_is_downloaded_once(hub_cache, tiny_model, monkeypatch):
    """Online (simulated: no network here), the commit is asked of the Hub and downloaded once."""
    import huggingface_hub
    from huggingface_hub import constants

    commit = commit_of("online")
    calls = {"resolve": 0, "download": 0}

    def resolve_revision(repo_id, *, revision=None, cache_dir=None, local_files_only=False, **_):
        assert not local_files_only and cache_dir == str(hub_cache)
        calls["resolve"] += 1
        return huggingface_hub.ResolvedRevision(resolved=commit, initial=revision, repo_id=repo_id)

    def snapshot_download(repo_id, *, revision, cache_dir, ignore_patterns, **_):
        assert revision == commit and "onnx/*" in ignore_patterns  # pinned, and no foreign weights
        calls["download"] += 1
        return str(add_to_hub_cache(Path(cache_dir), repo_id, tiny_model, commit=revision))

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "resolve_revision", resolve_revision)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    first = Encoder("org/online")
    second = Encoder("org/online")
    assert calls == {"resolve": 2, "download": 1}  # the second finds the commit in the cache
    assert first.spec == second.spec and first.spec.commit == commit


def test_done_when_the_notebook_cell_runs_against_a_populated_cache(hub_cache, tmp_path):
    """Issue 14's acceptance: the MiniLM Hub name, HF_HUB_OFFLINE=1, a populated cache, output=..."""
    commit = commit_of("all-MiniLM-L6-v2")
    add_to_hub_cache(hub_cache, PACKAGED_HUB_ID, packaged_model_dir(), commit=commit)
    texts = make_texts(12, seed=9)
    ddf = dd.from_pandas(pd.DataFrame({"text": texts}), npartitions=3)
    result = ddf.surge.encode(
        "text",
        model=PACKAGED_HUB_ID,
        output=str(tmp_path / "emb"),
        device="cpu",
        scheduler="sync",
        progress=False,
    )
    assert result.rows == 12
    back = dask_surge.read_embeddings(str(tmp_path / "emb")).compute().sort_values(["partition", "row"])
    reference = SentenceTransformer(str(packaged_model_dir()), device="cpu").encode(texts)
    assert min_cosine(np.stack(back["embedding"].to_numpy()), reference) >= 0.9999
    run = json.loads(next((tmp_path / "emb").rglob("run.json")).read_text())
    assert commit in json.dumps(run)  # the commit is in the run's fingerprint


def test_identity_of_an_in_memory_model_follows_its_prompts(tiny_model):
    model = SentenceTransformer(tiny_model, device="cpu")
    before = Encoder(model).identity()["digest"]
    model.prompts = {"query": "query: "}
    assert Encoder(model).identity()["digest"] != before


def test_a_worker_without_the_clients_path_loads_the_same_commit_from_its_cache(hub_cache, tiny_model):
    import dataclasses

    from dask_surge.models.encoders import from_spec

    commit = commit_of("worker")
    add_to_hub_cache(hub_cache, "org/tiny", tiny_model, commit=commit)
    client_side = Encoder("org/tiny", device="cpu")
    # as unpickled on a machine where the client's snapshot path does not exist
    worker_side = from_spec(dataclasses.replace(client_side.spec, source="/client/only/snapshot"))
    reference = SentenceTransformer(tiny_model, device="cpu").encode(TEXTS)
    assert min_cosine(worker_side.encode(TEXTS), reference) >= 0.9999
    assert worker_side.identity() == client_side.identity()
