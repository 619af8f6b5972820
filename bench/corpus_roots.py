"""Does this checkout prepare text corpora to the roots another checkout made? The check behind
"the same roots as the code before" when the prepare step began to stream text.

    python bench/corpus_roots.py --before SRC [--out bench/results/corpus_roots.json]

`SRC` is the `src` directory of the other checkout (e.g. `git worktree add /tmp/old 4acac50`,
then `--before /tmp/old/src`). Writes a small text corpus (a directory of 10 files: lines with
multi-byte characters, an empty file, one of 600 KB with no newline and bytes that are not
UTF-8, one in a subdirectory; and one 118 KB file) and a 1000-token byte-level BPE trained on
one standard-library module, then for 24 configurations (the embedded corpus, the directory,
the file; each whole and cut by `max_bytes`; as bytes, tokenized, and tokenized with `eos`)
prints the corpus root, token count and chunk count that the other checkout's `load_corpus`
makes (in a fresh interpreter on SRC) and that this checkout's `prepare_corpus` makes. Exits 1
if any differs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def cases(tmp: Path) -> list[list[str]]:
    docs, one = tmp / "docs", tmp / "one.txt"
    sources = [[], ["--data.max_bytes=0"], ["--data.max_bytes=777777"], [f"--data.source={docs}"],
               [f"--data.source={docs}", "--data.max_bytes=0"], [f"--data.source={docs}", "--data.max_bytes=300001"],
               [f"--data.source={one}"], [f"--data.source={one}", "--data.max_bytes=100000"]]
    tok = [f"--data.tokenizer={tmp / 'tokenizer.json'}", "--model.vocab_size=1000"]
    return sources + [c + tok for c in sources] + [c + tok + ["--data.eos=<|endoftext|>"] for c in sources]


def name(overrides: list[str]) -> str:
    """A case's overrides, short: its source, max_bytes (the tiny config's 262144 unless given),
    tokenized, eos."""
    given = dict(o.removeprefix("--data.").split("=", 1) for o in overrides if o.startswith("--data."))
    parts = [Path(given.get("source", "stdlib")).name, f"max_bytes={given.get('max_bytes', '262144')}"]
    return " ".join(parts + ["tokenized"] * ("tokenizer" in given) + ["eos"] * ("eos" in given))


def write_corpus(tmp: Path) -> None:
    import os
    import random

    docs = tmp / "docs"
    (docs / "sub").mkdir(parents=True)
    rng = random.Random(0)
    for i in range(7):
        lines = "".join(f"line {rng.random()} é ✓ {'x' * rng.randrange(0, 400)}\n" for _ in range(rng.randrange(0, 5000)))
        (docs / ("sub" if i % 2 else "") / f"doc{i}.txt").write_text(lines, encoding="utf-8")
    (docs / "empty.txt").write_text("")
    (docs / "nonl.txt").write_bytes(b"\xff\xfe" + b"abc" * 200000)
    (tmp / "one.txt").write_text(Path(os.__file__).read_text(encoding="utf-8") * 3, encoding="utf-8")
    byte_bpe(1000, tmp / "tokenizer.json")


def byte_bpe(vocab_size: int, out: Path) -> None:
    """A byte-level BPE of `vocab_size` tokens (with <|endoftext|>) trained on the `os` module's
    source, written to `out` as a tokenizer.json: a tokenizer without a download."""
    import os

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator([Path(os.__file__).read_text(encoding="utf-8")], trainer)
    tok.save(str(out))


def summaries(which: str, tmp: Path) -> list[list]:
    """[root, tokens, chunks] per case: "load" with the code on sys.path, "prepare" with this one's."""
    from veriloco import data
    from veriloco.config import load_config

    out = []
    for overrides in cases(tmp):
        cfg = load_config(ROOT / "configs" / "tiny.toml", [*overrides, "--data.chunk_bytes=65536"])
        if which == "load":
            m = data.load_corpus(cfg.data, cfg.model.vocab_size, cfg.model.ctx).manifest()
        else:
            with data.prepare_corpus(cfg.data, cfg.model.vocab_size, cfg.model.ctx, scratch=tmp) as prepared:
                m = prepared.manifest
        out.append([m["root"], m["tokens"], len(m["chunks"])])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="the src directory of the checkout to compare with")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "corpus_roots.json"))
    args = ap.parse_args(argv)
    if not (Path(args.before) / "veriloco" / "data.py").is_file():
        ap.error(f"--before {args.before!r}: not a checkout's src directory (no veriloco/data.py in it)")
    with tempfile.TemporaryDirectory() as tmp:
        write_corpus(Path(tmp))
        code = (f"import sys, json; sys.path.insert(0, {args.before!r}); sys.path.insert(1, {str(ROOT / 'bench')!r}); "
                f"import corpus_roots; print(json.dumps(corpus_roots.summaries('load', __import__('pathlib').Path({tmp!r}))))")
        old = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
        if old.returncode:
            raise SystemExit(f"the other checkout failed: {old.stderr.strip().splitlines()[-1:]}")
        before = json.loads(old.stdout.strip().splitlines()[-1])
        now = summaries("prepare", Path(tmp))
        names = [name(c) for c in cases(Path(tmp))]
    rows = [{"case": n, "before": b, "now": a, "same": a == b} for n, b, a in zip(names, before, now, strict=True)]
    print("| case | root (first 16) | tokens | chunks | same |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['now'][0][:16]} | {r['now'][1]} | {r['now'][2]} | {'yes' if r['same'] else 'NO'} |")
    same = sum(r["same"] for r in rows)
    print(f"{same} of {len(rows)} the same as {args.before}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"before": args.before, "rows": rows, "same": same}, indent=2) + "\n")
    return 0 if same == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
