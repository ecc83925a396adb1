"""Ways in from other libraries: ``torch.nn.MultiheadAttention`` (weights, masks and its call:
:class:`TorchMultiheadAttention`), and Hugging Face ``transformers`` models (:func:`from_hf`;
transformers is never imported here)."""

from attnkit.interop.hf import from_hf
from attnkit.interop.torch_mha import TorchMultiheadAttention, mask_from_torch

__all__ = ["TorchMultiheadAttention", "from_hf", "mask_from_torch"]
