"""The oneDNN-packed CPU GEMM (`attnserve.models.layers.cpu_gemm`) against float64, and
when it applies."""

import pytest
import torch

from attnserve.models.layers import cpu_gemm
from attnserve.models.layers.linear import Linear
from numeric_bounds import assert_within, dot_product_bound

pytestmark = pytest.mark.skipif(not cpu_gemm.packed_linear_available(), reason="PyTorch built without oneDNN")


def _ref(x, w, b):
    out = x.double() @ w.double().T
    return out if b is None else out + b.double()


@pytest.mark.parametrize("rows", [2, 5, 16, 333])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_float64(rows, bias):
    g = torch.Generator().manual_seed(rows + bias)
    x = torch.randn(rows, 96, generator=g)
    w = torch.randn(200, 96, generator=g)
    b = torch.randn(200, generator=g) if bias else None
    packed = cpu_gemm.PackedCPUWeight()
    out = packed.linear(x, w, b)
    assert out is not None and out.dtype == torch.float32 and out.shape == (rows, 200)
    torch.testing.assert_close(out.double(), _ref(x, w, b), rtol=1e-5, atol=1e-4)


def test_packed_copy_follows_in_place_weight_changes():
    g = torch.Generator().manual_seed(0)
    lin = Linear(64, 48, dtype=torch.float32)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 64, generator=g))
    x = torch.randn(8, 64, generator=g)
    first = lin(x)
    torch.testing.assert_close(first.double(), _ref(x, lin.weight, None), rtol=1e-5, atol=1e-4)
    with torch.no_grad():  # a reload writes the parameter in place: the packed copy must follow
        lin.weight.copy_(torch.randn(48, 64, generator=g))
    second = lin(x)
    torch.testing.assert_close(second.double(), _ref(x, lin.weight, None), rtol=1e-5, atol=1e-4)
    assert not torch.allclose(first, second)


def test_packed_path_only_where_it_applies():
    packed = cpu_gemm.PackedCPUWeight()
    w = torch.randn(32, 16)
    assert packed.linear(torch.randn(1, 16), w, None) is None  # one row: MKL's GEMV is faster
    assert packed.linear(torch.randn(2, 3, 16), w, None) is None  # not 2-D
    assert packed.linear(torch.randn(4, 16, dtype=torch.bfloat16), w.bfloat16(), None) is None
    assert packed.linear(torch.randn(4, 16), w, None) is not None
    # the dispatching helper gives the same numbers either way: within the float32 rounding
    # of two 16-term dot products (F.linear and matmul may reach different BLAS kernels)
    x = torch.randn(1, 16)
    assert_within(cpu_gemm.linear(x, w, None, packed), x @ w.T, dot_product_bound(x, w), "one-row dispatch")


def test_gated_projection_uses_the_same_weights():
    g = torch.Generator().manual_seed(1)
    lin = Linear(40, 2 * 24, dtype=torch.float32)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 40, generator=g))
    x = torch.randn(6, 40, generator=g)
    h = _ref(x, lin.weight, None)
    ref = torch.nn.functional.silu(h[:, :24]) * h[:, 24:]
    torch.testing.assert_close(lin.forward_gated(x, "silu").double(), ref, rtol=1e-5, atol=1e-4)


def test_a_packed_module_can_be_copied_and_pickled():
    import copy
    import pickle

    lin = Linear(16, 8, dtype=torch.float32)
    with torch.no_grad():
        lin.weight.normal_()
    x = torch.randn(4, 16)
    want = lin(x)  # packs the weight
    for clone in (copy.deepcopy(lin), pickle.loads(pickle.dumps(lin))):
        torch.testing.assert_close(clone(x), want)
        assert clone.cpu_packed is not lin.cpu_packed
