"""engine/cuda_context.ReserveWatch: the workers' log of PyTorch's peak
reserve (what a measured process peak is set against in the plan), and the
prefill worker's allocator setting that keeps that reserve near what it uses."""
import os

import pytest
import torch

from engine.cuda_context import ReserveWatch


def test_off_the_gpu_it_reports_nothing():
    lines = []
    watch = ReserveWatch(torch.device("cpu"), lines.append)
    watch.check("a request")
    watch.release("a release")
    assert lines == []


def test_a_step_must_be_positive():
    with pytest.raises(ValueError, match="step_bytes"):
        ReserveWatch(torch.device("cpu"), print, step_bytes=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_it_reports_first_then_only_growth_past_its_step_and_after_a_release():
    device = torch.device("cuda")
    lines = []
    watch = ReserveWatch(device, lines.append, step_bytes=256 << 20)
    watch.check("the start")
    assert len(lines) == 1 and "by the start" in lines[0]
    assert "(NVML)" in lines[0] and "stack limit" in lines[0], lines[0]
    watch.check("a small step")
    assert len(lines) == 1
    block = torch.empty(512 << 20, dtype=torch.uint8, device=device)
    watch.check("a big allocation")
    assert len(lines) == 2 and "a big allocation" in lines[1]
    del block
    watch.release("the release")
    assert len(lines) == 3 and "by the release" in lines[2]
    assert torch.cuda.memory_reserved(device) < 512 << 20


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_stack_limit_it_reports_is_the_contexts():
    from engine.cuda_context import stack_limit, trim_stack_reservation
    device = torch.device("cuda")
    assert trim_stack_reservation(device, 128)
    assert stack_limit(device) == 128
    lines = []
    ReserveWatch(device, lines.append).check("the trim")
    assert "stack limit 128 B" in lines[0]


def test_off_the_gpu_there_is_no_stack_limit_nor_nvml_figure():
    from engine.cuda_context import process_gpu_bytes, stack_limit
    assert stack_limit("cpu") is None and process_gpu_bytes("cpu") is None


def test_the_prefill_worker_grows_segments_unless_the_allocator_is_configured(monkeypatch):
    """A long prompt's chunks ask for ever larger buffers; with fixed segments
    the 24 GiB service's prefill worker kept 4.1 GiB for 0.48 allocated
    (BENCHMARKS 12-05). The setting must be in place before the worker's first
    CUDA call (run_server), and a user's own allocator settings win."""
    import prefill.server as server
    from engine.cuda_context import ALLOCATOR_ENV

    seen = []
    monkeypatch.setattr(server, "run_server",
                        lambda process, main: seen.append(os.environ.get(ALLOCATOR_ENV)) or 0)
    monkeypatch.setenv(ALLOCATOR_ENV, "recorded")  # so that the end restores what was there
    monkeypatch.delenv(ALLOCATOR_ENV)
    assert server.main(["--store", "unused.sock", "--socket", "unused.sock"]) == 0
    monkeypatch.setenv(ALLOCATOR_ENV, "max_split_size_mb:64")
    assert server.main(["--store", "unused.sock", "--socket", "unused.sock"]) == 0
    assert seen == ["expandable_segments:True", "max_split_size_mb:64"]
