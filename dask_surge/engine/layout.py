"""A sentence-transformers model's layout, read once from its files, and the one rule of a plain model.

The fast engine runs a *plain* model: Transformer (an encoder, or a decoder of a rotary
family, :data:`ROTARY_DECODERS`) + Pooling (:data:`FAST_POOLING`: cls, mean, max or lasttoken,
or several of them) (+ Normalize), with the Transformer's default text settings and no
``truncate_dim``. :func:`plain_reason` states that rule once; it is applied to a model's
files (:func:`read_layout`, which decides how :mod:`dask_surge.engine.loading` loads it and
what :func:`~dask_surge.models.loader.dimension_from_files` answers) and to a loaded
``SentenceTransformer`` (:func:`layout_of_model`, which
:meth:`~dask_surge.engine.transformer.TransformerEngine.from_sentence_transformer` checks).
Nothing here imports torch, transformers or sentence-transformers.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "FAST_POOLING",
    "POOL_FLAGS",
    "ROTARY_DECODERS",
    "ModelLayout",
    "is_decoder_config",
    "layout_of_model",
    "plain_reason",
    "read_layout",
]

#: the ``pooling_mode_*`` flags of a ``Pooling`` config -> the mode names ``Pooling.pooling_mode`` uses
POOL_FLAGS: dict[str, str] = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
#: the pooling modes the fast engine computes (the engine packs right-padded rows: ``lasttoken`` is a
#: text's row at its length less one, the position sentence-transformers gathers on either padding side)
FAST_POOLING = frozenset({"cls", "mean", "max", "lasttoken"})
#: ``config.json`` model types of the causal decoders the fast engine runs. Their positions are rotary
#: (relative): the engine's right-padded rows give the vectors of sentence-transformers' left-padded
#: batches (a left pad shifts every position of a row by the same amount, which rotary attention does
#: not see). A decoder with absolute positions (GPT-2's learned ones) would not, so it is refused.
ROTARY_DECODERS = frozenset({"qwen2", "qwen3", "mistral", "llama", "gemma", "gemma2", "gemma3_text"})
#: ``config.json`` model types of causal decoders with absolute positions, whose configs say nothing
#: else that marks them as decoders once sentence-transformers saved them (``GPT2Model``): refused
_ABSOLUTE_DECODERS = frozenset({"gpt2", "gpt_neo", "openai-gpt", "opt", "biogpt", "xglm", "ctrl"})
#: ``architectures`` name endings of a causal language model
_CAUSAL_ARCHITECTURES = ("ForCausalLM", "LMHeadModel")
#: a Transformer module's text-only ``modality_config`` (the default)
TEXT_ONLY: dict[str, Any] = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}
#: the stacks of a plain model
_PLAIN_STACKS = (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"])
#: modules whose effect on the embedding size the files say
_SIZED_MODULES = (
    "Transformer",
    "Pooling",
    "Normalize",
    "Dense",
    "SpladePooling",
    "MultiVectorMask",
)  # a sparse model's pooling; a multi-vector model's token mask
_NORMALIZE_IO = ("sentence_embedding", "sentence_embedding")


def is_decoder_config(config: Mapping[str, Any]) -> bool:
    """Whether the Hugging Face config ``config`` (its ``config.json``, or a loaded config's ``to_dict()``)
    is a causal decoder's: ``is_decoder`` set, a causal language model's architecture, or a known decoder
    type (:data:`ROTARY_DECODERS` and GPT-2-like ones, whose saved configs set neither: ``Qwen3Model``
    saves ``is_decoder: false``).

    Examples
    --------
    >>> is_decoder_config({"model_type": "qwen3", "architectures": ["Qwen3Model"]})
    True
    >>> is_decoder_config({"model_type": "gpt2", "architectures": ["GPT2Model"]})
    True
    >>> is_decoder_config({"model_type": "bert", "architectures": ["BertModel"]})
    False
    """
    architectures = config.get("architectures") or ()
    return (
        bool(config.get("is_decoder"))
        or config.get("model_type") in ROTARY_DECODERS | _ABSOLUTE_DECODERS
        or any(str(a).endswith(_CAUSAL_ARCHITECTURES) for a in architectures)
    )


def plain_reason(
    modules: Sequence[str],
    pooling: Sequence[str],
    *,
    module_types: Sequence[str] | None = None,
    settings: Mapping[str, Any] | None = None,
    is_decoder: bool = False,
    model_type: str | None = None,
    is_encoder_decoder: bool = False,
    truncate_dim: int | None = None,
    max_seq_length: Any = None,
    normalize_io: tuple[str, str] = _NORMALIZE_IO,
) -> str | None:
    """None when a model of this description is plain (the fast engine runs it), else why it is not.

    The same rule for a model's files and for a loaded model.

    Parameters
    ----------
    modules : sequence of str
        The module class names, in order (``["Transformer", "Pooling", "Normalize"]``).
    pooling : sequence of str
        The ``Pooling`` module's modes (``["mean"]``).
    module_types : sequence of str, optional
        The modules' qualified types; each must be sentence-transformers' own.
    settings : mapping, optional
        The Transformer module's ``transformer_task``, ``modality_config``,
        ``module_output_name`` and ``processing_kwargs`` (absent: the defaults).
    is_decoder, is_encoder_decoder : bool
        From the Hugging Face config (:func:`is_decoder_config`): the fast engine runs encoders and
        the decoders of :data:`ROTARY_DECODERS`, never an encoder-decoder.
    model_type : str, optional
        The Hugging Face config's ``model_type`` (a decoder's must be one of :data:`ROTARY_DECODERS`).
    truncate_dim : int, optional
        The model's Matryoshka truncation (none for a plain model).
    max_seq_length : int, optional
        The Transformer's truncation length, a positive int (None: the tokenizer's).
    normalize_io : tuple of str
        The ``Normalize`` module's input and output names.

    Returns
    -------
    str or None

    Examples
    --------
    >>> plain_reason(["Transformer", "Pooling", "Normalize"], ["mean"]) is None
    True
    >>> plain_reason(["Transformer", "Pooling"], ["lasttoken"], is_decoder=True, model_type="qwen3") is None
    True
    >>> plain_reason(["Transformer", "Pooling"], ["weightedmean"])
    "the pooling ['weightedmean'] is not of cls, lasttoken, max, mean"
    >>> plain_reason(["Transformer", "Pooling"], ["lasttoken"], is_decoder=True, model_type="gpt2")[:40]
    "a 'gpt2' decoder: the fast engine runs d"
    """
    if list(modules) not in _PLAIN_STACKS:
        return f"modules {list(modules)} are not Transformer + Pooling (+ Normalize)"
    if module_types is not None and not all(
        str(t).startswith("sentence_transformers.") for t in module_types
    ):
        return f"modules {list(module_types)} are not all sentence-transformers' own"
    if len(modules) == 3 and tuple(normalize_io) != _NORMALIZE_IO:
        return f"the Normalize module reads and writes {tuple(normalize_io)}, not the sentence embedding"
    if not pooling or not set(pooling) <= FAST_POOLING:
        return f"the pooling {list(pooling)} is not of {', '.join(sorted(FAST_POOLING))}"
    settings = settings or {}
    odd = [
        key
        for key, default in (
            ("transformer_task", "feature-extraction"),
            ("modality_config", TEXT_ONLY),
            ("module_output_name", "token_embeddings"),
        )
        if settings.get(key, default) != default
    ]
    if settings.get("processing_kwargs"):
        odd.append("processing_kwargs")
    if odd:
        return f"the Transformer module sets {odd}"
    if is_encoder_decoder:
        return "the Transformer is an encoder-decoder, not an encoder or a decoder alone"
    if is_decoder and model_type not in ROTARY_DECODERS:
        return (
            f"a {model_type!r} decoder: the fast engine runs decoders of rotary (relative) positions only, "
            f"{', '.join(sorted(ROTARY_DECODERS))}, whose right-padded rows give sentence-transformers' "
            "left-padded vectors"
        )
    if truncate_dim is not None:
        return f"truncate_dim={truncate_dim!r} is set"
    if max_seq_length is not None and (
        isinstance(max_seq_length, bool)
        or not isinstance(max_seq_length, int)
        or not 0 < max_seq_length < 2**31
    ):
        return f"max_seq_length={max_seq_length!r} is not a positive int"
    return None


@dataclass(frozen=True)
class ModelLayout:
    """What a sentence-transformers model's files (or a loaded model) say about its structure.

    Attributes
    ----------
    path : str
        The model directory ("" for a loaded model).
    modules : list of str
        The module class names, in order.
    module_types : list of str
        Their qualified types (``modules.json``'s ``type``).
    pooling : tuple of str
        The ``Pooling`` modes (empty without one).
    normalize : bool
        The stack ends with ``Normalize``.
    dimension : int or None
        The embedding size, when the files say it (Transformer, Pooling, Dense, Normalize).
    max_seq_length : int or None
        The Transformer's truncation length (None: the tokenizer's).
    plain : bool
        Whether :func:`plain_reason` holds: the fast engine runs the model.
    reason : str
        Why not, when it is not plain (else "").
    transformer : str or None
        The Transformer module's directory.
    include_prompt : bool
        Whether the prompt's tokens are pooled.
    prompts : dict
        The model's named prompts.
    default_prompt_name : str or None
    transformer_settings : dict
        ``sentence_bert_config.json``.
    model_settings : dict
        ``config_sentence_transformers.json``.
    hf_config : dict
        The Transformer's ``config.json``.
    hf_config_path : str or None
        Where that was read from.
    """

    path: str
    modules: list[str]
    module_types: list[str]
    pooling: tuple[str, ...]
    normalize: bool
    dimension: int | None
    max_seq_length: int | None
    plain: bool
    reason: str
    transformer: str | None = None
    include_prompt: bool = True
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    transformer_settings: dict[str, Any] = field(default_factory=dict)
    model_settings: dict[str, Any] = field(default_factory=dict)
    hf_config: dict[str, Any] = field(default_factory=dict)
    hf_config_path: str | None = None

    @property
    def model_type(self) -> str | None:
        """``config.json``'s ``model_type`` (``"bert"``), if any."""
        value = self.hf_config.get("model_type")
        return value if isinstance(value, str) else None

    @property
    def decoder(self) -> bool:
        """The Transformer is a causal decoder (:func:`is_decoder_config` of :attr:`hf_config`)."""
        return is_decoder_config(self.hf_config)


def _read(path: Path, files: dict[str, tuple[int, int] | None]) -> Any:
    files[str(path)] = _stat(path)
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _read_if_any(path: Path, files: dict[str, tuple[int, int] | None]) -> Any:
    files[str(path)] = _stat(path)
    return _read(path, files) if files[str(path)] is not None else {}


def _stat(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size)


def _pooling_modes(config: Mapping[str, Any]) -> tuple[str, ...]:
    mode = config.get("pooling_mode")
    if mode is not None:
        return (mode,) if isinstance(mode, str) else tuple(str(m) for m in mode)
    return tuple(name for flag, name in POOL_FLAGS.items() if config.get(flag))


def _dimension(modules: list[dict], root: Path, files: dict[str, tuple[int, int] | None]) -> int | None:
    """The embedding size the module configs say, or None where they do not."""
    dim: int | None = None
    vocab: Any = None
    try:
        for module in modules:
            kind = str(module.get("type", "")).rsplit(".", 1)[-1]
            where = root / str(module.get("path", ""))
            if kind not in _SIZED_MODULES:
                return None
            if kind == "Transformer":
                configs = [where / "config.json", where / "_transformer" / "config.json"]
                config = next((_read(c, files) for c in configs if c.is_file()), None)
                if config is None or not isinstance(config.get("hidden_size"), int):
                    return None
                dim = config["hidden_size"]
                vocab = config.get("vocab_size")
            elif kind == "SpladePooling":  # a weight per vocabulary id, from the MLM head's logits
                if not isinstance(vocab, int):
                    return None
                dim = vocab
            elif kind == "Pooling":
                cfg = _read(where / "config.json", files)
                width = cfg.get("embedding_dimension", cfg.get("word_embedding_dimension", dim))
                count = len(_pooling_modes(cfg))
                if not isinstance(width, int) or count < 1:
                    return None
                dim = width * count
            elif kind == "Dense":
                out = _read(where / "config.json", files).get("out_features")
                if not isinstance(out, int):
                    return None
                dim = out
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return dim if isinstance(dim, int) and dim > 0 else None


def _read_layout(path: str, files: dict[str, tuple[int, int] | None]) -> ModelLayout:
    root = Path(path)
    try:
        modules = sorted(_read(root / "modules.json", files), key=lambda m: m.get("idx", 0))
        types = [str(m.get("type", "")) for m in modules]
    except (OSError, ValueError, TypeError, AttributeError) as err:
        return ModelLayout(
            path,
            [],
            [],
            (),
            False,
            None,
            None,
            False,
            f"its files could not be read as a sentence-transformers model ({type(err).__name__}: {err})",
        )
    short = [t.rsplit(".", 1)[-1] for t in types]
    dimension = _dimension(modules, root, files)
    base: dict[str, Any] = {
        "path": path,
        "modules": short,
        "module_types": types,
        "dimension": dimension,
        "normalize": short[-1:] == ["Normalize"],
    }
    try:
        where = root / str(modules[0].get("path", "")) if short[:1] == ["Transformer"] else None
        transformer_settings = _read_if_any(where / "sentence_bert_config.json", files) if where else {}
        pooling_config = (
            _read(root / str(modules[1].get("path", "")) / "config.json", files)
            if short[1:2] == ["Pooling"]
            else {}
        )
        model_settings = _read_if_any(root / "config_sentence_transformers.json", files)
        hf_path = next(
            (
                c
                for c in ((where / "config.json", where / "_transformer" / "config.json") if where else ())
                if c.is_file()
            ),
            None,
        )
        hf_config = _read(hf_path, files) if hf_path is not None else {}
        if where is not None:
            files[str(where / "config.json")] = _stat(where / "config.json")
            files[str(where / "tokenizer.json")] = _stat(where / "tokenizer.json")
        prompts = model_settings.get("prompts") or {}
        max_seq_length = transformer_settings.get("max_seq_length")
        pooling = _pooling_modes(pooling_config)
        # null in sentence_bert_config.json is the setting left at its default
        settings = {k: v for k, v in transformer_settings.items() if v is not None}
        reason = plain_reason(
            short,
            pooling,
            module_types=types,
            settings=settings,
            is_decoder=is_decoder_config(hf_config),
            model_type=hf_config.get("model_type"),
            is_encoder_decoder=bool(hf_config.get("is_encoder_decoder")),
            truncate_dim=model_settings.get("truncate_dim"),
            max_seq_length=max_seq_length,
        )
        return ModelLayout(
            **base,
            pooling=pooling,
            max_seq_length=max_seq_length if reason is None else None,
            plain=reason is None,
            reason=reason or "",
            transformer=str(where) if where else None,
            include_prompt=bool(pooling_config.get("include_prompt", True)),
            prompts=dict(prompts) if isinstance(prompts, dict) else {},
            default_prompt_name=model_settings.get("default_prompt_name"),
            transformer_settings=dict(transformer_settings),
            model_settings=dict(model_settings),
            hf_config=dict(hf_config),
            hf_config_path=str(hf_path) if hf_path is not None else None,
        )
    except (OSError, ValueError, TypeError, AttributeError, KeyError, IndexError) as err:
        return ModelLayout(
            **base,
            pooling=(),
            max_seq_length=None,
            plain=False,
            reason=f"its files could not be read as a sentence-transformers model "
            f"({type(err).__name__}: {err})",
        )


_CACHE: dict[str, tuple[dict[str, tuple[int, int] | None], ModelLayout]] = {}
_CACHE_LOCK = threading.Lock()


def read_layout(path: str | os.PathLike) -> ModelLayout:
    """The layout of the model directory ``path``, read from its JSON files (nothing imported, no weights).

    Reads ``modules.json``, ``sentence_bert_config.json``, the ``Pooling``, ``Dense`` and
    Hugging Face configs and ``config_sentence_transformers.json`` once; a later call
    answers from memory while none of those files changed (size and mtime).

    Examples
    --------
    >>> from dask_surge.testing import packaged_model_dir
    >>> layout = read_layout(packaged_model_dir())
    >>> layout.modules, layout.pooling, layout.dimension, layout.max_seq_length, layout.plain
    (['Transformer', 'Pooling', 'Normalize'], ('mean',), 384, 256, True)
    >>> read_layout("/nonexistent").plain, read_layout("/nonexistent").dimension
    (False, None)
    """
    key = os.fspath(path)
    with _CACHE_LOCK:
        known = _CACHE.get(key)
    if known is not None and all(_stat(Path(f)) == st for f, st in known[0].items()):
        return known[1]
    files: dict[str, tuple[int, int] | None] = {}
    layout = _read_layout(key, files)
    with _CACHE_LOCK:
        _CACHE[key] = (files, layout)
    return layout


def layout_of_model(model: Any) -> ModelLayout:
    """The layout of a loaded ``SentenceTransformer``, as :func:`read_layout` reads it from files.

    Duck-typed (nothing imported): the modules are ``model``'s own, the settings their
    attributes. What only a loaded model has (its tokenizer, its truncation length) is the
    caller's to check.

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> Transformer = type("Transformer", (), {"__module__": "sentence_transformers.models"})
    >>> Pooling = type("Pooling", (), {"__module__": "sentence_transformers.models", "pooling_mode": "cls"})
    >>> class Model(list):
    ...     truncate_dim = None
    >>> layout_of_model(Model([Transformer(), Pooling()])).plain
    True
    >>> Model.truncate_dim = 8
    >>> layout_of_model(Model([Transformer(), Pooling()])).reason
    'truncate_dim=8 is set'
    """
    modules = list(model)
    short = [type(m).__name__ for m in modules]
    types = [f"{type(m).__module__}.{type(m).__qualname__}" for m in modules]
    pooling_module = modules[1] if short[1:2] == ["Pooling"] else None
    mode = getattr(pooling_module, "pooling_mode", ()) if pooling_module is not None else ()
    pooling = (mode,) if isinstance(mode, str) else tuple(mode)
    transformer = modules[0] if short[:1] == ["Transformer"] else None
    settings = {
        key: getattr(transformer, key)
        for key in ("transformer_task", "modality_config", "module_output_name", "processing_kwargs")
        if hasattr(transformer, key)
    }
    config = getattr(getattr(transformer, "auto_model", None), "config", None)
    to_dict = getattr(config, "to_dict", None)
    hf_config = to_dict() if callable(to_dict) else {}
    normalize = modules[2] if len(modules) == 3 else None
    normalize_io = (
        getattr(normalize, "module_input_name", _NORMALIZE_IO[0]),
        getattr(normalize, "module_output_name", _NORMALIZE_IO[1]),
    )
    reason = plain_reason(
        short,
        pooling,
        module_types=types,
        settings=settings,
        is_decoder=is_decoder_config(hf_config),
        model_type=hf_config.get("model_type"),
        is_encoder_decoder=bool(getattr(config, "is_encoder_decoder", False)),
        truncate_dim=getattr(model, "truncate_dim", None),
        normalize_io=normalize_io,
        max_seq_length=getattr(transformer, "max_seq_length", None),
    )
    max_seq_length = getattr(transformer, "max_seq_length", None)
    return ModelLayout(
        "",
        short,
        types,
        pooling,
        short[-1:] == ["Normalize"],
        None,
        max_seq_length if isinstance(max_seq_length, int) else None,
        reason is None,
        reason or "",
        include_prompt=bool(getattr(pooling_module, "include_prompt", True)),
        prompts=dict(getattr(model, "prompts", None) or {}),
        default_prompt_name=getattr(model, "default_prompt_name", None),
        hf_config=dict(hf_config),
    )
