"""A small GPT, written to be cut into pipeline stages.

Blocks live in a `ModuleDict` keyed by their global layer index, and the embedding and the head
are optional, so a pipeline stage is the same module with some layers absent (torchtitan's
habit): parameter names stay identical between the full model and its stages, which is what
lets a stage's delta, packet and checkpoint line up with the full model's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from .config import ModelConfig


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.fc_out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Byte-level GPT. `layers` selects which blocks this module holds (default: all);
    `embed`/`head` say whether it holds the token+position embedding and the final norm+head.

    forward(tokens) -> logits for the full model; a middle stage maps hidden -> hidden.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        layers: list[int] | None = None,
        embed: bool = True,
        head: bool = True,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        layers = list(range(cfg.n_layer)) if layers is None else layers
        if embed:
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos_emb = nn.Embedding(cfg.ctx, cfg.d_model)
        else:
            self.tok_emb = self.pos_emb = None
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in layers})
        if head:
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        else:
            self.ln_f = self.lm_head = None
        self.retie()
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by depth
            if name.endswith(("proj.weight", "fc_out.weight")):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    def retie(self) -> None:
        """`[model] tie`: the head's weight is the token embedding's, one parameter (named
        `tok_emb.weight`); `model_from` calls this again after it gives the model memory."""
        if self.cfg.tie and self.tok_emb is not None and self.lm_head is not None:
            self.lm_head.weight = self.tok_emb.weight

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def keep_stage(self, layers: set[int], embed: bool, head: bool) -> None:
        """Delete what a pipeline stage does not hold (the names of what stays do not change)."""
        for name in [k for k in self.blocks if int(k) not in layers]:
            del self.blocks[name]
        if not embed:
            self.tok_emb = self.pos_emb = None
        if not head:
            self.ln_f = self.lm_head = None
        if self.cfg.tie and head and not embed:
            head_copy(self.lm_head)

    def token_embedding(self) -> nn.Embedding | None:
        return self.tok_emb

    def reset_buffers(self, device: torch.device | str) -> None:
        """The GPT holds no buffers (`model_from` calls this on every model it materialises)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.tok_emb(x) + self.pos_emb(pos)
        recompute = self.cfg.checkpoint and torch.is_grad_enabled()  # [model] checkpoint
        for block in self.blocks.values():
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        if self.lm_head is not None:
            x = self.lm_head(self.ln_f(x))
        return x


def embedding_name(cfg: ModelConfig) -> str:
    """The token embedding's parameter name (a tied model's head is named by it)."""
    return "tok_emb.weight" if cfg.arch == "gpt" else "model.embed_tokens.weight"


def head_copy(head: nn.Linear) -> None:
    """`[model] tie` cut into pipeline stages: the last stage's head weight becomes a copy of the
    first stage's embedding, held as a buffer (not a parameter, so not in the stage's deltas,
    packets, checkpoints, optimizer or trace: the first stage owns the tensor). The pipeline
    refreshes the copy before every step and eval and returns its gradient to the first stage,
    which adds it to the embedding's (pipeline.TiedEnds)."""
    weight = head.weight
    del head.weight
    head.register_buffer("weight", weight.detach().clone(), persistent=False)


def tied_ends(model: nn.Module) -> tuple[nn.Parameter | None, torch.Tensor | None]:
    """(the token embedding's weight, when `model` is the first stage of a tied model cut into
    stages; the head's copy of it (`head_copy`), when it is the last stage). (None, None) for an
    untied model, a middle stage, the whole model (whose head is the embedding itself), or a
    model of a user's own `Task` (which has no `[model] tie`)."""
    if not getattr(getattr(model, "cfg", None), "tie", False) or not hasattr(model, "token_embedding"):
        return None, None
    embedding, head = model.token_embedding(), model.lm_head
    if embedding is not None and head is not None:
        return None, None
    return (embedding.weight if embedding is not None else None), (head.weight if head is not None else None)


def build_model(cfg: ModelConfig, seed: int) -> nn.Module:
    """The full model of `[model] arch` (the GPT, or a transformers architecture: hf.py),
    initialised from `seed` alone (every worker builds the same G_0). Either has
    `keep_stage(layers, embed, head)`, which cuts it down to one pipeline stage."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return _build(cfg)
    finally:
        torch.random.set_rng_state(gen_state)


def _build(cfg: ModelConfig) -> nn.Module:
    if cfg.arch != "gpt":
        from .hf import build_hf

        return build_hf(cfg)
    return GPT(cfg)


def model_from(
    cfg: ModelConfig, params: Mapping[str, torch.Tensor], device: torch.device | str = "cpu",
    stage: tuple[set[int], bool, bool] | None = None,
) -> nn.Module:
    """The model holding `params` (or, with `stage` = (layers, embed, head), one pipeline stage of
    it: `keep_stage`'s arguments), built without memory for anything else and without drawing an
    initialisation: the structure on the meta device, then only what it keeps made real on
    `device` and copied from `params`, one tensor at a time. `params` may be lazy (`task.StoredParams`
    reads a stored G_0 tensor by tensor), so a stage reads its slice and no more; a superset is
    fine. Buffers that are not parameters (the rotary tables of the transformers archs) are
    recomputed. Equal to `build_model` (and `keep_stage`) followed by `load_params`:
    tests/test_materialize.py."""
    model = build_meta(cfg)
    if stage is not None:
        model.keep_stage(*stage)
    model.to_empty(device=device)
    model.retie()  # to_empty makes a new tensor per module: a tied head would have its own
    load_params(model, params)
    model.reset_buffers(device)
    return model


def build_meta(cfg: ModelConfig) -> nn.Module:
    """The model's structure without memory: parameter names and shapes, on the meta device."""
    gen_state = torch.random.get_rng_state()  # meta tensors draw nothing; keep the RNG untouched regardless
    try:
        with torch.device("meta"), _NoDrawsOnMeta():
            return _build(cfg)
    finally:
        torch.random.set_rng_state(gen_state)


class _NoDrawsOnMeta(TorchFunctionMode):
    """Skips the in-place ops of an initialisation (draws, and `trunc_normal_`'s erfinv_/clamp_) on
    meta tensors, which hold no values and keep their shapes under them: torch runs those ops'
    meta kernels through its Python references, whose first call imports torch._dynamo (~1.5 s,
    in every process that builds a model's structure: `plan`, a run's launcher, a stage built from
    the store)."""

    SKIPPED = frozenset([getattr(torch.Tensor, name) for name in (
        "normal_", "uniform_", "erfinv_", "clamp_", "log_normal_", "exponential_", "cauchy_", "geometric_",
        "bernoulli_", "random_")] + [getattr(nn.init, name) for name in (  # these dispatch as themselves
        "normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
        "xavier_normal_", "orthogonal_")])

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))  # nn.init's come as keywords
        if func in self.SKIPPED and isinstance(target, torch.Tensor) and target.is_meta:
            return target
        return func(*args, **kwargs)


def load_params(model: nn.Module, params: Mapping[str, torch.Tensor]) -> None:
    """Copy `params` (by name; a superset is fine) into `model`'s parameters, across devices; a
    tied last stage's head copy (`head_copy`) from the embedding, when `params` holds it."""
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(params[k])
        _, copy = tied_ends(model)
        if copy is not None and embedding_name(model.cfg) in params:
            copy.copy_(params[embedding_name(model.cfg)])


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in nats."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
