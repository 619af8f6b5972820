"""`veriloco sample RUN`: text from a run's global params, to see what the model learned.

The params after a round come from the run's store, checked against the round record's params
hash (`export.open_round`). The prompt is encoded as the run's corpus was: bytes, or with the
tokenizer the run keeps in its store (`[data] tokenizer`). Sampling is autoregressive over the
last `ctx` tokens, at a temperature (0: greedy), with an optional top-k, from a seeded generator,
so the same command prints the same text.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from .data import DataError, load_tokenizer
from .export import ExportError, Opened, open_round
from .model import model_from
from .records import users_task
from .store import StoreError


def _codec(opened: Opened):
    """(encode, decode) of the run's corpus: bytes, or its stored tokenizer."""
    users = users_task(opened.manifest)
    if users is not None:
        raise ExportError(f"the run trained a user's Task ({users}), not a language model of veriloco's: there is "
                          "nothing here to sample from (its params: veriloco export)")
    tokenizer = opened.tokenizer_json()
    if tokenizer is None:
        try:
            kind = json.loads(opened.store.get(opened.manifest["corpus_manifest"]))["kind"]
        except (StoreError, KeyError, ValueError, TypeError) as e:
            raise ExportError(f"the run's corpus manifest does not load from its store: {str(e).splitlines()[0]}") from None
        if kind != "text":
            raise ExportError("the run trained on the token ids of a .bin file and keeps no tokenizer: "
                              "there is nothing to turn text into its tokens and back")
        return (lambda text: list(text.encode("utf-8")),
                lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    try:
        tok = load_tokenizer(tokenizer, what="the run's tokenizer")
    except DataError as e:
        raise ExportError(str(e)) from None
    return (lambda text: tok.encode(text, add_special_tokens=False).ids, lambda ids: tok.decode(ids))


def sample(run_dir: str | Path, prompt: str = "", tokens: int = 200, temperature: float = 0.8, top_k: int = 0,
           seed: int = 0, round: int | None = None) -> tuple[str, int]:
    """`tokens` new tokens after `prompt` from the params after `round` (default: the last);
    returns (the new text, the round)."""
    if tokens < 1:
        raise ExportError(f"--tokens must be >= 1, got {tokens}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ExportError(f"--temperature must be a number >= 0, got {temperature}")
    if top_k < 0:
        raise ExportError(f"--top-k must be >= 0, got {top_k}")
    if not -(1 << 63) <= seed < 1 << 64:  # what torch's generator takes
        raise ExportError(f"--seed must be in [-2^63, 2^64), got {seed}")
    opened = open_round(run_dir, round)
    cfg, params, r = opened.cfg, opened.params, opened.round
    encode, decode = _codec(opened)
    model = model_from(cfg.model, params)
    model.eval()
    ids = encode(prompt or "\n") or [0]  # no prompt: start after a newline
    gen = torch.Generator().manual_seed(seed)
    new: list[int] = []
    with torch.no_grad():
        for _ in range(tokens):
            x = torch.tensor([(ids + new)[-cfg.model.ctx:]], dtype=torch.long)
            logits = model(x)[0, -1].float()
            if temperature == 0:
                nxt = int(logits.argmax())
            else:
                if top_k:
                    cut = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                    logits = logits.masked_fill(logits < cut, float("-inf"))
                nxt = int(torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=gen))
            new.append(nxt)
    return decode(new), r


__all__ = ["sample"]
