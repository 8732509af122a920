"""engine/cuda_context.ReserveWatch: the workers' log of PyTorch's peak
reserve (what a measured process peak is set against in the plan)."""
import pytest
import torch

from engine.cuda_context import ReserveWatch


def test_off_the_gpu_it_reports_nothing():
    assert ReserveWatch(torch.device("cpu")).grown("a request") is None


def test_a_step_must_be_positive():
    with pytest.raises(ValueError, match="step_bytes"):
        ReserveWatch(torch.device("cpu"), step_bytes=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_it_reports_first_then_only_growth_past_its_step():
    device = torch.device("cuda")
    watch = ReserveWatch(device, step_bytes=256 << 20)
    assert "by the start" in watch.grown("the start")
    assert watch.grown("a small step") is None
    block = torch.empty(512 << 20, dtype=torch.uint8, device=device)
    line = watch.grown("a big allocation")
    assert line is not None and "a big allocation" in line
    del block
