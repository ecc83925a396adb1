"""The transformer layer of attnkit: self-attention, optional cross-attention, MLP, LayerNorms.

Dimension legend: B batch, L query length (tokens of ``x``), S context length (cross-attention),
E model width (``dim``), H heads, F MLP hidden width (``ffn_dim``).

One layer serves every architecture; the config says which:

    post-norm (BERT)             pre-norm (GPT-2)
    h = LN(x + attn(x))          h = x + attn(LN(x))
    h = LN(h + cross(h, c))      h = h + cross(LN(h), c)    (only with cross_attention=True)
    y = LN(h + mlp(h))           y = h + mlp(LN(h))         (a pre-norm stack ends with one LN)

Every attention call goes through :class:`attnkit.MultiHeadAttention` /
:class:`attnkit.CrossAttention`, hence through :func:`attnkit.attention`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import nn

from attnkit.errors import AttentionInputError, check_int
from attnkit.masks import MaskSpec
from attnkit.modules.attention import CrossAttention, MultiHeadAttention
from attnkit.modules.kv_cache import KVCache

__all__ = [
    "MLP",
    "LayerOutput",
    "TransformerConfig",
    "TransformerLayer",
    "TransformerOutput",
    "TransformerStack",
]

Activation = Literal["gelu", "gelu_tanh", "relu"]
_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "gelu": nn.GELU,  # exact, with erf (BERT's "gelu")
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),  # GPT-2's "gelu_new"
    "relu": nn.ReLU,
}


def _bad(name: str, problem: str, value: object, expected: str) -> AttentionInputError:
    return AttentionInputError(
        "attnkit.TransformerConfig", name, problem, got=f"{name}={value!r}", expected=expected
    )


@dataclass(frozen=True)
class TransformerConfig:
    """The settings of one :class:`TransformerLayer` (and of a :class:`TransformerStack`).

    >>> TransformerConfig(dim=384, num_heads=12).ffn_width
    1536
    """

    dim: int  # E, model width
    num_heads: int  # H, attention heads (dim % num_heads == 0)
    ffn_dim: int | None = None  # F, MLP hidden width; None = 4 * dim
    activation: Activation = "gelu"  # MLP activation: exact gelu, gelu_tanh or relu
    norm_eps: float = 1e-5  # LayerNorm epsilon (BERT uses 1e-12)
    norm_first: bool = False  # True: pre-norm (GPT-2); False: post-norm (BERT)
    dropout: float = 0.0  # on each residual branch, in training mode
    attn_dropout: float = 0.0  # on the attention weights, in training mode
    bias: bool = True  # biases in the projections, the MLP and the LayerNorms
    causal: bool = False  # self-attention sees only earlier tokens (a decoder)
    cross_attention: bool = False  # add a cross-attention block over a `context`
    context_dim: int | None = None  # width of the context; None = dim
    backend: str = "auto"  # passed to attnkit.attention
    attention_sinks: bool = False  # a learned sink per head in self-attention (gpt-oss)

    def __post_init__(self) -> None:
        for name in ("dim", "num_heads", "ffn_dim", "context_dim"):
            value = getattr(self, name)
            if value is not None or name in ("dim", "num_heads"):  # the others may be None
                check_int("attnkit.TransformerConfig", name, value)
        if self.activation not in _ACTIVATIONS:
            raise _bad(
                "activation",
                f"unknown activation {self.activation!r}.",
                self.activation,
                f"one of {sorted(_ACTIVATIONS)}",
            )
        if not self.norm_eps > 0:
            raise _bad("norm_eps", "`norm_eps` must be > 0.", self.norm_eps, "a float > 0")
        for name in ("dropout", "attn_dropout"):
            p = getattr(self, name)
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
                raise _bad(name, f"`{name}` must be in [0, 1).", p, "0 <= p < 1")
        if self.context_dim is not None and not self.cross_attention:
            raise _bad(
                "context_dim",
                "`context_dim` is set but there is no cross-attention.",
                self.context_dim,
                "context_dim=None, or cross_attention=True",
            )

    @property
    def ffn_width(self) -> int:
        """``F``: ``ffn_dim``, or ``4 * dim`` when it is not set."""
        return 4 * self.dim if self.ffn_dim is None else self.ffn_dim


class LayerOutput(NamedTuple):
    """What :class:`TransformerLayer` returns; unpacks as ``hidden, weights, cross_weights``.

    ``hidden`` is ``(B, L, E)``; ``weights`` the self-attention weights ``(B, H, L, L)`` and
    ``cross_weights`` the cross-attention weights ``(B, H, L, S)``, when asked, else ``None``.
    """

    hidden: torch.Tensor
    weights: torch.Tensor | None
    cross_weights: torch.Tensor | None


class TransformerOutput(NamedTuple):
    """What :class:`TransformerStack` (and the models built on it) return.

    ``last_hidden_state (B, L, E)``; ``hidden_states``: the input to the first layer, then each
    layer's output (``N + 1`` tensors ``(B, L, E)``; as in Hugging Face, the last one is
    ``last_hidden_state``, after a pre-norm stack's final LayerNorm), when asked;
    ``attentions``: each layer's self-attention weights ``(B, H, L, L)``, when asked.
    """

    last_hidden_state: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...] | None
    attentions: tuple[torch.Tensor, ...] | None


class MLP(nn.Module):
    """``(B, L, E) -> (B, L, F) -> activation -> (B, L, E)``.

    >>> MLP(TransformerConfig(dim=8, num_heads=2))(torch.randn(2, 3, 8)).shape
    torch.Size([2, 3, 8])
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(config.dim, config.ffn_width, bias=config.bias)
        self.act = _ACTIVATIONS[config.activation]()
        self.fc_out = nn.Linear(config.ffn_width, config.dim, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc_out(self.act(self.fc_in(x)))  # (B, L, F) -> (B, L, E)
        return out


class TransformerLayer(nn.Module):
    """Self-attention, optional cross-attention and an MLP, each with a residual and LayerNorm.

    ``forward(x, *, key_padding_mask=None, attention_mask=None, mask=None, context=None,
    context_padding_mask=None, context_attention_mask=None, need_weights=False,
    kv_cache=None)``:

    - ``x (B, L, E)``.
    - ``key_padding_mask`` ``(B, L)`` as in torch, bool **True = padding** (or float added);
      or its positive twin ``attention_mask`` ``(B, L)``, bool or 0/1 ints, **True/1 = a real
      token** (as in Hugging Face). Padded keys are not attended to; padded query rows still
      get an output, as in BERT. A batch row that is all padding gets attention output 0,
      and the other rows are unaffected.
    - ``mask``: an extra self-attention mask in attnkit's convention (bool, True = may
      attend, or float added), broadcastable to ``(B, H, L, L)``, or a mask spec such as
      ``alibi(H)``; combined with ``config.causal``.
    - ``context (B, S, context_dim)``, with ``context_padding_mask`` ``(B, S)`` (True =
      padding) or ``context_attention_mask`` ``(B, S)`` (True/1 = a real token): the
      cross-attention input; required exactly when ``config.cross_attention``.
    - ``need_weights``: also return the attention weights (``(B, H, L, L)`` and, with
      cross-attention, ``(B, H, L, S)``).
    - ``kv_cache``: a :class:`~attnkit.KVCache` for incremental decoding; ``x`` holds the new
      tokens only and self-attention sees every cached token (see
      :class:`~attnkit.MultiHeadAttention`; the weights are then ``(B, H, L, S)``).

    With ``config.attention_sinks`` the self-attention has learned sinks (``attn.sinks``
    ``(H,)``, ``state_dict`` key ``attn.sinks``; see :class:`~attnkit.MultiHeadAttention`);
    the cross-attention has none.

    Returns a :class:`LayerOutput` ``(hidden (B, L, E), weights, cross_weights)``.

    >>> layer = TransformerLayer(TransformerConfig(dim=16, num_heads=4, norm_first=True))
    >>> out = layer(torch.randn(2, 5, 16), need_weights=True)
    >>> out.hidden.shape, out.weights.shape
    (torch.Size([2, 5, 16]), torch.Size([2, 4, 5, 5]))
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.attn = MultiHeadAttention(
            c.dim,
            c.num_heads,
            bias=c.bias,
            dropout=c.attn_dropout,
            causal=c.causal,
            backend=c.backend,
            sinks=c.attention_sinks,
        )
        self.attn_norm = nn.LayerNorm(c.dim, eps=c.norm_eps, bias=c.bias)
        self.cross_attn: CrossAttention | None = None
        self.cross_norm: nn.LayerNorm | None = None
        if c.cross_attention:
            self.cross_attn = CrossAttention(
                c.dim,
                c.num_heads,
                context_dim=c.context_dim,
                bias=c.bias,
                dropout=c.attn_dropout,
                backend=c.backend,
            )
            self.cross_norm = nn.LayerNorm(c.dim, eps=c.norm_eps, bias=c.bias)
        self.mlp = MLP(c)
        self.mlp_norm = nn.LayerNorm(c.dim, eps=c.norm_eps, bias=c.bias)
        self.dropout = nn.Dropout(c.dropout)

    def forward(
        self,
        x: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        mask: torch.Tensor | MaskSpec | None = None,
        context: torch.Tensor | None = None,
        context_padding_mask: torch.Tensor | None = None,
        context_attention_mask: torch.Tensor | None = None,
        need_weights: bool = False,
        kv_cache: KVCache | None = None,
    ) -> LayerOutput:
        self._check_context(context, context_padding_mask, context_attention_mask)
        a = self.attn(
            self._norm_in(x, self.attn_norm),
            mask=mask,
            key_padding_mask=key_padding_mask,
            attention_mask=attention_mask,
            need_weights=need_weights,
            kv_cache=kv_cache,
        )
        h = self._add(x, a.output, self.attn_norm)  # (B, L, E)
        cross_weights = None
        if self.cross_attn is not None and self.cross_norm is not None and context is not None:
            c = self.cross_attn(
                self._norm_in(h, self.cross_norm),
                context,
                key_padding_mask=context_padding_mask,
                attention_mask=context_attention_mask,
                need_weights=need_weights,
            )
            h = self._add(h, c.output, self.cross_norm)  # (B, L, E)
            cross_weights = c.weights
        h = self._add(h, self.mlp(self._norm_in(h, self.mlp_norm)), self.mlp_norm)  # (B, L, E)
        return LayerOutput(h, a.weights, cross_weights)

    def _norm_in(self, x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
        """A block's input: ``norm(x)`` in a pre-norm layer, ``x`` in a post-norm one."""
        return norm(x) if self.config.norm_first else x

    def _add(self, x: torch.Tensor, out: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
        """The residual: ``x + out`` (pre-norm) or ``norm(x + out)`` (post-norm)."""
        h: torch.Tensor = x + self.dropout(out)
        return h if self.config.norm_first else norm(h)

    def _check_context(
        self,
        context: torch.Tensor | None,
        padding: torch.Tensor | None,
        real: torch.Tensor | None,
    ) -> None:
        where = "attnkit.TransformerLayer"
        if self.config.cross_attention and context is None:
            raise AttentionInputError(
                where,
                "context",
                "this layer has cross-attention, so it needs a `context`.",
                got="context=None",
                expected="context (B, S, context_dim)",
                fix="pass context=encoder_output, or build the layer with cross_attention=False",
            )
        given = [
            name
            for name, t in (
                ("context", context),
                ("context_padding_mask", padding),
                ("context_attention_mask", real),
            )
            if t is not None
        ]
        if not self.config.cross_attention and given:
            name = given[0]
            raise AttentionInputError(
                where,
                name,
                f"`{name}` was given but this layer has no cross-attention.",
                got=f"{name} given, config.cross_attention=False",
                expected=f"{name}=None",
                fix="build the layer with TransformerConfig(..., cross_attention=True)",
            )


class TransformerStack(nn.Module):
    """``num_layers`` :class:`TransformerLayer` s, and a final LayerNorm when pre-norm.

    A post-norm stack (BERT) ends normalised already; a pre-norm stack (GPT-2) ends with one
    LayerNorm (``final_norm``; an ``nn.Identity`` for post-norm). The same masks as
    :class:`TransformerLayer` go to every layer.

    ``forward(x, *, key_padding_mask=None, attention_mask=None, mask=None, context=None,
    context_padding_mask=None, context_attention_mask=None, need_weights=False,
    output_hidden_states=False, kv_cache=None)`` returns a
    :class:`TransformerOutput` ``(last_hidden_state (B, L, E), hidden_states, attentions)``;
    ``kv_cache`` is one :class:`~attnkit.KVCache` per layer.

    >>> stack = TransformerStack(TransformerConfig(dim=16, num_heads=4), num_layers=3)
    >>> out = stack(torch.randn(2, 5, 16), need_weights=True, output_hidden_states=True)
    >>> len(out.hidden_states), len(out.attentions), out.attentions[0].shape
    (4, 3, torch.Size([2, 4, 5, 5]))
    """

    def __init__(self, config: TransformerConfig, num_layers: int) -> None:
        super().__init__()
        check_int("attnkit.TransformerStack", "num_layers", num_layers, minimum=0)
        self.config = config
        self.layers = nn.ModuleList(TransformerLayer(config) for _ in range(num_layers))
        self.final_norm: nn.Module = (
            nn.LayerNorm(config.dim, eps=config.norm_eps, bias=config.bias)
            if config.norm_first
            else nn.Identity()
        )

    def forward(
        self,
        x: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        mask: torch.Tensor | MaskSpec | None = None,
        context: torch.Tensor | None = None,
        context_padding_mask: torch.Tensor | None = None,
        context_attention_mask: torch.Tensor | None = None,
        need_weights: bool = False,
        output_hidden_states: bool = False,
        kv_cache: Sequence[KVCache] | None = None,
    ) -> TransformerOutput:
        if kv_cache is not None and len(kv_cache) != len(self.layers):
            raise AttentionInputError(
                "attnkit.TransformerStack",
                "kv_cache",
                "`kv_cache` needs one KVCache per layer.",
                got=f"{len(kv_cache)} caches for {len(self.layers)} layers",
                expected=f"a sequence of {len(self.layers)} KVCache",
            )
        hidden_states = [x]
        attentions = []
        for i, layer in enumerate(self.layers):
            x, weights, _ = layer(
                x,
                key_padding_mask=key_padding_mask,
                attention_mask=attention_mask,
                mask=mask,
                context=context,
                context_padding_mask=context_padding_mask,
                context_attention_mask=context_attention_mask,
                need_weights=need_weights,
                kv_cache=None if kv_cache is None else kv_cache[i],
            )
            hidden_states.append(x)
            if weights is not None:
                attentions.append(weights)
        x = self.final_norm(x)  # (B, L, E)
        hidden_states[-1] = x
        return TransformerOutput(
            x,
            tuple(hidden_states) if output_hidden_states else None,
            tuple(attentions) if need_weights else None,
        )
