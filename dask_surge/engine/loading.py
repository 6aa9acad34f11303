"""Load a plain Transformer + Pooling (+ Normalize) model for the fast engine without sentence-transformers.

The fast engine (:class:`~dask_surge.engine.transformer.TransformerEngine`) needs three things
of a sentence-transformers model: the Hugging Face encoder (or rotary decoder), its fast
tokenizer and the pooling. Importing ``sentence_transformers`` to get them costs more than the rest of the
load (it imports scikit-learn and SciPy), and every cold worker pays it before its first
SuperBatch (the cold-start study in ``docs/ab_studies.md``). For a model directory whose
:class:`~dask_surge.engine.layout.ModelLayout` (read once from its JSON files, nothing
imported) says it is exactly that stack (:func:`direct_reason`), :func:`load_direct` loads it the way sentence-transformers' ``Transformer`` module does, so
the engine computes the same embeddings: the tokenizer with ``max_seq_length`` as
``model_max_length`` (a BERT one read by :mod:`dask_surge.engine.bert_tokenizer`, any other
by ``AutoTokenizer``), the encoder by :mod:`dask_surge.engine.bert` for a BERT (neither needs
``transformers``), else (a decoder of :data:`~dask_surge.engine.layout.ROTARY_DECODERS` included)
by ``AutoModel`` with the cache off, SDPA attention and float32 weights (the engine casts a half
copy on CUDA, as for any model). The tokenizer's padding side does not matter: the engine pads
its own rows. Anything else (other modules or
options, lower-casing, custom code, an architecture outside :data:`DIRECT_MODEL_TYPES`) is
loaded by sentence-transformers, as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .bert_tokenizer import NotNativeTokenizer, load_bert_tokenizer
from .layout import FAST_POOLING, ROTARY_DECODERS, TEXT_ONLY, ModelLayout, read_layout

logger = logging.getLogger(__name__)

__all__ = ["DIRECT_MODEL_TYPES", "DirectModule", "direct_layout", "direct_reason", "load_direct"]

#: ``config.json`` model types loaded directly: the encoders and the rotary decoders
#: (:data:`~dask_surge.engine.layout.ROTARY_DECODERS`) that ``AutoModel`` loads as
#: sentence-transformers' ``Transformer`` module does (no special case there for them)
DIRECT_MODEL_TYPES = (
    frozenset({"bert", "roberta", "xlm-roberta", "mpnet", "distilbert", "electra"}) | ROTARY_DECODERS
)

#: ``sentence_bert_config.json`` keys and the values that change nothing the engine does
_NEUTRAL_TRANSFORMER = {
    "transformer_task": ("feature-extraction",),
    "module_output_name": ("token_embeddings",),
    "model_args": ({},),
    "tokenizer_args": ({},),
    "config_args": ({},),
    "processing_kwargs": ({}, None),
    "do_lower_case": (False,),
    "unpad_inputs": (None, False),
    "modality_config": (None, TEXT_ONLY),
    "query_length": (None,),
    "document_length": (None,),
    "query_expansion": (None,),
}
_NEUTRAL_MODEL = {"__version__", "prompts", "default_prompt_name", "similarity_fn_name", "model_type"}


def direct_reason(layout: ModelLayout) -> str | None:
    """None when the model of ``layout`` loads directly (without sentence-transformers), else why not.

    A plain model (:func:`~dask_surge.engine.layout.plain_reason`) whose files also set
    nothing else the ``Transformer`` module would act on, with one pooling mode, a fast
    ``tokenizer.json`` and an architecture of :data:`DIRECT_MODEL_TYPES` without custom code.

    Examples
    --------
    >>> from dask_surge.testing import packaged_model_dir
    >>> direct_reason(read_layout(packaged_model_dir())) is None
    True
    """
    if not layout.plain:
        return layout.reason
    odd = {
        k: v
        for k, v in layout.transformer_settings.items()
        if k != "max_seq_length" and v not in _NEUTRAL_TRANSFORMER.get(k, ())
    }
    if odd:
        return f"sentence_bert_config.json sets {sorted(odd)}"
    if len(layout.pooling) != 1:
        return f"pooling_mode={list(layout.pooling)!r} is not one mode of {', '.join(sorted(FAST_POOLING))}"
    if set(layout.model_settings) - _NEUTRAL_MODEL:
        return f"config_sentence_transformers.json sets {sorted(set(layout.model_settings) - _NEUTRAL_MODEL)}"
    hf = layout.hf_config
    where = Path(layout.transformer or layout.path)
    if (
        layout.model_type not in DIRECT_MODEL_TYPES
        or hf.get("auto_map")
        or layout.hf_config_path != str(where / "config.json")
        or not (where / "tokenizer.json").is_file()
    ):
        return (
            f"a {layout.model_type} model (custom code, a decoder or no tokenizer.json) is left to "
            "sentence-transformers"
        )
    return None


def direct_layout(path: str) -> tuple[ModelLayout | None, str]:
    """The layout of the model in ``path`` when it can be loaded directly, else None; and why.

    The layout is :func:`~dask_surge.engine.layout.read_layout`'s (its JSON files, read once;
    nothing imported), and whether it loads directly :func:`direct_reason`'s.

    Examples
    --------
    >>> from dask_surge.testing import packaged_model_dir
    >>> layout, why = direct_layout(str(packaged_model_dir()))
    >>> layout.modules, layout.pooling, layout.max_seq_length, why
    (['Transformer', 'Pooling', 'Normalize'], ('mean',), 256, 'Transformer + Pooling + Normalize of a bert encoder')
    >>> direct_layout("/nonexistent")[0] is None
    True
    """
    layout = read_layout(path)
    why = direct_reason(layout)
    if why is not None:
        return None, why
    kind = "decoder" if layout.decoder else "encoder"
    return layout, f"{' + '.join(layout.modules)} of a {layout.model_type} {kind}"


@dataclass
class DirectModule:
    """What the engine reads of sentence-transformers' ``Transformer`` module: the tokenizer,
    the truncation length and the Hugging Face encoder (``auto_model``); and what loaded the encoder."""

    tokenizer: Any
    max_seq_length: int
    auto_model: Any
    #: ``"dask-surge"`` (:mod:`dask_surge.engine.bert`) or ``"transformers"`` (``AutoModel``).
    loaded_by: str = "transformers"


def load_direct(layout: ModelLayout, device: str) -> DirectModule:
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
        When the tokenizer is not a fast one (the caller loads with sentence-transformers).

    Examples
    --------
    >>> from dask_surge.testing import packaged_model_dir
    >>> module = load_direct(direct_layout(str(packaged_model_dir()))[0], "cpu")
    >>> module.max_seq_length, module.tokenizer.is_fast, module.auto_model.config.model_type, module.loaded_by
    (256, True, 'bert', 'dask-surge')
    """
    from .bert import NotNativeBert, load_bert  # imports torch: here, where a model loads

    if layout.transformer is None:
        raise ValueError(f"the model in {layout.path} has no Transformer module to load ({layout.reason})")
    tokenizer: Any
    try:
        tokenizer = load_bert_tokenizer(layout.transformer, model_max_length=layout.max_seq_length)
    except NotNativeTokenizer as why:
        logger.debug(
            "dask-surge: the tokenizer of %s is loaded with transformers' AutoTokenizer: %s",
            layout.transformer,
            why,
        )
        from transformers import AutoTokenizer

        kwargs = {"model_max_length": layout.max_seq_length} if layout.max_seq_length is not None else {}
        tokenizer = AutoTokenizer.from_pretrained(layout.transformer, local_files_only=True, **kwargs)
    if not getattr(tokenizer, "is_fast", False):  # either padding side: the engine pads its own rows
        raise ValueError(f"the tokenizer of {layout.transformer} is not a fast tokenizer")
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
    """``path``'s encoder (or decoder) loaded by ``transformers.AutoModel`` as sentence-transformers loads it,
    on ``device``, in eval mode: the cache off, SDPA attention, float32 weights (the engine makes the half
    copy it computes in on CUDA, :class:`~dask_surge.engine.forward.DeviceRunner`)."""
    import torch
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if hasattr(config, "use_cache"):  # sentence-transformers turns the cache off
        config.use_cache = False
    model = AutoModel.from_pretrained(
        path, config=config, local_files_only=True, attn_implementation="sdpa", dtype=torch.float32
    )
    model.to(device)
    model.eval()
    return model
