"""The device runner's finish (issue 27 item 3): on CUDA, asynchronous, so the GPU never drains between calls.

On a CPU, :meth:`DeviceRunner.finish` is what it always was (the finiteness check, then
``out.numpy()``) and never touches the CUDA API; the chunked copy through the staging
buffer, the same function on both, is checked here on CPU tensors. On CUDA the check and
the copy run on a side stream that waits on an event of the compute stream, and the
caller waits on the side stream's events only: the ``gpu`` tests run that path for real
(the GPU session's pytest stage runs them), on a tiny random-weight model built offline.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer

from dask_surge.engine.forward import _ENDED, STAGING_BYTES, _copy_out
from dask_surge.engine.transformer import TransformerEngine
from dask_surge.errors import SurgeModelError
from dask_surge.testing import make_texts

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def cpu_engine(tiny_model):
    engine = TransformerEngine.from_sentence_transformer(SentenceTransformer(tiny_model, device="cpu"))
    yield engine
    engine.close()


@pytest.fixture
def cuda_engine(tiny_model):
    engine = TransformerEngine.from_sentence_transformer(SentenceTransformer(tiny_model, device="cuda"))
    yield engine
    engine.close()


# -- the chunked copy, through two halves of one buffer -------------------------------------------------
@pytest.mark.parametrize("staging_size", [2, 3, 8, 16, 1000])
@pytest.mark.parametrize("shape", [(0, 5), (1, 1), (4, 4), (37, 5), (9, 8)])
def test_copy_out_through_two_halves_gives_every_value_once(staging_size, shape):
    out = torch.randn(shape)
    host = _copy_out(out, torch.empty(staging_size))
    np.testing.assert_array_equal(host, out.numpy())
    assert host.shape == shape and host.flags.owndata and host.flags.c_contiguous


def test_copy_out_refuses_a_buffer_with_no_two_halves():
    with pytest.raises(ValueError, match="needs 2 or more"):
        _copy_out(torch.randn(3, 2), torch.empty(1))


# -- the CPU path: unchanged, and no CUDA state made -----------------------------------------------------
def test_cpu_finish_is_the_check_and_a_numpy_view(cpu_engine):
    runner = cpu_engine.runner
    out = torch.randn(6, runner.dimension)
    host = runner.finish(out)
    np.testing.assert_array_equal(host, out.numpy())
    assert runner.staging is None and runner.side_stream is None  # the CUDA path was not taken
    out[4, 1] = float("nan")
    with pytest.raises(SurgeModelError, match=r"for 1 of 6 texts .*rows \[4\]"):
        runner.finish(out)


def _one_window(engine, texts):
    """``texts`` as one staged window of ``engine`` and an output tensor for it, on its device."""
    packer = engine.packer
    window = engine.runner.stage(packer.pack(packer.tokenize(texts), 0, max_tokens=engine.max_tokens))
    return window, torch.empty((len(texts), engine.dimension), device=engine.device)


def test_cpu_window_records_no_event(cpu_engine):
    texts = make_texts(30, seed=1)
    window, out = _one_window(cpu_engine, texts)
    with torch.inference_mode():
        cpu_engine._run_block(window, out, False)
    assert getattr(out, _ENDED, None) is None  # events are CUDA's only
    np.testing.assert_allclose(cpu_engine.runner.finish(out), cpu_engine.encode(texts), rtol=1e-5, atol=1e-6)


def test_cpu_finish_fed_runs_the_finish_on_the_feeder_thread(cpu_engine):
    runner = cpu_engine.runner
    feeder = runner.feeder_thread()
    out = torch.randn(5, runner.dimension)
    np.testing.assert_array_equal(runner.finish_fed(feeder, out), out.numpy())
    out[0, 0] = float("inf")
    with pytest.raises(SurgeModelError, match=r"rows \[0\]"):  # raised on the feeder, handed back
        runner.finish_fed(feeder, out)
    assert runner.staging is None and runner.side_stream is None


# -- the CUDA path, for real (the GPU session's pytest stage) ---------------------------------------------
@needs_cuda
@pytest.mark.gpu
def test_cuda_finish_syncs_neither_the_device_nor_a_stream(cuda_engine):
    runner = cuda_engine.runner
    runner.finish(torch.randn(2, 3, device=runner.device))  # makes the staging buffer and the side stream
    out = torch.randn(STAGING_BYTES // 4 + 1000, 3, device=runner.device)  # more than two chunks
    torch.cuda.set_sync_debug_mode("error")  # a stream/device sync or a blocking copy raises
    try:
        host = runner.finish(out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    np.testing.assert_array_equal(host, out.cpu().numpy())
    assert runner.staging is not None and runner.staging.is_pinned() and runner.side_stream is not None


@needs_cuda
@pytest.mark.gpu
def test_cuda_finish_returns_while_the_compute_stream_is_still_busy(cuda_engine):
    runner = cuda_engine.runner
    runner.finish(torch.randn(2, 3, device=runner.device))  # first use: buffer and stream made
    out = torch.randn(50_000, 8, device=runner.device) * 2
    ready = runner.mark()  # the end of this call's work on the compute stream
    torch.cuda._sleep(2_000_000_000)  # the next call's work: about a second of spinning on the same stream
    later = torch.cuda.Event()
    later.record()
    host = runner.collect(out, ready)
    still_busy = not later.query()
    torch.cuda.synchronize()
    np.testing.assert_array_equal(host, out.cpu().numpy())
    assert still_busy  # the results came back while the compute stream still ran: it did not drain


@needs_cuda
@pytest.mark.gpu
def test_cuda_finish_fed_waits_for_its_last_window_not_for_work_queued_after_it(cuda_engine):
    engine = cuda_engine
    runner = engine.runner
    texts = make_texts(2000, seed=5)
    expected = engine.encode(texts)
    feeder = runner.feeder_thread()
    window, out = _one_window(engine, texts)
    feeder.submit(lambda: engine._run_block(window, out, False)).result()
    assert getattr(out, _ENDED, None) is not None
    feeder.submit(lambda: torch.cuda._sleep(2_000_000_000))  # the next call's work, queued on the feeder
    later = feeder.submit(runner.mark).result()  # recorded after it on the compute stream
    host = runner.finish_fed(feeder, out)
    still_busy = not later.query()
    torch.cuda.synchronize()
    np.testing.assert_allclose(host, expected, rtol=1e-5, atol=1e-6)
    assert still_busy  # the copy waited for this call's window only, and the feeder was not blocked


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("value, row", [(float("nan"), 3), (float("-inf"), 0)])
def test_cuda_async_check_finds_a_bad_value(cuda_engine, value, row):
    runner = cuda_engine.runner
    out = torch.randn(STAGING_BYTES // 4, 2, device=runner.device)
    out[row, 1] = value
    with pytest.raises(SurgeModelError, match=rf"rows \[{row}\]"):
        runner.finish(out)
    out[row, 1] = 3e38  # finite values whose sum overflows pass
    out[row + 1, 1] = 3e38
    assert runner.finish(out).shape == out.shape


@needs_cuda
@pytest.mark.gpu
def test_cuda_concurrent_calls_share_one_bounded_staging_buffer(cuda_engine):
    engine = cuda_engine
    assert engine.use_feeder
    inputs = [make_texts(3000 + 500 * i, seed=i) for i in range(4)]
    expected = [engine.encode(t) for t in inputs]
    staging = engine.runner.staging
    assert staging is not None and staging.numel() * 4 == STAGING_BYTES
    results: dict[int, np.ndarray] = {}
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, engine.encode(inputs[i])))
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        np.testing.assert_allclose(results[i], expected[i], rtol=1e-5, atol=1e-6)
    assert engine.runner.staging.data_ptr() == staging.data_ptr()  # the same buffer, reused, never grown
    engine.use_feeder = False  # the inline path takes the same finish
    np.testing.assert_allclose(engine.encode(inputs[0]), expected[0], rtol=1e-5, atol=1e-6)
