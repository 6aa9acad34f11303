"""dask-surge's own BERT (engine/bert.py) and BERT tokenizer (engine/bert_tokenizer.py) against transformers'.

A plain BERT sentence-transformers model loads in a cold worker without importing transformers
(3.4 s on a 2-core machine); these tests hold that load to computing what transformers computes,
and to handing every other checkpoint to transformers.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dask_surge.engine.bert import BertEncoder, NotNativeBert, load_bert
from dask_surge.engine.bert_tokenizer import BertTokenizerFiles, NotNativeTokenizer, load_bert_tokenizer
from dask_surge.engine.loading import direct_layout, load_direct
from dask_surge.testing import make_tiny_model, packaged_model_dir

TEXTS = [
    "Hello world",
    "",
    "Ünïcödé café naïve façade",
    "漢字 かな カナ 한국어",
    "tabs\tand\nnew lines  ",
    "a " * 300,
    "[CLS] [SEP] [MASK] literal",
    "e-mail: someone@example.com, $4.50 (approx.)",
    "😀 🚀",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("native") / "tiny")


def _transformer_dir(model_dir) -> str:
    layout, why = direct_layout(str(model_dir))
    assert layout is not None, why
    return layout.transformer


def _edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _batch(vocab: int, seed: int = 0):
    """Four rows of 29 ids, two of them padded, and their 2D mask."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(min(1000, vocab // 2), vocab, (4, 29), generator=gen)
    valid = torch.ones(4, 29, dtype=torch.bool)
    valid[1, 20:] = False
    valid[3, 5:] = False
    return ids, valid


def _hf_bert(path: str):
    from transformers import AutoModel

    return AutoModel.from_pretrained(path, local_files_only=True).eval()


@pytest.mark.parametrize("which", ["minilm", "tiny"])
def test_it_computes_what_transformers_bert_model_computes(which, tiny_dir):
    path = _transformer_dir(packaged_model_dir() if which == "minilm" else tiny_dir)
    native, hf = load_bert(path, "cpu"), _hf_bert(path)
    ids, valid = _batch(hf.config.vocab_size)
    additive = torch.zeros(valid.shape).masked_fill_(~valid, torch.finfo(torch.float32).min)[:, None, None, :]
    with torch.inference_mode():
        want = hf(input_ids=ids, attention_mask=valid.long()).last_hidden_state
        unmasked = hf(input_ids=ids[:1]).last_hidden_state
        runs = {
            "2D mask": native(input_ids=ids, attention_mask=valid.long()).last_hidden_state,
            "4D additive mask": native(input_ids=ids, attention_mask=additive).last_hidden_state,
            "int32 ids and type ids": native(
                input_ids=ids.int(), attention_mask=valid.long(), token_type_ids=torch.zeros_like(ids)
            ).last_hidden_state,
        }
        alone = native(input_ids=ids[:1]).last_hidden_state
        native.pad_attention_keys(16)  # the engine's CPU copy: keys padded to 32, the padding masked out
        runs["keys padded"] = native(input_ids=ids, attention_mask=valid.long()).last_hidden_state
        padded_alone = native(input_ids=ids[:1]).last_hidden_state
    for name, got in runs.items():
        assert torch.allclose(got[valid], want[valid], atol=1e-5, rtol=1e-5), name
    assert torch.allclose(alone, unmasked, atol=1e-5) and torch.allclose(padded_alone, unmasked, atol=1e-5)
    assert native.config.dtype == "float32" and next(native.parameters()).dtype == torch.float32


def test_a_checkpoint_saved_from_a_task_model_loads_under_its_bert_prefix(tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(1)
    config = BertConfig(
        vocab_size=300,
        hidden_size=24,
        num_hidden_layers=2,
        num_attention_heads=3,
        intermediate_size=40,
        max_position_embeddings=64,
    )
    BertForMaskedLM(config).save_pretrained(tmp_path)  # keys "bert.*" and the "cls.*" head
    native, hf = load_bert(str(tmp_path), "cpu"), _hf_bert(str(tmp_path))
    ids, valid = _batch(300, seed=2)
    with torch.inference_mode():
        want = hf(input_ids=ids, attention_mask=valid.long()).last_hidden_state
        got = native(input_ids=ids, attention_mask=valid.long()).last_hidden_state
    assert torch.allclose(got[valid], want[valid], atol=1e-5)


def test_half_checkpoints_load_as_float32_and_say_what_they_store(tmp_path, tiny_dir):
    from safetensors.torch import load_file, save_file

    from dask_surge.engine.placement import checkpoint_dtype

    src = _transformer_dir(tiny_dir)
    shutil.copytree(src, tmp_path / "m")
    weights = load_file(str(tmp_path / "m" / "model.safetensors"))
    save_file(
        {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in weights.items()},
        str(tmp_path / "m" / "model.safetensors"),
    )
    model = load_bert(str(tmp_path / "m"), "cpu")
    assert next(model.parameters()).dtype == torch.float32
    assert (
        checkpoint_dtype(model) == "bfloat16"
    )  # so dtype="auto" picks bfloat16 on CUDA, as for transformers' load


def _drop_weight(directory):
    from safetensors.torch import load_file, save_file

    weights = load_file(str(directory / "model.safetensors"))
    del weights["encoder.layer.1.output.dense.weight"]
    save_file(weights, str(directory / "model.safetensors"))


def _as_bin(directory):
    from safetensors.torch import load_file

    weights = load_file(str(directory / "model.safetensors"))
    torch.save(weights, directory / "pytorch_model.bin")
    (directory / "model.safetensors").unlink()


@pytest.mark.parametrize(
    "edit, says",
    [
        (lambda d: _edit_json(d / "config.json", hidden_act="gelu_new"), "hidden_act='gelu_new'"),
        (
            lambda d: _edit_json(d / "config.json", position_embedding_type="relative_key"),
            "position_embedding_type",
        ),
        (lambda d: _edit_json(d / "config.json", is_decoder=True), "is_decoder"),
        (lambda d: _edit_json(d / "config.json", intermediate_size=48), "do not fit config.json"),
        (_drop_weight, "missing ['encoder.layer.1.output.dense.weight']"),
        (_as_bin, "one model.safetensors"),
    ],
)
def test_what_it_does_not_compute_is_refused_and_loaded_by_transformers(tiny_dir, tmp_path, edit, says):
    from sentence_transformers import SentenceTransformer

    from dask_surge import Encoder

    model_dir = tmp_path / "m"
    shutil.copytree(tiny_dir, model_dir)
    transformer = _transformer_dir(model_dir)
    edit(Path(transformer))
    with pytest.raises(NotNativeBert, match=r".") as info:
        load_bert(transformer, "cpu")
    assert says in str(info.value)
    if says in ("is_decoder", "do not fit config.json") or "missing" in says:
        return  # not a loadable encoder for transformers either (or not one the engine runs)
    module = load_direct(direct_layout(str(model_dir))[0], "cpu")
    assert module.loaded_by == "transformers" and not isinstance(module.auto_model, BertEncoder)
    with Encoder(str(model_dir), device="cpu") as enc:
        got = enc.encode(TEXTS)
        assert enc._loaded().impl.loaded_by == "transformers"
    want = SentenceTransformer(str(model_dir), device="cpu").encode(TEXTS)
    assert np.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("which", ["minilm", "tiny"])
def test_the_tokenizer_files_read_as_auto_tokenizer_reads_them(which, tiny_dir):
    from transformers import AutoTokenizer

    path = _transformer_dir(packaged_model_dir() if which == "minilm" else tiny_dir)
    for length in (None, 128):
        native = load_bert_tokenizer(path, model_max_length=length)
        kwargs = {} if length is None else {"model_max_length": length}
        hf = AutoTokenizer.from_pretrained(path, local_files_only=True, **kwargs)
        for name in (
            "model_max_length",
            "pad_token_id",
            "model_input_names",
            "truncation_side",
            "padding_side",
            "is_fast",
        ):
            assert getattr(native, name) == getattr(hf, name), name
        assert sorted(native.all_special_ids) == sorted(hf.all_special_ids)
        assert native.backend_tokenizer.to_str() == hf.backend_tokenizer.to_str()
        got = [e.ids for e in native.backend_tokenizer.encode_batch(TEXTS)]
        assert got == [e.ids for e in hf.backend_tokenizer.encode_batch(TEXTS)]


def _tokenizer_copy(tmp_path, tiny_dir):
    directory = tmp_path / "tok"
    shutil.copytree(_transformer_dir(tiny_dir), directory)
    return directory


def _other_post_processor(directory):
    data = json.loads((directory / "tokenizer.json").read_text())
    data["post_processor"] = None
    (directory / "tokenizer.json").write_text(json.dumps(data))


@pytest.mark.parametrize(
    "edit, says",
    [
        (lambda d: _edit_json(d / "tokenizer_config.json", do_lower_case=False), "normalizer"),
        (
            lambda d: _edit_json(d / "tokenizer_config.json", tokenizer_class="RobertaTokenizer"),
            "tokenizer_class",
        ),
        (
            lambda d: _edit_json(
                d / "tokenizer_config.json",
                added_tokens_decoder={"30522": {"content": "<new>", "special": True}},
            ),
            "adds tokens",
        ),
        (
            lambda d: _edit_json(d / "tokenizer_config.json", additional_special_tokens=["<absent>"]),
            "additional",
        ),
        (_other_post_processor, "post-processor"),
        (lambda d: (d / "tokenizer_config.json").unlink(), "no tokenizer_config.json"),
    ],
)
def test_tokenizer_files_transformers_would_change_are_refused(tmp_path, tiny_dir, edit, says):
    directory = _tokenizer_copy(tmp_path, tiny_dir)
    edit(directory)
    with pytest.raises(NotNativeTokenizer, match=r".") as info:
        load_bert_tokenizer(str(directory))
    assert says in str(info.value)


def test_a_refused_tokenizer_is_loaded_by_auto_tokenizer_and_encodes_as_sentence_transformers(
    tmp_path, tiny_dir
):
    from sentence_transformers import SentenceTransformer

    from dask_surge import Encoder

    model_dir = tmp_path / "m"
    shutil.copytree(tiny_dir, model_dir)
    _edit_json(Path(_transformer_dir(model_dir)) / "tokenizer_config.json", do_lower_case=False)
    module = load_direct(direct_layout(str(model_dir))[0], "cpu")
    assert not isinstance(module.tokenizer, BertTokenizerFiles) and module.loaded_by == "dask-surge"
    with Encoder(str(model_dir), device="cpu") as enc:
        got = enc.encode(TEXTS)
    want = SentenceTransformer(str(model_dir), device="cpu").encode(TEXTS)
    assert np.allclose(got, want, atol=1e-5)


def test_a_cold_bert_load_imports_no_transformers():
    code = (
        "import sys, torch; from dask_surge import Encoder; e = Encoder('default', device='cpu'); "
        "v = e.encode(['a dog', 'a cat']); "
        "print(e._loaded().impl.loaded_by, v.shape, sorted(m for m in sys.modules if m.split('.')[0] in "
        "('transformers', 'sentence_transformers', 'scipy', 'sympy')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split("\n")[-2] == "dask-surge (2, 384) []", done.stdout


def test_the_engine_gives_its_own_bert_the_4d_mask_without_a_probe(tiny_dir, monkeypatch):
    # BertEncoder turns a 2D mask into the 4D additive one itself (the test above checks both give what
    # transformers gives), so the engine sets mask4d without the probe's two forward passes (issue 63:
    # they came before a cold run's first SuperBatch); any other model is still probed
    from dask_surge.engine.forward import DeviceRunner
    from dask_surge.engine.tokenizing import StageClock

    calls = []
    real = BertEncoder.forward
    monkeypatch.setattr(BertEncoder, "forward", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    model = load_bert(_transformer_dir(tiny_dir), "cpu")
    runner = DeviceRunner(
        model, ("mean",), dtype=None, pad_id=0, type_ids=True, prompt_length=0, clock=StageClock()
    )
    assert runner.mask4d and calls == []

    class Wrapped(torch.nn.Module):  # the same model, not a BertEncoder: probed, and the probe agrees
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **kwargs):
            return self.inner(**kwargs)

    monkeypatch.setattr(DeviceRunner, "_encoder", lambda self: Wrapped(model))
    assert runner._takes_4d_mask() is True and calls == [1, 1]
