"""A BERT encoder in plain torch, loaded from a checkpoint's ``config.json`` and ``model.safetensors``.

Loading a BERT with ``transformers.AutoModel`` imports its modeling stack (torch.distributed.tensor
and SymPy, torch._dynamo, SciPy through the object-detection losses) on top of
``import transformers``: the largest part of a cold worker's first output (``docs/ab_studies.md``,
"Cold first output"). The forward pass of
an encoder is small: :class:`BertEncoder` is that forward (embeddings, self-attention through
``torch.nn.functional.scaled_dot_product_attention``, the feed-forward, post-LayerNorm), with the
module and parameter names of ``transformers``' ``BertModel``, so a checkpoint's state dict loads
as it is and the fast engine's CPU rewrites (oneDNN linears, the fused GELU) find the modules they
look for. It computes what ``BertModel`` computes in eval mode (the tests compare the two on the
packaged all-MiniLM-L6-v2 and on random tiny BERTs).

:func:`load_bert` takes only the configurations whose forward this module is: ``model_type``
``"bert"``, absolute position embeddings, exact GELU, an encoder (no decoder, no cross-attention),
one ``model.safetensors`` holding every weight under the expected names. For anything else it
raises :class:`NotNativeBert` saying why, and the caller loads the model with ``transformers``.

Examples
--------
>>> from dask_surge.testing import packaged_model_dir
>>> model = load_bert(str(packaged_model_dir()), "cpu")
>>> ids = torch.tensor([[101, 7592, 102]])
>>> model(input_ids=ids).last_hidden_state.shape
torch.Size([1, 3, 384])
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["BertConfig", "BertEncoder", "BertOutput", "NotNativeBert", "load_bert", "pad_keys"]

#: Weights a BERT checkpoint may hold that the encoder does not use (the pooler head, the position
#: ids buffer older transformers saved).
_UNUSED = ("pooler.", "embeddings.position_ids", "embeddings.token_type_ids")


class NotNativeBert(ValueError):
    """A checkpoint :class:`BertEncoder` does not compute (the message says why); load it with transformers."""


@dataclass
class BertConfig:
    """The parts of a BERT ``config.json`` the forward pass reads.

    ``dtype`` is the floating dtype the checkpoint stores its weights in (the weights are
    loaded as float32; :func:`~dask_surge.engine.placement.checkpoint_dtype` reads it here, as
    it reads a ``transformers`` config's).
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    model_type: str = "bert"
    dtype: str | None = None

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> BertConfig:
        """The config of a parsed ``config.json``; :class:`NotNativeBert` when this module does not compute that model.

        Examples
        --------
        >>> cfg = BertConfig.from_json({"model_type": "bert", "vocab_size": 10, "hidden_size": 8,
        ...     "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 16,
        ...     "max_position_embeddings": 32, "type_vocab_size": 2})
        >>> cfg.layer_norm_eps, cfg.hidden_size // cfg.num_attention_heads
        (1e-12, 4)
        >>> BertConfig.from_json({"model_type": "bert", "hidden_act": "gelu_new"})
        Traceback (most recent call last):
        ...
        dask_surge.engine.bert.NotNativeBert: hidden_act='gelu_new' is not the exact GELU
        """
        checks = {
            "model_type": (raw.get("model_type") == "bert", "is not 'bert'"),
            "hidden_act": (raw.get("hidden_act", "gelu") == "gelu", "is not the exact GELU"),
            "position_embedding_type": (
                raw.get("position_embedding_type", "absolute") in (None, "absolute"),
                "is not absolute position embeddings",
            ),
            "is_decoder": (not raw.get("is_decoder"), "makes a decoder"),
            "add_cross_attention": (not raw.get("add_cross_attention"), "adds cross-attention"),
            "is_encoder_decoder": (not raw.get("is_encoder_decoder"), "makes an encoder-decoder"),
            "auto_map": (not raw.get("auto_map"), "ships custom code"),
            "quantization_config": (not raw.get("quantization_config"), "asks for a quantized model"),
        }
        for key, (ok, rule) in checks.items():
            if not ok:
                raise NotNativeBert(f"{key}={raw.get(key)!r} {rule}")
        names = (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
            "type_vocab_size",
        )
        sizes = {name: raw.get(name) for name in names}
        bad = {k: v for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1}
        if bad:
            raise NotNativeBert(f"config.json sizes {bad} are not positive ints")
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        if hidden % heads:
            raise NotNativeBert(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
        eps = raw.get("layer_norm_eps", 1e-12)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise NotNativeBert(f"layer_norm_eps={eps!r} is not a positive number")
        return cls(**sizes, layer_norm_eps=float(eps))  # type: ignore[arg-type]


@dataclass
class BertOutput:
    """What the encoder returns (the one field the engine reads of ``transformers``' ``BaseModelOutput``)."""

    last_hidden_state: torch.Tensor


def pad_keys(
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    multiple: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Pad attention's keys and values to a multiple of ``multiple`` tokens, the padding masked out.

    The attention is the same (the padded keys get no weight); only the kernel's loops change
    (see :data:`dask_surge.engine.forward.CPU_KEY_MULTIPLE`). ``mask`` is None, a boolean mask
    (True: attend) or an additive one, broadcastable to ``(batch, heads, queries, keys)``.

    Examples
    --------
    >>> q, k, v = (torch.randn(3, 2, 29, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    >>> pk, pv, m = pad_keys(k, v, None, 16)
    >>> pk.shape[-2], m.shape
    (32, torch.Size([1, 1, 1, 32]))
    >>> sdpa = torch.nn.functional.scaled_dot_product_attention
    >>> bool(torch.allclose(sdpa(q, pk, pv, attn_mask=m), sdpa(q, k, v), atol=1e-6))
    True
    """
    length = key.shape[-2]
    pad = -length % multiple if multiple > 1 else 0
    if not pad:
        return key, value, mask
    key = nn.functional.pad(key, (0, 0, 0, pad))
    value = nn.functional.pad(value, (0, 0, 0, pad))
    if mask is None:
        mask = torch.zeros((1, 1, 1, length + pad), dtype=key.dtype, device=key.device)
        mask[..., length:] = torch.finfo(key.dtype).min
        return key, value, mask
    mask = mask.expand(*mask.shape[:-1], length)
    fill = False if mask.dtype == torch.bool else torch.finfo(mask.dtype).min
    return key, value, nn.functional.pad(mask, (0, pad), value=fill)


def _embedding(rows: int, width: int) -> nn.Embedding:
    """An embedding table left uninitialized (its weights are loaded next): ``nn.Embedding``'s own random
    init on the meta device imports torch._dynamo, the slow import the load is here to avoid."""
    return nn.Embedding(rows, width, _weight=torch.empty(rows, width))


class _Embeddings(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = _embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = _embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = _embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        length = input_ids.shape[1]
        positions = torch.arange(length, device=input_ids.device)
        if token_type_ids is None:  # BertModel adds type 0's embedding when none are given
            types = self.token_type_embeddings.weight[0]
        else:
            types = self.token_type_embeddings(token_type_ids)
        hidden = self.word_embeddings(input_ids) + types + self.position_embeddings(positions)
        return self.LayerNorm(hidden)


class _SelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.heads = cfg.num_attention_heads
        self.head_size = cfg.hidden_size // cfg.num_attention_heads
        self.scaling = self.head_size**-0.5
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        #: Keys padded to a multiple of this many tokens (1: none); the engine sets it on its CPU copy.
        self.key_multiple = 1

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        batch, length, width = hidden.shape
        shape = (batch, length, self.heads, self.head_size)
        query = self.query(hidden).view(shape).transpose(1, 2)
        key = self.key(hidden).view(shape).transpose(1, 2)
        value = self.value(hidden).view(shape).transpose(1, 2)
        key, value, mask = pad_keys(key, value, mask, self.key_multiple)
        out = nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=self.scaling
        )
        return out.transpose(1, 2).reshape(batch, length, width)


class _Residual(nn.Module):
    """``LayerNorm(dense(x) + residual)``: BERT's attention output and feed-forward output."""

    def __init__(self, width_in: int, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(width_in, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden) + residual)


class _Attention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.self = _SelfAttention(cfg)
        self.output = _Residual(cfg.hidden_size, cfg)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self.output(self.self(hidden, mask), hidden)


class _Intermediate(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.intermediate_act_fn: nn.Module = nn.GELU()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.intermediate_act_fn(self.dense(hidden))


class _Layer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.attention = _Attention(cfg)
        self.intermediate = _Intermediate(cfg)
        self.output = _Residual(cfg.intermediate_size, cfg)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        attended = self.attention(hidden, mask)
        return self.output(self.intermediate(attended), attended)


class _Stack(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_hidden_layers))


class BertEncoder(nn.Module):
    """BERT's encoder (no pooler head), computing what ``transformers``' ``BertModel`` computes in eval mode.

    Called as the engine calls a Hugging Face encoder: ``model(input_ids=..., attention_mask=...,
    token_type_ids=..., return_dict=True).last_hidden_state``. ``attention_mask`` is the 2D 0/1
    mask (1: a real token), or a 4D additive one (0 to attend, a large negative to skip) in the
    weights' dtype, or None (every token is real).

    Build it with :func:`load_bert`, which assigns the checkpoint's weights: constructed on its
    own, its embedding tables are left uninitialized.

    Parameters
    ----------
    config : BertConfig
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = _Embeddings(config)
        self.encoder = _Stack(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        return_dict: bool = True,
    ) -> BertOutput:
        hidden = self.embeddings(input_ids, token_type_ids)
        mask = attention_mask
        if mask is not None and mask.dim() == 2:
            keep = mask.bool()[:, None, None, :]
            mask = torch.zeros(keep.shape, dtype=hidden.dtype, device=hidden.device).masked_fill_(
                ~keep, torch.finfo(hidden.dtype).min
            )
        for layer in self.encoder.layer:
            hidden = layer(hidden, mask)
        return BertOutput(hidden)

    def pad_attention_keys(self, multiple: int) -> None:
        """Pad every layer's attention keys to a multiple of ``multiple`` tokens (1: no padding)."""
        for module in self.modules():
            if isinstance(module, _SelfAttention):
                module.key_multiple = multiple


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def load_bert(directory: str, device: str | torch.device) -> BertEncoder:
    """The BERT encoder of the Hugging Face checkpoint in ``directory``, on ``device``, in eval mode.

    The weights are loaded as float32 (the compute dtype is the engine's choice); the
    checkpoint's own dtype is kept in ``config.dtype``.

    Raises
    ------
    NotNativeBert
        When the checkpoint is not one this module computes (another architecture or option,
        weights not in one ``model.safetensors``, a missing or misshapen weight): the message
        says which, and the caller loads it with ``transformers``.

    Examples
    --------
    >>> import tempfile
    >>> load_bert(tempfile.mkdtemp(), "cpu")
    Traceback (most recent call last):
    ...
    dask_surge.engine.bert.NotNativeBert: no config.json ...
    """
    root = Path(directory)
    try:
        with open(root / "config.json", encoding="utf-8") as fh:
            raw = json.load(fh)
    except (OSError, ValueError) as err:
        raise NotNativeBert(f"no config.json could be read in {directory} ({type(err).__name__})") from None
    if not isinstance(raw, dict):
        raise NotNativeBert("config.json is not a JSON object")
    config = BertConfig.from_json(raw)
    if not (root / "model.safetensors").is_file():
        raise NotNativeBert("the weights are not in one model.safetensors")
    try:
        state = _weights(root / "model.safetensors")
    except Exception as err:  # noqa: BLE001 - any unreadable file: transformers' load reports it its own way
        raise NotNativeBert(f"model.safetensors could not be read ({type(err).__name__}: {err})") from None
    if state and all(name.startswith("bert.") for name in state if not name.startswith("cls.")):
        state = {name[len("bert.") :]: t for name, t in state.items() if name.startswith("bert.")}
    floating = [t.dtype for t in state.values() if t.is_floating_point()]
    config.dtype = str(floating[0]).removeprefix("torch.") if floating else None
    wanted = {
        name: t.to(torch.float32) if t.is_floating_point() else t
        for name, t in state.items()
        if not name.startswith(_UNUSED)
    }
    with torch.device("meta"):
        model = BertEncoder(config)
    expected = set(model.state_dict())
    missing, extra = sorted(expected - set(wanted)), sorted(set(wanted) - expected)
    if missing or extra:
        raise NotNativeBert(
            f"model.safetensors does not hold BERT's weights under BertModel's names "
            f"(missing {missing[:3]}, unexpected {extra[:3]})"
        )
    try:
        model.load_state_dict(wanted, strict=True, assign=True)
    except RuntimeError as err:
        raise NotNativeBert(f"model.safetensors' weights do not fit config.json ({str(err)[:200]})") from None
    return model.to(device).eval().requires_grad_(False)
