"""Tokenize-sort-forward inference engine for sentence-transformers models.

:class:`TransformerEngine` replaces ``SentenceTransformer.encode`` for the most
common model shape (a Hugging Face encoder, a ``Pooling`` module and an optional
``Normalize`` module), prompts included. It tokenizes with the Rust tokenizer in one
call, sorts the texts by token length, cuts micro-batches under a token budget so that
padding is nearly zero, runs the encoder, pools on the device and puts the rows back in
the caller's order.
"""

from __future__ import annotations

import contextlib
import copy
import operator
import os
import queue
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import SurgeInputError, SurgeModelError, SurgeValueError
from .batching import CPU_MAX_TOKENS, WINDOW_TEXTS, BatchPlan, plan_batches
from .prompts import resolve_prompt

__all__ = ["NOOP_FORWARD_ENV", "TransformerEngine"]

_DTYPES = {None: None, "float32": None, "float16": torch.float16, "bfloat16": torch.bfloat16}
_POOLING_MODES = frozenset({"cls", "max", "mean"})
_TEXT_ONLY = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}
#: Token budget per micro-batch on CPU (rows x padded length); the rule lives in :mod:`dask_surge.models.batching`.
_CPU_MAX_TOKENS = CPU_MAX_TOKENS
#: Texts tokenized and length-sorted together (one window); on CUDA the next window tokenizes during compute.
_CHUNK_TEXTS = WINDOW_TEXTS
#: FOR BENCHMARKING ONLY. When this environment variable is "1" in the process that builds an
#: engine, the engine skips the encoder's forward pass and returns zeros of the right shape, so
#: a benchmark measures everything else (read, tokenize, sort, pad, write). Never set it otherwise:
#: the embeddings are all zero (benchmarks/host_ceiling.py sets it in its own worker processes).
NOOP_FORWARD_ENV = "DASK_SURGE_BENCH_NOOP_FORWARD"
#: Bytes of the one pinned host buffer per CUDA engine through which every result is copied out
#: (reused, never grown): results are ordinary numpy memory, and the pinned memory stays bounded.
STAGING_BYTES = 8 << 20


class TransformerEngine:
    """Fast ``encode`` for Transformer + Pooling (+ Normalize) sentence-transformers models.

    Build it with :meth:`from_sentence_transformer`; the constructor is internal.
    The engine shares the weights of the model it was built from and snapshots its
    truncation length, so change ``model.max_seq_length`` before building it. On a
    CPU its linear layers also hold a copy of their weights packed for oneDNN, used
    only while the shared weight is unchanged (an in-place update, e.g. more
    fine-tuning, falls back to the shared weight).

    Attributes
    ----------
    dimension : int
        Embedding size.
    max_seq_length : int
        Truncation length in tokens, the model's.
    max_tokens : int
        Token budget of one micro-batch (rows times padded length).
    device : torch.device
        Device the encoder runs on.
    prompt : str
        Text put before every input (``""`` for none), resolved as ``model.encode`` does.
    prompt_length : int
        Leading tokens left out of pooling: the prompt's, when the ``Pooling`` module
        has ``include_prompt=False``; else 0.

    Examples
    --------
    >>> from sentence_transformers import SentenceTransformer
    >>> from dask_surge.testing import packaged_model_dir
    >>> model = SentenceTransformer(str(packaged_model_dir()), device="cpu")
    >>> engine = TransformerEngine.from_sentence_transformer(model)
    >>> engine.encode(["a dog", "", "a cat"]).shape
    (3, 384)
    """

    def __init__(self, transformer, pooling_modes, *, normalize, max_tokens, dtype, prompt="", include_prompt=True):
        hf_tokenizer = transformer.tokenizer
        self._hf = transformer.auto_model.eval()
        self.device = next(self._hf.parameters()).device
        self._amp = _DTYPES[dtype]
        if self.device.type == "cpu":
            self._hf = _with_onednn_linear(self._hf)
        elif self._amp is not None:
            self._hf = _cast_copy(self._hf, self._amp)  # native half weights: no autocast re-cast per call
        #: Dtype the encoder computes in (its weights'); pooling and normalization stay float32.
        self._compute_dtype = self._amp or torch.float32
        self._modes = pooling_modes
        self._normalize = normalize
        #: Benchmarking only: skip the forward pass (see NOOP_FORWARD_ENV).
        self._noop = os.environ.get(NOOP_FORWARD_ENV, "") == "1"
        self.max_seq_length = int(transformer.max_seq_length)
        self.dimension = len(pooling_modes) * self._hf.config.hidden_size
        self._tokenizer = hf_tokenizer.backend_tokenizer.__class__.from_str(hf_tokenizer.backend_tokenizer.to_str())
        self._tokenizer.no_padding()
        self._tokenizer.enable_truncation(
            self.max_seq_length, strategy="longest_first", direction=hf_tokenizer.truncation_side
        )
        self._encode_batch = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
        self._pad_id = hf_tokenizer.pad_token_id or 0
        self._type_ids = "token_type_ids" in hf_tokenizer.model_input_names
        self._mask4d = False
        self._mask4d = self._takes_4d_mask()
        self.max_tokens = self._auto_max_tokens() if max_tokens is None else max_tokens
        self._lock = threading.Lock()
        #: Launch all device work from one dedicated thread (:class:`_Feeder`); on by default on
        #: CUDA, where the calling threads then only tokenize and pack. Settable (tests set it on CPU).
        self.use_feeder = self.device.type == "cuda"
        self._feeder: _Feeder | None = None
        self._closed = False
        #: Cut micro-batches where the sorted length changes (:func:`dask_surge.models.batching.cut`,
        #: ``split_runs``), and run the one-length ones without an attention mask. Settable
        #: (benchmarks compare both); the embeddings are the same either way.
        self.split_runs = True
        self._staging: torch.Tensor | None = None  # the pinned copy-out buffer, made on first use (CUDA)
        self._staging_lock = threading.Lock()
        #: Seconds spent per stage since the engine was built, summed over calls and threads:
        #: ``tokenize`` (Rust tokenizer), ``pack`` (plan and int32 ids), ``device`` (running or,
        #: on CUDA, launching the micro-batches), ``finish`` (finite check, wait for the device, copy
        #: back); with ``calls`` and ``texts``. For benchmarks and diagnosis; read, don't rely on it.
        self.stats: dict[str, float] = dict.fromkeys(("calls", "texts", "tokenize", "pack", "device", "finish"), 0)
        self._stats_lock = threading.Lock()
        #: The prompt put before every text ("" for none), resolved as ``SentenceTransformer.encode`` does.
        self.prompt = prompt or ""
        #: Tokens of the prompt left out of pooling (0 when the Pooling module includes the prompt).
        self.prompt_length = 0
        if self.prompt and not include_prompt:
            self.prompt_length = self._prompt_tokens(set(getattr(hf_tokenizer, "all_special_ids", ()) or ()))

    @classmethod
    def from_sentence_transformer(
        cls, model, *, max_tokens: int | None = None, dtype: str | None = None, prompt: str | None = None,
        prompt_name: str | None = None,
    ) -> TransformerEngine | None:
        """Build an engine for ``model``, or return None when its structure is not supported.

        Supported: a ``Transformer`` module wrapping a Hugging Face encoder (BERT-like,
        not a decoder), a ``Pooling`` module in ``cls``, ``mean`` or ``max`` mode (or a
        combination of them), and optionally a ``Normalize`` module; no ``truncate_dim``.
        Anything else returns None, and the caller should use ``model.encode``.

        Prompts follow ``model.encode(prompt=..., prompt_name=...)``: the prompt text is
        put before each text, and when the ``Pooling`` module has
        ``include_prompt=False`` its tokens (the prompt tokenized alone, less a trailing
        special token) are left out of the pooling.

        Parameters
        ----------
        model : sentence_transformers.SentenceTransformer
            The model; the engine shares its weights and device.
        max_tokens : int, optional
            Token budget per micro-batch: rows times the longest token length in
            the batch. None picks 2048 on CPU and a budget sized from free memory
            on CUDA (at most 65536). A single text always fits.
        dtype : {None, "float32", "float16", "bfloat16"}, optional
            Compute dtype of the forward pass. Half precisions run under autocast
            and need a CUDA device; pooling is always done in float32.
        prompt : str, optional
            Prompt text, as in ``model.encode``; wins over ``prompt_name``, and ``""``
            means no prompt.
        prompt_name : str, optional
            Key of ``model.prompts``. With neither, the model's default prompt applies.

        Returns
        -------
        TransformerEngine or None

        Raises
        ------
        SurgeValueError
            If ``max_tokens`` is not a positive int, ``dtype`` is unknown, or a half
            precision is asked for on a non-CUDA device.

        Examples
        --------
        >>> from sentence_transformers import SentenceTransformer
        >>> from dask_surge.testing import packaged_model_dir
        >>> model = SentenceTransformer(str(packaged_model_dir()), device="cpu")
        >>> TransformerEngine.from_sentence_transformer(model).dimension
        384
        >>> TransformerEngine.from_sentence_transformer(model, prompt="query: ").prompt
        'query: '
        """
        from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer


        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
            raise SurgeValueError(
                f"max_tokens={max_tokens!r} is not a positive int: it is the token budget of one micro-batch; "
                "Fix: pass e.g. max_tokens=2048, or None to pick it automatically."
            )
        if dtype not in _DTYPES:
            raise SurgeValueError(
                f"dtype={dtype!r} is not supported: the compute dtype must be one of None, 'float32', "
                "'float16' or 'bfloat16'. Fix: pass one of those."
            )
        modules = list(model)
        if not 2 <= len(modules) <= 3 or type(modules[0]) is not Transformer or type(modules[1]) is not Pooling:
            return None
        transformer, pooling, *rest = modules
        if rest and (
            type(rest[0]) is not Normalize
            or (rest[0].module_input_name, rest[0].module_output_name) != ("sentence_embedding",) * 2
        ):
            return None
        modes = (pooling.pooling_mode,) if isinstance(pooling.pooling_mode, str) else tuple(pooling.pooling_mode)
        tokenizer = transformer.tokenizer
        config = transformer.auto_model.config
        if (
            not set(modes) <= _POOLING_MODES
            or getattr(transformer, "transformer_task", "feature-extraction") != "feature-extraction"
            or getattr(transformer, "modality_config", _TEXT_ONLY) != _TEXT_ONLY
            or getattr(transformer, "module_output_name", "token_embeddings") != "token_embeddings"
            or getattr(transformer, "processing_kwargs", None)
            or tokenizer is None
            or not getattr(tokenizer, "is_fast", False)
            or tokenizer.padding_side != "right"
            or not isinstance(transformer.max_seq_length, int)
            or not 0 < transformer.max_seq_length < 2**31
            or getattr(config, "is_decoder", False)
            or getattr(config, "is_encoder_decoder", False)
            or getattr(model, "truncate_dim", None) is not None
        ):
            return None
        prompt = resolve_prompt(dict(model.prompts), model.default_prompt_name, prompt, prompt_name)
        device = next(transformer.auto_model.parameters()).device
        if _DTYPES[dtype] is not None and device.type != "cuda":
            raise SurgeValueError(
                f"dtype={dtype!r} needs a CUDA device but the model is on {device}: half precision only runs "
                "on CUDA. Fix: pass dtype=None (or 'float32') on CPU, or load the model with device='cuda'."
            )
        return cls(transformer, modes, normalize=bool(rest), max_tokens=max_tokens, dtype=dtype, prompt=prompt,
                   include_prompt=getattr(pooling, "include_prompt", True))

    def encode(self, texts: Sequence[str], *, normalize: bool = False) -> np.ndarray:
        """Embed ``texts`` and return the rows in the order of ``texts``.

        Parameters
        ----------
        texts : sequence of str
            Texts to embed; empty strings are allowed. Texts longer than
            :attr:`max_seq_length` tokens are truncated, as ``model.encode`` does.
        normalize : bool, default False
            L2-normalize the embeddings (always done when the model ends with a
            ``Normalize`` module).

        Returns
        -------
        numpy.ndarray
            ``(len(texts), dimension)`` float32, C-contiguous.

        Raises
        ------
        SurgeInputError
            If an element of ``texts`` is not a str.

        Examples
        --------
        >>> from sentence_transformers import SentenceTransformer
        >>> from dask_surge.testing import packaged_model_dir
        >>> engine = TransformerEngine.from_sentence_transformer(
        ...     SentenceTransformer(str(packaged_model_dir()), device="cpu"))
        >>> engine.encode([]).shape
        (0, 384)
        """
        if self._closed:
            raise SurgeValueError(
                "this TransformerEngine was closed (close() released its feeder thread and buffers), so it "
                "cannot encode. Fix: build a new engine with TransformerEngine.from_sentence_transformer(model)."
            )
        texts = texts if isinstance(texts, list) else list(texts)
        normalize = normalize or self._normalize
        if self.use_feeder:
            return self._encode_fed(texts, normalize)
        with self._lock, torch.inference_mode():
            out = torch.empty((len(texts), self.dimension), dtype=torch.float32, device=self.device)
            for start, encodings in self._tokenized_chunks(texts):
                self._run_window(self._prepare_window(encodings, start), out, normalize)
            return self._finish(out)

    def _encode_fed(self, texts: list[str], normalize: bool) -> np.ndarray:
        """Prepare windows in the calling thread; the feeder thread launches all device work."""
        feeder = self._feeder_thread()
        state: dict = {}

        def start() -> None:
            state["out"] = torch.empty((len(texts), self.dimension), dtype=torch.float32, device=self.device)

        jobs = [feeder.submit(start)]
        try:
            for offset, encodings in self._tokenized_chunks(texts):
                window = self._prepare_window(encodings, offset)
                jobs.append(feeder.submit(lambda w=window: self._run_window(w, state["out"], normalize)))
        finally:  # a failed preparation still waits for what was queued (it writes into ``out``)
            for job in jobs:
                job.exception()
        for job in jobs:
            job.result()  # the first device error, if any
        return feeder.submit(lambda: self._finish(state["out"])).result()

    def _finish(self, out: torch.Tensor) -> np.ndarray:
        """Check the call's embeddings and bring them to the host in one copy."""
        t0 = time.perf_counter()
        with self._stats_lock:
            self.stats["calls"] += 1
            self.stats["texts"] += out.shape[0]
        try:
            _check_finite(out)
            if self.device.type != "cuda":
                return out.numpy()
            with self._staging_lock:
                if self._staging is None:
                    self._staging = torch.empty(STAGING_BYTES // 4, dtype=torch.float32, pin_memory=True)
                return _copy_out(out, self._staging, torch.cuda.current_stream(self.device))
        finally:
            self._count("finish", t0)

    def _feeder_thread(self) -> _Feeder:
        with self._lock:
            if self._feeder is None:
                self._feeder = _Feeder(self.device)
                # dropping the engine stops its thread (the feeder holds no reference to the engine)
                weakref.finalize(self, self._feeder.close).atexit = False
            return self._feeder

    def close(self) -> None:
        """Stop the feeder thread and release the pinned staging buffer; idempotent.

        Work already queued finishes first. The engine cannot encode afterwards; the
        model's weights are the caller's and stay as they are.

        Examples
        --------
        >>> from sentence_transformers import SentenceTransformer
        >>> from dask_surge.testing import packaged_model_dir
        >>> engine = TransformerEngine.from_sentence_transformer(
        ...     SentenceTransformer(str(packaged_model_dir()), device="cpu"))
        >>> engine.close(); engine.close()
        """
        with self._lock:
            self._closed = True
            feeder, self._feeder = self._feeder, None
        if feeder is not None:
            feeder.close()
        with self._staging_lock:
            self._staging = None

    def count_tokens(self, texts: Sequence[str]) -> np.ndarray:
        """Token length of each text after truncation, special tokens included.

        Parameters
        ----------
        texts : sequence of str

        Returns
        -------
        numpy.ndarray
            int32 array of length ``len(texts)``, each value in ``[0, max_seq_length]``.

        Examples
        --------
        >>> from sentence_transformers import SentenceTransformer
        >>> from dask_surge.testing import packaged_model_dir
        >>> engine = TransformerEngine.from_sentence_transformer(
        ...     SentenceTransformer(str(packaged_model_dir()), device="cpu"))
        >>> engine.count_tokens(["", "hello world"]).tolist()
        [2, 4]
        """
        texts = texts if isinstance(texts, list) else list(texts)
        return np.fromiter(map(len, self._tokenize(texts)), dtype=np.int32, count=len(texts))

    def _auto_max_tokens(self) -> int:
        if self.device.type != "cuda":
            return _CPU_MAX_TOKENS
        config = self._hf.config
        # fp32 bytes of the widest activations alive per token during one layer
        per_token = 4 * (
            getattr(config, "intermediate_size", 4 * config.hidden_size)
            + 6 * config.hidden_size
            + getattr(config, "num_attention_heads", 1) * self.max_seq_length
        )
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(min(65536, max(4096, free // 4 // per_token)))

    def _prompt_tokens(self, special_ids: set[int]) -> int:
        """Tokens of the prompt alone (truncated), less a trailing special token: sentence-transformers' rule."""
        ids = self._tokenizer.encode(self.prompt).ids
        return len(ids) - 1 if ids and ids[-1] in special_ids else len(ids)

    def _count(self, key: str, t0: float) -> None:
        dt = time.perf_counter() - t0
        with self._stats_lock:
            self.stats[key] += dt

    def _tokenize(self, texts: list[str]) -> list:
        t0 = time.perf_counter()
        try:
            encodings = self._encode_batch([self.prompt + t for t in texts] if self.prompt else texts)
            self._count("tokenize", t0)
            return encodings
        except TypeError:
            bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
            if bad is None:
                raise
            raise SurgeInputError(
                f"texts[{bad}]={texts[bad]!r} is a {type(texts[bad]).__name__}, but every text must be a str; "
                "Fix: drop or fill missing values first (e.g. series.fillna(''))."
            ) from None

    def _tokenized_chunks(self, texts: list[str]) -> Iterator[tuple[int, list]]:
        """Yield ``(offset, encodings)`` per chunk; on CUDA the next chunk tokenizes in the background."""
        starts = range(0, len(texts), _CHUNK_TEXTS)
        if self.device.type != "cuda" or len(starts) < 2:
            for start in starts:
                yield start, self._tokenize(texts[start : start + _CHUNK_TEXTS])
            return
        with ThreadPoolExecutor(1, thread_name_prefix="surge-tokenize") as pool:
            pending = pool.submit(self._tokenize, texts[:_CHUNK_TEXTS])
            for start in starts:
                encodings = pending.result()
                nxt = start + _CHUNK_TEXTS
                if nxt < len(texts):
                    pending = pool.submit(self._tokenize, texts[nxt : nxt + _CHUNK_TEXTS])
                yield start, encodings

    def _prepare_window(self, encodings: list, offset: int) -> _Window:
        """Host side of one window: the plan and the token ids in run order, as int32 (pinned on CUDA).

        The host only plans (:func:`dask_surge.models.batching.plan_batches`) and gathers the
        token ids of the window, in run order, into one int32 array that travels once.
        """
        t0 = time.perf_counter()
        lengths = np.fromiter(map(len, encodings), dtype=np.int32, count=len(encodings))
        plan = plan_batches(lengths, self.max_tokens, split_runs=self.split_runs)
        ordered = operator.itemgetter(*plan.order.tolist())(encodings) if len(encodings) > 1 else encodings
        flat = np.fromiter(_chain_ids(ordered), dtype=np.int32, count=plan.real_tokens)
        pin = self.device.type == "cuda"
        window = _Window(
            plan=plan, size=int(flat.size),
            ids=_host(flat, pin), lengths=_host(plan.lengths.astype(np.int32), pin),
            starts=_host((np.cumsum(plan.lengths) - plan.lengths).astype(np.int64), pin),
            where=_host(plan.order + offset, pin),
        )
        self._count("pack", t0)
        return window

    def _run_window(self, window: _Window, out: torch.Tensor, normalize: bool) -> None:
        """Device side of one window: every micro-batch, written into ``out`` at its rows.

        Each micro-batch's padded ids, attention mask and pooling weights are built on
        the device from lengths, so no micro-batch waits for the device. A micro-batch
        whose texts all have its width runs with no attention mask at all.
        """
        t0 = time.perf_counter()
        dev, plan = self.device, window.plan
        flat_d, lengths_d, starts_d, where_d = (
            t.to(dev, non_blocking=True) for t in (window.ids, window.lengths, window.starts, window.where)
        )
        top = max(int(plan.widths[0]) if len(plan.widths) else 1, 1)
        positions = torch.arange(top, device=dev)
        uniform = (plan.uniform & (plan.lengths[plan.bounds[1:] - 1] > 0)).tolist() if self.split_runs else ()
        for j, (start, stop, width) in enumerate(plan.batches()):
            if j < len(uniform) and uniform[j]:  # one length: no padding, no mask (SDPA's fastest path)
                ids = flat_d[starts_d[start:stop, None] + positions[None, :width]]
                pooled = self._forward(ids, None)
            else:
                length = lengths_d[start:stop]
                valid = positions[None, :width] < length[:, None]  # (rows, width) on the device
                gather = (starts_d[start:stop, None] + positions[None, :width]).clamp_(max=max(window.size - 1, 0))
                ids = flat_d[gather] if window.size else torch.zeros(valid.shape, dtype=torch.int32, device=dev)
                ids = ids.masked_fill_(~valid, self._pad_id)
                pooled = self._forward(ids, valid)
            if normalize:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
            out.index_copy_(0, where_d[start:stop], pooled)
        self._count("device", t0)

    def _forward(self, ids: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """Pooled float32 embeddings of one micro-batch (``ids`` int32, ``valid`` bool, on the device).

        ``valid`` None: every token is real (a one-length micro-batch), and the encoder
        runs with no attention mask.
        """
        if self._noop:
            return torch.zeros((ids.shape[0], self.dimension), dtype=torch.float32, device=ids.device)
        inputs = {"input_ids": ids}
        if valid is not None:
            inputs["attention_mask"] = self._mask(valid)
        if self._type_ids:
            inputs["token_type_ids"] = torch.zeros_like(ids)
        hidden = self._hf(**inputs, return_dict=True).last_hidden_state.float()
        return self._pool(hidden, valid)

    def _mask(self, valid: torch.Tensor) -> torch.Tensor:
        """The attention mask the encoder takes, built on the device.

        A 4D additive mask (0 to attend, the dtype's minimum to skip) where the model
        takes one as is (checked when the engine is built): transformers then skips
        its ``padding_mask.all()`` test, a blocking device-to-host read per call.
        Else the 2D 0/1 mask.
        """
        if not self._mask4d:
            return valid.to(torch.int64)
        bias = torch.zeros(valid.shape, dtype=self._compute_dtype, device=valid.device)
        return bias.masked_fill_(~valid, torch.finfo(self._compute_dtype).min)[:, None, None, :]

    def _takes_4d_mask(self) -> bool:
        """True when the encoder gives the same output for the 4D additive mask as for the 2D mask."""
        valid = torch.tensor([[True, True, True], [True, True, False]], device=self.device)
        ids = torch.full(valid.shape, 101, dtype=torch.int32, device=self.device).masked_fill_(~valid, self._pad_id)
        extra = {"token_type_ids": torch.zeros_like(ids)} if self._type_ids else {}
        try:
            with torch.inference_mode():
                two = self._hf(input_ids=ids, attention_mask=valid.to(torch.int64), **extra).last_hidden_state
                self._mask4d = True
                four = self._hf(input_ids=ids, attention_mask=self._mask(valid), **extra).last_hidden_state
        except Exception:  # noqa: BLE001 - a model that refuses a 4D mask keeps the 2D one
            return False
        finally:
            self._mask4d = False
        tol = 1e-4 if self._compute_dtype == torch.float32 else 2e-2
        return bool(torch.allclose(two[valid].float(), four[valid].float(), rtol=tol, atol=tol))

    def _pool(self, hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Pool like ``sentence_transformers`` ``Pooling`` (right padding; prompt tokens out if it says so).

        ``mask`` None means every token is real.
        """
        if mask is None and not self.prompt_length:
            parts = [hidden[:, 0] if mode == "cls" else hidden.max(dim=1).values if mode == "max"
                     else hidden.mean(dim=1) for mode in self._modes]
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        if mask is None:
            mask = torch.ones(hidden.shape[:2], dtype=torch.int32, device=hidden.device)
        mask = mask.to(torch.int32)  # a fresh tensor: the caller's mask stays as it was
        if self.prompt_length:
            mask[:, : self.prompt_length] = 0
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        parts = []
        for mode in self._modes:
            if mode == "cls" and self.prompt_length:  # the first token pooled: the first after the prompt
                first = mask.argmax(dim=1)
                parts.append(hidden[torch.arange(hidden.shape[0], device=hidden.device), first])
            elif mode == "cls":
                parts.append(hidden[:, 0])
            elif mode == "max":
                parts.append(hidden.masked_fill(weights == 0, float("-inf")).max(dim=1).values)
            else:
                parts.append((hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def _chain_ids(encodings) -> Iterator[int]:
    """The token ids of ``encodings``, one after the other (C-level iteration over the lists)."""
    from itertools import chain

    return chain.from_iterable(map(operator.attrgetter("ids"), encodings))


def _copy_out(out: torch.Tensor, staging: torch.Tensor, stream=None) -> np.ndarray:
    """``out`` as a new numpy array, copied through ``staging`` (1-D, same dtype) chunk by chunk.

    On CUDA ``staging`` is pinned and ``stream`` is the stream that wrote ``out``: each
    chunk is an asynchronous device-to-host copy, waited for, then copied into ordinary
    (pageable) memory, so no pinned block outlives the call.

    Examples
    --------
    >>> out = torch.arange(10, dtype=torch.float32).reshape(5, 2)
    >>> _copy_out(out, torch.empty(3)).tolist()
    [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0], [8.0, 9.0]]
    """
    host = np.empty(tuple(out.shape), dtype=np.float32)
    src, dst, step = out.reshape(-1), host.reshape(-1), staging.numel()
    view = staging.numpy()
    for a in range(0, src.numel(), step):
        b = min(a + step, src.numel())
        staging[: b - a].copy_(src[a:b], non_blocking=stream is not None)
        if stream is not None:
            stream.synchronize()
        dst[a:b] = view[: b - a]
    return host


def _host(array: np.ndarray, pin: bool) -> torch.Tensor:
    """``array`` as a tensor, in pinned memory when it will travel to a GPU asynchronously."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    return host.pin_memory() if pin else host


@dataclass(frozen=True)
class _Window:
    """One prepared window: its micro-batch plan and its host tensors (ids in run order, int32)."""

    plan: BatchPlan
    size: int
    ids: torch.Tensor
    lengths: torch.Tensor
    starts: torch.Tensor
    where: torch.Tensor


class _Feeder:
    """One thread that runs every device job of an engine, in submission order.

    The threads that call :meth:`TransformerEngine.encode` tokenize and pack windows
    (GIL-free Rust and numpy work, mostly) and queue closures here; this thread only
    launches device work on prepared tensors, so a GPU is fed by one thread whatever
    the number of Dask threads, and one SuperBatch is prepared while another runs.

    Examples
    --------
    >>> feeder = _Feeder(torch.device("cpu"))
    >>> feeder.submit(lambda: 1 + 1).result()
    2
    >>> feeder.close(); feeder.thread.is_alive()
    False
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._state = threading.Lock()
        self._closed = False
        self.thread = threading.Thread(target=self._loop, name=f"surge-feeder-{device}", daemon=True)
        self.thread.start()

    def submit(self, fn) -> Future:
        """Queue ``fn()`` to run on the feeder thread; its future holds the result or the error.

        Raises
        ------
        RuntimeError
            If the feeder was closed.
        """
        future: Future = Future()
        with self._state:
            if self._closed:
                raise RuntimeError("this feeder thread was closed; Fix: build a new engine")
            self._jobs.put((fn, future))
        return future

    def close(self, timeout: float = 30.0) -> None:
        """Let the queued jobs run, then stop the thread (idempotent); waits up to ``timeout`` s."""
        with self._state:
            if not self._closed:
                self._closed = True
                self._jobs.put(None)
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)

    def _loop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        with torch.inference_mode():
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                fn, future = job
                job = None
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as err:  # noqa: BLE001 - handed to the caller through the future
                        future.set_exception(err)
                # drop the job now, not when the next one arrives: its closure holds the engine, its
                # windows' pinned tensors and the call's output
                fn = future = None


def _check_finite(out: torch.Tensor) -> None:
    """Raise if any embedding holds NaN or inf, naming the rows (one device sync per call).

    Raises
    ------
    SurgeModelError
        Naming the first bad row positions of the call.
    """
    # a NaN or inf anywhere makes the sum NaN or inf, so a finite sum proves every value finite; one
    # reduction instead of a bool tensor of the whole call (measured: 2.3 ms against 61 ms for 50k x 384)
    if bool(torch.isfinite(out.sum())):
        return
    finite = torch.isfinite(out).all(dim=1)
    if bool(finite.all()):  # finite values whose sum overflowed
        return
    bad = (~finite).nonzero().flatten()
    first = bad[:10].tolist()
    raise SurgeModelError(
        f"the encoder produced NaN or inf embeddings for {bad.numel()} of {out.shape[0]} texts of this call "
        f"(rows {first}{' ...' if bad.numel() > 10 else ''}, 0-based in the call, i.e. in the SuperBatch): "
        "embeddings must be finite. This usually means a half-precision overflow (a bfloat16 checkpoint run in "
        "float16) or broken weights. Fix: pass dtype='float32' (or dtype='bfloat16' for a bfloat16 checkpoint), "
        "and check the model's weights for NaN."
    )


def _cast_copy(hf: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of ``hf`` whose floating-point weights and buffers are in ``dtype``; ``hf`` is untouched.

    Examples
    --------
    >>> lin = torch.nn.Linear(2, 2)
    >>> half = _cast_copy(lin, torch.bfloat16)
    >>> half.weight.dtype, lin.weight.dtype
    (torch.bfloat16, torch.float32)
    """
    memo: dict[int, torch.Tensor] = {}
    for tensor in (*hf.parameters(), *hf.buffers()):
        if id(tensor) in memo:
            continue
        cast = tensor.detach().to(dtype) if tensor.is_floating_point() else tensor
        memo[id(tensor)] = torch.nn.Parameter(cast, requires_grad=False) if isinstance(
            tensor, torch.nn.Parameter) else cast
    return copy.deepcopy(hf, memo)


class _OneDNNLinear(torch.nn.Linear):
    """``nn.Linear`` computed by oneDNN from a weight pre-packed in its blocked layout.

    Same fp32 math; ~10% faster than MKL sgemm on AVX-512 CPUs, and packing
    the weight once (instead of on every call) saves another 3-5% per GEMM.
    The packed copy is used only while the weight's version is the one it was
    packed from; after an in-place update the layer reads the shared weight.
    """

    _packed: torch.Tensor | None = None
    _packed_version: int = -1  # weight._version when packed: an in-place update makes the copy stale
    _gelu: bool = False  # exact (erf) GELU fused as a oneDNN post-op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or self.weight.dtype != torch.float32:
            out = super().forward(x)
            return torch.nn.functional.gelu(out) if self._gelu else out
        fresh = self._packed is not None and self.weight._version == self._packed_version
        weight = self._packed if fresh else self.weight
        if self._gelu:
            return torch.ops.mkldnn._linear_pointwise(x, weight, self.bias, "gelu", [], "none")
        return torch.ops.mkldnn._linear_pointwise(x, weight, self.bias, "none", [], "")


def _with_onednn_linear(hf: torch.nn.Module) -> torch.nn.Module:
    """A copy of the module tree of ``hf`` sharing its weights, with oneDNN linears; ``hf`` is untouched.

    Each linear also holds its weight packed for oneDNN (a second copy of the
    linear weights: about 85 MB for MiniLM-L6), where this torch can pack.
    """
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return hf
    try:
        clone = copy.deepcopy(hf, {id(t): t for t in (*hf.parameters(), *hf.buffers())})
    except (TypeError, RuntimeError):  # modules holding uncopyable state keep the stock path
        return hf
    pack = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    for module in clone.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = _OneDNNLinear
            if pack is not None and module.weight.dtype == torch.float32:
                with contextlib.suppress(RuntimeError), torch.no_grad():
                    module._packed = pack(module.weight.detach(), _CPU_MAX_TOKENS)
                    module._packed_version = module.weight._version  # type: ignore[assignment]
    for module in list(clone.modules()):
        _fuse_gelu(module)
    return clone


def _is_exact_gelu(act) -> bool:
    if isinstance(act, torch.nn.GELU):
        return act.approximate == "none"
    return type(act).__name__ == "GELUActivation" and getattr(act, "act", None) is torch.nn.functional.gelu


def _fuse_gelu(module: torch.nn.Module) -> None:
    """Fuse a BERT-style feed-forward input (``dense`` then exact GELU) into one oneDNN call.

    Kept only if the fused module gives the same output on a random input as
    before (so a module that does something between the two stays as it was).
    """
    dense, act = getattr(module, "dense", None), getattr(module, "intermediate_act_fn", None)
    if not (isinstance(dense, _OneDNNLinear) and dense.weight.dtype == torch.float32 and _is_exact_gelu(act)):
        return
    x = torch.randn(2, 3, dense.in_features, generator=torch.Generator().manual_seed(0))
    try:
        with torch.inference_mode():
            before = module(x)
            dense._gelu, module.intermediate_act_fn = True, torch.nn.Identity()
            same = torch.allclose(module(x), before, rtol=1e-4, atol=1e-5)
    except Exception:  # noqa: BLE001 - any failure means: leave the module as it was
        same = False
    if not same:
        dense._gelu, module.intermediate_act_fn = False, act  # type: ignore[assignment]
