"""What tests/distributed/test_ring_sinks.py runs, shared with its worker script (without the
worker's imports, which patch the gather kernel to count its calls)."""

#: the ring cases of tests/distributed/ring_workers.py run with sinks
SINK_CASES = ("dense", "causal", "padding", "mqa_causal", "causal_headwise", "cross_lengths_causal")
#: the sinks' shapes: per head (H,), per token (B, H, L) and (1, H, L)
KINDS = ("H", "BHL", "1HL")
