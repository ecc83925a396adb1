"""Ways in from other libraries: ``torch.nn.MultiheadAttention`` (weights and masks)."""

from attnkit.interop.torch_mha import mask_from_torch

__all__ = ["mask_from_torch"]
