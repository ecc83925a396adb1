"""attnkit: self-attention for PyTorch that is correct, fast, and easy to look inside.

One function, :func:`attention`, with one convention (see its docstring and the README):
``q (B, H, L, Dk)``, ``k (B, Hkv, S, Dk)``, ``v (B, Hkv, S, Dv)`` -> ``(B, H, L, Dv)``;
bool masks say True = may attend; ``causal`` is aligned to the end when ``L != S``.
"""

from attnkit.backends import available_backends, register_backend, unregister_backend
from attnkit.call import AttentionCall
from attnkit.errors import AttentionInputError, AttentionMaskWarning
from attnkit.explain import Explanation, explain
from attnkit.functional import AttentionOutput, attention
from attnkit.heads import merge_heads, split_heads
from attnkit.inspect.tracing import Trace, trace
from attnkit.masks import causal_mask
from attnkit.memory import AttentionMemoryError, set_memory_limit
from attnkit.modules import CrossAttention, MultiHeadAttention, SelfAttention
from attnkit.modules.kv_cache import KVCache

__version__ = "0.1.0"

__all__ = [
    "AttentionCall",
    "AttentionInputError",
    "AttentionMaskWarning",
    "AttentionMemoryError",
    "AttentionOutput",
    "CrossAttention",
    "Explanation",
    "KVCache",
    "MultiHeadAttention",
    "SelfAttention",
    "Trace",
    "attention",
    "available_backends",
    "causal_mask",
    "explain",
    "merge_heads",
    "register_backend",
    "set_memory_limit",
    "split_heads",
    "trace",
    "unregister_backend",
]

#: subpackages a user reaches as ``attnkit.<name>`` after ``import attnkit`` alone (imported on
#: first use: ``interop`` and ``models`` pull in more than the core needs)
_SUBPACKAGES = ("bench", "distributed", "inspect", "interop", "masks", "models", "train")


def __getattr__(name: str) -> object:
    if name in _SUBPACKAGES:
        import importlib

        return importlib.import_module(f"attnkit.{name}")
    raise AttributeError(f"module 'attnkit' has no attribute {name!r}")
