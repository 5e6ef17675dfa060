"""`row_argmax` (two-pass Triton argmax) against ``torch.argmax`` under the interpreter:
ragged widths, ties across and inside pieces, NaN and -inf rows, 16-bit input, row strides."""

import pytest
import torch

from attnserve.engine.row_argmax import ARGMAX_PIECE, row_argmax, row_argmax_supported


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _cases():
    g = torch.Generator().manual_seed(0)
    v = 2 * ARGMAX_PIECE + 37  # three pieces, the last one ragged
    x = torch.randn(9, v, generator=g)
    x[1, 5] = x[1, ARGMAX_PIECE + 3] = x[1, -1] = 50.0      # a tie across pieces: the first wins
    x[2, 7] = x[2, 8] = 60.0                                   # a tie inside a piece
    x[3, ARGMAX_PIECE + 11] = float("nan")                     # NaN beats every number ...
    x[3, 0] = float("inf")
    x[4, -2] = x[4, ARGMAX_PIECE] = float("nan")               # ... and the first NaN wins
    x[5] = float("-inf")                                        # all -inf: index 0
    x[6, -1] = 1e30                                             # the max in the ragged tail
    x[7, :] = 3.0                                               # all equal
    x[8, ARGMAX_PIECE - 1] = 99.0                               # the last entry of a piece
    return x


def test_matches_torch_argmax():
    x = _cases()
    assert torch.equal(row_argmax(x), torch.argmax(x, dim=-1))
    assert row_argmax(x).dtype == torch.int64


@pytest.mark.parametrize("v", [1, 5, 4096, 4097])
def test_widths_and_16_bit(v):
    g = torch.Generator().manual_seed(v)
    x = torch.randn(3, v, generator=g).to(torch.bfloat16)  # bf16 makes ties common
    assert torch.equal(row_argmax(x), torch.argmax(x.float(), dim=-1))


def test_row_stride_and_errors():
    g = torch.Generator().manual_seed(1)
    base = torch.randn(4, 300, generator=g)
    x = base[:, :257]  # rows 300 apart
    assert torch.equal(row_argmax(x), torch.argmax(x, dim=-1))
    assert row_argmax(torch.empty(0, 10)).shape == (0,)
    assert not row_argmax_supported(base.t())
    with pytest.raises(ValueError, match="2-D"):
        row_argmax(torch.randn(10))
    with pytest.raises(ValueError, match="unit stride"):
        row_argmax(base.t())
