"""The device side of the fast engine: the encoder's forward pass, pooling, and the copy back to the host.

:class:`DeviceRunner` owns what runs on (or feeds) the device for one model: the
encoder module (a oneDNN copy sharing the weights on a CPU, native half weights on
CUDA), the attention-mask form the encoder takes (probed once, when the runner is
built), pooling, the one feeder thread that launches device work on CUDA
(:class:`_Feeder`), and the pinned staging buffer results are copied out through.
It turns the host's packed windows (:class:`dask_surge.engine.tokenizing.PackedBlock`)
into tensors and runs their micro-batches. :meth:`DeviceRunner.close` releases all of it.

On CUDA a call's finish never drains the GPU: an event marks the end of the call's
micro-batches on the compute stream, and the finiteness check and the copy to the host
run on a side stream that waits on that event, waited for by the calling thread through
events of the side stream only (see :meth:`DeviceRunner.finish_fed`). The compute stream
meanwhile runs the micro-batches the feeder thread launches for the next call.
"""

from __future__ import annotations

import contextlib
import copy
import math
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import SurgeModelError
from . import tuning
from .batching import CPU_MAX_TOKENS, BatchPlan, activation_bytes_per_token, cpu_max_tokens
from .bert import BertEncoder, pad_keys
from .layout import is_decoder_config
from .tokenizing import PackedBlock, StageClock

__all__ = ["DTYPES", "STAGING_BYTES", "DeviceBlock", "DeviceRunner"]

#: Compute dtypes by name (None: the weights' own, float32).
DTYPES = {None: None, "float32": None, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: Bytes of the one pinned host buffer per CUDA engine through which every result is copied out
#: (reused, never grown): results are ordinary numpy memory, and the pinned memory stays bounded.
STAGING_BYTES = 8 << 20

#: Attribute of a call's output tensor holding the CUDA event recorded at the end of its latest window
#: (set by :meth:`DeviceRunner.run_block`; it lives and dies with the tensor).
_ENDED = "_surge_ended"

#: A forward pass: ``(ids, valid) -> pooled float32 embeddings`` (see :meth:`DeviceRunner.forward`).
Forward = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]


@dataclass(frozen=True)
class DeviceBlock:
    """One prepared window: its micro-batch plan and its host tensors (ids in run order, int32)."""

    plan: BatchPlan
    size: int
    ids: torch.Tensor
    lengths: torch.Tensor
    starts: torch.Tensor
    where: torch.Tensor


class DeviceRunner:
    """The encoder of one model on its device: forward, pooling, feeder thread and staging buffer.

    Parameters
    ----------
    hf : torch.nn.Module
        The Hugging Face encoder (``Transformer.auto_model``); put in eval mode. The
        runner shares its weights (on a CPU it runs a copy of the module tree whose
        linear layers also hold their weights packed for oneDNN; on CUDA with a half
        ``dtype``, a copy whose weights are in that dtype).
    pooling_modes : tuple of str
        Modes of :data:`~dask_surge.engine.layout.FAST_POOLING`, concatenated in that order.
    dtype : {None, "float32", "float16", "bfloat16"}
        Compute dtype of the forward pass.
    pad_id : int
        Id padding a row.
    type_ids : bool
        Pass ``token_type_ids`` (zeros) to the encoder.
    prompt_length : int
        Leading tokens left out of pooling.
    clock : StageClock
        Where the ``device`` and ``finish`` seconds go.

    Attributes
    ----------
    device : torch.device
    dimension : int
    mask4d : bool
        The encoder takes a 4D additive attention mask and gives the same output as
        with the 2D mask: probed once, here (never for a causal decoder: a 4D mask
        replaces its causal mask, so it keeps the 2D one).
    decoder : bool
        The model is a causal decoder (:func:`~dask_surge.engine.layout.is_decoder_config`).
    """

    def __init__(
        self,
        hf: torch.nn.Module,
        pooling_modes: tuple[str, ...],
        *,
        dtype: str | None,
        pad_id: int,
        type_ids: bool,
        prompt_length: int,
        clock: StageClock,
    ) -> None:
        model = hf.eval()
        self.device: torch.device = next(model.parameters()).device
        amp = DTYPES[dtype]
        if self.device.type == "cpu" and tuning.setting("cpu-kernels", "cpu"):  # surge.tuning.cpu-kernels
            model = _with_onednn_linear(model)
            if model is not hf:  # a copy of the tree (its own config): the user's model stays as it was
                _pad_cpu_attention(model, self._probe_input(pad_id, type_ids))
        elif amp is not None:
            model = _cast_copy(model, amp)  # native half weights: no autocast re-cast per call
        self.hf: torch.nn.Module | None = model
        self.config: Any = getattr(
            model, "config"
        )  # the HF config (a Module attribute mypy sees as Tensor | Module)
        #: Dtype the encoder computes in (its weights'); pooling and normalization stay float32.
        self.compute_dtype = amp or torch.float32
        self.modes = pooling_modes
        self.dimension: int = len(pooling_modes) * int(self.config.hidden_size)
        self.pad_id = pad_id
        self.type_ids = type_ids
        self.prompt_length = prompt_length
        self.clock = clock
        to_dict = getattr(self.config, "to_dict", None)
        self.decoder = is_decoder_config(to_dict() if callable(to_dict) else {})
        self.mask4d = not self.decoder and self._takes_4d_mask()
        self._feeder: _Feeder | None = None
        self._feeder_lock = threading.Lock()
        self.staging: torch.Tensor | None = None  # the pinned copy-out buffer, made on first use (CUDA)
        #: On CUDA, with :attr:`staging`: the stream that checks and copies out results (waiting on the
        #: compute stream's event, never draining it) and a pinned slot for the finiteness check's sum.
        #: Made on first use; used only under ``_staging_lock``, so one call at a time.
        self.side_stream: Any = None
        self._flag: torch.Tensor | None = None
        self._staging_lock = threading.Lock()

    # -- host tensors and the micro-batches ---------------------------------------------------
    def stage(self, packed: PackedBlock) -> DeviceBlock:
        """``packed`` as host tensors, pinned on CUDA (they travel to the device asynchronously)."""
        t0 = time.perf_counter()
        pin = self.device.type == "cuda"
        window = DeviceBlock(
            plan=packed.plan,
            size=packed.size,
            ids=_host(packed.ids, pin),
            lengths=_host(packed.lengths, pin),
            starts=_host(packed.starts, pin),
            where=_host(packed.where, pin),
        )
        self.clock.count("pack", t0)
        return window

    def run_block(
        self,
        window: DeviceBlock,
        out: torch.Tensor,
        normalize: bool,
        *,
        split_runs: bool = True,
        forward: Forward | None = None,
    ) -> None:
        """Device side of one window: every micro-batch, written into ``out`` at its rows.

        Each micro-batch's padded ids, attention mask and pooling weights are built on
        the device from lengths, so no micro-batch waits for the device. A micro-batch
        whose texts all have its width runs with no attention mask at all.
        ``forward`` replaces :meth:`forward` (the engine passes its own, which tests wrap).
        """
        t0 = time.perf_counter()
        forward = forward or self.forward
        dev, plan = self.device, window.plan
        flat_d, lengths_d, starts_d, where_d = (
            t.to(dev, non_blocking=True) for t in (window.ids, window.lengths, window.starts, window.where)
        )
        top = max(int(plan.widths[0]) if len(plan.widths) else 1, 1)
        positions = torch.arange(top, device=dev)
        uniform = (plan.uniform & (plan.lengths[plan.bounds[1:] - 1] > 0)).tolist() if split_runs else ()
        for j, (start, stop, width) in enumerate(plan.batches()):
            if j < len(uniform) and uniform[j]:  # one length: no padding, no mask (SDPA's fastest path)
                ids = flat_d[starts_d[start:stop, None] + positions[None, :width]]
                pooled = forward(ids, None)
            else:
                length = lengths_d[start:stop]
                valid = positions[None, :width] < length[:, None]  # (rows, width) on the device
                gather = (starts_d[start:stop, None] + positions[None, :width]).clamp_(
                    max=max(window.size - 1, 0)
                )
                ids = (
                    flat_d[gather] if window.size else torch.zeros(valid.shape, dtype=torch.int32, device=dev)
                )
                ids = ids.masked_fill_(~valid, self.pad_id)
                pooled = forward(ids, valid)
            if normalize:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
            out.index_copy_(0, where_d[start:stop], pooled)
        if dev.type == "cuda":  # where this window's work ends on the compute stream: finish_fed waits on it
            ended = torch.cuda.Event()
            ended.record(torch.cuda.current_stream(dev))
            setattr(out, _ENDED, ended)
        self.clock.count("device", t0)

    def finish(self, out: torch.Tensor) -> np.ndarray:
        """Check the call's embeddings (all finite) and bring them to the host.

        Call it from the thread that launched the call's device work. On a CPU, the
        check and ``out.numpy()``. On CUDA, an event is recorded on this thread's current
        stream, the stream that ran the call, and the rest is :meth:`collect`'s: nothing
        waits for that stream as a whole.

        Raises
        ------
        SurgeModelError
            If an embedding holds NaN or inf (naming the rows).
        """
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            self.clock.call(out.shape[0])
            try:
                _check_finite(out)
                return out.numpy()
            finally:
                self.clock.count("finish", t0)
        return self.collect(out, self.mark())

    def finish_fed(self, feeder: _Feeder, out: torch.Tensor) -> np.ndarray:
        """:meth:`finish` of a call whose device work ``feeder`` launched; called from the calling thread.

        Call it once every window of the call has been launched (their jobs are done). On
        CUDA this thread waits for the check and the copy (:meth:`collect`) after the event
        :meth:`run_block` recorded on the compute stream at the end of the call's last window,
        so neither the feeder thread nor the GPU waits: the feeder launches the next call's
        micro-batches while this one's results travel, and the copy does not wait for work
        queued after this call's. A call with no window gets an event from the feeder thread
        (:meth:`mark`). On a CPU the feeder thread runs :meth:`finish`.
        """
        if self.device.type != "cuda":
            return feeder.submit(lambda: self.finish(out)).result()
        ready = getattr(out, _ENDED, None)
        if ready is None:
            ready = feeder.submit(self.mark).result()
        return self.collect(out, ready)

    def mark(self) -> Any:
        """A CUDA event recorded now on this thread's current stream of the device (the compute stream)."""
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        return ready

    def collect(self, out: torch.Tensor, ready: Any) -> np.ndarray:
        """CUDA: ``out`` as a host array, once the work before the event ``ready`` is done; checked finite.

        On the side stream, which first waits on ``ready`` (a device-side wait: the host
        and the compute stream go on): the sum of ``out`` into a pinned slot (a NaN or inf
        anywhere makes it non-finite), then ``out`` through the pinned staging buffer, in
        chunks (:func:`_copy_out`). This thread waits on events of the side stream only,
        never on the compute stream or the device, and holds the staging lock while it
        does, so two calls never share the buffer. ``out`` is marked as used by the side
        stream (``record_stream``): the caching allocator does not hand its memory to the
        compute stream until the copy is done, even if ``out`` is dropped early.

        Raises
        ------
        SurgeModelError
            If an embedding holds NaN or inf (naming the rows).
        """
        t0 = time.perf_counter()
        self.clock.call(out.shape[0])
        try:
            with self._staging_lock, torch.cuda.device(self.device), torch.inference_mode():
                if self.staging is None or self._flag is None or self.side_stream is None:
                    self.staging = torch.empty(STAGING_BYTES // 4, dtype=torch.float32, pin_memory=True)
                    self._flag = torch.empty(1, dtype=torch.float32, pin_memory=True)
                    # high priority: the check's small reduction runs ahead of the next call's forwards
                    self.side_stream = torch.cuda.Stream(self.device, priority=-1)
                side = self.side_stream
                with torch.cuda.stream(side):
                    side.wait_event(ready)
                    if out.numel() == 0:
                        return np.empty(tuple(out.shape), dtype=np.float32)
                    out.record_stream(side)
                    self._flag.copy_(out.sum().reshape(1), non_blocking=True)
                    host = _copy_out(out, self.staging, side)  # waits on the side stream's events
                    if not math.isfinite(float(self._flag[0])):  # ordered before the last chunk's event
                        _check_finite(out)
                    return host
        finally:
            self.clock.count("finish", t0)

    # -- the forward pass and pooling ----------------------------------------------------------
    def forward(self, ids: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """Pooled float32 embeddings of one micro-batch (``ids`` int32, ``valid`` bool, on the device).

        ``valid`` None: every token is real (a one-length micro-batch), and the encoder
        runs with no attention mask.
        """
        inputs = {"input_ids": ids}
        if valid is not None:
            inputs["attention_mask"] = self.attention_mask(valid)
        if self.type_ids:
            inputs["token_type_ids"] = torch.zeros_like(ids)
        hidden = self._encoder()(**inputs, return_dict=True).last_hidden_state.float()
        return self.pool(hidden, valid)

    def _encoder(self) -> torch.nn.Module:
        if self.hf is None:
            raise RuntimeError("this DeviceRunner was closed; Fix: build a new engine")
        return self.hf

    def attention_mask(self, valid: torch.Tensor, *, four_d: bool | None = None) -> torch.Tensor:
        """The attention mask the encoder takes, built on the device.

        A 4D additive mask (0 to attend, the dtype's minimum to skip) where the model
        takes one as is (:attr:`mask4d`, probed when the runner is built; ``four_d``
        overrides it): transformers then skips its ``padding_mask.all()`` test, a
        blocking device-to-host read per call. Else the 2D 0/1 mask.
        """
        if not (self.mask4d if four_d is None else four_d):
            return valid.to(torch.int64)
        bias = torch.zeros(valid.shape, dtype=self.compute_dtype, device=valid.device)
        return bias.masked_fill_(~valid, torch.finfo(self.compute_dtype).min)[:, None, None, :]

    def _probe_input(self, pad_id: int, type_ids: bool) -> dict[str, torch.Tensor]:
        """A two-row encoder input, the second row padded, with its 2D mask (for the probes)."""
        valid = torch.tensor([[True, True, True], [True, True, False]], device=self.device)
        ids = torch.full(valid.shape, 101, dtype=torch.int32, device=self.device).masked_fill_(~valid, pad_id)
        extra = {"token_type_ids": torch.zeros_like(ids)} if type_ids else {}
        return {"input_ids": ids, "attention_mask": valid.to(torch.int64), **extra}

    def _takes_4d_mask(self) -> bool:
        """True when the encoder gives the same output for the 4D additive mask as for the 2D mask.

        Probed with two forward passes on a two-row input, except for dask-surge's own BERT
        (:class:`~dask_surge.engine.bert.BertEncoder`), which turns a 2D mask into this very 4D mask
        itself: no probe, so the load ends sooner before a cold run's first SuperBatch.
        """
        hf = self._encoder()
        if isinstance(hf, BertEncoder):
            return True
        extra = self._probe_input(self.pad_id, self.type_ids)
        valid = extra.pop("attention_mask").bool()
        try:
            with torch.inference_mode():
                two = hf(attention_mask=self.attention_mask(valid, four_d=False), **extra).last_hidden_state
                four = hf(attention_mask=self.attention_mask(valid, four_d=True), **extra).last_hidden_state
        except Exception:  # noqa: BLE001 - a model that refuses a 4D mask keeps the 2D one
            return False
        tol = 1e-4 if self.compute_dtype == torch.float32 else 2e-2
        return bool(torch.allclose(two[valid].float(), four[valid].float(), rtol=tol, atol=tol))

    def pool(self, hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Pool like ``sentence_transformers`` ``Pooling`` (right padding; prompt tokens out if it says so).

        ``mask`` None means every token is real. ``lasttoken`` is each row's token at its
        length less one (the rows are right-padded): the position sentence-transformers
        gathers whichever side its tokenizer pads; a row whose tokens are all the prompt's,
        left out of pooling, gets zeros, as there.
        """
        if mask is None and not self.prompt_length:
            parts = [
                hidden[:, 0]
                if mode == "cls"
                else hidden.max(dim=1).values
                if mode == "max"
                else hidden[:, -1]
                if mode == "lasttoken"
                else hidden.mean(dim=1)
                for mode in self.modes
            ]
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        if mask is None:
            mask = torch.ones(hidden.shape[:2], dtype=torch.int32, device=hidden.device)
        lengths = mask.sum(dim=1) if "lasttoken" in self.modes else None
        mask = mask.to(torch.int32)  # a fresh tensor: the caller's mask stays as it was
        if self.prompt_length:
            mask[:, : self.prompt_length] = 0
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        parts = []
        for mode in self.modes:
            if mode == "cls" and self.prompt_length:  # the first token pooled: the first after the prompt
                first = mask.argmax(dim=1)
                parts.append(hidden[torch.arange(hidden.shape[0], device=hidden.device), first])
            elif mode == "cls":
                parts.append(hidden[:, 0])
            elif mode == "lasttoken" and lengths is not None:
                rows = torch.arange(hidden.shape[0], device=hidden.device)
                last = hidden[rows, (lengths - 1).clamp(min=0)]
                parts.append(last * (lengths > self.prompt_length).unsqueeze(-1).to(last.dtype))
            elif mode == "max":
                parts.append(hidden.masked_fill(weights == 0, float("-inf")).max(dim=1).values)
            else:
                parts.append((hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    # -- sizing, the feeder thread, release ----------------------------------------------------
    def auto_max_tokens(self, max_seq_length: int) -> int:
        """The token budget of one micro-batch: on a CPU, :func:`~dask_surge.engine.batching.cpu_max_tokens`
        (2,048 for MiniLM-sized and wider models, up to 8,192 for narrower ones); on CUDA, sized from
        free memory.

        Both come from one estimate, :func:`~dask_surge.engine.batching.activation_bytes_per_token`
        of this model's config: its width, feed-forward size and heads, and one attention row a
        head over ``max_seq_length``, so a wide decoder with a 32k window gets a budget of its own
        size, never a narrow model's larger one. The layer count does not enter: inference frees
        each layer's activations before the next. A single text longer than the budget still runs,
        alone, as one row of its length.
        """
        per_token = activation_bytes_per_token(self.config, max_seq_length)
        if self.device.type != "cuda":
            return cpu_max_tokens(per_token)
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(min(65536, max(4096, free // 4 // per_token)))

    @property
    def feeder(self) -> _Feeder | None:
        """The feeder thread, once started (None before the first fed call and after :meth:`close`)."""
        return self._feeder

    def feeder_thread(self) -> _Feeder:
        """The feeder thread, started on first use."""
        with self._feeder_lock:
            if self._feeder is None:
                self._feeder = _Feeder(self.device)
                # dropping the runner stops its thread (the feeder holds no reference to the runner)
                weakref.finalize(self, self._feeder.close).atexit = False
            return self._feeder

    def close(self) -> None:
        """Stop the feeder thread (queued work finishes first), drop the pinned buffer and the encoder; idempotent.

        The encoder module this runner made (oneDNN-packed or half copies) goes with it;
        the weights it shares are the model's and stay as they are.
        """
        with self._feeder_lock:
            feeder, self._feeder = self._feeder, None
        if feeder is not None:
            feeder.close()
        with self._staging_lock:
            self.staging = self._flag = self.side_stream = None
        if feeder is None or not feeder.thread.is_alive():
            self.hf = None


def _copy_out(out: torch.Tensor, staging: torch.Tensor, stream: Any = None) -> np.ndarray:
    """``out`` as a new numpy array, copied through ``staging`` (1-D, same dtype, 2 elements or more).

    ``staging`` is used as two halves in turn: chunk ``k`` goes into half ``k % 2``
    while chunk ``k - 1`` is copied from the other half into the result, so on CUDA the
    device-to-host copy of one chunk overlaps the host's copy of the one before.

    On CUDA ``staging`` is pinned and ``stream`` is a stream ordered after the work that
    wrote ``out``: each chunk is an asynchronous device-to-host copy on ``stream``, and an
    event recorded after it is waited for before the host reads that half (the only
    waiting: on ``stream``'s events, never the device). The result is ordinary (pageable)
    memory, so no pinned block outlives the call. With ``stream`` None the copies are
    synchronous (a CPU ``out``).

    Examples
    --------
    >>> out = torch.arange(10, dtype=torch.float32).reshape(5, 2)
    >>> _copy_out(out, torch.empty(3)).tolist()
    [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0], [8.0, 9.0]]
    """
    host = np.empty(tuple(out.shape), dtype=np.float32)
    src, dst, step = out.reshape(-1), host.reshape(-1), staging.numel() // 2
    if step < 1:
        raise ValueError(f"the staging buffer holds {staging.numel()} values; it needs 2 or more")
    halves = (staging[:step], staging[step : 2 * step])
    views = tuple(h.numpy() for h in halves)
    copied = (torch.cuda.Event(), torch.cuda.Event()) if stream is not None else None
    waiting: tuple[int, int, int] | None = None  # (half, a, b): copied into a half, not yet read from it

    def drain(half: int, a: int, b: int) -> None:
        if copied is not None:
            copied[half].synchronize()
        dst[a:b] = views[half][: b - a]

    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for k, a in enumerate(range(0, src.numel(), step)):
            b, half = min(a + step, src.numel()), k % 2
            halves[half][: b - a].copy_(
                src[a:b], non_blocking=stream is not None
            )  # this half was read already
            if copied is not None:
                copied[half].record(stream)
            if waiting is not None:
                drain(*waiting)
            waiting = (half, a, b)
        if waiting is not None:
            drain(*waiting)
    return host


def _host(array: np.ndarray, pin: bool) -> torch.Tensor:
    """``array`` as a tensor, in pinned memory when it will travel to a GPU asynchronously."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    return host.pin_memory() if pin else host


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
    # reduction instead of a bool tensor of the whole call (docs/ab_studies.md)
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
        memo[id(tensor)] = (
            torch.nn.Parameter(cast, requires_grad=False) if isinstance(tensor, torch.nn.Parameter) else cast
        )
    return copy.deepcopy(hf, memo)


class _OneDNNLinear(torch.nn.Linear):
    """``nn.Linear`` computed by oneDNN from a weight pre-packed in its blocked layout.

    Same fp32 math as MKL sgemm, faster on AVX-512 CPUs, and the weight is packed
    once instead of on every call (``docs/ab_studies.md``).
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


#: A linear layer runs through oneDNN (:class:`_OneDNNLinear`) only when its weight has at least
#: this many elements (``in_features * out_features``). oneDNN builds and caches a primitive for each
#: new input shape (a run's micro-batches bring hundreds of shapes), and pays it back only on wide
#: layers; narrow ones gain nothing and their primitives fill a worker's heap (``docs/ab_studies.md``).
ONEDNN_MIN_WEIGHT = 1 << 17


def _with_onednn_linear(hf: torch.nn.Module) -> torch.nn.Module:
    """A copy of the module tree of ``hf`` sharing its weights, with oneDNN linears; ``hf`` is untouched.

    Each linear of at least :data:`ONEDNN_MIN_WEIGHT` weights becomes a :class:`_OneDNNLinear`
    holding its weight packed for oneDNN (a second copy of those weights: about 85 MB for
    MiniLM-L6), where this torch can pack; narrower ones stay ``nn.Linear`` (MKL, no per-shape
    primitive). The tree is copied either way: the engine changes the copy's attention.

    Examples
    --------
    >>> layer = torch.nn.Sequential(torch.nn.Linear(384, 384), torch.nn.Linear(32, 128))
    >>> [type(m).__name__ for m in _with_onednn_linear(layer)] if torch.backends.mkldnn.is_available() else None
    ['_OneDNNLinear', 'Linear']
    >>> [type(m).__name__ for m in layer]  # the caller's modules are left as they were
    ['Linear', 'Linear']
    """
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return hf
    try:
        clone = copy.deepcopy(hf, {id(t): t for t in (*hf.parameters(), *hf.buffers())})
    except (TypeError, RuntimeError):  # modules holding uncopyable state keep the stock path
        return hf
    pack = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    for module in clone.modules():
        if type(module) is torch.nn.Linear and module.in_features * module.out_features >= ONEDNN_MIN_WEIGHT:
            module.__class__ = _OneDNNLinear
            if pack is not None and module.weight.dtype == torch.float32:
                with contextlib.suppress(RuntimeError), torch.no_grad():
                    module._packed = pack(module.weight.detach(), CPU_MAX_TOKENS)
                    module._packed_version = module.weight._version  # type: ignore[assignment]
    for module in list(clone.modules()):
        _fuse_gelu(module)
    return clone


#: On a CPU, attention runs with its keys padded to a multiple of this many (masked out): torch's
#: flash kernel computes each row's softmax 16 floats at a time and the rest one by one, so a
#: key length off that multiple (29 tokens: 16 + 13 scalar exponentials a row) costs up to twice
#: the aligned one (see :func:`_padded_sdpa`).
CPU_KEY_MULTIPLE = 16
_PADDED_SDPA = "dask_surge_padded_sdpa"


def _padded_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """transformers' SDPA attention with the keys padded to :data:`CPU_KEY_MULTIPLE`, the padding masked out.

    The same attention (the padded keys get no weight): only the kernel's loops change. Left
    as it is for causal attention and a position bias, which padding would have to follow.

    Examples
    --------
    >>> q, k, v = (torch.randn(3, 2, 29, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    >>> out, _ = _padded_sdpa(torch.nn.Module(), q, k, v, None, is_causal=False)
    >>> bool(torch.allclose(out, torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2), atol=1e-6))
    True
    """
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
    if not causal and kwargs.get("position_bias") is None:
        key, value, attention_mask = pad_keys(key, value, attention_mask, CPU_KEY_MULTIPLE)
    return _sdpa_forward(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=dropout,
        scaling=scaling,
        is_causal=is_causal,
        **kwargs,
    )


def _sdpa_forward(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """transformers' own SDPA attention function (imported on first use)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(*args, **kwargs)


def _pad_cpu_attention(model: torch.nn.Module, probe: dict[str, torch.Tensor]) -> bool:
    """Run ``model``'s SDPA attention through :func:`_padded_sdpa`, where it gives the same output on ``probe``
    (a :class:`~dask_surge.engine.bert.BertEncoder` pads its keys itself: the same padding, no probe).

    Only for a model whose config says ``sdpa`` and a transformers that takes an attention
    function by name (``AttentionInterface``, with its mask function); it sets ``model.config``,
    so ``model`` must be the engine's own copy. True if the model now runs padded.
    """
    if isinstance(model, BertEncoder):  # dask-surge's own BERT pads its keys itself when asked
        model.pad_attention_keys(CPU_KEY_MULTIPLE)
        return True
    config: Any = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        AttentionMaskInterface.register(_PADDED_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
        AttentionInterface.register(_PADDED_SDPA, _padded_sdpa)
        with torch.inference_mode():
            before = model(**probe).last_hidden_state
            config._attn_implementation = _PADDED_SDPA
            after = model(**probe).last_hidden_state
        valid = probe["attention_mask"].bool()
        if torch.allclose(before[valid], after[valid], rtol=1e-4, atol=1e-5):
            return True
    except Exception:  # noqa: BLE001 - any failure: the model keeps its stock attention
        pass
    config._attn_implementation = "sdpa"
    return False


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
