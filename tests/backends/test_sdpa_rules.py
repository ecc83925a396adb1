"""The sdpa backend's rules agree with torch: it serves a call iff torch runs a fused kernel.

For each case, torch itself is asked to run with its math kernel excluded
(``sdpa_kernel([FLASH, EFFICIENT, CUDNN])``): it succeeds exactly when a fused kernel serves
the arguments. attnkit's ``check`` must say the same, so ``auto`` never takes ``sdpa`` for a
call that torch would quietly run on its slow path, and never passes it over needlessly.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnkit
from attnkit.backends import get_backend
from calls import make_call

SDPA = get_backend("sdpa")

FUSED = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]


def _tensors(dtype, Dv, Hkv, last_dim_strided, mask_kind, mask_grad, L, S):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, L, 16, generator=g).to(dtype)
    if last_dim_strided:
        q = torch.randn(2, 4, 16, L, generator=g).to(dtype).transpose(-1, -2)
    k = torch.randn(2, Hkv, S, 16, generator=g).to(dtype)
    v = torch.randn(2, Hkv, S, Dv, generator=g).to(dtype)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(2, 1, L, S, generator=g) > 0.3
    elif mask_kind == "float":
        mask = torch.randn(2, 1, L, S, generator=g).to(dtype).requires_grad_(mask_grad)
    return q, k, v, mask


def _torch_runs_fused(q, k, v, mask, dropout_p, *, backward: bool) -> bool:
    try:
        with sdpa_kernel(FUSED):
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=q.shape[1] != k.shape[1]
            )
            if backward:
                out.sum().backward()
    except RuntimeError as e:
        if "No available kernel" not in str(e):
            raise
        return False
    return True


GRID = list(
    itertools.product(
        [torch.float32, torch.float64, torch.bfloat16, torch.float16],  # dtype
        [16, 24],  # Dv (Dk = 16)
        [4, 2],  # Hkv (H = 4)
        [False, True],  # q's last dim strided
        ["none", "bool", "float"],  # mask
        [False, True],  # float mask requires grad
        [0.0, 0.2],  # dropout_p
        [(24, 24), (17, 24)],  # (L, S): more rows than the decode kernel takes (MAX_L)
    )
)


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch explains each refusal
@pytest.mark.parametrize(
    ("dtype", "Dv", "Hkv", "strided", "mask_kind", "mask_grad", "dropout_p", "LS"),
    [c for c in GRID if not (c[5] and c[4] != "float")],
)
def test_check_agrees_with_torch_fused_dispatch(
    dtype, Dv, Hkv, strided, mask_kind, mask_grad, dropout_p, LS
) -> None:
    L, S = LS
    q, k, v, mask = _tensors(dtype, Dv, Hkv, strided, mask_kind, mask_grad, L, S)
    torch_fused = _torch_runs_fused(q, k, v, mask, dropout_p, backward=mask_grad)
    reason = SDPA.decide(
        make_call(q, k, v, mask, False, 0.25, dropout_p, False, where="test")
    ).reason
    assert (reason is None) == torch_fused, reason
    chosen = attnkit.explain(q, k, v, mask=mask, dropout_p=dropout_p).chosen
    assert chosen == ("sdpa" if torch_fused else "math")


def test_return_weights_is_never_sdpa() -> None:
    q = torch.randn(1, 2, 4, 8)
    assert "weights" in str(
        SDPA.decide(make_call(q, q, q, None, False, 1.0, 0.0, True, where="test")).reason
    )
    assert attnkit.explain(q, q, q, return_weights=True).chosen == "math"


def test_dense_and_causal_auto_take_the_fused_kernel() -> None:
    q = torch.randn(1, 8, 128, 64)
    assert attnkit.explain(q, q, q).chosen == "sdpa"
    assert attnkit.explain(q, q, q, causal=True).chosen == "sdpa"
    kv = torch.randn(1, 2, 200, 64)
    assert attnkit.explain(q, kv, kv, causal=True).chosen == "sdpa"  # GQA, end-aligned


def test_the_cuda_rule_asks_torch_which_kernel_it_would_run() -> None:
    """``cuda_fused_kernel`` is torch's own selection (``torch._fused_sdp_choice``), so torch's
    priority order and ``sdpa_kernel``'s settings hold. Shown on CPU tensors, where the same
    selection answers with the CPU's kernels (flash, or only math)."""
    from attnkit.backends.sdpa import cuda_fused_kernel

    q = torch.randn(1, 4, 8, 16)
    k = torch.randn(1, 2, 8, 16)
    assert cuda_fused_kernel(q, k, k, None, 0.0, True, True) == "flash"
    assert cuda_fused_kernel(q, q, q, None, 0.0, False, False) == "flash"
    with sdpa_kernel([SDPBackend.MATH]):
        assert cuda_fused_kernel(q, q, q, None, 0.0, False, False) is None
