"""The run report: one self-contained HTML page that shows a run directory at a glance.

    veriloco report RUN          # writes RUN/report.html (the end of `veriloco train` prints it)

```python
from veriloco.report import render_report, write_report
path = write_report("runs/<run-id>")      # RUN/report.html
html = render_report("runs/<run-id>")     # the same page as a string
```

The page has four parts:
- **header card**: model, workers x stages, rounds done / planned, tokens, wall time, eval loss,
  bytes sent, run id, sha256 of manifest.json, and the audit result when RUN/audit.json exists;
- **plots** (matplotlib, inline SVG): eval and per-worker train loss per round; bytes sent per
  round and cumulative, beside the DDP baseline when there is one (`baseline` in summary.json or
  RUN/baseline/); compute utilisation per round; a table of the codecs chosen per round;
- **trust**: a worker x round grid of verdicts (accept / reject with its reason, absent, late,
  replay-audited), every rejection with its evidence, the ledger head and Merkle root;
- **notes**: whatever could not be read (a bad line, a malformed summary), so a partial or
  damaged run still gets a page rather than a traceback.

Everything in the run directory is untrusted input (records come from peers): every string is
HTML-escaped, every number is checked to be a finite number before it is used, every optional
field may be absent, and the page fetches nothing (inline CSS, inline SVG, no script; a
Content-Security-Policy forbids any fetch). A run without summary.json is shown as in progress.
"""

from __future__ import annotations

import hashlib
import html
import io
import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import __version__
from .records import RunDir, RunDirError, atomic_write

REPORT_NAME = "report.html"
MAX_WORKERS = 10_000  # a manifest claiming more is not believed (the grid would not fit anyway)
MAX_WORKERS_DRAWN = 12  # above this, train loss is drawn as mean and min-max band
MAX_REJECTIONS_LISTED = 500  # a hostile run could reject everyone every round
MAX_EVIDENCE_CHARS = 4000
MAX_REASON_CHARS = 300
MANY_ROUNDS = 40  # above this, plots drop markers and bars for lines
DENSE_GRID_ROUNDS = 60  # above this, the verdict grid shrinks to small glyph-less cells
MAX_GRID_ROUNDS = 1000  # the grid shows the latest rounds; the rejection list covers them all


# -- reading untrusted values ----------------------------------------------------------------
def _num(x: Any) -> float | None:
    """x as a float of sane size, or None (bools, strings, NaN, infinities and values that would
    overflow a sum or a plot are not numbers here)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    try:
        x = float(x)
    except OverflowError:  # an int too large for a float
        return None
    return x if math.isfinite(x) and abs(x) <= 1e18 else None


def _int(x: Any) -> int | None:
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x
    if isinstance(x, str) and x.strip().lstrip("-").isdigit() and len(x) < 20:
        return int(x)
    return None


def _list(x: Any) -> list:
    return x if isinstance(x, list) else []


def _dict(x: Any) -> dict:
    return x if isinstance(x, dict) else {}


def _nums(x: Any) -> list[float]:
    return [v for v in (_num(y) for y in _list(x)) if v is not None]


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def e(x: Any) -> str:
    """HTML-escape anything (quotes too: safe in attributes)."""
    return html.escape(str(x), quote=True)


# -- the run, as far as it can be read -------------------------------------------------------
@dataclass
class RunView:
    """What the report knows about one run directory; every field may be empty."""

    root: Path
    manifest: dict[str, Any]
    manifest_sha256: str
    summary: dict[str, Any] | None
    audit: dict[str, Any] | None
    rounds: list[dict[str, Any]]  # one record per round, sorted by round, duplicates dropped
    metrics: dict[int, dict[str, Any]]  # round -> metrics line
    baseline: list[dict[str, Any]] | None = None  # DDP baseline records, when found
    baseline_dir: Path | None = None
    notes: list[str] = field(default_factory=list)  # problems met while reading
    events: list[dict[str, Any]] = field(default_factory=list)  # elastic runs: the launcher's RUN/events.jsonl

    @property
    def config(self) -> dict[str, Any]:
        return _dict(self.manifest.get("config"))

    def cfg(self, section: str, key: str) -> Any:
        return _dict(self.config.get(section)).get(key)

    @property
    def planned_rounds(self) -> int | None:
        return _int(self.cfg("train", "rounds"))

    @property
    def n_workers(self) -> int:
        lens = [len(_list(r.get(k))) for r in self.rounds for k in ("verdicts", "train_loss")]
        configured = min(max(_int(self.cfg("topology", "workers")) or 0, 0), MAX_WORKERS)
        return min(max([configured, *lens]), MAX_WORKERS)


def _read_json(path: Path, notes: list[str]) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        obj = json.loads(path.read_bytes())
    except (ValueError, RecursionError, OSError) as err:  # ValueError: not JSON or UTF-8, a 5000-digit int
        notes.append(f"{path.name} could not be read ({type(err).__name__}); ignored")
        return None
    if not isinstance(obj, dict):
        notes.append(f"{path.name} is not a JSON object; ignored")
        return None
    return obj


def _read_jsonl(path: Path, notes: list[str]) -> list[dict[str, Any]]:
    """Every readable line; a torn last line is normal (a run being written), others are noted."""
    if not path.is_file():
        return []
    lines = path.read_bytes().split(b"\n")
    out = []
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            if i < len(lines) - 1:  # the last line without a newline is a write in progress
                notes.append(f"{path.name} line {i + 1} is not valid JSON; skipped")
            continue
        if isinstance(obj, dict):
            out.append(obj)
        else:
            notes.append(f"{path.name} line {i + 1} is not a JSON object; skipped")
    return out


def _by_round(records: list[dict[str, Any]], name: str, notes: list[str]) -> list[dict[str, Any]]:
    """Records keyed by their round number (the line index when it has none); a repeat wins."""
    seen: dict[int, dict[str, Any]] = {}
    for i, rec in enumerate(records):
        r = _int(rec.get("round"))
        if r is None or r < 0:
            notes.append(f"{name} record {i + 1} has no valid round number; placed by position")
            r = i
        if r in seen:
            notes.append(f"{name} holds round {r} twice; the later line is shown")
        seen[r] = rec | {"round": r}
    return [seen[r] for r in sorted(seen)]


def load_run(run_dir: str | Path) -> RunView:
    """Read everything the report shows; only a missing or unreadable manifest is an error."""
    run = RunDir(run_dir)
    manifest = run.read_manifest(hashes=False)  # RunDirError: not a run directory at all
    notes: list[str] = []
    summary = _read_json(run.summary_path, notes)
    audit = _read_json(run.root / "audit.json", notes)
    rounds = _by_round(_read_jsonl(run.rounds_path, notes), "rounds.jsonl", notes)
    metrics = {m["round"]: m for m in _by_round(_read_jsonl(run.metrics_path, notes), "metrics.jsonl", notes)}
    view = RunView(
        root=run.root, manifest=manifest,
        manifest_sha256=hashlib.sha256(run.manifest_path.read_bytes()).hexdigest(),
        summary=summary, audit=audit, rounds=rounds, metrics=metrics, notes=notes,
    )
    view.baseline_dir, view.baseline = _find_baseline(run.root, summary, notes)
    view.events = _read_jsonl(run.root / "events.jsonl", notes)
    return view


MAX_EVENTS = 200  # the membership table lists at most this many (the first ones)
_EVENT_TEXT = {
    "started": "started", "died": "died", "restarting": "to be started again", "cut": "cut off",
    "reconnected": "reconnected",
}


def membership_section(v: RunView) -> str:
    """Elastic runs: what happened to the workers (the launcher's events: starts, deaths, restarts,
    cuts; the rounds' members are in the verdict grid). Empty for a run without events."""
    if not v.events:
        return ""
    shown = [x for x in v.events if x.get("event") != "committed"]
    tally = Counter(str(x.get("event")) for x in shown)
    starts = Counter(_int(x.get("worker")) for x in shown if x.get("event") == "started")
    restarts = sum(n - 1 for n in starts.values())  # every start of a worker after its first
    rows = []
    for x in shown[:MAX_EVENTS]:
        kind = str(x.get("event"))
        worker, peer = _int(x.get("worker")), _int(x.get("peer"))
        who = "" if worker is None else f"worker {worker}" + ("" if peer is None else f" ↔ worker {peer}")
        detail = []
        if _num(x.get("seconds")) is not None:
            detail.append(f"for {_num(x.get('seconds')):g} s")
        if _int(x.get("exitcode")) is not None:
            detail.append(f"exit {_int(x.get('exitcode'))}")
        if x.get("error"):
            detail.append(_clip(str(x.get("error")), 160))
        if _int(x.get("restarts_left")) is not None:
            detail.append(f"{_int(x.get('restarts_left'))} restarts left")
        t, r = _num(x.get("t")), _int(x.get("round"))
        rows.append(f"<tr><td>{'' if t is None else f'{t:.1f} s'}</td><td>{'' if r is None else r}</td>"
                    f"<td>{e(_EVENT_TEXT.get(kind, _clip(kind, 40)))}</td><td>{e(who)}</td>"
                    f"<td>{e('; '.join(detail))}</td></tr>")
    more = f"<p class=muted>The first {MAX_EVENTS} of {len(shown)} events.</p>" if len(shown) > MAX_EVENTS else ""
    summary = (f"<p>Elastic membership: {tally['died']} deaths, {restarts} restarts, "
               f"{tally['cut']} cuts (a worker's link, or the path between two workers).</p>")
    table = ("<div class=scroll><table id=events><tr><th>time</th><th>rounds committed</th><th>event</th>"
             f"<th>worker</th><th>detail</th></tr>{''.join(rows)}</table></div>") if rows else ""
    return summary + table + more


def _find_baseline(
    root: Path, summary: dict[str, Any] | None, notes: list[str]
) -> tuple[Path | None, list[dict[str, Any]] | None]:
    """The DDP baseline's records: summary's `baseline` path, else RUN/baseline/; or none."""
    candidates = []
    named = _dict(summary).get("baseline")
    if isinstance(named, str) and named:
        p = Path(named)
        candidates.append(p if p.is_absolute() else root / p)
    candidates.append(root / "baseline")
    for d in candidates:
        try:
            if (d / "rounds.jsonl").is_file():
                records = _by_round(_read_jsonl(d / "rounds.jsonl", notes), "baseline rounds.jsonl", notes)
                return d, records or None
        except OSError:  # a path too long or not readable: no baseline, not a crash
            continue
    if isinstance(named, str) and named:
        notes.append("summary names a baseline run but it has no rounds.jsonl; shown without it")
    return None, None


# -- formatting ------------------------------------------------------------------------------
def _bytes(n: float | None) -> str:
    if n is None:
        return "–"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _seconds(s: float | None) -> str:
    if s is None:
        return "–"
    if s < 60:
        return f"{s:.1f} s"
    m, sec = divmod(int(round(s)), 60)
    return f"{m}m {sec:02d}s" if m < 60 else f"{m // 60}h {m % 60:02d}m"


def _loss(x: float | None) -> str:
    return "–" if x is None else f"{x:.4f}"


def _count(x: float | None) -> str:
    return "–" if x is None else f"{x:,.0f}"


def _unit_for(values: list[float]) -> tuple[str, float]:
    top = max(values, default=0.0)
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if top >= size:
            return unit, size
    return "B", 1.0


# -- plots -----------------------------------------------------------------------------------
def _figure(width: float = 7.6, height: float = 3.0, ncols: int = 1) -> tuple[Any, Any]:
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no GUI backend

    fig = Figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(1, ncols)
    from matplotlib.ticker import MaxNLocator

    for ax in axes if ncols > 1 else [axes]:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
        ax.grid(True, color="#e5e7eb", linewidth=0.8)
        ax.set_axisbelow(True)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    return fig, axes


def _svg(fig: Any, name: str) -> str:
    """The figure as inline SVG; ids prefixed with `name` so several SVGs share one page."""
    import matplotlib

    buf = io.StringIO()
    # a fixed salt keeps the page byte-stable; text stays text (smaller, selectable)
    with matplotlib.rc_context({"svg.hashsalt": name, "svg.fonttype": "none"}):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    svg = buf.getvalue()
    svg = svg[svg.index("<svg") :]  # drop the XML prolog and DOCTYPE (a URL, never fetched)
    svg = re.sub(r'(\bid="|href="#|url\(#)', rf"\g<1>{name}-", svg)
    return svg.replace("<svg ", f'<svg role="img" aria-label="{e(name)} plot" class="plot" ', 1)


def _x(rec: dict[str, Any]) -> int:
    return rec["round"] + 1  # rounds completed after this record


def plot_loss(v: RunView) -> str | None:
    """Global eval loss after each round, and each worker's mean train loss during it."""
    evals = [(_x(r), _num(r.get("eval_loss"))) for r in v.rounds]
    evals = [(x, y) for x, y in evals if y is not None]
    start = _num(_dict(v.summary).get("eval_loss_start"))
    if start is None:
        start = next((_num(r.get("eval_loss_start")) for r in v.rounds if _num(r.get("eval_loss_start")) is not None), None)
    if start is not None:
        evals.insert(0, (0, start))
    train = [(_x(r), _nums(r.get("train_loss"))) for r in v.rounds]
    train = [(x, ys) for x, ys in train if ys]
    if not evals and not train:
        return None
    fig, ax = _figure(height=3.2)
    dots = len(v.rounds) <= MANY_ROUNDS
    n = max((len(ys) for _, ys in train), default=0)
    if n and n <= MAX_WORKERS_DRAWN:
        cmap = _worker_colors(n)
        for w in range(n):
            pts = [(x - 0.5, ys[w]) for x, ys in train if w < len(ys)]
            ax.plot(*zip(*pts, strict=True), color=cmap[w], lw=1.0, alpha=0.8, marker="." if dots else None, ms=3,
                    label=f"train, worker {w}")
    elif n:
        xs = [x - 0.5 for x, _ in train]
        ax.fill_between(xs, [min(ys) for _, ys in train], [max(ys) for _, ys in train],
                        color="#93c5fd", alpha=0.5, lw=0, label=f"train, min-max of {n} workers")
        ax.plot(xs, [sum(ys) / len(ys) for _, ys in train], color="#2563eb", lw=1.2, label="train, mean")
    if evals:
        ax.plot(*zip(*evals, strict=True), color="#111827", lw=2.0, marker="o" if dots else None, ms=4, label="eval (global params)")
    base = [(_x(r), _num(r.get("eval_loss"))) for r in v.baseline or []]
    base = [(x, y) for x, y in base if y is not None]
    if base:
        b0 = next((_num(r.get("eval_loss_start")) for r in v.baseline or []), None)
        if b0 is not None:
            base.insert(0, (0, b0))
        ax.plot(*zip(*base, strict=True), color="#9333ea", lw=1.6, ls="--", marker="s" if dots else None, ms=3, label="eval, DDP baseline")
    ax.set_xlabel("round (eval after it; train loss is the mean over its inner steps)")
    ax.set_ylabel("loss (nats/token)")
    ax.legend(fontsize=8, frameon=False, ncols=2 if n > 3 else 1)
    return _svg(fig, "loss")


def _worker_colors(n: int) -> list[str]:
    palette = ["#2563eb", "#f97316", "#16a34a", "#dc2626", "#0891b2", "#a16207",
               "#db2777", "#4f46e5", "#65a30d", "#7c3aed", "#0d9488", "#ea580c"]
    return [palette[i % len(palette)] for i in range(n)]


def _bytes_per_round(records: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(round number, mean bytes sent per worker in that round), measured by the exchange."""
    out = []
    for r in records:
        sent = _nums(r.get("bytes_sent"))
        if sent:
            out.append((_x(r), sum(sent) / len(sent)))
    return out


def plot_bytes(v: RunView) -> tuple[str | None, str]:
    """Bytes sent per worker, per round and cumulative; the DDP baseline beside when present."""
    ours = _bytes_per_round(v.rounds)
    base = _bytes_per_round(v.baseline or [])
    if not ours:
        return None, ""
    unit, size = _unit_for([y for _, y in ours + base] + [sum(y for _, y in ours), sum(y for _, y in base)])
    fig, (a1, a2) = _figure(height=3.0, ncols=2)
    mode = str(v.cfg("train", "mode") or _dict(v.summary).get("mode") or "diloco")
    label = "this run" + (f" ({mode})" if mode else "")
    if max(len(ours), len(base)) > MANY_ROUNDS:  # bars too thin to see: steps
        for series, color in ((ours, "#2563eb"), (base, "#9333ea")):
            if series:
                a1.plot([x for x, _ in series], [y / size for _, y in series], color=color, lw=1.2,
                        drawstyle="steps-mid")
    else:
        a1.bar([x for x, _ in ours], [y / size for _, y in ours], width=0.8 if not base else 0.4,
               align="center" if not base else "edge", color="#2563eb")
        if base:
            a1.bar([x - 0.4 for x, _ in base], [y / size for _, y in base], width=0.4, align="edge",
                   color="#9333ea")
    a1.set_title("per round", fontsize=10)
    a1.set_xlabel("round")
    a1.set_ylabel(f"{unit} sent per worker")
    for series, color, name in ((ours, "#2563eb", label), (base, "#9333ea", "DDP baseline")):
        if series:
            total, cum = 0.0, [0.0]
            for _, y in series:
                total += y
                cum.append(total / size)
            a2.plot([0] + [x for x, _ in series], cum, color=color, lw=1.8, ms=3, label=name,
                    marker="o" if len(series) <= MANY_ROUNDS else None)
    a2.set_title("cumulative", fontsize=10)
    a2.set_xlabel("round")
    if base:
        ratio = max(y for _, y in base) / max(max(y for _, y in ours), 1.0)
        if ratio > 20 or ratio < 1 / 20:  # an order of magnitude apart: log scale shows both
            for ax in (a1, a2):
                ax.set_yscale("log")
    a2.legend(fontsize=8, frameon=False, loc="upper left")  # one legend for both panels
    caption = _bytes_caption(ours, base)
    return _svg(fig, "bytes"), caption


def _bytes_caption(ours: list[tuple[int, float]], base: list[tuple[int, float]]) -> str:
    total = sum(y for _, y in ours)
    text = f"This run sent {_bytes(total)} per worker in {len(ours)} rounds (measured on the wire)."
    if not base:
        return text + " No DDP baseline found (run one with <code>--train.mode=ddp</code> into RUN/baseline/)."
    common = min(len(ours), len(base))
    ours_c, base_c = sum(y for _, y in ours[:common]), sum(y for _, y in base[:common])
    text += f" The DDP baseline sent {_bytes(base_c)} per worker over the same {common} rounds"
    if ours_c > 0:
        text += f": {base_c / ours_c:,.1f}× what this run sent"
    return text + "."


def _utilisation(v: RunView) -> list[tuple[int, float]]:
    """Per round: metrics' `utilisation`, else mean(inner_s) / round_s from the record."""
    out = []
    for r in v.rounds:
        u = _num(v.metrics.get(r["round"], {}).get("utilisation"))
        if u is None:
            inner, round_s = _nums(r.get("inner_s")), _num(r.get("round_s"))
            if inner and round_s:
                u = sum(inner) / len(inner) / round_s
        if u is not None:
            out.append((_x(r), u))
    return out


def plot_utilisation(v: RunView) -> tuple[str | None, str]:
    util = _utilisation(v)
    if not util:
        return None, ""
    fig, ax = _figure(height=2.6)
    if len(util) > MANY_ROUNDS:
        ax.fill_between([x for x, _ in util], [u * 100 for _, u in util], step="mid", color="#16a34a", lw=0)
    else:
        ax.bar([x for x, _ in util], [u * 100 for _, u in util], width=0.8, color="#16a34a")
    mean = sum(u for _, u in util) / len(util)
    ax.axhline(mean * 100, color="#111827", lw=1, ls=":", label=f"mean {mean:.0%}")
    ax.set_ylim(0, max(100, max(u for _, u in util) * 105))
    ax.set_xlabel("round")
    ax.set_ylabel("compute utilisation (%)")
    ax.legend(fontsize=8, loc="upper right", framealpha=0.9, edgecolor="none")
    caption = (f"Share of each round spent in inner steps (mean over workers): {mean:.0%} on average. "
               "The rest is encoding, exchange, verification, aggregation and records.")
    return _svg(fig, "utilisation"), caption + _hide_caption(v)


def _hide_caption(v: RunView) -> str:
    """A sentence when the records' `hide_steps` (round.hide_steps) exceeded the compute that a
    delayed exchange had to hide under."""
    window = _int(v.cfg("outer", "overlap_steps")) or _int(v.cfg("train", "inner_steps"))
    need = [(r["round"], n) for r in v.rounds if (n := _int(r.get("hide_steps"))) is not None]
    if not _int(v.cfg("outer", "delay")) or not window or not need:
        return ""
    short = [n for _, n in need if n > window]
    if not short:
        return f" The exchange fit under the {window} inner steps it overlaps in all {len(need)} rounds that measured it."
    return (f" In {len(short)} of {len(need)} rounds the exchange needed more compute to hide under than the "
            f"{window} inner steps it overlaps: up to {max(short)} (round.hide_steps).")


# -- codecs ----------------------------------------------------------------------------------
def _codec_counts(raw: Any, depth: int = 0) -> Counter[str]:
    """Tensors per codec spec in a round's `codecs`: a spec string (one for the whole packet),
    {param: spec}, {spec: n_tensors}, {"codecs": ...}, or a list of these (one per worker)."""
    c: Counter[str] = Counter()
    if depth > 4:  # nested deeper than any record we write: not worth following
        return c
    if isinstance(raw, str):
        c[_clip(raw, 80)] += 1
    elif isinstance(raw, dict):
        if "codecs" in raw:
            return _codec_counts(raw["codecs"], depth + 1)
        for key, val in raw.items():
            n = _int(val) if not isinstance(val, str) else None
            if n is not None:  # {spec: n_tensors}
                c[_clip(str(key), 80)] += max(n, 0)
            else:
                c += _codec_counts(val, depth + 1)
    elif isinstance(raw, list):
        for val in raw:
            c += _codec_counts(val, depth + 1)
    return c


def codec_section(v: RunView) -> str:
    per_round: list[tuple[int, Counter[str], bool]] = []
    for r in v.rounds:
        raw = r.get("codecs", r.get("codec"))
        counts = +_codec_counts(raw)  # unary +: keep positive counts only
        if counts:
            per_round.append((r["round"], counts, isinstance(raw, str)))
    if not per_round:
        configured = v.cfg("compress", "codec")
        if configured is None:
            return "<p class=muted>No codec recorded.</p>"
        return f"<p>Configured codec: <code>{e(configured)}</code> (rounds do not record their codec).</p>"
    specs = sorted(set().union(*(c for _, c, _ in per_round)))
    if specs == ["fp32"]:
        return "<p>All rounds sent <code>fp32</code>: no compression.</p>"
    head = "".join(f"<th>{r + 1}</th>" for r, _, _ in per_round)
    rows = []
    for spec in specs:
        cells = []
        for r, counts, whole in per_round:
            n = counts.get(spec, 0)
            share = n / sum(counts.values())
            text = ("all" if whole else str(n)) if n else ""
            cells.append(f'<td style="background:rgba(37,99,235,{0.12 + 0.6 * share:.2f})" '
                         f'title="round {r + 1}: {e(spec)} on {n} of {sum(counts.values())}">{text}</td>'
                         if n else "<td></td>")
        rows.append(f"<tr><th class=spec><code>{e(spec)}</code></th>{''.join(cells)}</tr>")
    return ("<p>Codecs chosen per round: the number of tensors encoded with each spec, summed over "
            "the workers' packets (“all”: one spec for the whole packet).</p>"
            f"<div class=scroll><table class=heat><tr><th>codec \\ round</th>{head}</tr>{''.join(rows)}</table></div>")


# -- trust -----------------------------------------------------------------------------------
@dataclass
class Cell:
    state: str  # accept | reject | absent | unknown
    reason: str = ""
    replayed: bool = False
    late: bool = False


def _verdict(v: Any) -> tuple[str, str]:
    """(state, reason) of a recorded verdict: "accept", "reject:<why>", a reason code, or a dict."""
    if isinstance(v, dict):
        v = v.get("reason", v.get("verdict"))
    if not isinstance(v, str) or not v:
        return "unknown", "" if v is None else "unreadable verdict"
    if v == "accept":
        return "accept", ""
    return "reject", v[len("reject:"):] if v.startswith("reject:") else v


def _worker_ids(raw: Any, n: int) -> set[int]:
    """Worker ids in a record list; ids outside the run's workers are ignored (never grow the grid)."""
    return {w for w in (_int(x) for x in _list(raw)) if w is not None and 0 <= w < n}


def _evidence(rec: dict[str, Any], w: int) -> Any:
    ev = rec.get("evidence")
    if isinstance(ev, dict):
        return ev.get(str(w), ev.get(w))  # type: ignore[call-overload]
    if isinstance(ev, list) and w < len(ev):
        return ev[w]
    return None


def verdict_grid(v: RunView) -> tuple[list[list[Cell]], int]:
    """cells[round index][worker] for every recorded round; and the number of workers."""
    n = v.n_workers
    grid = []
    for rec in v.rounds:
        verdicts = _list(rec.get("verdicts"))
        replayed, late = _worker_ids(rec.get("replayed"), n), _worker_ids(rec.get("late"), n)
        absent = _worker_ids(rec.get("absent"), n)
        row = []
        for w in range(n):
            state, reason = _verdict(verdicts[w]) if w < len(verdicts) else ("unknown", "")
            if w in absent:
                state, reason = "absent", reason or "no packet arrived"
            row.append(Cell(state, reason, w in replayed, w in late))
        grid.append(row)
    return grid, n


_GLYPH = {"accept": "✓", "reject": "✗", "absent": "·", "unknown": "?"}


def trust_section(v: RunView) -> str:
    if not v.rounds:
        return "<p class=muted>No rounds recorded yet.</p>"
    grid, n = verdict_grid(v)
    if n == 0:
        return "<p class=muted>The records name no workers.</p>"
    cells = [c for row in grid for c in row]
    tally = Counter(c.state for c in cells)
    n_replayed = sum(c.replayed for c in cells)
    shown, shown_grid = v.rounds[-MAX_GRID_ROUNDS:], grid[-MAX_GRID_ROUNDS:]
    dense = len(shown) > DENSE_GRID_ROUNDS
    step = 10 if dense else 1
    head = "".join(f"<th>{rec['round'] + 1 if rec['round'] % step == 0 or step == 1 else ''}</th>" for rec in shown)
    rows = []
    for w in range(n):
        tds = []
        for rec, row in zip(shown, shown_grid, strict=True):
            c, r = row[w], rec["round"]
            title = f"round {r + 1}, worker {w}: {c.state}"
            if c.reason:
                title += f" ({_clip(c.reason, MAX_REASON_CHARS)})"
            if c.replayed:
                title += "; replay-audited"
            if c.late:
                title += "; late"
            cls = " ".join(["v", c.state] + (["replayed"] if c.replayed else []) + (["late"] if c.late else []))
            glyph = "" if dense else _GLYPH[c.state]
            if c.state == "reject":
                glyph = f'<a href="#rej-{r}-{w}">{glyph}</a>'
            tds.append(f'<td class="{cls}" data-round="{r}" data-worker="{w}" data-state="{c.state}" '
                       f'title="{e(title)}">{glyph}</td>')
        rows.append(f"<tr><th>worker {w}</th>{''.join(tds)}</tr>")
    legend = (
        '<div class=legend><span class="v accept">✓</span> accepted '
        '<span class="v reject">✗</span> rejected (hover for the reason) '
        '<span class="v absent">·</span> absent '
        '<span class="v accept late">✓</span> late '
        '<span class="v accept replayed">✓</span> replay-audited '
        '<span class="v unknown">?</span> not recorded</div>'
    )
    summary = (f"<p>{len(v.rounds)} rounds × {n} workers: {tally['accept']} accepted, "
               f"{tally['reject']} rejected, {tally['absent']} absent"
               + (f", {tally['unknown']} not recorded" if tally["unknown"] else "")
               + f"; {n_replayed} replay-audited.</p>")
    if len(shown) < len(v.rounds):
        summary += f"<p class=muted>The grid shows the latest {len(shown)} rounds.</p>"
    grid_html = (f'<div class=scroll><table class="grid{" dense" if dense else ""}" id=verdict-grid>'
                 f"<tr><th>round →</th>{head}</tr>{''.join(rows)}</table></div>")
    return summary + legend + grid_html + _rejections(v, grid) + _agreement(v)


def _rejections(v: RunView, grid: list[list[Cell]]) -> str:
    found = [(rec, w, c) for rec, row in zip(v.rounds, grid, strict=True) for w, c in enumerate(row)
             if c.state == "reject"]
    if not found:
        return "<h3>Rejections</h3><p>None: every recorded packet was accepted.</p>"
    items = []
    for rec, w, c in found[:MAX_REJECTIONS_LISTED]:
        ev = _evidence(rec, w)
        if ev is None:
            ev_html = "<span class=muted>no evidence recorded</span>"
        else:
            text = json.dumps(ev, indent=1, sort_keys=True, default=str, ensure_ascii=False)
            ev_html = f"<pre>{e(_clip(text, MAX_EVIDENCE_CHARS))}</pre>"
        items.append(f'<tr id="rej-{rec["round"]}-{w}" class=rejection><td>{rec["round"] + 1}</td><td>{w}</td>'
                     f"<td><code>{e(_clip(c.reason, MAX_REASON_CHARS))}</code></td><td>{ev_html}</td></tr>")
    more = len(found) - MAX_REJECTIONS_LISTED
    tail = f"<p class=muted>… and {more} more.</p>" if more > 0 else ""
    return (f"<h3>Rejections ({len(found)})</h3><table class=list id=rejections>"
            f"<tr><th>round</th><th>worker</th><th>reason</th><th>evidence</th></tr>{''.join(items)}</table>{tail}")


def _agreement(v: RunView) -> str:
    flags = [(r["round"], r.get("hashes_agree")) for r in v.rounds if "hashes_agree" in r]
    if not flags:
        return ""
    bad = [r + 1 for r, ok in flags if ok is not True]
    if bad:
        return f"<p class=bad>Workers disagreed on the global params after round(s) {e(', '.join(map(str, bad[:20])))}.</p>"
    return f"<p class=good>All workers derived the same global params in all {len(flags)} recorded rounds.</p>"


def ledger_section(v: RunView) -> str:
    s = _dict(v.summary)
    last_entry = next((r.get("entry_hash") for r in reversed(v.rounds) if isinstance(r.get("entry_hash"), str)), None)
    head = s.get("ledger_head") if isinstance(s.get("ledger_head"), str) else last_entry
    root = s.get("ledger_root") if isinstance(s.get("ledger_root"), str) else None
    if head is None and root is None:
        return "<p class=muted>This run recorded no ledger entries.</p>"
    rows = [("ledger head (last entry hash)", head), ("Merkle root of the entries", root)]
    return "<table class=kv>" + "".join(
        f"<tr><th>{label}</th><td><code>{e(_clip(val, 200)) if val else '–'}</code></td></tr>" for label, val in rows
    ) + "</table>"


# -- header ----------------------------------------------------------------------------------
def _status(v: RunView) -> tuple[str, str]:
    planned, done = v.planned_rounds, len(v.rounds)
    if v.summary is None:
        return "running", "in progress"
    complete = v.summary.get("complete")
    if complete is False or (complete is None and planned is not None and done < planned):
        return "stopped", "stopped (resume with <code>veriloco train --resume RUN</code>)"
    return "done", "complete"


def _audit_badge(v: RunView) -> str:
    if v.audit is None:
        return '<span class="badge muted">not audited</span>'
    if v.audit.get("ok") is True:
        return '<span class="badge good">audit passed</span>'
    first = v.audit.get("first_failure")
    why = f": {e(_clip(str(first), MAX_REASON_CHARS))}" if first is not None else ""
    return f'<span class="badge bad">audit failed{why}</span>'


def _mode_text(v: RunView, mode: Any, codec: Any) -> str:
    delay = _int(v.cfg("outer", "delay"))
    if delay:
        mode = f"{mode}, outer delay {delay} ({v.cfg('outer', 'correction') or 'naive'})"
        tau = _int(v.cfg("outer", "overlap_steps"))
        if tau:
            mode = f"{mode}, lands after {tau} inner step{'s' if tau > 1 else ''}"
    where = [str(x) for x in (v.cfg("run", "device"), v.cfg("train", "precision")) if x not in (None, "cpu", "fp32")]
    if where:  # [run] device, [train] precision, when not the CPU in fp32
        mode = ", ".join([str(mode), *where])
    codec = "–" if codec is None else codec
    if v.cfg("compress", "error_feedback") is True:
        codec = f"{codec} + error feedback"
    return f"{mode} / {codec}"


def header(v: RunView) -> str:
    s = _dict(v.summary)
    m = _dict(v.config.get("model"))
    model = " · ".join([*([e(m["arch"])] if m.get("arch") not in (None, "gpt") else []),  # [model] arch: transformers'
                        *(f"{e(val)} {label}" for key, label in
                          (("n_layer", "layers"), ("d_model", "d_model"), ("n_head", "heads"), ("kv_heads", "kv heads"),
                           ("ctx", "ctx"), ("vocab_size", "vocab")) if (val := m.get(key))),
                        *(["tied embeddings"] if m.get("tie") is True else [])])
    stages = _int(v.cfg("topology", "stages")) or 1
    planned = v.planned_rounds
    tokens = _num(s.get("tokens"))
    if tokens is None:
        tokens = sum(_num(r.get("tokens")) or 0 for r in v.rounds) or None
    wall = _num(s.get("wall_s"))
    if wall is None and v.metrics:
        wall = _num(v.metrics[max(v.metrics)].get("elapsed_s"))
    if wall is None:
        wall = sum(_num(r.get("round_s")) or 0 for r in v.rounds) or None
    evals = [x for x in (_num(r.get("eval_loss")) for r in v.rounds) if x is not None]
    # the records' numbers first (what `veriloco audit` checks), summary.json's (not audited) only without them
    end = evals[-1] if evals else _num(s.get("eval_loss_end"))
    start = _num(s.get("eval_loss_start"))
    if start is None and v.rounds:
        start = _num(v.rounds[0].get("eval_loss_start"))
    sent = _num(s.get("bytes_sent_per_worker"))
    if sent is None:
        sent = sum(y for _, y in _bytes_per_round(v.rounds)) or None
    tps = _num(s.get("tokens_per_s"))
    if tps is None and tokens and wall:
        tps = tokens / wall
    status_cls, status = _status(v)
    mode = v.cfg("train", "mode") or s.get("mode") or "diloco"
    codec = v.cfg("compress", "codec")
    inner_steps = v.cfg("train", "inner_steps")
    grown = sorted({n for r in v.rounds if (n := _int(r.get("inner_steps"))) is not None})  # adaptive H
    if len(grown) > 1:
        inner_steps = f"{grown[0]} to {grown[-1]}"
    loss_text = _loss(end)
    if start is not None and end is not None:
        loss_text += f'<div class=sub>from {_loss(start)} at the start</div>'
    numbers = [
        ("workers × stages", f"{v.n_workers} × {stages}"),
        ("rounds", f"{len(v.rounds)} / {planned if planned is not None else '?'}"
                   + (f'<div class=sub>H = {e(inner_steps)} inner steps each</div>' if inner_steps is not None else "")),
        ("tokens", _count(tokens)),
        ("wall time", _seconds(wall) + (f'<div class=sub>{tps / 1e3:.1f}k tokens/s</div>' if tps else "")),
        ("final eval loss" if v.summary is not None else "latest eval loss", loss_text),
        ("sent per worker", _bytes(sent)),
    ]
    for key, label, sub in (("peak_rss_mb", "peak memory", "resident, the largest worker process"),  # ru_maxrss
                            ("peak_gpu_mb", "peak GPU memory", "allocated, the largest worker process")):
        most = max((x for r in v.rounds for x in _nums(r.get(key))), default=None)
        if most:
            size = f"{most / 1024:.2f} GB" if most >= 1024 else f"{most:.0f} MB"
            numbers.append((label, size + f"<div class=sub>{sub}</div>"))
    stats = "".join(f"<div class=stat><div class=label>{label}</div><div class=value>{value}</div></div>"
                    for label, value in numbers)
    ids = [
        ("run id", v.manifest.get("run_id") or v.root.name),
        ("manifest sha256", v.manifest_sha256),
        ("model", model or "–"),
        ("mode / codec", _mode_text(v, mode, codec)),
        ("corpus root", v.manifest.get("corpus_root")),
        ("model init hash", v.manifest.get("model_init_hash")),
        ("starting weights (store)", v.manifest.get("init")),  # [model] init
        ("tokenizer (store)", v.manifest.get("tokenizer")),  # [data] tokenizer
        ("transformers version", v.manifest.get("transformers_version")),
        ("final params hash" if v.summary is not None else "latest params hash", (v.rounds[-1].get("params_hash") if v.rounds else None) or s.get("final_params_hash")),
        ("code version", v.manifest.get("code_version")),
        # how its params, trace and aggregate hashes are computed (a run made before the tree: one stream a dict)
        ("tensor hash", _clip(str(v.manifest.get("tensor_hash") or "one sha256 stream a dict"), 64)),
        ("run directory", str(v.root)),
    ]
    kv = "".join(f"<tr><th>{label}</th><td><code>{e(_clip(str(val), 200))}</code></td></tr>"
                 for label, val in ids if val is not None and val != "")
    return (
        f'<header class=card><div class=title><h1>veriloco run <code>{e(_clip(str(v.manifest.get("run_id") or v.root.name), 64))}</code></h1>'
        f'<div class=badges><span class="badge {status_cls}" id=status>{status}</span> {_audit_badge(v)}</div></div>'
        f"<div class=stats>{stats}</div><table class=kv>{kv}</table></header>"
    )


# -- page ------------------------------------------------------------------------------------
CSS = """
:root { --fg:#111827; --muted:#6b7280; --line:#e5e7eb; --bg:#f8fafc; --card:#fff;
        --good:#16a34a; --bad:#dc2626; --blue:#2563eb; --amber:#f59e0b; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--fg);
       font:14px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif; }
main { max-width:1100px; margin:0 auto; padding:24px 20px 48px; }
h1 { font-size:20px; margin:0; } h2 { font-size:17px; margin:0 0 12px; } h3 { font-size:15px; margin:20px 0 8px; }
code, pre { font-family:ui-monospace,"DejaVu Sans Mono",Menlo,Consolas,monospace; font-size:12px; }
pre { margin:0; white-space:pre-wrap; word-break:break-all; max-height:220px; overflow:auto; }
.card, section { background:var(--card); border:1px solid var(--line); border-radius:10px; padding:18px 20px; margin:0 0 18px; }
.title { display:flex; flex-wrap:wrap; justify-content:space-between; align-items:center; gap:10px; }
.badge { display:inline-block; padding:2px 10px; border-radius:999px; font-size:12px; font-weight:600;
         background:#eef2ff; color:#3730a3; }
.badge.done, .badge.good { background:#dcfce7; color:#166534; }
.badge.running { background:#dbeafe; color:#1e40af; }
.badge.stopped { background:#fef3c7; color:#92400e; }
.badge.bad { background:#fee2e2; color:#991b1b; } .badge.muted { background:#f3f4f6; color:var(--muted); }
.stats { display:grid; grid-template-columns:repeat(auto-fit,minmax(150px,1fr)); gap:10px; margin:16px 0; }
.stat { border:1px solid var(--line); border-radius:8px; padding:8px 12px; }
.stat .label { color:var(--muted); font-size:12px; }
.stat .value { font-size:20px; font-weight:600; font-variant-numeric:tabular-nums; }
.sub { color:var(--muted); font-size:12px; font-weight:400; }
table { border-collapse:collapse; }
table.kv th { text-align:left; color:var(--muted); font-weight:500; padding:2px 16px 2px 0; white-space:nowrap; vertical-align:top; }
table.kv td { padding:2px 0; word-break:break-all; }
table.list { width:100%; } table.list th, table.list td { border-bottom:1px solid var(--line); padding:6px 8px; text-align:left; vertical-align:top; }
figure { margin:0 0 14px; } figcaption { color:var(--muted); font-size:13px; }
svg.plot { width:100%; height:auto; max-width:900px; display:block; }
.scroll { overflow-x:auto; padding-bottom:4px; }
table.grid th { font-size:11px; font-weight:500; color:var(--muted); padding:0 6px 0 0; white-space:nowrap; text-align:right; }
table.grid tr:first-child th { text-align:center; padding:0; min-width:22px; }
.v { width:22px; height:22px; min-width:22px; text-align:center; font-size:12px; line-height:20px;
     border:2px solid #fff; border-radius:4px; color:#fff; padding:0; }
.legend .v { display:inline-block; margin:0 4px 0 12px; vertical-align:middle; }
.legend .v:first-child { margin-left:0; }
.v a { color:inherit; text-decoration:none; display:block; min-height:100%; }
table.grid.dense .v { width:11px; height:14px; min-width:11px; border-width:1px; border-radius:2px; font-size:0; line-height:12px; }
table.grid.dense .v a { height:12px; }
table.grid.dense .v.replayed { box-shadow:inset 0 0 0 1px var(--blue); }
table.grid.dense tr:first-child th { min-width:11px; font-size:10px; overflow:visible; }
.v.accept { background:var(--good); } .v.reject { background:var(--bad); }
.v.absent { background:#d1d5db; color:#374151; } .v.unknown { background:#f3f4f6; color:var(--muted); }
.v.replayed { box-shadow:inset 0 0 0 2px var(--blue); border-color:var(--blue); }
.v.late { background-image:linear-gradient(135deg,var(--amber) 0 35%,transparent 35%); }
.legend { font-size:12px; color:var(--muted); margin:6px 0 10px; }
table.heat th, table.heat td { border:1px solid var(--line); padding:2px 6px; text-align:center; font-size:12px; }
table.heat th.spec { text-align:left; }
.good { color:var(--good); } .bad { color:var(--bad); } .muted { color:var(--muted); }
.notes { background:#fffbeb; border-color:#fde68a; }
footer { color:var(--muted); font-size:12px; text-align:center; }
"""

# the page runs nothing and fetches nothing, whatever a record holds
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"


def _figure_html(svg: str | None, caption: str, empty: str) -> str:
    if svg is None:
        return f"<p class=muted>{empty}</p>"
    return f"<figure>{svg}<figcaption>{caption}</figcaption></figure>"


def render_report(run_dir: str | Path) -> str:
    """The report of `run_dir` as one self-contained HTML page."""
    v = load_run(run_dir)
    loss_svg = plot_loss(v)
    bytes_svg, bytes_caption = plot_bytes(v)
    util_svg, util_caption = plot_utilisation(v)
    membership = membership_section(v)
    notes = ""
    if v.notes:
        unique = list(dict.fromkeys(v.notes))  # once each, in order
        items = "".join(f"<li>{e(n)}</li>" for n in unique[:50])
        if len(unique) > 50:
            items += f"<li>… and {len(unique) - 50} more</li>"
        notes = f"<section class=notes><h2>Notes on this run directory</h2><ul>{items}</ul></section>"
    title = f"veriloco report: {_clip(str(v.manifest.get('run_id') or v.root.name), 64)}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{CSP}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>{e(title)}</title>
<style>{CSS}</style></head>
<body><main>
{header(v)}
{notes}
<section id=training><h2>Training</h2>
{_figure_html(loss_svg, "Eval loss of the global params after each round, beside each worker's mean train loss during the round.", "No losses recorded yet.")}
</section>
<section id=communication><h2>Communication</h2>
{_figure_html(bytes_svg, bytes_caption, "No bytes recorded yet.")}
<h3>Codecs</h3>
{codec_section(v)}
</section>
<section id=utilisation><h2>Compute utilisation</h2>
{_figure_html(util_svg, util_caption, "No round timings recorded yet.")}
</section>
<section id=trust><h2>Trust</h2>
{trust_section(v)}
<h3>Ledger</h3>
{ledger_section(v)}
</section>
{f"<section id=membership><h2>Membership</h2>{membership}</section>" if membership else ""}
<footer>written by veriloco {e(__version__)} from {e(v.root.name)}/ (manifest.json, rounds.jsonl, metrics.jsonl, summary.json{", events.jsonl" if v.events else ""})</footer>
</main></body></html>
"""


def write_report(run_dir: str | Path) -> Path:
    """Write RUN/report.html (atomically) and return its path."""
    page = render_report(run_dir)
    path = Path(run_dir) / REPORT_NAME
    atomic_write(path, page.encode("utf-8"))
    return path


__all__ = ["REPORT_NAME", "RunDirError", "RunView", "load_run", "render_report", "write_report"]
