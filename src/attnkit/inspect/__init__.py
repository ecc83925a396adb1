"""Look inside: shape tracing (:func:`trace`), and the attention maps of one sequence as NPZ,
PNG and HTML.

Dimension legend: N layers, H heads, T tokens, E hidden width. ``attentions (N, H, T, T)`` holds
softmax weights with query rows and key columns. Importing this package does not import
matplotlib; only :func:`write_png` and :func:`write_all` do.
"""

from attnkit.inspect.maps import write_all, write_html, write_npz, write_png
from attnkit.inspect.tracing import Trace, TraceStep, trace

__all__ = ["Trace", "TraceStep", "trace", "write_all", "write_html", "write_npz", "write_png"]
