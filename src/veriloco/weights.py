"""Starting weights: `[model] init`, a run that starts from weights on disk instead of run.seed's.

`[model] init` names a safetensors file, or a directory of `*.safetensors` files (a `veriloco
export` directory, or a transformers model directory, sharded or not). When the run is prepared
(`run.prepare_run`) the weights are read once and checked against the model `[model]` describes:

- every parameter present, none left over, every shape equal (one line naming the first tensor
  that differs);
- with a transformers `config.json` beside them, every setting that changes the computation
  without changing a shape (rope_theta, rms_norm_eps, head_dim, a rope scaling, the
  architecture, SmolLM3's NoPE layers) equal to `[model]`'s, one line naming each field to set;
  for the GPT, a `veriloco export`'s `model.json` likewise (n_head, which no shape shows);
- a checkpoint with tied embeddings (no `lm_head.weight`) stays tied with `[model] tie`; without
  it, the head becomes a copy of the embedding and from there on the two train apart. A
  checkpoint with a head of its own under `[model] tie` is one line.

The weights, as float32 under the model's names, become one canonical safetensors blob in the run's
store; the manifest names it (`init`) and its model-init hash is the hash of those params, so
the run id covers them. Workers, the DDP baseline and the audit start from that blob
(`task.CorpusTask`), never from the file again: a run directory is self-contained.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

from .config import ConfigError, ModelConfig
from .hashing import TensorsHasher
from .model import embedding_name
from .tensorfile import FileTensors, TensorFile, layout_of, write_tensors

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some older checkpoints saved beside the weights


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if files:
            return files
        raise ConfigError(f"model.init: {path} holds no *.safetensors file")
    raise ConfigError(f"model.init not found: {path}")


def _hf_settings(m: ModelConfig, config: dict) -> list[str]:
    """Where a transformers config.json disagrees with `[model]`, as 'field X but [model] key Y'."""
    from .hf import check_rope_scaling, ffn_width, rope_scaling

    rope = config.get("rope_parameters") or {}
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    scaling = config.get("rope_scaling") or ({k: v for k, v in rope.items() if k != "rope_theta"}
                                             if rope.get("rope_type", "default") != "default" else None)
    n_head = config.get("num_attention_heads")
    pairs = [
        ("model_type", config.get("model_type"), "arch", m.arch),
        ("num_hidden_layers", config.get("num_hidden_layers"), "n_layer", m.n_layer),
        ("hidden_size", config.get("hidden_size"), "d_model", m.d_model),
        ("num_attention_heads", n_head, "n_head", m.n_head),
        ("num_key_value_heads", config.get("num_key_value_heads") or n_head, "kv_heads", m.kv_heads or m.n_head),
        ("head_dim", config.get("head_dim") or (config.get("hidden_size", 0) // (n_head or 1)), "head_dim",
         m.head_dim or m.d_model // m.n_head),
        ("intermediate_size", config.get("intermediate_size"), "ffn", ffn_width(m)),
        ("vocab_size", config.get("vocab_size"), "vocab_size", m.vocab_size),
        ("rope_theta", float(theta), "rope_theta", m.rope_theta),
        ("rms_norm_eps", config.get("rms_norm_eps"), "norm_eps", m.norm_eps),
    ]
    out = [f"config.json {a} = {x!r} but model.{b} = {y!r}" for a, x, b, y in pairs if x is not None and x != y]
    ours = rope_scaling(m)
    if scaling:
        try:
            theirs = check_rope_scaling(scaling, "config.json's rope scaling")
        except ValueError:
            out.append(f"config.json has a rope scaling ({json.dumps(scaling)[:60]}), which veriloco does not run")
        else:
            if theirs != ours:
                out.append(f"config.json's rope scaling is {json.dumps(theirs)} but model.rope_scaling = {m.rope_scaling!r}")
    elif ours is not None:
        out.append(f"config.json has no rope scaling but model.rope_scaling = {m.rope_scaling!r}")
    from .hf import hf_config

    ours = hf_config(m)  # settings no [model] key sets: the checkpoint's must be what veriloco builds
    for key, default in (("hidden_act", None), ("attention_bias", False), ("mlp_bias", False),
                         ("partial_rotary_factor", 1.0)):
        if key in config and config[key] != getattr(ours, key, default):
            out.append(f"config.json {key} = {config[key]!r} but veriloco's {m.arch} has {getattr(ours, key, default)!r} "
                       "(no [model] key sets it)")
    def window(w: Any) -> Any:  # the window as it acts on model.ctx tokens (None: full attention)
        return w if isinstance(w, int) and not isinstance(w, bool) and 0 < w < m.ctx else None

    if config.get("use_sliding_window"):
        out.append("config.json uses sliding-window attention on some layers (use_sliding_window), which veriloco "
                   "does not run")
    elif m.arch == "mistral" and window(config.get("sliding_window")) != window(m.sliding_window):
        out.append(f"config.json sliding_window = {config.get('sliding_window')!r} but model.sliding_window = "
                   f"{m.sliding_window!r} (at model.ctx = {m.ctx})")
    layer_types = config.get("layer_types") or []  # qwen2, qwen3, smollm3: each layer's attention
    if not isinstance(layer_types, list):
        raise ValueError(f"layer_types = {layer_types!r:.40}")
    kinds = sorted(set(map(str, layer_types)) - {"full_attention"})
    if kinds:
        out.append(f"config.json layer_types has {', '.join(kinds)} layers, which veriloco's {m.arch} does not run "
                   "(full_attention only)")
    if m.arch == "smollm3":
        out += _smollm3_settings(m, config, ours)
    return out


def _smollm3_settings(m: ModelConfig, config: dict, ours: Any) -> list[str]:
    """SmolLM3's layers that attend without rotary (NoPE), which change the computation and no
    shape: a checkpoint's must be those veriloco builds."""
    out = []
    interval = config.get("no_rope_layer_interval", 4)
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ValueError(f"no_rope_layer_interval = {interval!r:.20}")
    # as transformers reads them: the list if given, else every interval-th layer without rotary
    theirs = config.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(m.n_layer)]
    if [bool(r) for r in theirs[:m.n_layer]] != [bool(r) for r in ours.no_rope_layers]:
        nope = [i for i, rope in enumerate(theirs[:m.n_layer]) if not rope]
        short = f", {len(theirs)} entries for {m.n_layer} layers" if len(theirs) < m.n_layer else ""
        out.append(f"config.json no_rope_layers has NoPE layers {nope}{short} but veriloco's smollm3 has "
                   f"{[i for i, rope in enumerate(ours.no_rope_layers) if not rope]} (no [model] key sets them)")
    return out


def read_init(m: ModelConfig, model: nn.Module) -> InitParams:
    """The weights `[model] init` names, checked against `model` (the full model `[model]`
    builds; its meta structure is enough) from the files' headers, as float32 under its parameter
    names, each read when asked for (`InitParams`). ConfigError (one line) for anything amiss."""
    path = Path(m.init)
    files = _files(path)
    # the settings beside the weights: transformers' config.json, or a veriloco export's model.json (the GPT)
    beside = path / ("model.json" if m.arch == "gpt" else "config.json") if path.is_dir() else None
    if beside is not None and beside.is_file():
        try:
            settings = json.loads(beside.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise ConfigError(f"model.init: {beside} is not JSON: {str(e)[:80]}") from None
        if not isinstance(settings, dict):
            wrong = ["it is not a JSON object"]
        elif m.arch == "gpt":
            wrong = [f"{key} = {settings[key]!r} but model.{key} = {getattr(m, key)!r}"
                     for key in ("arch", "n_layer", "n_head", "d_model", "ctx", "vocab_size")
                     if key in settings and settings[key] != getattr(m, key)]
        else:
            try:
                wrong = _hf_settings(m, settings)
            except (TypeError, ValueError, AttributeError) as e:  # a value of the wrong type in the file
                raise ConfigError(f"model.init: {beside} has a setting veriloco cannot read: {str(e)[:80]}") from None
        if wrong:
            raise ConfigError(f"model.init: {beside}: {'; '.join(wrong)}")
    found: dict[str, tuple[TensorFile, str]] = {}  # name -> the file holding it, and its name there
    for f in files:
        try:
            tensors = TensorFile(f, str(f))  # the header now, each tensor when it is read
        except (OSError, ValueError) as e:
            raise ConfigError(f"model.init: {str(e).splitlines()[0][:200]}") from None
        twice = sorted(set(tensors.index) & set(found))
        if twice:
            raise ConfigError(f"model.init: {twice[0]} is in {f.name} and in another file")
        found.update((k, (tensors, k)) for k in tensors.index)
    for name in [k for k in found if k.endswith(IGNORED_SUFFIXES)]:
        del found[name]
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    embedding = embedding_name(m)
    if m.tie and "lm_head.weight" in found and embedding in found:  # [model] tie: the head is the embedding
        read = FileTensors(found, ConfigError, "model.init: ")
        if not torch.equal(read["lm_head.weight"], read[embedding]):
            raise ConfigError(f"model.init: {path} has a head of its own (lm_head.weight is not its embedding): "
                              "set model.tie = false")
        del found["lm_head.weight"]  # a tied model's export writes the head too (GPT): the same matrix
    if "lm_head.weight" in expected and "lm_head.weight" not in found and embedding in found:
        found["lm_head.weight"] = found[embedding]  # tied embeddings, model.tie = false: untied from here on
    missing, extra = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
    if missing or extra:
        what = [f"{word} {names[0]}" + (f" and {len(names) - 1} more" if len(names) > 1 else "")
                for word, names in (("missing", missing), ("unexpected", extra)) if names]
        raise ConfigError(f"model.init: {path} does not hold this [model]'s parameters: {'; '.join(what)}")
    for name, shape in expected.items():
        file, key = found[name]
        dtype, theirs = file.index[key][:2]
        if theirs != shape:
            raise ConfigError(f"model.init: {name} has shape {theirs}, this [model] makes "
                              f"{shape}: set [model] to the checkpoint's sizes")
        if not dtype.is_floating_point:
            raise ConfigError(f"model.init: {name} is {dtype}, not a float tensor")
    return InitParams({name: found[name] for name in expected})


class InitParams(FileTensors):
    """The `[model] init` weights under the model's names, each read from its file as float32
    when asked for (`read_init`): nothing is held, so run.prepare_run writes G_0 from a
    checkpoint holding one tensor at a time. A tied checkpoint's head, untied, is read from the
    embedding."""

    def __init__(self, where: dict[str, tuple[TensorFile, str]]) -> None:
        super().__init__(where, ConfigError, "model.init: ")

    def layout(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return {name: (torch.float32, shape) for name, (_, shape) in super().layout().items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        return super().__getitem__(name).to(torch.float32).contiguous()


def write_initial(f: BinaryIO, params: Mapping[str, torch.Tensor]) -> str:
    """Write G_0's canonical blob (`init_blob`'s bytes) to `f`, reading one tensor of `params` at a
    time (an `InitParams` or a model's params); returns the model-init hash, `tensors_hash(params)`,
    computed on the way."""
    layout = layout_of(params)
    hasher = TensorsHasher()

    def tensor_of(name: str) -> torch.Tensor:
        t = params[name]
        hasher.add(name, t)
        return t

    write_tensors(f, layout, tensor_of)
    return hasher.hexdigest()


def init_blob(params: Mapping[str, torch.Tensor]) -> bytes:
    """The canonical safetensors bytes of `params` (sorted names, float32, no metadata): what the
    store keeps as G_0. The same bytes as `safetensors.torch.save` (tests/test_tensorfile.py)."""
    out = io.BytesIO()
    write_initial(out, params)
    return out.getvalue()


__all__ = ["InitParams", "init_blob", "read_init", "write_initial"]
