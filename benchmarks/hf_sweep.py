"""Every transformers model type, tiny and random, on ``attn_implementation="attnkit"`` and on
``eager``: does attnkit compute the model's attention, or refuse it?

For each ``config.model_type`` transformers knows (or the ones named), the default config is
shrunk in place (2 layers, hidden 32, 4 heads of 8, 2 key/value heads, vocabulary 128, windows
of 4, small experts and ranks: :data:`SHRINK`) and its ``AutoModelForCausalLM`` (else
``AutoModel``) is built twice with one state dict (weights drawn with std 0.3, so that attention
matters). A batch of 2 rows of 9 token ids, the first left-padded by 3, runs through both with
``output_attentions=True`` (an encoder-decoder such as T5 gets the same ids as its
``decoder_input_ids``, and its encoder, decoder and cross-attention maps are compared). Each
type gets one line, with what its layers' masks were
(:func:`mask_kind`: ``spec``, ``none``, ``dense rule``, ``tensor``):

- ``match``: logits (or hidden states) within 1e-4 on real tokens, the same number of attention
  maps, and the maps within 1e-5 on real query rows;
- ``DIFFER``: any of those is not so (a silent wrong answer);
- ``refused``: attnkit raised its ``AttentionInputError`` (the line shows its first sentence);
- ``skip``: the shrunk model could not be built or run on ``eager`` (vision or audio inputs, a
  config the shrink breaks, a missing package): nothing is said about it.

Also printed: how many of the types attnkit ran got no L x S mask tensor in any layer, and
what the others got; and every keyword argument that reached attnkit's attention function,
with the types that passed it (the survey behind ``attnkit.interop.hf_kwargs.KWARGS``). Nothing is
downloaded. Slow (every model file is imported): about 15 minutes on 2 cores for all types.

    python benchmarks/hf_sweep.py [TYPE ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import json
import signal
import warnings
from typing import Any

import torch

SHRINK: dict[str, int] = {
    **dict.fromkeys(["hidden_size", "d_model", "n_embd", "embed_dim", "dim", "n_embed"], 32),
    **dict.fromkeys(
        ["num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_decoder_layers"], 2
    ),
    **dict.fromkeys(["encoder_layers", "decoder_layers"], 2),
    **dict.fromkeys(["num_attention_heads", "n_head", "n_heads", "num_heads"], 4),
    **dict.fromkeys(["encoder_attention_heads", "decoder_attention_heads"], 4),
    **dict.fromkeys(["num_key_value_heads", "n_kv_heads", "num_kv_heads"], 2),
    **dict.fromkeys(["head_dim", "d_kv", "kv_channels"], 8),
    **dict.fromkeys(["intermediate_size", "ffn_dim", "d_ff", "encoder_ffn_dim"], 64),
    "decoder_ffn_dim": 64,
    **dict.fromkeys(
        ["moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"],
        32,
    ),
    **dict.fromkeys(["num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"], 4),
    **{"num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1},
    **{"q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8},
    **{"v_head_dim": 8, "qk_head_dim": 16, "index_head_dim": 16, "index_n_heads": 2},
    **{"index_topk": 4, "sliding_window": 4, "attention_window": 4},
    **{"vocab_size": 128, "max_position_embeddings": 256},
}
B, T, PAD = 2, 9, 3
ATOL_LOGITS, ATOL_WEIGHTS = 1e-4, 1e-5


def shrink(config: Any, depth: int = 0) -> Any:
    """``config`` with the sizes of :data:`SHRINK` set where it has them (sub-configs too)."""
    fields = vars(config)
    tokens = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # within the vocabulary
    mla = isinstance(fields.get("kv_lora_rank"), int)  # latent attention: as many kv heads
    for name, value in {**SHRINK, **tokens}.items():
        now = fields.get(name)
        if mla and name == "num_key_value_heads":
            value = SHRINK["num_attention_heads"]
        if name in tokens and not (isinstance(now, int) and now >= SHRINK["vocab_size"]):
            continue
        if isinstance(now, int | float) and not isinstance(now, bool):
            with contextlib.suppress(Exception):  # a property or a validated field: left as is
                setattr(config, name, value)
    layer_types = fields.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        kinds = list(dict.fromkeys(layer_types))[:2]  # one layer of each of the first two kinds
        with contextlib.suppress(Exception):
            config.layer_types = (kinds * 2)[:2]
    for value in list(fields.values()):
        if depth < 3 and hasattr(value, "to_dict") and hasattr(value, "model_type"):
            shrink(value, depth + 1)
    return config


def tiny_config(config_class: Any) -> Any:
    """The default config of ``config_class`` shrunk: built with the sizes of :data:`SHRINK` it
    has (so that the fields it derives from them follow), then :func:`shrink` for the rest."""
    default = config_class()
    sizes = {
        name: value
        for name, value in SHRINK.items()
        if isinstance(getattr(default, name, None), int | float)
        and not isinstance(getattr(default, name), bool)
    }
    if "kv_lora_rank" in sizes and "num_key_value_heads" in sizes:  # latent attention (MLA)
        sizes["num_key_value_heads"] = SHRINK["num_attention_heads"]
    layer_types = getattr(default, "layer_types", None)
    if isinstance(layer_types, list) and layer_types and "num_hidden_layers" in sizes:
        sizes["layer_types"] = (list(dict.fromkeys(layer_types))[:2] * 2)[:2]
    try:
        config = config_class(**sizes)
    except Exception:  # a size the constructor checks against another: shrink in place
        config = default
    return shrink(config)


def _auto_class(transformers: Any, model_type: str) -> Any | None:
    from transformers.models.auto import modeling_auto as auto

    for names, cls in (
        (auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, transformers.AutoModelForCausalLM),
        (auto.MODEL_MAPPING_NAMES, transformers.AutoModel),
    ):
        if model_type in names:
            return cls
    return None


def _main_output(out: Any) -> torch.Tensor:
    for name in ("logits", "last_hidden_state", "prediction_logits"):
        value = getattr(out, name, None)
        if isinstance(value, torch.Tensor):
            return value
    first: torch.Tensor = out[0]
    return first


def _maps(out: Any) -> tuple[torch.Tensor, ...]:
    """The attention maps of a model's output: ``attentions``, or an encoder-decoder's encoder,
    decoder and cross-attention maps."""
    names = ("attentions", "encoder_attentions", "decoder_attentions", "cross_attentions")
    maps: list[torch.Tensor] = []
    for name in names:
        for entry in getattr(out, name, None) or ():
            # a layer's entry: its map, or (Pegasus-X and others) a dict or tuple of maps
            parts = entry.values() if isinstance(entry, dict) else [entry]
            for part in parts:
                maps += [part] if isinstance(part, torch.Tensor) else list(part or ())
    return tuple(maps)


def _gap(a: torch.Tensor, b: torch.Tensor, real: torch.Tensor) -> float:
    """max |a - b| over real tokens (rows of ``real`` (B, T)) where the shapes allow it."""
    if a.shape != b.shape:
        return float("inf")
    if a.dim() >= 2 and tuple(a.shape[:2]) == tuple(real.shape):
        return float((a - b)[real].abs().max())
    return float((a - b).abs().max())


def run_type(transformers: Any, model_type: str) -> tuple[str, str]:
    """(verdict, detail) of one model type."""
    from transformers import CONFIG_MAPPING

    from attnkit.errors import AttentionInputError

    auto = _auto_class(transformers, model_type)
    if auto is None:
        return "skip", "no causal-LM or base model class"
    try:
        config = tiny_config(CONFIG_MAPPING[model_type])
        models = []
        for impl in ("eager", "attnkit"):
            torch.manual_seed(0)
            models.append(auto.from_config(copy.deepcopy(config), attn_implementation=impl))
        ref, ours = (m.eval() for m in models)
        if sum(p.numel() for p in ref.parameters()) > 30_000_000:
            return "skip", "too big once shrunk"
        with torch.no_grad():
            for p in ref.parameters():
                if p.is_floating_point():
                    p.normal_(std=0.3)
        ours.load_state_dict(ref.state_dict())
        vocab = min(int(getattr(config.get_text_config(), "vocab_size", 128) or 128), 128)
        ids = torch.randint(3, vocab, (B, T), generator=torch.Generator().manual_seed(1))
        mask = torch.ones(B, T, dtype=torch.long)
        mask[0, :PAD] = 0
        inputs = {"input_ids": ids, "attention_mask": mask, "output_attentions": True}
        if "decoder_input_ids" in inspect.signature(ref.forward).parameters:
            inputs["decoder_input_ids"] = ids  # an encoder-decoder (T5): the decoder reads ids too
        with torch.no_grad():
            expected = ref(**inputs)
    except Exception as e:  # the shrunk model does not run on eager: not attnkit's to judge
        return "skip", f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
    try:
        with torch.no_grad():
            got = ours(**inputs)
    except AttentionInputError as e:
        return "refused", str(e).splitlines()[0][:160]
    except Exception as e:
        return "DIFFER", f"eager ran, attnkit raised {type(e).__name__}: {str(e)[:100]}"
    real = mask.bool()
    gap = _gap(_main_output(got), _main_output(expected), real)
    theirs, mine = _maps(expected), _maps(got)
    weights = 0.0
    if len(mine) == len(theirs):
        for a, b in zip(mine, theirs, strict=True):
            if a.shape != b.shape:
                weights = float("inf")
                continue
            diff = (a - b).abs()
            if diff.dim() == 4 and tuple(diff.shape[::2]) == (B, T):  # real query rows only
                diff = diff[real[:, None, :, None].expand_as(diff)]
            weights = max(weights, float(diff.max()))
    detail = f"logits {gap:.1e}, maps {len(mine)}/{len(theirs)}, weights {weights:.1e}"
    ok = gap <= ATOL_LOGITS and len(mine) == len(theirs) and weights <= ATOL_WEIGHTS
    return ("match" if ok else "DIFFER"), detail


def mask_kind(mask: Any, lazy: type) -> str:
    """What a layer's mask was: ``spec`` (a lazy mask handed on untouched, or a spec; lazy masks
    concatenated over the keys, ``concat_keys`` of their specs, included),
    ``none``, ``edited`` (a lazy mask the model's code operated on, so a dense tensor),
    ``dense rule`` (transformers' dense mask from attnkit's mask interface: a rule it could
    neither prove as a spec nor evaluate as a function mask, since a rule it cannot prove is
    ``from_function`` over transformers' function, a ``spec`` here), ``keys`` (a tensor the
    model built with one row for all queries, such as Switch's ``(B, 1, 1, S)`` padding: not
    L x S) or ``tensor``
    (another L x S tensor: made from attnkit's lazy mask by the model's code, the caller's,
    or one the model built itself)."""
    if mask is None:
        return "none"
    if isinstance(mask, lazy):
        if mask.made:  # type: ignore[attr-defined]
            return "edited"
        # a lazy mask whose spec holds a mask tensor (a model's own, joined to a rule) is one
        return "tensor" if mask.spec.from_tensor else "spec"  # type: ignore[attr-defined]
    if not isinstance(mask, torch.Tensor):
        return "spec"
    if any(mask is d for d in DENSE_MADE):
        return "dense rule"
    if mask.dim() >= 2 and mask.shape[-2] == 1:
        return "keys"  # one row for every query (a (B, 1, 1, S) padding mask): O(S), not L x S
    return "tensor"


#: the dense masks attnkit's mask function returned for the type being run (rules it could
#: not prove as specs)
DENSE_MADE: list[torch.Tensor] = []


class _TimeoutError(Exception):
    pass


def _alarm(*_: object) -> None:
    raise _TimeoutError


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("types", nargs="*", help="model types (default: every one)")
    parser.add_argument("--json", help="write the verdicts and the keywords seen here")
    parser.add_argument("--timeout", type=int, default=60, help="seconds per type")
    args = parser.parse_args()

    warnings.filterwarnings("ignore")
    import transformers

    import attnkit.interop.hf_attention as hfa
    from attnkit.interop import register_hf

    transformers.logging.set_verbosity_error()
    register_hf()
    from attnkit.interop.hf_lazy_mask import LazyMask

    seen: dict[str, dict[str, list[str]]] = {}
    masks: dict[str, set[str]] = {}  # per type, what its masks were (mask_kind)
    current = [""]
    real = hfa.hf_attention

    def recording(module: Any, query: Any, key: Any, value: Any, attention_mask: Any = None,
                  **kwargs: Any) -> Any:  # fmt: skip
        for name, v in kwargs.items():
            shown = "None" if v is None else type(v).__name__
            passed = seen.setdefault(name, {}).setdefault(shown, [])
            if current[0] not in passed:
                passed.append(current[0])
        masks.setdefault(current[0], set()).add(mask_kind(attention_mask, LazyMask))
        return real(module, query, key, value, attention_mask, **kwargs)

    transformers.AttentionInterface._global_mapping["attnkit"] = recording
    mask_interface = transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    real_mask = mask_interface["attnkit"]

    def recording_mask(*args: Any, **kwargs: Any) -> Any:
        made = real_mask(*args, **kwargs)
        if isinstance(made, torch.Tensor) and not isinstance(made, LazyMask):
            DENSE_MADE.append(made)
        return made

    mask_interface["attnkit"] = recording_mask
    signal.signal(signal.SIGALRM, _alarm)
    types = args.types or sorted(transformers.CONFIG_MAPPING.keys())
    verdicts: dict[str, tuple[str, str]] = {}
    for model_type in types:
        current[0] = model_type
        DENSE_MADE.clear()
        signal.alarm(args.timeout)
        try:
            try:
                verdicts[model_type] = run_type(transformers, model_type)
            finally:
                signal.alarm(0)
        except _TimeoutError:  # also the alarm that fires as run_type returns, before alarm(0)
            verdicts[model_type] = ("skip", f"over {args.timeout} s")
        verdict, detail = verdicts[model_type]
        kinds = ", ".join(sorted(masks.get(model_type, set())))
        print(f"{model_type:34s} {verdict:8s} {detail}; masks: {kinds or '-'}", flush=True)
    transformers.AttentionInterface._global_mapping["attnkit"] = real
    mask_interface["attnkit"] = real_mask

    counts = {v: sum(1 for r in verdicts.values() if r[0] == v) for v in ("match", "DIFFER")}
    counts |= {v: sum(1 for r in verdicts.values() if r[0] == v) for v in ("refused", "skip")}
    print("\n" + ", ".join(f"{n} {v}" for v, n in counts.items()) + f" of {len(verdicts)} types")
    ran = [t for t, r in verdicts.items() if r[0] in ("match", "DIFFER")]
    lean = [t for t in ran if masks.get(t, set()) <= {"spec", "none", "keys"}]
    print(f"without an L x S mask tensor: {len(lean)} of the {len(ran)} types attnkit ran")
    for t in sorted(set(ran) - set(lean)):
        print(f"  {t}: {', '.join(sorted(masks.get(t, set()) - {'spec', 'none'}))}")
    print("\nkeywords that reached the attention function (value type: model types):")
    for name in sorted(seen):
        parts = [f"{t}: {len(ms)} ({', '.join(ms[:4])}{', ...' if len(ms) > 4 else ''})"
                 for t, ms in seen[name].items()]  # fmt: skip
        print(f"  {name}: " + "; ".join(parts))
    if args.json:
        with open(args.json, "w") as f:
            kinds = {t: sorted(k) for t, k in masks.items()}
            json.dump({"verdicts": verdicts, "keywords": seen, "masks": kinds}, f, indent=1)


if __name__ == "__main__":
    main()
