"""A Mistral-like model in Hugging Face transformers: ``attn_implementation="attnkit"`` against
``"sdpa"``, same weights, one run, judged on its speed bars (:data:`BARS`).

    python benchmarks/hf_speed.py [--reps 5] [--length 8192] [--train-length 4096] [--quick]
                                  [--dtype float32|bfloat16] [--intermediate 1792] [--no-memory]
                                  [--json out.json] [--markdown docs/hf.md]

The model is built from a tiny random config, nothing downloaded: ``MistralConfig`` with hidden
512, 8 query and 2 key/value heads of 64, 2 layers, sliding window 256, intermediate 1792 (Mistral
7B's 3.5x of hidden), vocabulary 1024, float32 (the model the bars judge; ``--dtype bfloat16``
builds the same model in bfloat16, as people run models on CPUs with bf16 instructions: its
table goes between markers of its own and its verdicts do not count). One model is built per
implementation, the second loading the first's weights. ``--intermediate`` sets the MLP's
width (the bars do not fix it; the MLP's share of the time bounds what any attention can
gain, see the ceiling below); a width other than :data:`BAR_INTERMEDIATE` prints a line saying
the verdicts do not count.

What it measures, in one process, *interleaved* (one call of each implementation in turn, the
order flipped every round, median of ``--reps`` rounds, after one untimed call of each):

* **forward**: ``model(input_ids)`` under ``torch.no_grad()`` at ``--length`` (8192), B=1;
* **training step**: forward with ``labels=input_ids`` (transformers' cross-entropy on the
  logits), then ``loss.backward()``, at ``--train-length`` (4096); no optimizer step (it is
  the same for both and tiny);
* **peak memory** (unless ``--no-memory``): each (implementation, case) in a fresh process of
  its own: the model and inputs are built, one warm-up call at L=256 loads kernels and makes
  the first-call allocations, then the peak resident set (``VmHWM`` of ``/proc/self/status``,
  reset through ``/proc/self/clear_refs`` after the warm-up) during one call, minus the resident
  set just before it. This sees everything the process holds, torch's allocations included
  (``tracemalloc`` would not see them); it is Linux-only.

**The ceiling**: a third copy of the model, ``none``, has its attention replaced by a
pass-through (each query position gets its own position's values, repeated over the query heads
of a key/value head: no scores, no softmax, almost no time) and is timed in the same rounds. No
attention implementation can make a step faster than sdpa's time over ``none``'s: that is the
most any kernel could gain on this model, printed under the table.

It checks the two models agree (the untimed calls: logits, loss, gradients), and records which
attnkit backend and path served each attention layer: ``attnkit.trace()`` on the untimed call,
and ``attnkit.explain`` on the exact arguments a layer passes (one more untimed forward through
a probe implementation that explains, then runs attnkit's).

The table shows the times, ``sdpa / attnkit`` and the bars: forward >= 4x, training step >= 4x,
peak memory lower, at :data:`BAR_LENGTHS`. ``--quick`` runs short sequences (1024 and 512, 3
rounds) as a smoke test; its verdicts do not count. Where the bars come from, and what they
measured: docs/hf.md.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import attnkit
import attnkit.interop
from attnkit import files
from attnkit.bench.clock import clocking
from attnkit.bench.machine import describe_features, machine

IMPLS = ("sdpa", "attnkit")
NONE = "attnkit_none"  # the reference model with its attention taken out (the ceiling)
MODEL = {
    "vocab_size": 1024,
    "hidden_size": 512,
    "intermediate_size": 1792,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "sliding_window": 256,
}
#: the lengths the bars judge: forward, training step
BAR_LENGTHS = (8192, 4096)
#: the MLP width the bars judge (Mistral 7B's 3.5 x hidden)
BAR_INTERMEDIATE = MODEL["intermediate_size"]
QUICK_LENGTHS = (1024, 512)
WARMUP_LENGTH = 256  # the memory processes' warm-up call
MAX_LENGTH = 131072
BARS = {"fwd": 4.0, "train": 4.0}
DTYPES = ("float32", "bfloat16")
#: how far the two models may differ in each dtype (logits, loss, gradients): float32 rounds
#: alike; in bfloat16 two correct kernels differ by the dtype's rounding
AGREE = {"float32": 1e-4, "bfloat16": 0.1}


def markers(dtype: str = "float32", intermediate: int | None = None) -> tuple[str, str]:
    """The comment lines the markdown report goes between: one pair per dtype and MLP width
    (``<!-- hf_speed: start -->`` for the model the bars judge, ``<!-- hf_speed bfloat16
    intermediate 1: start -->`` for others)."""
    tag = "hf_speed" + ("" if dtype == "float32" else f" {dtype}")
    if intermediate is not None and intermediate != BAR_INTERMEDIATE:
        tag += f" intermediate {intermediate}"
    return f"<!-- {tag}: start -->", f"<!-- {tag}: end -->"


START, END = markers()
MiB = 1 << 20


# ---------------------------------------------------------------------------------------------
# the model and the two steps


def build(
    impl: str, max_len: int, dtype: str = "float32", intermediate: int = BAR_INTERMEDIATE
) -> torch.nn.Module:
    """The Mistral-like model on ``impl`` in ``dtype`` (MLP ``intermediate`` wide), weights
    from seed 0."""
    import transformers

    attnkit.interop.register_hf()
    if impl == NONE:
        _register_none()
    config = transformers.MistralConfig(
        **(MODEL | {"intermediate_size": intermediate}),
        max_position_embeddings=max(max_len, 4096),
        use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation=impl, dtype=getattr(torch, dtype)
    )
    model.requires_grad_(True)
    return model  # type: ignore[no-any-return]


def no_attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kw: Any
) -> tuple[torch.Tensor, None]:
    """An "attention" function that does none: query position ``i`` gets value ``i`` (repeated
    over the query heads of its key/value head), ``(B, L, H, D)`` as transformers expects. The
    model around it (projections, RoPE, MLP, norms, logits, loss) runs as usual, forward and
    backward, so timing it gives what the model costs without attention."""
    H, Hkv = query.shape[1], value.shape[1]
    return value.repeat_interleave(H // Hkv, dim=1).transpose(1, 2), None


def _register_none() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from attnkit.interop.hf_attention import hf_mask

    AttentionInterface.register(NONE, no_attention)
    AttentionMaskInterface.register(NONE, hf_mask)  # a spec: cheap, and unused


def input_ids(L: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(L)
    return torch.randint(0, MODEL["vocab_size"], (1, L), generator=g)


def forward(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        logits: torch.Tensor = model(input_ids=ids).logits
    return logits


def train_step(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.train()
    model.zero_grad(set_to_none=True)
    loss: torch.Tensor = model(input_ids=ids, labels=ids).loss
    loss.backward()  # type: ignore[no-untyped-call]
    return loss.detach()


STEPS: dict[str, Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]] = {
    "fwd": forward,
    "train": train_step,
}


# ---------------------------------------------------------------------------------------------
# which path attnkit took


def explain_layers(model: torch.nn.Module, ids: torch.Tensor) -> list[str]:
    """One untimed forward through a probe implementation: each layer's call explained with
    the arguments it passes (as attnkit's attention function hands them on), then run on
    attnkit. Returns ``"<backend>: <its note>"`` per layer."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    # the mapping from what a layer passes to attention()'s arguments: attnkit's own, so the
    # explained call is the one that runs
    from attnkit.interop.hf_attention import attention_arguments, hf_attention, hf_mask

    seen: list[str] = []

    def probe(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kw: Any) -> Any:
        e = attnkit.explain(query, key, value, **attention_arguments(module, attention_mask, **kw))
        seen.append(f"{e.chosen}: {e.notes.get(e.chosen, e.rule)}")
        return hf_attention(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("attnkit_probe", probe)
    AttentionMaskInterface.register("attnkit_probe", hf_mask)
    model.set_attn_implementation("attnkit_probe")  # type: ignore[operator]
    try:
        forward(model, ids)
    finally:
        model.set_attn_implementation("attnkit")  # type: ignore[operator]
    return seen


# ---------------------------------------------------------------------------------------------
# memory: one case in a fresh process


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field}")


def memory_case(
    impl: str, step: str, L: int, dtype: str = "float32", intermediate: int = BAR_INTERMEDIATE
) -> dict[str, float]:
    """Peak resident memory of one call above what the process held before it (MiB)."""
    model = build(impl, L, dtype, intermediate)
    ids = input_ids(L)
    STEPS[step](model, input_ids(min(WARMUP_LENGTH, L)))
    model.zero_grad(set_to_none=True)
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident set starts again from the current one
    STEPS[step](model, ids)
    return {"peak_mib": (_status("VmHWM") - before) / MiB, "before_mib": before / MiB}


def measure_memory(
    impl: str, step: str, L: int, dtype: str = "float32", intermediate: int = BAR_INTERMEDIATE
) -> dict[str, Any]:
    job = json.dumps(
        {"impl": impl, "step": step, "L": L, "dtype": dtype, "intermediate": intermediate}
    )
    done = subprocess.run(
        [sys.executable, __file__, "--memory-case", job],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"error": f"exit {done.returncode}: {tail[:200]}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


# ---------------------------------------------------------------------------------------------
# the run


@contextlib.contextmanager
def attention_clock(spent: dict[str, float]) -> Iterator[None]:
    """Add the seconds spent inside each implementation's attention function (its forward
    calls, as the model's layers make them) to ``spent[impl]``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    with clocking(ALL_ATTENTION_FUNCTIONS, {impl: impl for impl in IMPLS}, spent):
        yield


def interleaved(
    calls: dict[str, Callable[[], object]], reps: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Seconds of each call, ``reps`` rounds, one call of each per round, order flipped; and
    the seconds of each call spent inside the attention functions (forward calls only)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    inside: dict[str, list[float]] = {name: [] for name in calls}
    spent = dict.fromkeys(calls, 0.0)
    names = list(calls)
    with attention_clock(spent):
        for r in range(reps):
            for name in names if r % 2 == 0 else names[::-1]:
                before = spent[name]
                t0 = time.perf_counter()
                calls[name]()
                times[name].append(time.perf_counter() - t0)
                inside[name].append(spent[name] - before)
    return times, inside


def run(
    L_fwd: int,
    L_train: int,
    reps: int,
    memory: bool,
    dtype: str = "float32",
    intermediate: int = BAR_INTERMEDIATE,
) -> dict[str, Any]:
    info = machine()
    import transformers

    info["transformers"] = transformers.__version__
    width = max(L_fwd, L_train), dtype, intermediate
    models = {impl: build(impl, *width) for impl in IMPLS}
    models["attnkit"].load_state_dict(models["sdpa"].state_dict())
    models[NONE] = build(NONE, *width)
    models[NONE].load_state_dict(models["sdpa"].state_dict())
    lengths = {"fwd": L_fwd, "train": L_train}
    result: dict[str, Any] = {
        "machine": info,
        "model": MODEL
        | {"intermediate_size": intermediate, "family": "mistral", "dtype": dtype}
        | {"batch": 1},
        "lengths": lengths,
        "reps": reps,
        "times_ms": {},
        "median_ms": {},
        "checks": {},
        "attnkit_path": {},
        "peak_mib": {},
        "attention_ms": {},
        "no_attention_ms": {},
    }
    for step, L in lengths.items():
        ids = input_ids(L)
        # the untimed first call of each: the models must agree, and attnkit must have run
        with attnkit.trace() as t:
            ours = STEPS[step](models["attnkit"], ids)
        theirs = STEPS[step](models["sdpa"], ids)
        checks: dict[str, Any] = {"attnkit_backends": t.backends}
        if step == "fwd":
            checks["logits_max_abs_diff"] = float((ours.float() - theirs.float()).abs().max())
        else:
            checks["loss_abs_diff"] = float((ours.float() - theirs.float()).abs())
            grads = {n: p.grad for n, p in models["sdpa"].named_parameters()}
            checks["grad_max_abs_diff"] = max(
                float((p.grad.float() - grads[n].float()).abs().max())  # type: ignore[union-attr]
                for n, p in models["attnkit"].named_parameters()
            )
        result["checks"][step] = checks
        result["attnkit_path"][step] = explain_layers(models["attnkit"], ids)
        STEPS[step](models[NONE], ids)  # its untimed first call too
        times, inside = interleaved(
            {i: functools.partial(STEPS[step], models[i], ids) for i in (*IMPLS, NONE)}, reps
        )
        result["no_attention_ms"][step] = statistics.median(s * 1e3 for s in times.pop(NONE))
        result["times_ms"][step] = {k: [s * 1e3 for s in v] for k, v in times.items()}
        result["attention_ms"][step] = {
            k: statistics.median(s * 1e3 for s in v) for k, v in inside.items() if k in IMPLS
        }
        result["median_ms"][step] = {
            k: statistics.median(v) for k, v in result["times_ms"][step].items()
        }
    del models
    if memory:
        for step, L in lengths.items():
            result["peak_mib"][step] = {
                impl: measure_memory(impl, step, L, dtype, intermediate) for impl in IMPLS
            }
    info["load_at_end"] = round(os.getloadavg()[0], 2)
    result["verdicts"] = verdicts(result)
    return result


def verdicts(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The speed bars: each step's sdpa / attnkit time, and each step's peak memory."""
    out = []
    for step, bar in BARS.items():
        med = result["median_ms"][step]
        ratio = med["sdpa"] / med["attnkit"]
        case = {"case": f"{step} time", "value": ratio, "bar": f">= {bar:g}x"}
        out.append(case | {"passed": ratio >= bar})
    for step, peaks in result["peak_mib"].items():
        a, b = peaks["attnkit"].get("peak_mib"), peaks["sdpa"].get("peak_mib")
        passed = None if a is None or b is None else a < b
        value = None if passed is None else b / a
        out.append(
            {
                "case": f"{step} peak memory",
                "value": value,
                "bar": "attnkit lower",
                "passed": passed,
            }
        )
    return out


# ---------------------------------------------------------------------------------------------
# the report


def _verdict(passed: bool | None) -> str:
    return "-" if passed is None else "PASS" if passed else "FAIL"


def agreement(result: dict[str, Any]) -> str:
    """How the models' differences compare with what the dtype allows (:data:`AGREE`)."""
    tol = AGREE[result["model"]["dtype"]]
    c = result["checks"]
    worst = max(
        c["fwd"]["logits_max_abs_diff"],
        c["train"]["loss_abs_diff"],
        c["train"]["grad_max_abs_diff"],
    )
    if worst <= tol:
        return f": within {tol:g}."
    return f": **more than {tol:g} apart, so the times compare different computations.**"


def report(result: dict[str, Any]) -> str:
    """The markdown report: machine and model lines, the table, the checks and the path."""
    m, md, L = result["machine"], result["model"], result["lengths"]
    load = f"load {m.get('load_at_start')} -> {m.get('load_at_end')}"
    lines = [
        f"**Machine:** {m['cpu']}, {m['cores']} cores ({m['capability']}; "
        f"{describe_features(m.get('cpu_features'))}), {m['memory_gib']} GiB; torch "
        f"{m['torch']} with {m['threads']} threads, transformers {m['transformers']}; {load}; "
        f"{m['date']}; median of {result['reps']} interleaved rounds",
        "",
        f"**Model:** Mistral-like, hidden {md['hidden_size']}, {md['num_attention_heads']} query /"
        f" {md['num_key_value_heads']} key-value heads of {md['head_dim']}, "
        f"{md['num_hidden_layers']} layers, sliding window {md['sliding_window']}, intermediate "
        f"{md['intermediate_size']}, vocabulary {md['vocab_size']}, {md['dtype']}, B=1, random "
        "weights "
        "(the same in both)",
        "",
        "| case | sdpa | attnkit | sdpa / attnkit | bar | verdict |",
        "|---|---|---|---|---|---|",
    ]
    v = {x["case"]: x for x in result["verdicts"]}
    names = {
        "fwd": f"forward, L={L['fwd']} (no_grad): median ms",
        "train": f"training step, L={L['train']} (forward + backward, loss on logits): median ms",
    }
    for step, name in names.items():
        med, x = result["median_ms"][step], v[f"{step} time"]
        lines.append(
            f"| {name} | {med['sdpa']:,.1f} | {med['attnkit']:,.1f} | {x['value']:.2f}x | "
            f"{x['bar']} | {_verdict(x['passed'])} |"
        )
    for step, peaks in result["peak_mib"].items():
        x = v[f"{step} peak memory"]
        cells = [
            f"{peaks[i]['peak_mib']:,.0f}" if "peak_mib" in peaks[i] else peaks[i]["error"]
            for i in IMPLS
        ]
        ratio = "-" if x["value"] is None else f"{x['value']:.2f}x"
        lines.append(
            f"| {names[step].split(':')[0]}: peak MiB above model and inputs | {cells[0]} | "
            f"{cells[1]} | {ratio} | {x['bar']} | {_verdict(x['passed'])} |"
        )
    lines += _not_judged(L, md) + _ceiling(result, names)
    att = result["attention_ms"].get("fwd")
    if att:
        lines += [
            "",
            f"Inside the attention functions during the forward (medians, ms; transformers' "
            f"layers call attention forward only, so the backward's share is in the ceiling "
            f"line above): sdpa {att['sdpa']:,.1f}, attnkit {att['attnkit']:,.1f} "
            f"({att['sdpa'] / max(att['attnkit'], 1e-9):.1f}x).",
        ]
    c = result["checks"]
    lines += [
        "",
        f"Same model on both: logits max |attnkit - sdpa| {c['fwd']['logits_max_abs_diff']:.2e}"
        f" (forward); loss {c['train']['loss_abs_diff']:.2e}, gradients max "
        f"{c['train']['grad_max_abs_diff']:.2e} (training step)" + agreement(result),
        "",
        "attnkit's path (`attnkit.trace()` backends per layer; `attnkit.explain` on each "
        "layer's call):",
        "",
    ]
    for step in ("fwd", "train"):
        backends = ", ".join(c[step]["attnkit_backends"])
        paths = result["attnkit_path"][step]
        lines.append(f"- {names[step].split(':')[0]}: traced {backends}")
        for p in dict.fromkeys(paths):
            layers = [str(j) for j, q in enumerate(paths) if q == p]
            lines.append(f"  - layer{'s' if len(layers) > 1 else ''} {', '.join(layers)}: {p}")
    return "\n".join(lines) + "\n"


def _not_judged(L: dict[str, int], md: dict[str, Any]) -> list[str]:
    """A line for each way the run is not the one the bars judge (lengths, MLP width, dtype)."""
    lines: list[str] = []
    if (L["fwd"], L["train"]) != BAR_LENGTHS:
        lines += [
            "",
            f"Lengths {L['fwd']} / {L['train']} are not the issue's {BAR_LENGTHS[0]} / "
            f"{BAR_LENGTHS[1]}: these verdicts do not judge it.",
        ]
    if md["intermediate_size"] != BAR_INTERMEDIATE:
        lines += [
            "",
            f"The MLP is {md['intermediate_size']} wide, not Mistral's 3.5 x hidden "
            f"({BAR_INTERMEDIATE}) recorded for the issue: these verdicts do not judge it.",
        ]
    if md["dtype"] != "float32":
        lines += [
            "",
            f"The model is {md['dtype']}, not the issue's float32: these verdicts do not judge it.",
        ]
    return lines


def _ceiling(result: dict[str, Any], names: dict[str, str]) -> list[str]:
    """The lines on the ceiling: each step's time without attention, and what attention adds."""
    lines: list[str] = []
    none = result.get("no_attention_ms", {})
    if none:
        lines += [
            "",
            "The ceiling: the same model with its attention taken out (`none`, timed in the same "
            "rounds; see the program's docstring):",
            "",
        ]
        for step in (s for s in names if s in none):
            med, base = result["median_ms"][step], none[step]
            ours, theirs = med["attnkit"] - base, med["sdpa"] - base
            # a ratio only where attnkit's share stands above the rounds' noise (5% of the step)
            ratio = f"{theirs / ours:.1f}x" if ours > 0.05 * base else "attnkit's within noise"
            lines.append(
                f"- {names[step].split(':')[0]}: {base:,.1f} ms without attention, so no "
                f"attention implementation can make it more than {med['sdpa'] / base:.2f}x "
                f"faster than sdpa's {med['sdpa']:,.1f} ms; attention adds {ours:,.1f} ms on "
                f"attnkit, {theirs:,.1f} ms on sdpa ({ratio})."
            )
    return lines


def write_markdown(
    text: str, path: Path, dtype: str = "float32", intermediate: int | None = None
) -> None:
    """Into ``path`` between the markers of the dtype and MLP width (:func:`markers`; the
    prose around stays), or as the whole file."""
    start, end = markers(dtype, intermediate)
    old = files.read_own_text(path)  # a regular file only: a link there is replaced
    if start in old and end in old:
        head, rest = old.split(start, 1)
        text = head + start + "\n" + text + end + rest.split(end, 1)[1]
    files.write_text(path, text, argument="--markdown")


# ---------------------------------------------------------------------------------------------
# the command


def _length(text: str) -> int:
    try:
        L = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
    if not 2 <= L <= MAX_LENGTH:
        raise argparse.ArgumentTypeError(f"{L} is not a length from 2 to {MAX_LENGTH}")
    return L


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is not >= 1")
    return n


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="benchmarks/hf_speed.py",
        description="Mistral-like model on transformers: attnkit against sdpa.",
    )
    ap.add_argument("--reps", type=_positive, help="interleaved rounds (default 5; quick 3)")
    ap.add_argument("--length", type=_length, help="forward length (default 8192; quick 1024)")
    ap.add_argument(
        "--train-length", type=_length, help="training-step length (default 4096; quick 512)"
    )
    ap.add_argument("--quick", action="store_true", help="short sequences, 3 rounds (a smoke run)")
    ap.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="the model's dtype (default float32, the one the bars judge)",
    )
    ap.add_argument(
        "--intermediate",
        type=_positive,
        default=BAR_INTERMEDIATE,
        help=f"the MLP's width (default {BAR_INTERMEDIATE}: Mistral's 3.5 x hidden)",
    )
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    ap.add_argument("--json", type=Path, help="write the measurements here")
    ap.add_argument(
        "--markdown",
        type=Path,
        help=f"write the report here (between {START} / {END}, or the markers of another "
        "--dtype or --intermediate, if the file has them)",
    )
    ap.add_argument("--memory-case", help=argparse.SUPPRESS)  # one memory process's job
    args = ap.parse_args(argv)
    for flag, path in (("--json", args.json), ("--markdown", args.markdown)):
        if path is not None and not path.parent.is_dir():
            ap.error(f"{flag} {path}: the directory {path.parent} does not exist")
    if args.markdown is not None and args.markdown.exists():
        text = files.read_own_text(args.markdown)
        start, end = markers(args.dtype, args.intermediate)
        if (start in text) != (end in text) or (text and start not in text):
            ap.error(
                f"--markdown {args.markdown}: the file exists without the markers {start} and "
                f"{end} (add them where the table goes)"
            )
    if args.memory_case is None and not sys.platform.startswith("linux") and not args.no_memory:
        ap.error("peak memory reads /proc/self/status (Linux); pass --no-memory elsewhere")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.memory_case is not None:
        job = json.loads(args.memory_case)
        case = (job["impl"], job["step"], int(job["L"]), job["dtype"], int(job["intermediate"]))
        print(json.dumps(memory_case(*case)))
        return
    L_fwd, L_train = QUICK_LENGTHS if args.quick else BAR_LENGTHS
    result = run(
        args.length or L_fwd,
        args.train_length or L_train,
        args.reps or (3 if args.quick else 5),
        memory=not args.no_memory,
        dtype=args.dtype,
        intermediate=args.intermediate,
    )
    text = report(result)
    print(text, end="")
    try:  # each file replaced whole, never written through a link (attnkit.files)
        if args.json is not None:
            files.write_text(args.json, json.dumps(result, indent=2) + "\n", argument="--json")
            print(f"wrote {args.json}")
        if args.markdown is not None:
            write_markdown(text, args.markdown, args.dtype, args.intermediate)
            print(f"wrote {args.markdown}")
    except files.WriteError as e:  # a full disk: one line, exit 2
        print(f"hf_speed.py: error: {e.problem}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
