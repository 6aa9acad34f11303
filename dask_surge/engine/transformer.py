"""Tokenize-sort-forward inference engine for sentence-transformers models.

:class:`TransformerEngine` replaces ``SentenceTransformer.encode`` for the most
common model shape (a Hugging Face encoder, a ``Pooling`` module and an optional
``Normalize`` module), prompts included. It tokenizes with the Rust tokenizer in one
call, sorts the texts by token length, cuts micro-batches under a token budget so that
padding is nearly zero, runs the encoder, pools on the device and puts the rows back in
the caller's order.

It is two parts: the host side, :class:`~dask_surge.engine.tokenizing.TextPacker`
(tokenize, length sort, pack int32 ids; no torch), and the device side,
:class:`~dask_surge.engine.forward.DeviceRunner` (forward, pooling, the feeder thread and
the pinned staging buffer; the attention-mask form probed once, when it is built).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ..config import check_argument
from ..errors import SurgeValueError
from ..io.texts import ArrowTexts, as_list, as_texts
from ..options import DEFAULT_CHUNK_OVERLAP, LongTexts
from .batching import CallShape
from .forward import DTYPES, DeviceBlock, DeviceRunner
from .layout import layout_of_model
from .long_texts import (
    TextEmbeddings,
    TextTooLong,
    WindowCutter,
    WindowGroup,
    check_long_texts,
    encode_windows,
)
from .prompts import resolve_prompt
from .tokenizing import StageClock, TextPacker, prepared

__all__ = ["TransformerEngine"]


class TransformerEngine:
    """Fast ``encode`` for Transformer + Pooling (+ Normalize) sentence-transformers models, encoders and
    rotary decoders (last-token pooling) alike.

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
    packer : TextPacker
        The host side: tokenize, length sort, pack (:mod:`dask_surge.engine.tokenizing`).
    runner : DeviceRunner
        The device side: the model, its forward and pooling, the feeder thread and the
        staging buffer (:mod:`dask_surge.engine.forward`).

    Examples
    --------
    >>> from sentence_transformers import SentenceTransformer
    >>> from dask_surge.testing import packaged_model_dir
    >>> model = SentenceTransformer(str(packaged_model_dir()), device="cpu")
    >>> engine = TransformerEngine.from_sentence_transformer(model)
    >>> engine.encode(["a dog", "", "a cat"]).shape
    (3, 384)
    """

    _cutter: WindowCutter | None  # the long-text window cutter, built on first use (see cutter())

    def __init__(
        self, transformer, pooling_modes, *, normalize, max_tokens, dtype, prompt="", include_prompt=True
    ):
        self._clock = StageClock()
        self._hf_tokenizer = transformer.tokenizer  # for the long-text window cutter, built on first use
        self._cutter = None
        self.packer = TextPacker(
            transformer.tokenizer,
            int(transformer.max_seq_length),
            prompt=prompt or "",
            include_prompt=include_prompt,
            clock=self._clock,
        )
        self.runner = DeviceRunner(
            transformer.auto_model,
            tuple(pooling_modes),
            dtype=dtype,
            pad_id=self.packer.pad_id,
            type_ids=self.packer.type_ids,
            prompt_length=self.packer.prompt_length,
            clock=self._clock,
        )
        self.device = self.runner.device
        self._normalize = normalize
        self.max_seq_length = self.packer.max_seq_length
        self.dimension = self.runner.dimension
        self.max_tokens = (
            self.runner.auto_max_tokens(self.max_seq_length) if max_tokens is None else max_tokens
        )
        self._lock = threading.Lock()
        #: Launch all device work from one dedicated thread (the device side's feeder); on by default on
        #: CUDA, where the calling threads then only tokenize and pack. Settable (tests set it on CPU).
        self.use_feeder = self.device.type == "cuda"
        self._closed = False
        #: Cut micro-batches where the sorted length changes (:func:`dask_surge.engine.batching.cut`,
        #: ``split_runs``), and run the one-length ones without an attention mask. Settable
        #: (``docs/ab_studies.md`` compares both); the embeddings are the same either way.
        self.split_runs = True
        #: The prompt put before every text ("" for none), resolved as ``SentenceTransformer.encode`` does.
        self.prompt = self.packer.prompt
        #: Tokens of the prompt left out of pooling (0 when the Pooling module includes the prompt).
        self.prompt_length = self.packer.prompt_length
        #: Helper processes that tokenize (:mod:`~dask_surge.engine.tokenpool`): None reads
        #: ``surge.tuning.tokenize-processes`` at each call (:mod:`~dask_surge.engine.tuning`, for the
        #: device). Settable; the embeddings are the same either way.
        self.tokenize_processes: int | None = None

    def _use_processes(self) -> None:
        """Set the packer's tuning settings for this call (see :attr:`tokenize_processes`)."""
        self.packer.tune(self.device.type, self.tokenize_processes)

    @property
    def stats(self) -> dict[str, float]:
        """Seconds spent per stage since the engine was built, summed over calls and threads.

        ``tokenize`` (Rust tokenizer), ``pack`` (plan and int32 ids), ``device`` (running or,
        on CUDA, launching the micro-batches), ``finish`` (finite check, wait for the device, copy
        back); with ``calls`` and ``texts``. For measurement and diagnosis; read, don't rely on it.
        """
        return self._clock.stats

    @classmethod
    def from_sentence_transformer(
        cls,
        model,
        *,
        max_tokens: int | None = None,
        dtype: str | None = None,
        prompt: str | None = None,
        prompt_name: str | None = None,
    ) -> TransformerEngine | None:
        """Build an engine for ``model``, or return None when its structure is not supported.

        Supported: a ``Transformer`` module wrapping a Hugging Face encoder (BERT-like) or
        a causal decoder of :data:`~dask_surge.engine.layout.ROTARY_DECODERS` (Qwen3, Mistral,
        Llama...), a ``Pooling`` module in the modes of
        :data:`~dask_surge.engine.layout.FAST_POOLING` (``lasttoken`` included, or a
        combination of them), and optionally a ``Normalize`` module; no ``truncate_dim``;
        a fast tokenizer padding either side (the engine packs right-padded rows itself).
        Anything else returns None (:func:`~dask_surge.engine.layout.plain_reason` says
        why), and the caller should use ``model.encode``.

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
        max_tokens = check_argument("max_tokens", max_tokens)
        if dtype not in DTYPES:
            raise SurgeValueError(
                f"dtype={dtype!r} is not supported: the compute dtype must be one of None, 'float32', "
                "'float16' or 'bfloat16'. Fix: pass one of those."
            )
        layout = layout_of_model(model)  # the plain rule, the one the model's files are read by
        if not layout.plain:
            return None
        transformer = model[0]
        tokenizer = transformer.tokenizer
        if (  # what only a loaded model has: its tokenizer and its truncation length
            tokenizer is None
            or not getattr(tokenizer, "is_fast", False)  # either padding side: the packer pads its own rows
            or not isinstance(transformer.max_seq_length, int)
        ):
            return None
        prompt = resolve_prompt(dict(model.prompts), model.default_prompt_name, prompt, prompt_name)
        device = next(transformer.auto_model.parameters()).device
        if DTYPES[dtype] is not None and device.type != "cuda":
            raise SurgeValueError(
                f"dtype={dtype!r} needs a CUDA device but the model is on {device}: half precision only runs "
                "on CUDA. Fix: pass dtype=None (or 'float32') on CPU, or load the model with device='cuda'."
            )
        return cls(
            transformer,
            layout.pooling,
            normalize=layout.normalize,
            max_tokens=max_tokens,
            dtype=dtype,
            prompt=prompt,
            include_prompt=layout.include_prompt,
        )

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
        self._check_open()
        self._use_processes()
        texts = as_texts(texts)
        return self._encode_with(
            len(texts), self._blocks(texts), self._prepare_block, normalize or self._normalize
        )

    def _check_open(self) -> None:
        if self._closed:
            raise SurgeValueError(
                "this TransformerEngine was closed (close() released its feeder thread and buffers), so it "
                "cannot encode. Fix: build a new engine with TransformerEngine.from_sentence_transformer(model)."
            )

    def _encode_with(
        self,
        count: int,
        windows: Iterable[tuple[int, Any]],
        prepare: Callable[[Any, int], DeviceBlock],
        normalize: bool,
    ) -> np.ndarray:
        """``(count, dimension)`` embeddings: ``prepare(item, offset)`` of each ``(offset, item)`` of ``windows``, run."""
        if self.use_feeder:
            return self._encode_fed(count, windows, prepare, normalize)
        with self._lock, torch.inference_mode():
            out = torch.empty((count, self.dimension), dtype=torch.float32, device=self.device)
            for window in prepared(iter(windows), prepare):
                self._run_block(window, out, normalize)
            return self.runner.finish(out)

    def _encode_fed(
        self,
        count: int,
        windows: Iterable[tuple[int, Any]],
        prepare: Callable[[Any, int], DeviceBlock],
        normalize: bool,
    ) -> np.ndarray:
        """Prepare windows in the calling thread; the feeder thread launches all device work."""
        with self._lock:
            feeder = self.runner.feeder_thread()
        state: dict = {}

        def start() -> None:
            state["out"] = torch.empty((count, self.dimension), dtype=torch.float32, device=self.device)

        jobs = [feeder.submit(start)]
        try:
            for window in prepared(iter(windows), prepare):
                jobs.append(feeder.submit(lambda w=window: self._run_block(w, state["out"], normalize)))
        finally:  # a failed preparation still waits for what was queued (it writes into ``out``)
            for job in jobs:
                job.exception()
        for job in jobs:
            job.result()  # the first device error, if any
        return self.runner.finish_fed(feeder, state["out"])  # CUDA: waits here, not on the feeder thread

    def _blocks(self, texts: list[str] | ArrowTexts):
        """``(offset, encodings)`` per window; on CUDA the next window tokenizes during compute."""
        return self.packer.blocks(texts, background=self.device.type == "cuda")

    def _prepare_block(self, encodings: Any, offset: int) -> DeviceBlock:
        """Host side of one window: the plan and the token ids in run order, as int32 (pinned on CUDA)."""
        packed = self.packer.pack(encodings, offset, max_tokens=self.max_tokens, split_runs=self.split_runs)
        return self.runner.stage(packed)

    def _run_block(self, window: DeviceBlock, out: torch.Tensor, normalize: bool) -> None:
        self.runner.run_block(window, out, normalize, split_runs=self.split_runs, forward=self._forward)

    def _forward(self, ids: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """Pooled float32 embeddings of one micro-batch (see :meth:`DeviceRunner.forward`); tests wrap it."""
        return self.runner.forward(ids, valid)

    def cutter(self) -> WindowCutter:
        """The :class:`~dask_surge.engine.long_texts.WindowCutter` of this model and prompt (built on first use)."""
        if self._cutter is None:
            self._cutter = WindowCutter(self._hf_tokenizer, self.max_seq_length, prompt=self.prompt)
        return self._cutter

    def encode_long(
        self,
        texts: Sequence[str],
        *,
        normalize: bool = False,
        long_texts: LongTexts = "truncate",
        chunk_overlap: int = DEFAULT_CHUNK_OVERLAP,
    ) -> TextEmbeddings:
        """Embed ``texts``, doing with those over the window what ``long_texts`` says.

        See :meth:`dask_surge.models.encoders.Encoder.encode_long`. ``"truncate"`` and
        ``"error"`` tokenize once, as :meth:`encode` does (a text was cut when the tokenizer
        left tokens over); ``"chunk"`` and ``"mean"`` tokenize once with offsets, cut windows
        on the token ids and run them through the same length-sorted micro-batches.

        Examples
        --------
        >>> from sentence_transformers import SentenceTransformer
        >>> from dask_surge.testing import packaged_model_dir
        >>> engine = TransformerEngine.from_sentence_transformer(
        ...     SentenceTransformer(str(packaged_model_dir()), device="cpu"))
        >>> out = engine.encode_long(["a dog", "a cat " * 300], long_texts="chunk")
        >>> out.embeddings.shape, out.windows.chunk.tolist(), out.windows.tokens.tolist(), out.over
        ((4, 384), [0, 0, 1, 2], [2, 254, 254, 156], 1)
        """
        self._check_open()
        self._use_processes()
        check_long_texts(long_texts, chunk_overlap)
        texts = as_texts(texts)
        normalize = normalize or self._normalize
        shape = CallShape()  # what this call's forward passes compute (blocks are prepared in this thread)
        if long_texts in ("chunk", "mean"):
            cutter = self.cutter()
            cutter.check_overlap(chunk_overlap)
            out = encode_windows(
                as_list(texts),
                long_texts,
                chunk_overlap,
                cutter,
                lambda g: self._encode_groups(g, normalize, shape),
                self.dimension,
                renormalize=normalize,
                clock=self._clock,
            )
            return dataclasses.replace(out, shape=shape)
        truncated = np.zeros(len(texts), dtype=bool)

        def prepare(encodings: Any, offset: int) -> DeviceBlock:
            over = self.packer.overflowed(encodings)
            if long_texts == "error" and over.any():
                first = offset + int(np.argmax(over))
                cutter = self.cutter()
                raise TextTooLong(first, cutter.content_tokens(texts[first]), cutter.capacity)
            truncated[offset : offset + len(encodings)] = over
            block = self._prepare_block(encodings, offset)
            shape.add(block.plan)
            return block

        emb = self._encode_with(len(texts), self._blocks(texts), prepare, normalize)
        return TextEmbeddings(emb, None, truncated, int(truncated.sum()), shape)

    def _encode_groups(
        self, groups: Iterable[WindowGroup], normalize: bool, shape: CallShape | None = None
    ) -> Iterator[np.ndarray]:
        """Each group's windows' embeddings; on CUDA the next group is cut while this one runs.
        ``shape`` (optional) counts what their forward passes compute."""

        def prepare(group: WindowGroup, offset: int) -> DeviceBlock:
            block = self._prepare_group(group, offset)
            if shape is not None:
                shape.add(block.plan)
            return block

        for group in _prefetch(groups, background=self.device.type == "cuda"):
            yield self._encode_with(len(group), [(0, group)], prepare, normalize)

    def _prepare_group(self, group: WindowGroup, offset: int) -> DeviceBlock:
        """Host side of one group of windows: packed from their ids (no tokenizing), staged."""
        cutter = self.cutter()
        packed = self.packer.pack_windows(
            group.content,
            group.starts,
            group.windows.tokens,
            offset,
            head=cutter.head,
            tail=cutter.tail,
            max_tokens=self.max_tokens,
            split_runs=self.split_runs,
        )
        return self.runner.stage(packed)

    def close(self) -> None:
        """Stop the feeder thread and the tokenizer helper processes, release the pinned staging buffer and the
        engine's encoder copy; idempotent.

        Work already queued finishes first. The engine cannot encode afterwards; the
        model's weights are the caller's and stay as they are (the engine's own copies,
        the oneDNN-packed linears on a CPU or the half weights on CUDA, are dropped).

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
        self.packer.close()
        self.runner.close()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

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
        self._use_processes()
        return self.packer.count_tokens(texts)


def _prefetch(items: Iterable[Any], *, background: bool) -> Iterator[Any]:
    """``items``, with the next one made in a background thread while the caller uses this one."""
    if not background:
        yield from items
        return
    iterator = iter(items)
    done = object()
    with ThreadPoolExecutor(1, thread_name_prefix="surge-cut") as pool:
        pending = pool.submit(next, iterator, done)
        while True:
            item = pending.result()
            if item is done:
                return
            pending = pool.submit(next, iterator, done)
            yield item
