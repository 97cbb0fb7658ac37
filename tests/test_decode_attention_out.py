"""The decode step's attention fused with its output projection (kernels/decode_attention_out.py), interpreted on
the CPU: the residual it adds to equals the separate attention and projection's, for 16-bit, INT8 and INT4 weights
(groups narrower and wider than a head's columns), GQA, ragged lengths and empty chunks; bad input is named."""

from __future__ import annotations

import pytest
import torch
from test_decode_step import _weight

from adaattn.kernels import decode_attention_out as dao


@pytest.mark.parametrize("bits, group, D", [(16, 0, 32), (8, 0, 32), (4, 32, 64), (4, 128, 32)])
@pytest.mark.parametrize("B, H, G, lengths", [(1, 4, 2, [37]), (3, 4, 1, [1, 70, 129])])
@pytest.mark.parametrize("hp", [1, 2])  # heads a program combines and projects
def test_the_residual_gets_the_separate_kernels_sum(bits, group, D, B, H, G, lengths, hp, monkeypatch):
    monkeypatch.setattr(dao, "HEADS_PER_PROGRAM", hp)
    torch.manual_seed(bits + B)
    M, N = 192, 96  # 192 positions: three chunks of 64, the last empty for the shorter sequences
    q, k, v = torch.randn(B, H, D), torch.randn(B, G, M, D), torch.randn(B, G, M, D)
    w = _weight(N, H * D, bits, group)
    length = torch.tensor(lengths)
    res = torch.randn(B, N)
    want = res.clone()
    dao.attention_out_(res, q, k, v, length - 1, w, length_offset=1)
    dao.attention_out_ref(want, q, k, v, length - 1, w, length_offset=1)
    torch.testing.assert_close(res, want, atol=1e-5, rtol=1e-5)


def test_bad_input_is_named():
    q, k = torch.randn(1, 4, 32), torch.randn(1, 2, 64, 32)
    w = _weight(96, 128, 16, 0)
    with pytest.raises(ValueError, match=r"attention_out_: the residual must be fp32 \(1, 96\)"):
        dao.attention_out_(torch.zeros(1, 96, dtype=torch.bfloat16), q, k, k, torch.tensor([3]), w)
    with pytest.raises(ValueError, match=r"attention_out_: x must be \(rows, 256\)"):
        dao.attention_out_(torch.zeros(1, 96), q, k, k, torch.tensor([3]), _weight(96, 256, 16, 0))
    with pytest.raises(ValueError, match="decode_attention: k"):
        dao.attention_out_(torch.zeros(1, 96), q, torch.randn(1, 3, 64, 32), torch.randn(1, 3, 64, 32),
                           torch.tensor([3]), w)
