"""The input checks of the attention modules, and their messages; the call they make.

Dimension legend: B batch, L query length, S key length, E model width; H query heads, Hkv
key/value heads, Dk query/key head dim, Dv value head dim.
"""

from __future__ import annotations

import torch

from attnkit.call import AttentionCall
from attnkit.errors import (
    DTYPE_NAMES,
    DTYPES,
    AttentionInputError,
    check_int,
    dtype_error,
    rank_error,
    shape_str,
)
from attnkit.mask_checks import check_mask
from attnkit.masks import MaskSpec
from attnkit.validate import WHERE, check_qkv, check_scalars

__all__ = ["attention_call", "check_batch", "check_head_sizes", "check_input"]


def check_head_sizes(
    where: str,
    embed_dim: object,
    num_heads: object,
    num_kv_heads: object,
    head_dim: object,
    v_head_dim: object,
    *,
    dropout: object,
) -> tuple[int, int, int, int, int]:
    """A module's sizes ``(E, H, Hkv, Dk, Dv)``, defaults filled in, once each is a positive
    int, ``E`` splits into ``H`` heads (unless ``head_dim`` is given), ``Hkv`` divides ``H``
    and ``dropout`` is in ``[0, 1)``."""
    E = check_int(where, "embed_dim", embed_dim)
    H = check_int(where, "num_heads", num_heads)
    Hkv = check_int(where, "num_kv_heads", H if num_kv_heads is None else num_kv_heads)
    if head_dim is None and E % H != 0:
        divisors = [h for h in range(1, E + 1) if E % h == 0]
        raise AttentionInputError(
            where,
            "embed_dim",
            f"embed_dim={E} is not divisible by num_heads={H}.",
            got=f"embed_dim={E}  num_heads={H}",
            expected="embed_dim % num_heads == 0 (each head gets embed_dim // num_heads)",
            fix=f"choose num_heads from {divisors[-8:]}, or pass head_dim=... explicitly",
        )
    if H % Hkv != 0:
        raise AttentionInputError(
            where,
            "num_kv_heads",
            f"num_kv_heads={Hkv} does not divide num_heads={H}.",
            got=f"num_heads={H}  num_kv_heads={Hkv}",
            expected="num_heads % num_kv_heads == 0 (grouped-query attention)",
            fix="num_kv_heads=1 is multi-query; num_kv_heads=num_heads is plain multi-head",
        )
    if (
        isinstance(dropout, bool)
        or not isinstance(dropout, (int, float))
        or not (0.0 <= dropout < 1.0)
    ):
        raise AttentionInputError(
            where,
            "dropout",
            f"`dropout` must be in [0, 1), got {dropout!r}.",
            got=f"dropout={dropout!r}",
            expected="0 <= dropout < 1 (the probability of dropping an attention weight)",
            fix="dropout=0.0 turns it off",
        )
    Dk = check_int(where, "head_dim", E // H if head_dim is None else head_dim)
    Dv = check_int(where, "v_head_dim", Dk if v_head_dim is None else v_head_dim)
    return E, H, Hkv, Dk, Dv


def check_input(
    where: str,
    name: str,
    x: object,
    width: int,
    width_name: str,
    batch_first: bool,
    dtype: torch.dtype,
    device: torch.device | None = None,
) -> torch.Tensor:
    """``x`` if it is a 3-D input of width ``width`` and the parameters' ``dtype`` (and
    ``device``, when given).

    Under autocast a floating input of another dtype is fine (autocast casts it).
    """
    dims = ("B", "L", "E") if name == "query" else ("B", "S", "E")
    if not batch_first:
        dims = (dims[1], dims[0], dims[2])
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise rank_error(
            where,
            name,
            x,
            dims,
            expected=f"{name} ({', '.join(dims)}) with E={width}",
            fix="add a batch dim with x.unsqueeze(0)"
            if isinstance(x, torch.Tensor) and x.dim() == 2
            else "attention on 4-D heads is attnkit.attention(q, k, v)",
        )
    if x.shape[-1] != width:
        raise AttentionInputError(
            where,
            name,
            f"`{name}` has width {x.shape[-1]} but the module expects {width_name}={width}.",
            got=shape_str(name, x, dims),
            expected=f"{name}.shape[-1] == {width_name} == {width}",
            fix=f"build the module with {width_name}={x.shape[-1]}"
            if name != "query"
            else f"build the module with embed_dim={x.shape[-1]}",
        )
    if x.is_floating_point() or x.is_complex():  # float8, complex: not computed in
        got = f"{shape_str(name, x, dims)} dtype={x.dtype}  parameters: dtype={dtype}"
        error = dtype_error(where, name, x.dtype, got)
        if error is not None:
            raise error
    if dtype not in DTYPES:  # module.to(torch.float8_e4m3fn), module.to(torch.complex64)
        raise AttentionInputError(
            where,
            "dtype",
            f"the module's parameters are {dtype}, which attnkit does not compute in.",
            got=f"parameters: dtype={dtype}  {shape_str(name, x, dims)} dtype={x.dtype}",
            expected=f"parameters of dtype {DTYPE_NAMES}",
            fix="module.to(torch.bfloat16) (or float16, float32, float64); float8 weights are "
            "dequantized before use",
        )
    if x.dtype != dtype and not (
        x.is_floating_point() and torch.is_autocast_enabled(x.device.type)
    ):
        raise AttentionInputError(
            where,
            name,
            f"`{name}` has dtype {x.dtype} but the module's parameters are {dtype}; attnkit "
            "never casts silently.",
            got=f"{shape_str(name, x, dims)} dtype={x.dtype}  parameters: dtype={dtype}",
            expected=f"{name} of dtype {dtype}",
            fix=f"{name}.to({dtype}), or module.to({x.dtype})"
            if x.is_floating_point()
            else f"token ids go through an nn.Embedding first; numbers: {name}.to({dtype})",
        )
    if device is not None and x.device != device:
        raise AttentionInputError(
            where,
            name,
            f"`{name}` is on {x.device} but the module's parameters are on {device}.",
            got=f"{shape_str(name, x, dims)} on {x.device}  parameters: on {device}",
            expected=f"{name} on {device}",
            fix=f"{name}.to({str(device)!r}), or module.to({str(x.device)!r})",
        )
    return x


def check_batch(
    where: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch_first: bool
) -> None:
    """``query``, ``key`` and ``value`` as the caller passed them (``(B, L, E)``, or
    ``(L, B, E)`` when not ``batch_first``) agree on B, and ``key`` and ``value`` on S."""
    b, s = (0, 1) if batch_first else (1, 0)

    def agree(b: int, s: int) -> bool:
        B = query.shape[b]
        return key.shape[b] == B and value.shape[b] == B and value.shape[s] == key.shape[s]

    if agree(b, s):
        return
    names = {"query": ("B", "L", "E"), "key": ("B", "S", "E"), "value": ("B", "S", "E")}
    if not batch_first:
        names = {n: (d[1], d[0], d[2]) for n, d in names.items()}
    other_layout = agree(s, b)  # read the other way, all three agree
    if other_layout and batch_first:
        fix = "these look like (seq, batch, embed) tensors: pass batch_first=False or "
        fix += "x.transpose(0, 1)"
    elif other_layout:
        fix = "these look like (batch, seq, embed) tensors, and this module was built with "
        fix += "batch_first=False: build it with batch_first=True, or pass x.transpose(0, 1)"
    else:
        fix = "key and value must come from the same sequence"
    raise AttentionInputError(
        where,
        "key" if key.shape[b] != query.shape[b] else "value",
        "query, key and value disagree on batch or key length.",
        got="  ".join(
            shape_str(n, t, names[n]) for n, t in zip(names, (query, key, value), strict=True)
        ),
        expected="the same B in all three, the same S in key and value",
        fix=fix,
    )


def attention_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | MaskSpec | None,
    causal: bool,
    dropout_p: float,
    need_weights: bool,
    sinks: torch.Tensor | None = None,
) -> AttentionCall:
    """The call a module makes of its heads ``q (B, H, L, Dk)``, ``k (B, Hkv, S, Dk)``,
    ``v (B, Hkv, S, Dv)`` and its merged mask in attnkit's convention: the checks
    :func:`attnkit.attention` runs, errors named as its, but the inverted-causal-mask warning
    (:func:`~attnkit.modules.masking.module_mask` gave it, in the convention of the argument
    the mask came as); then :meth:`AttentionCall.build`. ``sinks`` were checked by
    :func:`~attnkit.modules.sinks.module_sinks`, in the module's name."""
    dims = check_qkv(q, k, v, where=WHERE)
    check_mask(mask, q, dims, where=WHERE)
    check_scalars(
        dims, where=WHERE, causal=causal, dropout_p=dropout_p, return_weights=need_weights
    )
    return AttentionCall.build(
        q=q, k=k, v=v, dims=dims, where=WHERE, mask=mask, causal=causal, dropout_p=dropout_p,
        return_weights=need_weights, sinks=sinks,
    )  # fmt: skip
