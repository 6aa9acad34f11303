"""Load a plain Transformer + Pooling (+ Normalize) model for the fast engine without sentence-transformers.

The fast engine (:class:`~dask_surge.engine.transformer.TransformerEngine`) needs three things
of a sentence-transformers model: the Hugging Face encoder, its fast tokenizer and the
pooling. Importing ``sentence_transformers`` to get them costs more than the rest of the
load (it imports scikit-learn and SciPy), and every cold worker pays it before its first
SuperBatch (the cold-start study in ``docs/ab_studies.md``). For a model directory whose files say it is exactly that stack,
:func:`direct_layout` reads the layout from the JSON files (nothing imported), and
:func:`load_direct` loads it the way sentence-transformers' ``Transformer`` module does, so
the engine computes the same embeddings: the tokenizer with ``max_seq_length`` as
``model_max_length`` (a BERT one read by :mod:`dask_surge.engine.bert_tokenizer`, any other
by ``AutoTokenizer``), the encoder by :mod:`dask_surge.engine.bert` for a BERT (neither needs
``transformers``), else by ``AutoModel`` with the cache off. Anything else (other modules or
options, lower-casing, custom code, an architecture outside :data:`DIRECT_MODEL_TYPES`) is
loaded by sentence-transformers, as before.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .bert_tokenizer import NotNativeTokenizer, load_bert_tokenizer

logger = logging.getLogger(__name__)

__all__ = ["DIRECT_MODEL_TYPES", "DirectLayout", "DirectModule", "direct_layout", "load_direct"]

#: ``config.json`` model types loaded directly: encoders that ``AutoModel`` loads as
#: sentence-transformers' ``Transformer`` module does (no encoder-only special case there)
DIRECT_MODEL_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "mpnet", "distilbert", "electra"})

_ST_TYPES = {"Transformer", "Pooling", "Normalize"}
_POOL_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max"}
_OTHER_FLAGS = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")
#: ``sentence_bert_config.json`` keys and the values that change nothing the engine does
_NEUTRAL_TRANSFORMER = {"transformer_task": ("feature-extraction",), "module_output_name": ("token_embeddings",),
                        "model_args": ({},), "tokenizer_args": ({},), "config_args": ({},),
                        "processing_kwargs": ({}, None), "do_lower_case": (False,), "unpad_inputs": (None, False),
                        "modality_config": (None, {"text": {"method": "forward",
                                                             "method_output_name": "last_hidden_state"}}), "query_length": (None,), "document_length": (None,),
                        "query_expansion": (None,)}
_NEUTRAL_MODEL = {"__version__", "prompts", "default_prompt_name", "similarity_fn_name", "model_type"}


@dataclass(frozen=True)
class DirectLayout:
    """What a Transformer + Pooling (+ Normalize) model directory says, read from its JSON files.

    Attributes
    ----------
    transformer : str
        The directory of the Hugging Face encoder and tokenizer.
    max_seq_length : int or None
        ``sentence_bert_config.json``'s truncation length (None: the tokenizer's, capped at the
        model's position embeddings).
    mode : str
        The pooling: ``"cls"``, ``"mean"`` or ``"max"``.
    include_prompt : bool
        Whether the prompt's tokens are pooled.
    normalize : bool
        The stack ends with ``Normalize``.
    prompts : dict
        The model's named prompts.
    default_prompt_name : str or None
    """

    transformer: str
    max_seq_length: int | None
    mode: str
    include_prompt: bool
    normalize: bool
    prompts: dict
    default_prompt_name: str | None

    @property
    def modules(self) -> list[str]:
        """The module names, as ``type(module).__name__`` of the sentence-transformers stack."""
        return ["Transformer", "Pooling", *(["Normalize"] if self.normalize else [])]


def _read(path: Path) -> Any:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def direct_layout(path: str) -> tuple[DirectLayout | None, str]:
    """The layout of the model in ``path`` when it can be loaded directly, else None; and why.

    Reads ``modules.json``, ``sentence_bert_config.json``, the ``Pooling`` config,
    ``config_sentence_transformers.json`` and ``config.json``; imports nothing.

    Examples
    --------
    >>> from dask_surge.testing import packaged_model_dir
    >>> layout, why = direct_layout(str(packaged_model_dir()))
    >>> layout.modules, layout.mode, layout.max_seq_length, why
    (['Transformer', 'Pooling', 'Normalize'], 'mean', 256, 'Transformer + Pooling + Normalize of a bert encoder')
    >>> direct_layout("/nonexistent")[0] is None
    True
    """
    root = Path(path)
    try:
        modules = sorted(_read(root / "modules.json"), key=lambda m: m.get("idx", 0))
        kinds = [str(m.get("type", "")) for m in modules]
        short = [k.rsplit(".", 1)[-1] for k in kinds]
        if short not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]) \
                or not all(k.startswith("sentence_transformers.") for k in kinds):
            return None, f"modules {short} are not Transformer + Pooling (+ Normalize)"
        where = root / str(modules[0].get("path", ""))
        st_config = _read(where / "sentence_bert_config.json") if (where / "sentence_bert_config.json").is_file() else {}
        odd = {k: v for k, v in st_config.items() if k != "max_seq_length" and v not in _NEUTRAL_TRANSFORMER.get(k, ())}
        if odd:
            return None, f"sentence_bert_config.json sets {sorted(odd)}"
        max_seq_length = st_config.get("max_seq_length")
        if max_seq_length is not None and (isinstance(max_seq_length, bool) or not isinstance(max_seq_length, int)
                                           or max_seq_length < 1):
            return None, f"max_seq_length={max_seq_length!r} is not a positive int"
        pooling = _read(root / str(modules[1].get("path", "")) / "config.json")
        mode = pooling.get("pooling_mode")
        if mode is None:
            if any(pooling.get(flag) for flag in _OTHER_FLAGS):
                return None, "the pooling is not cls, mean or max"
            chosen = [name for flag, name in _POOL_FLAGS.items() if pooling.get(flag)]
            mode = chosen[0] if len(chosen) == 1 else chosen
        if isinstance(mode, list) and len(mode) == 1:
            mode = mode[0]
        if mode not in ("cls", "mean", "max"):
            return None, f"pooling_mode={mode!r} is not one of cls, mean or max"
        include_prompt = pooling.get("include_prompt", True)
        model_config_path = root / "config_sentence_transformers.json"
        model_config = _read(model_config_path) if model_config_path.is_file() else {}
        if set(model_config) - _NEUTRAL_MODEL:
            return None, f"config_sentence_transformers.json sets {sorted(set(model_config) - _NEUTRAL_MODEL)}"
        hf = _read(where / "config.json")
        model_type = hf.get("model_type")
        if model_type not in DIRECT_MODEL_TYPES or hf.get("auto_map") or hf.get("is_decoder") \
                or hf.get("is_encoder_decoder") or not (where / "tokenizer.json").is_file():
            return None, f"a {model_type} model (custom code, a decoder or no tokenizer.json) is left to sentence-transformers"
    except (OSError, ValueError, TypeError, AttributeError, KeyError, IndexError) as err:
        return None, f"its files could not be read as a sentence-transformers model ({type(err).__name__}: {err})"
    prompts = model_config.get("prompts") or {}
    layout = DirectLayout(str(where), max_seq_length, mode, bool(include_prompt), len(modules) == 3,
                          dict(prompts) if isinstance(prompts, dict) else {}, model_config.get("default_prompt_name"))
    return layout, f"{' + '.join(layout.modules)} of a {model_type} encoder"


@dataclass
class DirectModule:
    """What the engine reads of sentence-transformers' ``Transformer`` module: the tokenizer,
    the truncation length and the Hugging Face encoder (``auto_model``); and what loaded the encoder."""

    tokenizer: Any
    max_seq_length: int
    auto_model: Any
    #: ``"dask-surge"`` (:mod:`dask_surge.engine.bert`) or ``"transformers"`` (``AutoModel``).
    loaded_by: str = "transformers"


def load_direct(layout: DirectLayout, device: str) -> DirectModule:
    """Load ``layout``'s encoder and tokenizer as sentence-transformers' ``Transformer`` module does, onto
    ``device``, in eval mode.

    The tokenizer has ``max_seq_length`` as ``model_max_length``: a BERT tokenizer that
    :mod:`dask_surge.engine.bert_tokenizer` reads as transformers does is read by it, any other
    by ``AutoTokenizer``. A BERT checkpoint that :mod:`dask_surge.engine.bert` computes is
    loaded by it, any other encoder by ``AutoModel`` (its config's cache off, as
    sentence-transformers sets it). A BERT loaded that way imports no ``transformers`` at all,
    which shortens a cold worker's start (``docs/ab_studies.md``, "Cold first output").

    Raises
    ------
    ValueError
        When the tokenizer is not a right-padding fast one (the caller loads with sentence-transformers).

    Examples
    --------
    >>> from dask_surge.testing import packaged_model_dir
    >>> module = load_direct(direct_layout(str(packaged_model_dir()))[0], "cpu")
    >>> module.max_seq_length, module.tokenizer.is_fast, module.auto_model.config.model_type, module.loaded_by
    (256, True, 'bert', 'dask-surge')
    """
    from .bert import NotNativeBert, load_bert  # imports torch: here, where a model loads

    tokenizer: Any
    try:
        tokenizer = load_bert_tokenizer(layout.transformer, model_max_length=layout.max_seq_length)
    except NotNativeTokenizer as why:
        logger.debug("dask-surge: the tokenizer of %s is loaded with transformers' AutoTokenizer: %s",
                     layout.transformer, why)
        from transformers import AutoTokenizer

        kwargs = {"model_max_length": layout.max_seq_length} if layout.max_seq_length is not None else {}
        tokenizer = AutoTokenizer.from_pretrained(layout.transformer, local_files_only=True, **kwargs)
    if not getattr(tokenizer, "is_fast", False) or tokenizer.padding_side != "right":
        raise ValueError(f"the tokenizer of {layout.transformer} is not a right-padding fast tokenizer")
    try:
        model, loaded_by = load_bert(layout.transformer, device), "dask-surge"
    except NotNativeBert as why:
        logger.debug("dask-surge: %s is loaded with transformers' AutoModel: %s", layout.transformer, why)
        model, loaded_by = _auto_model(layout.transformer, device), "transformers"
    positions = getattr(model.config, "max_position_embeddings", -1)
    if layout.max_seq_length is None and positions != -1:
        tokenizer.model_max_length = min(tokenizer.model_max_length, positions)
    return DirectModule(tokenizer, int(tokenizer.model_max_length), model, loaded_by)


def _auto_model(path: str, device: str) -> Any:
    """``path``'s encoder loaded by ``transformers.AutoModel`` as sentence-transformers loads it, on ``device``, in eval mode."""
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if hasattr(config, "use_cache"):  # sentence-transformers turns the cache off
        config.use_cache = False
    model = AutoModel.from_pretrained(path, config=config, local_files_only=True)
    model.to(device)
    model.eval()
    return model
