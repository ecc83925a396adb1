"""Ways in from other libraries: ``torch.nn.MultiheadAttention`` (weights, masks and its call:
:class:`TorchMultiheadAttention`), and Hugging Face ``transformers``: :func:`from_hf` copies a
GPT-2 or BERT into attnkit's own models, :func:`register_hf` makes attnkit an
``attn_implementation`` of any transformers model, and :func:`use_by_default` makes it
the one models get when they are loaded without naming one. Importing this package never imports
transformers (``register_hf`` does, when called)."""

from attnkit.interop.hf import from_hf
from attnkit.interop.hf_attention import register_hf
from attnkit.interop.hf_default import use_by_default
from attnkit.interop.torch_mha import TorchMultiheadAttention, mask_from_torch

__all__ = ["TorchMultiheadAttention", "from_hf", "mask_from_torch", "register_hf", "use_by_default"]
