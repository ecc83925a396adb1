"""A GPT-2-style decoder built from attnkit's one transformer layer, with KV-cache generation.

Dimension legend: B batch, T tokens (of this call), E model width, H heads, V vocabulary size,
P max positions, N new tokens.

The model is token + learned position embeddings, a pre-norm causal
:class:`~attnkit.modules.transformer.TransformerStack` (GELU-tanh MLP; the stack ends with the
final LayerNorm), and an LM head, tied to the token embeddings by default. Every attention call
goes through :func:`attnkit.attention`. :func:`attnkit.interop.from_hf` loads a Hugging Face
``GPT2LMHeadModel``'s weights into it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from attnkit.configs import derive_config
from attnkit.errors import AttentionInputError, check_int, shape_str
from attnkit.models.generate_args import Backend, check_compile_args, check_generate_args
from attnkit.models.token_ids import check_token_ids
from attnkit.modules.kv_cache import KVCache
from attnkit.modules.masking import check_zero_one
from attnkit.modules.positions import LearnedPositions
from attnkit.modules.transformer import Activation, TransformerConfig, TransformerStack

__all__ = ["GPT", "GPTConfig"]

WHERE = "attnkit.models.GPT"


@dataclass(frozen=True)
class GPTConfig:
    """The shape of a :class:`GPT`. The defaults are a small model (51M parameters, tied) with
    GPT-2's vocabulary and head size, at 2/3 of its width and depth.

    >>> GPTConfig().transformer_config().norm_first
    True
    """

    vocab_size: int = 50257  # V, GPT-2's BPE vocabulary
    max_positions: int = 1024  # P, the longest sequence (prompt + generated tokens)
    dim: int = 512  # E, model width
    num_layers: int = 8  # transformer layers
    num_heads: int = 8  # H (dim % num_heads == 0); head dim 64, as GPT-2's
    ffn_dim: int | None = None  # MLP hidden width; None = 4 * dim
    activation: Activation = "gelu_tanh"  # GPT-2's "gelu_new"
    norm_eps: float = 1e-5  # LayerNorm epsilon
    embed_dropout: float = 0.0  # on the embeddings, in training mode
    dropout: float = 0.0  # on each residual branch, in training mode
    attn_dropout: float = 0.0  # on the attention weights, in training mode
    tie_embeddings: bool = True  # the LM head shares the token embedding matrix
    backend: str = "auto"  # passed to attnkit.attention
    attention_sinks: bool = False  # a learned sink per head in every layer (gpt-oss)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_positions", "num_layers"):
            check_int("attnkit.models.GPTConfig", name, getattr(self, name))
        self.transformer_config()  # validates the layer's fields

    def transformer_config(self) -> TransformerConfig:
        """One decoder layer: the fields it shares with this config, pre-norm, causal, biases
        everywhere."""
        return derive_config(TransformerConfig, self, norm_first=True, causal=True)


class GPT(nn.Module):
    """A GPT-2-style language model: ``input_ids (B, T) -> logits (B, T, V)``.

    ``forward(input_ids, *, attention_mask=None, kv_cache=None)``:

    - ``input_ids (B, T)`` integer token ids.
    - ``attention_mask (B, T)`` bool or 0/1, **1/True = a real token** (Hugging Face's
      convention). Without a cache, padding may be on the left or the right: padded keys are
      not attended to and positions count real tokens only (``cumsum - 1``, as Hugging Face's
      ``generate``). With a cache it must be right padding (each row ``1..1 0..0``): the
      cache then keeps each sequence's real tokens only.
    - ``kv_cache``: one :class:`~attnkit.KVCache` per layer (:meth:`new_cache`). ``input_ids``
      are then the *new* tokens; each sequence continues at its cached length.

    :meth:`generate` decodes greedily by default, with the cache; ``generate(...,
    compile=True)`` compiles its decode step over a static-shape cache (``new_cache(...,
    static=True)``), which compiles once instead of at every step.

    >>> model = GPT(GPTConfig(vocab_size=100, max_positions=32, dim=32, num_layers=2,
    ...                       num_heads=4)).eval()
    >>> model(torch.tensor([[1, 2, 3]])).shape
    torch.Size([1, 3, 100])
    >>> model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4).shape
    torch.Size([1, 7])
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        E = config.dim
        self.tok_emb = nn.Embedding(config.vocab_size, E)
        self.pos_emb = LearnedPositions(config.max_positions, E)
        self.drop = nn.Dropout(config.embed_dropout)
        self.stack = TransformerStack(config.transformer_config(), config.num_layers)
        self.lm_head = nn.Linear(E, config.vocab_size, bias=False)
        self.apply(_init_weights)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def new_cache(
        self, batch_size: int, max_len: int | None = None, *, static: bool = False
    ) -> list[KVCache]:
        """One empty :class:`~attnkit.KVCache` per layer, on the model's dtype and device.

        ``max_len`` defaults to ``max_positions``; ``static=True`` builds static-shape caches
        (for a compiled decode step, as :meth:`generate` with ``compile`` uses).
        """
        c = self.config
        w = self.tok_emb.weight
        return [
            KVCache(
                batch_size,
                c.num_heads,
                c.max_positions if max_len is None else max_len,
                c.dim // c.num_heads,
                dtype=w.dtype,
                device=w.device,
                static=static,
            )
            for _ in range(c.num_layers)
        ]

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        kv_cache: Sequence[KVCache] | None = None,
    ) -> torch.Tensor:
        h = self.hidden(input_ids, attention_mask=attention_mask, kv_cache=kv_cache)
        logits: torch.Tensor = self.lm_head(h)  # (B, T, V)
        return logits

    def hidden(
        self,
        input_ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        kv_cache: Sequence[KVCache] | None = None,
    ) -> torch.Tensor:
        """The final hidden states ``(B, T, E)`` (after the last LayerNorm, before the head)."""
        real = self._check(input_ids, attention_mask, kv_cache)  # (B, T) bool or None
        T = input_ids.shape[1]
        steps = torch.arange(T, device=input_ids.device)  # (T,)
        keys_real = None  # (B, T), True = a real token; with a cache, the cache's lengths
        start: int | torch.Tensor = 0
        if kv_cache is None:
            positions = steps[None] if real is None else (real.long().cumsum(1) - 1).clamp(min=0)
            keys_real = real
        else:
            start = kv_cache[0].next_pos()  # int, or (B,) for a ragged batch
            positions = (
                start[:, None] + steps if isinstance(start, torch.Tensor) else steps[None] + start
            )
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(positions))  # (B, T, E)
        h: torch.Tensor = self.stack(
            x, attention_mask=keys_real, kv_cache=kv_cache
        ).last_hidden_state  # (B, T, E)
        if kv_cache is not None and real is not None:  # keep each sequence's real tokens
            for cache in kv_cache:
                cache.truncate(start + real.sum(dim=1))
        return h

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        *,
        use_cache: bool = True,
        temperature: float = 0.0,
        top_k: int | None = None,
        attention_mask: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        compile: bool | Backend = False,
        static_cache: bool | None = None,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` tokens to each prompt: ``(B, T) -> (B, T + N)``.

        Greedy (``temperature=0``) by default; ``temperature > 0`` samples from
        ``softmax(logits / temperature)``, restricted to the ``top_k`` likeliest tokens when
        given (``generator`` seeds the sampling). ``use_cache=True`` feeds each new token
        alone against a :class:`~attnkit.KVCache`; ``False`` recomputes the whole sequence at
        every step (same tokens, slower). Call ``.eval()`` first: dropout is not switched off.

        Prompts of different lengths: pass ``attention_mask (B, T)`` (1/True = a real token)
        with **left or right padding**; each sequence continues right after its own last real
        token. The result is ``input_ids`` as given (padding where it was) followed by the
        ``N`` new tokens of each sequence.

        Compiled decoding: ``compile=True`` runs each decode step (one token per sequence
        against the cache) through ``torch.compile(fullgraph=True)`` with its default backend
        (inductor), ``compile="aot_eager"`` (any ``torch.compile`` backend, a name or a
        callable) with that one. The step then uses a static-shape cache
        (``KVCache(..., static=True)``: the whole buffer, masked by each sequence's length),
        so the step compiles once and no later step recompiles; the prompt runs eagerly. A
        later call with another prompt length or ``max_new_tokens`` (another buffer length)
        compiles once more, with symbolic sizes. ``static_cache=True`` uses the static cache
        without compiling (``None``, the default: when compiling). Greedy tokens are the
        same as without ``compile``.
        """
        where = f"{WHERE}.generate"
        check_generate_args(where, max_new_tokens, temperature, top_k)
        backend, static = check_compile_args(where, compile, static_cache, use_cache)
        real = self._check(input_ids, attention_mask, None, where=where)
        n, first = self._prompt_runs(where, input_ids, real, max_new_tokens)
        B, T = input_ids.shape
        N = max_new_tokens
        dev = input_ids.device
        new = torch.zeros(B, N, dtype=torch.long, device=dev)
        if N == 0:
            return torch.cat([input_ids, new], dim=1)
        # each prompt moved to the start of its row (right padding): (B, T + N)
        steps = torch.arange(T, device=dev)
        tokens = torch.zeros(B, T + N, dtype=torch.long, device=dev)
        moved = input_ids.gather(1, (first[:, None] + steps).clamp(max=T - 1))  # (B, T)
        tokens[:, :T] = torch.where(steps < n[:, None], moved, 0)
        pick = partial(_pick, temperature=temperature, top_k=top_k, generator=generator)
        if use_cache:
            self._decode_cached(tokens, n, new, pick, static, backend)
        else:
            self._decode_full(tokens, n, new, pick)
        return torch.cat([input_ids, new], dim=1)

    def _prompt_runs(
        self, where: str, input_ids: torch.Tensor, real: torch.Tensor | None, N: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each prompt's length and start ``(B,)``, checked: at least one prompt, each one run
        of real tokens, and room for ``N`` new tokens in the model's positions."""
        B, T = input_ids.shape
        if B == 0 or T == 0:
            raise AttentionInputError(
                where,
                "input_ids",
                "there is no prompt to continue: generate() needs at least one sequence of "
                "at least one token.",
                got=shape_str("input_ids", input_ids, ("B", "T")),
                expected="input_ids (B >= 1, T >= 1)",
                fix="start each sequence with a token (a BOS id, if the model has one)",
            )
        dev = input_ids.device
        if real is None:
            real = torch.ones(B, T, dtype=torch.bool, device=dev)
        n = real.sum(dim=1)  # (B,) prompt lengths
        first = real.long().argmax(dim=1)  # (B,) where each prompt starts
        steps = torch.arange(T, device=dev)
        inside = (steps >= first[:, None]) & (steps < (first + n)[:, None])  # (B, T)
        if bool((n == 0).any()) or not torch.equal(inside, real):
            raise AttentionInputError(
                where,
                "attention_mask",
                "each prompt must be one run of real tokens, padded on the left or the right.",
                got=f"attention_mask rows {real.int().tolist()[:4]}",
                expected="rows like 0 0 1 1 1 (left padding) or 1 1 1 0 0 (right padding), "
                "with at least one 1",
            )
        longest = int(n.max())
        if longest + N - 1 > self.config.max_positions:
            raise AttentionInputError(
                where,
                "max_new_tokens",
                f"a prompt of {longest} tokens and {N} new tokens need "
                f"{longest + N - 1} positions; the model has {self.config.max_positions}.",
                got=f"{shape_str('input_ids', input_ids, ('B', 'T'))}  max_new_tokens={N}",
                expected=f"longest prompt + max_new_tokens - 1 <= {self.config.max_positions}",
                fix="shorten the prompt or ask for fewer tokens",
            )
        return n, first

    def _decode_cached(
        self,
        tokens: torch.Tensor,
        n: torch.Tensor,
        new: torch.Tensor,
        pick: Callable[[torch.Tensor], torch.Tensor],
        static: bool = False,
        backend: Backend | None = None,
    ) -> None:
        """Fill ``new (B, N)``: the right-padded prompts ``tokens[:, :max(n)]`` once into a
        KV cache, then each new token alone against it (a compiled step with ``backend``)."""
        B, N = new.shape
        longest = int(n.max())
        ragged = bool((n != longest).any())
        rows = torch.arange(B, device=tokens.device)
        steps = torch.arange(longest, device=tokens.device)
        cache = self.new_cache(B, max_len=longest + N - 1, static=static)
        right = steps < n[:, None] if ragged else None  # (B, longest)
        prompts = tokens[:, :longest]  # (B, longest): right-padded prompts
        h = self.hidden(prompts, attention_mask=right, kv_cache=cache)  # (B, longest, E)
        logits = self.lm_head(h[rows, n - 1])  # (B, V): after each prompt's last real token
        step = self._decode_step
        if backend is not None:
            step = torch.compile(step, fullgraph=True, backend=backend)
        for i in range(N):
            token = pick(logits)  # (B,)
            new[:, i] = token
            if i < N - 1:
                logits = step(token[:, None], cache)

    def _decode_step(self, token: torch.Tensor, cache: Sequence[KVCache]) -> torch.Tensor:
        """The logits ``(B, V)`` after ``token (B, 1)``, one new token per sequence, written
        to ``cache`` (what :meth:`generate` compiles)."""
        logits: torch.Tensor = self.lm_head(self.hidden(token, kv_cache=cache)[:, -1])
        return logits

    def _decode_full(
        self,
        tokens: torch.Tensor,
        n: torch.Tensor,
        new: torch.Tensor,
        pick: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """Fill ``new (B, N)`` recomputing the whole sequence at every step; ``tokens`` holds
        the right-padded prompts and gets each new token after its row's last one."""
        B, N = new.shape
        ragged = bool((n != n.max()).any())
        rows = torch.arange(B, device=tokens.device)
        length = n.clone()  # (B,)
        for i in range(N):
            width = int(length.max())
            right = torch.arange(width, device=tokens.device) < length[:, None]  # (B, width)
            h = self.hidden(tokens[:, :width], attention_mask=right if ragged else None)
            new[:, i] = pick(self.lm_head(h[rows, length - 1]))
            tokens[rows, length] = new[:, i]
            length += 1

    def _check(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        kv_cache: Sequence[KVCache] | None,
        where: str = WHERE,
    ) -> torch.Tensor | None:
        """Validate; return the mask as bool ``(B, T)`` (True = real) or ``None``."""
        check_token_ids(where, input_ids, self.config.vocab_size)
        if attention_mask is None:
            return None
        if (
            not isinstance(attention_mask, torch.Tensor)
            or attention_mask.shape != input_ids.shape
            or attention_mask.is_floating_point()
        ):
            got = (
                f"{shape_str('attention_mask', attention_mask, ('B', 'T'))} "
                f"dtype={attention_mask.dtype}"
                if isinstance(attention_mask, torch.Tensor)
                else f"attention_mask: {type(attention_mask).__name__}"
            )
            raise AttentionInputError(
                where,
                "attention_mask",
                "`attention_mask` must be bool or 0/1 integers shaped like input_ids.",
                got=f"{got}  {shape_str('input_ids', input_ids, ('B', 'T'))}",
                expected="attention_mask (B, T), 1/True = a real token",
            )
        check_zero_one(where, "attention_mask", attention_mask, ("B", "T"), "token")
        real = attention_mask != 0
        if kv_cache is not None:
            n = real.sum(dim=1, keepdim=True)
            if not torch.equal(real, torch.arange(real.shape[1], device=real.device) < n):
                raise AttentionInputError(
                    where,
                    "attention_mask",
                    "with a kv_cache, the new tokens must be right-padded (1..1 0..0).",
                    got=f"attention_mask rows {real.int().tolist()[:4]}",
                    expected="each row: its real tokens first, then padding",
                    fix="generate() accepts left padding and re-aligns it",
                )
        return real


def _pick(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> torch.Tensor:
    """The next token per sequence from ``logits (B, V)``: argmax, or a sample."""
    if temperature == 0:
        return logits.argmax(dim=-1)  # (B,)
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)  # (B, V)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def _init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation: normal(0, 0.02) weights, zero biases, unit LayerNorms."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
