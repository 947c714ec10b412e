"""On an accelerator: the same counts as on CPU, and latencies taken after synchronizing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_profiler import FlopsProfiler, get_model_profile

pytestmark = pytest.mark.gpu


@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device("cuda")


def test_cuda_counts_match_cpu_and_latency_is_measured(cuda, tiny):
    torch.manual_seed(0)
    model = tiny.TinyGPT2().eval()
    ids = torch.randint(0, 128, (2, 12))
    cpu = get_model_profile(model, kwargs={"input_ids": ids}, print_profile=False, as_string=False)
    gpu = get_model_profile(model.to(cuda), kwargs={"input_ids": ids.to(cuda)}, print_profile=False,
                            as_string=False)
    assert gpu[1] == cpu[1] and gpu[2] == cpu[2]


def test_fused_cuda_attention_and_lstm_are_counted(cuda):
    lstm = nn.LSTM(16, 32).to(cuda)
    prof = FlopsProfiler(lstm)
    prof.start_profile()
    with torch.no_grad():
        lstm(torch.randn(5, 3, 16, device=cuda))
    assert prof.get_total_macs() == 15 * 4 * 32 * (16 + 32)
    assert prof.get_total_duration() > 0
    prof.end_profile()

    class Attn(nn.Module):
        def forward(self, q, k, v):
            return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    q = torch.randn(2, 4, 64, 32, device=cuda, dtype=torch.float16)
    prof = FlopsProfiler(Attn())
    prof.start_profile()
    prof.model(q, q, q)
    assert prof.get_total_macs() == 2 * 4 * 64 * 64 * 64
    prof.end_profile()
