"""Peak memory of the prepare step's tokenization (`data._encoded`) on text with and without
newlines: a text without them used to be one tokenizer piece, whose encoding held about 70 times
its size; pieces are now at most `data.MAX_PIECE` bytes.

    python bench/tokenize_memory.py [--mb 8,32] [--out bench/results/tokenize_memory.json]

Each (layout, size) runs in a fresh interpreter: a WordLevel tokenizer of two words encodes
"hello world " x 8 per line, the lines ended by a newline ("lines") or a space ("one line"),
read in 1 MiB blocks; prints the tokens and the peak resident memory above the start (ru_maxrss).
The text itself is held by the script (its size is in the figure).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import resource, sys
from tokenizers import Tokenizer, models, pre_tokenizers
from veriloco import data
tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
line = b"hello world " * 8 + (b"\\n" if sys.argv[1] == "lines" else b" ")
text = line * (int(sys.argv[2]) * (1 << 20) // len(line))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
n = sum(len(ids) for ids in data._encoded(tok, (text[i:i + (1 << 20)] for i in range(0, len(text), 1 << 20))))
print(n, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", default="8,32", help="text sizes in MB, comma-separated")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "tokenize_memory.json"))
    args = ap.parse_args()
    try:
        sizes = [int(x) for x in args.mb.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        print(f"bench/tokenize_memory.py: error: --mb takes sizes >= 1 separated by commas, got {args.mb!r}",
              file=sys.stderr)
        sys.exit(2)
    rows = []
    print("| text | MB | tokens | peak MB above start |\n|---|---|---|---|")
    for layout in ("lines", "one line"):
        for mb in sizes:
            p = subprocess.run([sys.executable, "-c", CHILD, "lines" if layout == "lines" else "none", str(mb)],
                               capture_output=True, text=True, check=True)
            tokens, peak = p.stdout.split()
            rows.append({"text": layout, "mb": mb, "tokens": int(tokens), "peak_mb": round(float(peak), 1)})
            print(f"| {layout} | {mb} | {tokens} | {float(peak):.0f} |", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
