"""The boundary with ``torch.nn.MultiheadAttention``, re-exported from :mod:`attnkit.modules`.

torch's masks say True = *ignore*; attnkit's say True = *may attend*. The translation,
:func:`mask_from_torch`, lives beside the modules' masks (:mod:`attnkit.modules.torch_masks`);
:class:`TorchMultiheadAttention` (what ``MultiHeadAttention.from_torch`` returns: torch's call,
torch's results) and the weights both ways (:func:`from_torch`, :func:`to_torch`) live with
the modules (:mod:`attnkit.modules.attention`). Here they keep their ``attnkit.interop`` names;
the modules never import this package.
"""

from attnkit.modules.attention import MultiHeadAttention, TorchMultiheadAttention
from attnkit.modules.torch_masks import mask_from_torch

__all__ = ["TorchMultiheadAttention", "from_torch", "mask_from_torch", "to_torch"]

#: a :class:`TorchMultiheadAttention` with the weights of an ``nn.MultiheadAttention``
from_torch = MultiHeadAttention.from_torch
#: an ``nn.MultiheadAttention`` with the weights of a :class:`~attnkit.MultiHeadAttention`
to_torch = MultiHeadAttention.to_torch
