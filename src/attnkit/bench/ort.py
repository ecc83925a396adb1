"""onnxruntime's ``GroupQueryAttention`` as a peer of the decode rows (optional: ``pip install
'attnkit[peers]'``; without onnxruntime and onnx the peer is skipped, with that reason).

Dimension legend: B batch, H query heads, Hkv key/value heads, S cache length, D head dim.

``GroupQueryAttention`` is a contrib operator (domain ``com.microsoft``) of onnxruntime's CPU
provider: grouped-query attention over a KV cache, causal, with per-sequence cache lengths
(``seqlens_k``) and a left window (``local_window_size``). The peer builds a one-node ONNX
graph with ``onnx.helper`` and runs a decode step the way onnxruntime's generation loop does:
the cache is a preallocated buffer ``(B, Hkv, S, D)`` bound both as ``past_key`` and as the
``present_key`` output (IO binding on one ``OrtValue``, so the operator shares it and copies
nothing), the new token's key and value are the cache's last entries of each sequence (written
back in place: the cache does not change), and ``seqlens_k`` is each sequence's length minus
one. It reads the K/V it needs and no more, as a decode kernel should; the time of one
``run_with_iobinding`` call is what the bench counts.

Rows it runs: one query per sequence (``decode``, ``decode-gqa``, ``decode-ragged``,
``decode-window``) in float32 or float16, forward.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from attnkit.bench.peers_base import Case, Fn, Peer
from attnkit.bench.workloads import Inputs, Workload, ragged_lengths

__all__ = ["OrtGqa", "unavailable"]

INSTALL = "pip install 'attnkit[peers]' (onnxruntime and onnx)"
_DTYPES = {torch.float32: 1, torch.float16: 10}  # onnx TensorProto: FLOAT, FLOAT16


def unavailable() -> str | None:
    """Why the peer cannot run here (a package missing), else ``None``."""
    missing = [m for m in ("onnxruntime", "onnx") if importlib.util.find_spec(m) is None]
    if missing:
        return f"{' and '.join(missing)} not installed ({INSTALL})"
    return None


def _graph(H: int, Hkv: int, D: int, window: int, dtype: torch.dtype) -> bytes:
    """The one-node model: ``GroupQueryAttention`` with H / Hkv heads of D and a window of
    ``window`` keys (onnxruntime's ``local_window_size``, which counts the query's own key, as
    attnkit's ``sliding_window`` does; 0: none), serialised."""
    from onnx import TensorProto, helper  # type: ignore[import-not-found, unused-ignore]

    t = _DTYPES[dtype]
    node = helper.make_node(
        "GroupQueryAttention",
        ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length"],
        ["output", "present_key", "present_value"],
        domain="com.microsoft",
        num_heads=H,
        kv_num_heads=Hkv,
        local_window_size=window if window > 0 else -1,
    )
    cache: list[str | int | None] = ["B", Hkv, "S", D]
    graph = helper.make_graph(
        [node],
        "decode",
        [
            helper.make_tensor_value_info("query", t, ["B", 1, H * D]),
            helper.make_tensor_value_info("key", t, ["B", 1, Hkv * D]),
            helper.make_tensor_value_info("value", t, ["B", 1, Hkv * D]),
            helper.make_tensor_value_info("past_key", t, cache),
            helper.make_tensor_value_info("past_value", t, cache),
            helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["B"]),
            helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
        ],
        [
            helper.make_tensor_value_info("output", t, ["B", 1, H * D]),
            helper.make_tensor_value_info("present_key", t, cache),
            helper.make_tensor_value_info("present_value", t, cache),
        ],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    out: bytes = model.SerializeToString()
    return out


def _lengths(wl: Workload, S: int) -> torch.Tensor:
    """Each sequence's cache length: the ragged row's own, else the whole cache."""
    if wl.name == "decode-ragged":
        return ragged_lengths(wl.B, S)
    return torch.full((wl.B,), S, dtype=torch.long)


class OrtGqa(Peer):
    """onnxruntime's ``GroupQueryAttention`` on a decode row (see the module's docstring)."""

    def skip_case(self, case: Case) -> str | None:
        why = unavailable()
        if why is not None:
            return why
        if case.backward:
            return "onnxruntime's GroupQueryAttention runs forward only"
        if case.dtype not in _DTYPES:
            return f"GroupQueryAttention on the CPU takes float32 and float16, not {case.dtype}"
        if not case.wl.name.startswith("decode"):
            return "GroupQueryAttention is causal over a KV cache: decode rows only"
        return None

    def __init__(self, name: str, description: str) -> None:
        super().__init__(name, description)
        self._sessions: dict[tuple[Any, ...], Any] = {}

    def setup(self, wl: Workload, inputs: Inputs) -> Fn:
        import numpy as np
        import onnxruntime as ort  # type: ignore[import-not-found, import-untyped, unused-ignore]

        q, k, v = inputs.q, inputs.k, inputs.v
        B, H, _, D = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        window = wl.window if "window" in wl.name else 0
        key = (H, Hkv, D, window, q.dtype, torch.get_num_threads())
        sess = self._sessions.get(key)
        if sess is None:  # one session for every copy of the inputs (its threads: one pool)
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = torch.get_num_threads()
            opts.inter_op_num_threads = 1
            # its threads sleep when a run ends instead of spinning: spinning threads would
            # take the cores from the peer timed next
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
            sess = ort.InferenceSession(
                _graph(H, Hkv, D, window, q.dtype), opts, providers=["CPUExecutionProvider"]
            )
            self._sessions[key] = sess
        lengths = _lengths(wl, S)
        last = (lengths - 1).view(B, 1, 1, 1).expand(B, Hkv, 1, D)
        # the new token: each sequence's last cached key and value, (B, 1, Hkv * D)
        new_k, new_v = (
            t.gather(2, last).permute(0, 2, 1, 3).reshape(B, 1, Hkv * D) for t in (k, v)
        )
        arrays: dict[str, Any] = {
            "query": q.permute(0, 2, 1, 3).reshape(B, 1, H * D).numpy(),
            "key": new_k.contiguous().numpy(),
            "value": new_v.contiguous().numpy(),
            "seqlens_k": (lengths - 1).to(torch.int32).numpy(),
            "total_sequence_length": np.array(int(lengths.max()), dtype=np.int32),
        }
        # the cache: one OrtValue each for K and V, bound as input and output (shared buffer)
        cache = {
            n: ort.OrtValue.ortvalue_from_numpy(t.contiguous().numpy())
            for n, t in (("key", k), ("value", v))
        }
        binding = sess.io_binding()
        binding.bind_output("output", "cpu")  # first: get_outputs()[0]
        for name, array in arrays.items():
            binding.bind_cpu_input(name, array)
        for n in ("key", "value"):
            binding.bind_ortvalue_input(f"past_{n}", cache[n])
            binding.bind_ortvalue_output(f"present_{n}", cache[n])
        keep = (sess, arrays, cache)  # alive as long as the call

        def run() -> torch.Tensor:
            keep[0].run_with_iobinding(binding)
            out = binding.get_outputs()[0].numpy()
            return torch.from_numpy(out).view(B, 1, H, D).transpose(1, 2)

        return run
