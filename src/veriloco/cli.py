"""The `veriloco` command line.

    veriloco train [CONFIG.toml] [--section.key=value ...] [--out DIR]
    veriloco train --resume DIR
    veriloco config                # print the config reference (every section and key)

Bad input (config typo, wrong type, missing file, corrupt run directory) prints one line
naming the problem and exits with code 2; a failure during training exits with code 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from .config import ConfigError, describe, load_config
from .data import DataError
from .records import RunDirError
from .store import StoreError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Verifiable low-communication decentralized training.")

USER_ERRORS = (ConfigError, DataError, RunDirError, StoreError, FileNotFoundError)


def fail(msg: str, code: int = 2) -> None:
    typer.echo(f"veriloco: error: {msg}", err=True)
    raise typer.Exit(code)


def _print_summary(run_dir: Path, summary: dict) -> None:
    s = summary
    start, end = s.get("eval_loss_start"), s.get("eval_loss_end")
    loss = f"{start:.4f} -> {end:.4f} ({1 - end / start:.1%} lower)" if start and end else "-"
    typer.echo(
        f"done: {s['rounds']} rounds, {s['tokens'] / 1e6:.2f}M tokens in {s['wall_s']:.1f}s "
        f"({s['tokens_per_s'] / 1e3:.1f}k tok/s) | eval loss {loss} | "
        f"sent {s['bytes_sent_per_worker'] / 1e6:.1f} MB/worker\n"
        f"run: {run_dir}  (summary.json, rounds.jsonl, metrics.jsonl)"
    )


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def train(
    ctx: typer.Context,
    config: str = typer.Argument(None, help="TOML config file (default: built-in defaults)"),
    out: str = typer.Option(None, "--out", help="run directory (default: runs/<run-id>/)"),
    resume: str = typer.Option(None, "--resume", help="continue the run in this directory"),
    quiet: bool = typer.Option(False, "--quiet", help="no per-round progress lines"),
    stop_after: int = typer.Option(None, "--stop-after", help="stop cleanly after this many rounds (resume later)"),
) -> None:
    """Train: the default config, a config file, `--section.key=value` overrides (CLI > file > defaults)."""
    from .run import resume as resume_run
    from .run import train as train_run

    overrides = list(ctx.args)
    if config is not None and config.startswith("--"):
        overrides.insert(0, config)
        config = None
    bad = [a for a in overrides if not (a.startswith("--") and "=" in a)]
    if bad:
        fail(f"unexpected argument {bad[0]!r}; overrides look like --section.key=value")
    try:
        if resume:
            if config or overrides:
                fail("--resume takes no config or overrides: the run's manifest holds its config")
            run_dir, summary = resume_run(resume, quiet, stop_after)
        else:
            cfg = load_config(config, overrides)
            if cfg.train.mode == "ddp":
                from .baseline import train_ddp

                run_dir, summary = train_ddp(cfg, out, quiet)
            else:
                run_dir, summary = train_run(cfg, out, quiet, stop_after)
    except USER_ERRORS as e:
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    except Exception as e:  # a worker failed: torch.multiprocessing re-raises its traceback here
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        fail(f"training failed: {lines[-1] if lines else type(e).__name__}", code=1)
    _print_summary(run_dir.root, summary)


@app.command("config")
def config_reference() -> None:
    """Print every config section and key with its type, default and meaning."""
    typer.echo(describe())


def main() -> None:
    app(prog_name="veriloco")


if __name__ == "__main__":
    sys.exit(main())
