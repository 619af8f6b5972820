"""`veriloco sample RUN`: text from a run's global params, to see what the model learned.

The params after a round come from the run's store, checked against the round record's params
hash (`export.open_round`). The prompt is encoded as the run's corpus was: bytes, or with the
tokenizer the run keeps in its store (`[data] tokenizer`). Sampling is autoregressive over the
last `ctx` tokens, at a temperature (0: greedy), with an optional top-k, from a seeded generator,
so the same command prints the same text. The text streams as it is written (`on_text`): a byte
is passed on once it completes a UTF-8 character, a token once its text no longer ends in an
unfinished one, so a long sample shows from its first token and Ctrl-C keeps what was printed.
"""

from __future__ import annotations

import codecs
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch

from .data import DataError, load_tokenizer
from .export import ExportError, Opened, open_round
from .model import model_from
from .records import users_task
from .store import StoreError


class _ByteStream:
    """The text of a byte-level sample as it grows: each byte is fed to an incremental UTF-8
    decoder, which holds an unfinished character back (what `bytes.decode(errors="replace")`
    gives for the whole, piece by piece)."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: list[int]) -> str:
        return self._decoder.decode(bytes(ids[-1:]))

    def end(self, ids: list[int]) -> str:
        return self._decoder.decode(b"", final=True)


class _TokenStream:
    """The text of a tokenizer's sample as it grows: the ids since the last newline printed are
    decoded together (a tokenizer may strip a leading space or join pieces at the start of a
    decode), and only what is new and does not end in an unfinished character (U+FFFD, a byte
    token waiting for the rest of its character) is passed on."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode, self._anchor, self._shown = decode, 0, ""

    def push(self, ids: list[int]) -> str:
        text = self._decode(ids[self._anchor:])
        if text.endswith("\ufffd") or not text.startswith(self._shown):
            return ""
        new, self._shown = text[len(self._shown):], text
        if text.endswith("\n"):
            self._anchor, self._shown = len(ids), ""
        return new

    def end(self, ids: list[int]) -> str:
        text = self._decode(ids[self._anchor:])
        return text[len(self._shown):] if text.startswith(self._shown) else ""


def _codec(opened: Opened):
    """(encode, decode, byte-level?) of the run's corpus: bytes, or its stored tokenizer."""
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
                lambda ids: bytes(ids).decode("utf-8", errors="replace"), True)
    try:
        tok = load_tokenizer(tokenizer, what="the run's tokenizer")
    except DataError as e:
        raise ExportError(str(e)) from None
    return (lambda text: tok.encode(text, add_special_tokens=False).ids, lambda ids: tok.decode(ids), False)


def sample(run_dir: str | Path, prompt: str = "", tokens: int = 200, temperature: float = 0.8, top_k: int = 0,
           seed: int = 0, round: int | None = None, on_text: Callable[[str], None] | None = None) -> tuple[str, int]:
    """`tokens` new tokens after `prompt` from the params after `round` (default: the last);
    returns (the new text, the round). `on_text(piece)`: called with the text as it is written,
    in pieces that add up to the returned text (a tokenizer whose text of more tokens is not an
    extension of its text of fewer, which byte-level and BPE tokenizers' is, may print less)."""
    if tokens < 1:
        raise ExportError(f"--tokens must be >= 1, got {tokens}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ExportError(f"--temperature must be a number >= 0, got {temperature}")
    if top_k < 0:
        raise ExportError(f"--top-k must be >= 0, got {top_k}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:  # bytes the terminal's encoding could not decode (sys.argv's surrogates)
        raise ExportError("--prompt is not UTF-8 text") from None
    if not -(1 << 63) <= seed < 1 << 64:  # what torch's generator takes
        raise ExportError(f"--seed must be in [-2^63, 2^64), got {seed}")
    opened = open_round(run_dir, round)
    cfg, params, r = opened.cfg, opened.params, opened.round
    encode, decode, byte_level = _codec(opened)
    model = model_from(cfg.model, params)
    model.eval()
    ids = encode(prompt or "\n") or [0]  # no prompt: start after a newline
    gen = torch.Generator().manual_seed(seed)
    new: list[int] = []
    stream = None if on_text is None else _ByteStream() if byte_level else _TokenStream(decode)
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
                # less the largest first: a tiny temperature makes inf / inf of the largest, and NaN of softmax
                scaled = (logits - logits.max()) / temperature
                nxt = int(torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=gen))
            new.append(nxt)
            if stream is not None and (piece := stream.push(new)):
                on_text(piece)
    if stream is not None and (piece := stream.end(new)):
        on_text(piece)
    return decode(new), r


__all__ = ["sample"]
