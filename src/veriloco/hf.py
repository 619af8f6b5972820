"""Hugging Face causal LMs (Llama, Mistral, Qwen2, Qwen3, OLMo 2, SmolLM3) built from the run's config, no download.

`[model] arch = "llama"` (or "mistral", "qwen2", "qwen3", "olmo2", "smollm3") trains that `transformers` architecture
instead of the built-in GPT, at the sizes `[model]` gives (n_layer, n_head, kv_heads, head_dim,
d_model, ffn, ctx, vocab_size, rope_theta, rope_scaling, norm_eps, tie, sliding_window). Nothing is fetched: the `transformers`
config is made from those fields (`hf_config`), the weights are initialised from `run.seed` (or
read from `[model] init`: weights.py), and the tokens are the run's own (bytes, a .bin corpus's
ids, or `[data] tokenizer`'s).

`HFCausalLM` holds the `transformers` model's parts under the same parameter names as its
`*ForCausalLM` (`model.embed_tokens.weight`, `model.layers.<i>.*`, `model.norm.weight`,
`lm_head.weight`), which is what lets a pipeline stage (`keep_stage`: the full model with the
other stages' parts deleted) line up with the whole model, and what lets `veriloco export` write
a checkpoint that `AutoModelForCausalLM.from_pretrained` loads as it is (`save_hf`).

Its forward is the decoder loop of `LlamaModel.forward` (and of the other archs', which is the
same loop), written out so that a stage can run a
slice of it: embed (first stage), rotary position embeddings (every stage: they hold no
parameters; SmolLM3's NoPE layers, every 4th, are handed them and skip them inside their
attention), the held layers, the final norm and head (last stage). Attention is PyTorch's SDPA
with `is_causal` (no padding: every sequence is a full window), or with Mistral's sliding-window
mask (`window_mask`) when `[model] sliding_window` is shorter than the sequence. `tests/test_hf.py` checks that
the full model's logits equal `transformers`' own forward and that the stages chained equal the
full model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .config import HF_ARCHS, ModelConfig

# Each arch's model forward is embed -> rotary -> its decoder layers -> norm -> head, which
# HFCausalLM.forward writes out (OLMo 2's post-norms and q/k norms are inside its layers, and so is
# SmolLM3's choice of which layers apply the rotary tables); tests/test_hf.py holds each to
# transformers' own logits.


def transformers_version() -> str | None:
    """The installed `transformers` version, or None."""
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


ROPE_SCALINGS = {  # rope_type -> (the numbers it takes, those it may take): transformers' rope_parameters, less rope_theta
    "linear": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    # YaRN (Peng et al. 2023, arXiv 2309.00071; Qwen3's long-context setting): static tables, and
    # cos/sin scaled by attention_factor (by default from factor, or mscale / mscale_all_dim)
    "yarn": (("factor", "original_max_position_embeddings"),
             ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")),
}


def check_rope_scaling(value: Any, where: str) -> dict[str, Any]:
    """`value` as a rope scaling veriloco runs ({"rope_type": ..., its numbers}), normalised
    (floats; original_max_position_embeddings an int; yarn's truncate a bool); ValueError, one
    line, naming `where`."""
    if isinstance(value, dict) and "rope_type" not in value and "type" in value:  # transformers 4's spelling
        value = {("rope_type" if k == "type" else k): v for k, v in value.items()}
    kind = value.get("rope_type") if isinstance(value, dict) else None
    if kind not in ROPE_SCALINGS:
        names = list(ROPE_SCALINGS)
        raise ValueError(f"{where}: rope_type must be {', '.join(names[:-1])} or {names[-1]} (what veriloco runs), "
                         f"got {kind!r:.40}")
    required, optional = ROPE_SCALINGS[kind]
    given = set(value) - {"rope_type"}
    if not set(required) <= given <= set(required) | set(optional):
        also = f" and may take {', '.join(optional)}" if optional else ""
        raise ValueError(f"{where}: rope_type {kind!r} takes {', '.join(sorted(required))}{also}; "
                         f"got {', '.join(sorted(given)) or 'nothing'}")
    out: dict[str, Any] = {"rope_type": kind}
    for key in sorted(given):
        v = value[key]
        if key == "truncate":
            if not isinstance(v, bool):
                raise ValueError(f"{where}: truncate must be true or false, got {v!r:.40}")
            out[key] = v
            continue
        integral = key == "original_max_position_embeddings"
        if isinstance(v, bool) or not isinstance(v, int if integral else (int, float)) or not (0 < v < math.inf):
            raise ValueError(f"{where}: {key} must be {'an integer' if integral else 'a finite number'} > 0, "
                             f"got {v!r:.40}")
        out[key] = v if integral else float(v)
    if kind == "llama3" and not out["high_freq_factor"] > out["low_freq_factor"]:  # its wavelength bands are empty
        raise ValueError(f"{where}: llama3's high_freq_factor must be greater than its low_freq_factor, got "
                         f"{out['high_freq_factor']} and {out['low_freq_factor']}")
    return out


def rope_scaling(m: ModelConfig) -> dict[str, Any] | None:
    """`[model] rope_scaling`, parsed and checked (`check_rope_scaling`), or None."""
    if not m.rope_scaling:
        return None
    try:
        value = json.loads(m.rope_scaling)
    except ValueError:
        raise ValueError(f"model.rope_scaling is not JSON: {m.rope_scaling!r:.80}") from None
    return check_rope_scaling(value, "model.rope_scaling")


def ffn_width(m: ModelConfig) -> int:
    """`[model] ffn`, or Llama's default: 8/3 of d_model, rounded up to a multiple of 32."""
    return m.ffn or -(-(8 * m.d_model) // (3 * 32)) * 32


def hf_config(m: ModelConfig) -> Any:
    """The `transformers` config of `[model]` (no file, no download)."""
    from transformers import CONFIG_MAPPING, AutoConfig

    extra: dict[str, Any] = {}
    defaults = CONFIG_MAPPING[m.arch]()
    for key in ("bos_token_id", "eos_token_id"):  # an arch's default outside this vocab (OLMo 2's eos 50279)
        if isinstance(getattr(defaults, key, None), int) and getattr(defaults, key) >= m.vocab_size:
            extra[key] = None
    # No padding: every sequence is a full window of the run's own tokens. An arch's default pad id
    # (OLMo 2's 1, SmolLM3's 128004) would make that row of the embedding zero and never trained
    # (nn.Embedding's padding_idx), though in the run's vocabulary it is a real token (GPT-2's '"').
    extra["pad_token_id"] = None
    if m.arch in ("mistral", "qwen2", "qwen3", "smollm3"):  # [model] sliding_window (mistral), else full causal attention
        extra["sliding_window"] = (m.sliding_window or None) if m.arch == "mistral" else None
    if m.arch in ("qwen2", "qwen3", "smollm3"):
        extra["use_sliding_window"] = False
    # smollm3's NoPE layers are transformers' default, no_rope_layers from no_rope_layer_interval = 4
    # (layers 3, 7, ... attend without rotary); no [model] key sets them, weights.py holds a
    # checkpoint's config.json to them
    scaling, positions = rope_scaling(m), m.ctx
    if scaling is None:
        extra["rope_theta"] = m.rope_theta
    else:  # [model] rope_scaling: transformers computes the scaled rotary tables (tests/test_rope_scaling.py)
        extra["rope_parameters"] = {**scaling, "rope_theta": m.rope_theta}
        if scaling["rope_type"] in ("llama3", "yarn"):  # the context the scaling stretches to (transformers wants it above the original)
            positions = max(m.ctx, int(scaling["original_max_position_embeddings"] * scaling["factor"]))
    return AutoConfig.for_model(
        m.arch,
        vocab_size=m.vocab_size,
        hidden_size=m.d_model,
        intermediate_size=ffn_width(m),
        num_hidden_layers=m.n_layer,
        num_attention_heads=m.n_head,
        num_key_value_heads=m.kv_heads or m.n_head,
        head_dim=m.head_dim or m.d_model // m.n_head,
        rms_norm_eps=m.norm_eps,
        max_position_embeddings=positions,
        tie_word_embeddings=m.tie,
        attention_dropout=0.0,
        use_cache=False,
        attn_implementation="sdpa",
        torch_dtype="float32",
        **extra,
    )


class HFCausalLM(nn.Module):
    """A `transformers` decoder-only causal LM, or one pipeline stage of it.

    forward(token ids) -> logits for the full model; a first stage maps ids -> hidden, a middle
    one hidden -> hidden, a last one hidden -> logits.
    """

    def __init__(self, m: ModelConfig, causal_lm: nn.Module) -> None:
        super().__init__()
        self.cfg = m
        base = causal_lm.model
        base.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(base.layers)})  # same names as the list
        self.model = base
        self.lm_head = causal_lm.lm_head

    def keep_stage(self, layers: set[int], embed: bool, head: bool) -> None:
        """Delete what a stage does not hold (the names of what stays do not change)."""
        for name in [k for k in self.model.layers if int(k) not in layers]:
            del self.model.layers[name]
        if not embed:
            self.model.embed_tokens = None
        if not head:
            self.model.norm = self.lm_head = None
        if self.cfg.tie and head and not embed:
            from .model import head_copy

            head_copy(self.lm_head)

    def token_embedding(self) -> nn.Module | None:
        return self.model.embed_tokens

    def retie(self) -> None:
        """`[model] tie`: the head's weight is the embedding's (`model.embed_tokens.weight`), as
        transformers ties it; `model.model_from` calls this after it gives the model memory."""
        if self.cfg.tie and self.model.embed_tokens is not None and self.lm_head is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    def reset_buffers(self, device: torch.device | str) -> None:
        """Recompute the rotary tables (`inv_freq`: buffers, not parameters) on `device`, as
        transformers computes them when it builds the model (`model.model_from` builds on the
        meta device, where they are empty)."""
        rotary = self.model.rotary_emb
        with torch.device("cpu"):
            fresh = type(rotary)(config=self.model.config)
        self.model.rotary_emb = fresh.to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(x) if self.model.embed_tokens is not None else x
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        rope = self.model.rotary_emb(h, position_ids=pos)
        mask = window_mask(h.shape[1], self.cfg.sliding_window, h.device)
        recompute = self.cfg.checkpoint and torch.is_grad_enabled()  # [model] checkpoint
        for layer in self.model.layers.values():
            if recompute:
                h = checkpoint(_run_layer, layer, h, pos, rope, mask, use_reentrant=False)
            else:
                h = _run_layer(layer, h, pos, rope, mask)
        if self.lm_head is not None:
            h = self.lm_head(self.model.norm(h))
        return h


def window_mask(length: int, window: int, device: torch.device) -> torch.Tensor | None:
    """`[model] sliding_window`: the boolean attention mask [1, 1, length, length] that lets a token
    see itself and the `window` - 1 before it (transformers' sliding-window causal mask), or None
    (SDPA's `is_causal`) when the window covers the sequence."""
    if not window or window >= length:
        return None
    q, k = torch.arange(length, device=device)[:, None], torch.arange(length, device=device)[None, :]
    return ((k <= q) & (q - k < window))[None, None]


def _run_layer(layer: nn.Module, h: torch.Tensor, pos: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
               mask: torch.Tensor | None = None) -> torch.Tensor:
    out = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=rope)
    return out[0] if isinstance(out, tuple) else out


def build_hf(m: ModelConfig) -> HFCausalLM:
    """The full model with `transformers`' own initialisation, drawn from torch's global RNG
    (the caller seeds it: `model.build_model`)."""
    from transformers import AutoModelForCausalLM

    return HFCausalLM(m, AutoModelForCausalLM.from_config(hf_config(m), dtype=torch.float32))


def save_hf(params: Mapping[str, torch.Tensor], m: ModelConfig, directory: Path) -> None:
    """Write `params` (the full model's, under HFCausalLM's names; a lazy mapping is read a tensor
    at a time: export.RoundParams) into `directory` as a `transformers` model: config.json and
    model.safetensors, which `AutoModelForCausalLM.from_pretrained(directory)` loads (`veriloco
    export`, export.py)."""
    from .model import build_meta
    from .tensorfile import layout_of, write_tensors

    expected = {name for name, _ in build_meta(m).named_parameters()}
    missing, extra = sorted(expected - params.keys()), sorted(params.keys() - expected)
    if missing or extra:
        raise ValueError(f"the checkpoint does not hold a {m.arch} model of this config: "
                         f"missing {missing[:3]}, unexpected {extra[:3]}")
    config = hf_config(m)
    config.architectures = [_causal_lm_name(config)]
    (directory / "config.json").write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    layout = {k: (torch.float32, shape) for k, (_, shape) in layout_of(params).items()}
    with (directory / "model.safetensors").open("wb") as f:
        write_tensors(f, layout, lambda k: params[k].detach().float(), metadata={"format": "pt"})


def _causal_lm_name(config: Any) -> str:
    """`LlamaForCausalLM` and the like: what from_pretrained builds from config.json."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping[type(config)].__name__


__all__ = ["HF_ARCHS", "HFCausalLM", "ROPE_SCALINGS", "build_hf", "check_rope_scaling", "ffn_width", "hf_config",
           "rope_scaling", "save_hf", "transformers_version"]
