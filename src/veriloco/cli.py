"""The `veriloco` command line.

    veriloco train [CONFIG.toml] [--section.key=value ...] [--out DIR]
    veriloco train --resume DIR
    veriloco train ... --run.membership=elastic --host ADDR --workers 0,1   # and on other machines:
    veriloco join RUN --workers 2,3   # more workers of that elastic run (the run directory is shared)
    veriloco audit RUN             # re-verify a finished run from its directory alone
    veriloco audit --ledger RUN/ledger.sqlite --store s3://bucket/store   # ... or from where it was published
    veriloco audit --ledger evm:CONTRACT@RPC_URL --run-id ID --store URL   # ... with an EVM ledger
    veriloco prove RUN ROUND       # inclusion proof of a round's ledger entry
    veriloco report RUN            # RUN/report.html: one self-contained page
    veriloco export RUN --out DIR  # the global params as a model directory (transformers archs: from_pretrained)
    veriloco sample RUN --prompt TEXT   # what the run's model writes after TEXT
    veriloco tokenize SOURCE --tokenizer T --out X.bin [--eos TOKEN]   # a text source as a token .bin, a document at a time
    veriloco keygen --out DIR --workers N   # Ed25519 keys for [verify] key_dir (--worker W: one party's own)
    veriloco config                # print the config reference (every section and key)

Bad input (config typo, wrong type, missing file, corrupt run directory) prints one line
naming the problem and exits with code 2; a failure during training exits with code 1.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NoReturn

import typer

from .config import ConfigError, config_warnings, describe, load_config

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Verifiable low-communication decentralized training.")


def user_errors() -> tuple[type[Exception], ...]:
    """The errors that mean bad input (one line, exit 2). Imported when an exception is matched, so
    that importing this module imports no torch: `veriloco train` starts the workers' forkserver
    first (train below), and `veriloco config` or `--help` answer at once."""
    from .data import DataError
    from .export import ExportError
    from .faults import FaultError
    from .records import RunDirError
    from .store import StoreError
    from .verify.identity import IdentityError

    # OSError: a path the OS refuses (a name past 255 bytes, a directory where a file goes, a place it may not
    # write); an error of the machine mid-run (a full disk) reads the same, one line and exit 2
    return (ConfigError, DataError, ExportError, RunDirError, StoreError, OSError, FaultError, IdentityError)


def fail(msg: str, code: int = 2) -> None:
    typer.echo(f"veriloco: error: {msg}", err=True)
    raise typer.Exit(code)


def _count(n: float) -> str:
    """A count for people: 3.44M, 3.8k, 512."""
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e3 else f"{n:.0f}"


def _print_summary(run_dir: Path, summary: dict) -> None:
    s = summary
    start, end = s.get("eval_loss_start"), s.get("eval_loss_end")
    loss = f"{start:.4f} -> {end:.4f} ({1 - end / start:.1%} lower)" if start and end else "-"
    typer.echo(
        f"done: {s['rounds']} rounds, {_count(s['tokens'])} tokens in {s['wall_s']:.1f}s "
        f"({s['tokens_per_s'] / 1e3:.1f}k tok/s) | eval loss {loss} | "
        f"sent {s['bytes_sent_per_worker'] / 1e6:.1f} MB/worker\n"
        f"run: {run_dir}  (summary.json, rounds.jsonl, metrics.jsonl)"
    )
    if s.get("complete") is False:
        typer.echo(f"stopped before the last round: continue with `veriloco train --resume {run_dir}`")
    try:
        from .report import write_report

        typer.echo(f"report: {write_report(run_dir)}")
    except Exception as e:  # the run itself succeeded; a report problem must not hide that
        typer.echo(f"report: not written ({type(e).__name__}: {str(e)[:120]})")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def train(
    ctx: typer.Context,
    config: str = typer.Argument(None, help="TOML config file (default: built-in defaults)"),
    out: str = typer.Option(None, "--out", help="run directory (default: runs/<run-id>/, or -2, -3, ... once taken)"),
    resume: str = typer.Option(None, "--resume", help="continue the run in this directory"),
    quiet: bool = typer.Option(False, "--quiet", help="no per-round progress lines"),
    stop_after: int = typer.Option(None, "--stop-after", help="stop cleanly after this many rounds (resume later)"),
    fault: list[str] = typer.Option(None, "--fault", help="inject a fault (elastic membership): die:W@R[.S], "
                                    "die:W@R.sent, stop:W@R+SECONDS, late:W@R+SECONDS, restart:W+SECONDS, join:W@R, "
                                    "partition:W@R+SECONDS, sever:A-B@R+SECONDS; repeatable"),
    host: str = typer.Option(None, "--host", help="elastic: the address this machine's coordinator listens on "
                             "and other machines reach it at (default 127.0.0.1: this machine only)"),
    workers: str = typer.Option(None, "--workers", help="elastic: the workers to start here, e.g. 0,1 (default: "
                                "all); start the others with `veriloco join RUN --workers ...` elsewhere"),
) -> None:
    """Train: the default config, a config file, `--section.key=value` overrides (CLI > file > defaults)."""
    config, overrides = _config_and_overrides(ctx, config)
    local = None if workers is None else tuple(_worker_list(workers))
    if resume and (config or overrides):
        fail("--resume takes no config or overrides: the run's manifest holds its config")
    from .procs import stop, warm

    # first: the workers' server imports torch and the engine (~3 s) while this process does (loading
    # the config's codecs imports torch); stopped if the command fails (_train's bad input, a failed run)
    started = warm()
    try:
        _train(config, overrides, out, resume, quiet, stop_after, fault, host, local)
    except KeyboardInterrupt as e:  # Ctrl-C (or SIGTERM while workers ran): one line, and what continues the run
        if started:
            stop()
        from .records import RunDir

        run_dir = getattr(e, "run_dir", None)
        resumable = run_dir is not None and RunDir(run_dir).has_records()
        _interrupted(e, f"; continue with `veriloco train --resume {run_dir}`" if resumable else "")
    except BaseException:
        if started:
            stop()
        raise


def _train(config: str | None, overrides: list[str], out: str | None, resume: str | None, quiet: bool,
           stop_after: int | None, fault: list[str] | None, host: str | None, local: tuple[int, ...] | None) -> None:
    """`veriloco train` once its arguments are read and the workers' server is starting."""
    try:
        cfg = None if resume else load_config(config, overrides)
    except ConfigError as e:  # load_config's only error; user_errors() would import torch (~1.5 s) to match it
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    from .run import placement_of
    from .run import resume as resume_run
    from .run import train as train_run

    placement = placement_of(host, local)
    try:
        if resume:
            run_dir, summary = resume_run(resume, quiet, stop_after, placement)
        else:
            for line in config_warnings(cfg):
                typer.echo(f"veriloco: warning: {line}", err=True)
            if cfg.train.mode == "ddp":
                from .baseline import train_ddp

                if stop_after is not None or fault or placement:  # the baseline runs start to end over a fixed world
                    flag = "--stop-after" if stop_after is not None else "--fault" if fault else "--host/--workers"
                    raise ConfigError(f"{flag} needs train.mode = 'diloco'")

                run_dir, summary = train_ddp(cfg, out, quiet)
            else:
                run_dir, summary = train_run(cfg, out, quiet, stop_after, fault or None, placement)
    except user_errors() as e:
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    except typer.Exit:  # fail() above already said what is wrong
        raise
    except Exception as e:  # a worker failed: torch.multiprocessing re-raises its traceback here
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        fail(f"training failed: {lines[-1] if lines else type(e).__name__}", code=1)
    _print_summary(run_dir.root, summary)


def _worker_list(text: str) -> list[int]:
    """"0,1,3" -> [0, 1, 3]; fail() in one line otherwise."""
    try:
        workers = [int(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        workers = []
    if not workers or any(j < 0 for j in workers) or len(set(workers)) != len(workers):
        fail(f"--workers takes distinct worker ids separated by commas, e.g. 0,1; got {text!r}")
    return workers


def _config_and_overrides(ctx: typer.Context, config: str | None) -> tuple[str | None, list[str]]:
    """A command's config file and its `--section.key=value` overrides (the file may be left out)."""
    overrides = list(ctx.args)
    if config is not None and config.startswith("--"):
        overrides.insert(0, config)
        config = None
    bad = [a for a in overrides if not (a.startswith("--") and "=" in a)]
    if bad:
        fail(f"unexpected argument {bad[0]!r}; overrides look like --section.key=value")
    return config, overrides


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def plan(
    ctx: typer.Context,
    config: str = typer.Argument(None, help="TOML config file (default: built-in defaults), or a run "
                                 "directory: its config, and the inner-step time it measured"),
    step_s: float = typer.Option(None, "--step-s", help="seconds one inner step takes on your hardware "
                                 "(a short run's inner_s / inner_steps): checks that the exchange hides"),
) -> None:
    """What a config will run, before it runs: processes, memory, bytes per round against DDP.

    Each stage's slice and memory, and whether the exchange hides under the inner steps."""
    from .plan import format_plan, make_plan, measured_verification, run_config

    config, overrides = _config_and_overrides(ctx, config)
    try:
        if run := config is not None and Path(config).is_dir():
            cfg, measured = run_config(config, overrides)
            if step_s is None and measured is not None:
                step_s = measured
                typer.echo(f"from {config}: its config, and {measured:.4f} s an inner step as it measured "
                           "(its layout, its machines)")
        else:
            cfg = load_config(config, overrides)
        typer.echo(format_plan(make_plan(cfg, step_s), measured_verification(config) if run else None))
    except (*user_errors(), ValueError) as e:
        fail(str(e).splitlines()[0])


@app.command()
def join(
    run: str = typer.Argument(..., help="the run directory, shared with the launcher's machine"),
    workers: str = typer.Option(..., "--workers", help="the workers to start on this machine, e.g. 2,3"),
    quiet: bool = typer.Option(False, "--quiet", help="no per-round progress lines"),
) -> None:
    """Elastic: start some of a run's workers on this machine (the run directory is shared).

    Its launcher, `veriloco train ... --host ADDR --workers ...`, runs on another machine."""
    from .elastic import join_elastic

    try:
        codes = join_elastic(run, _worker_list(workers), quiet)
    except user_errors() as e:
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    except KeyboardInterrupt as e:
        _interrupted(e, f"; workers {', '.join(map(str, _worker_list(workers)))} of {run} stopped")
    failed = {j: c for j, c in codes.items() if c != 0}
    if failed:
        fail(f"workers ended in failure: {', '.join(f'{j} (exit {c})' for j, c in sorted(failed.items()))}; "
             f"see {run}/error-J.txt", code=1)
    typer.echo(f"workers {', '.join(map(str, sorted(codes)))} done")


@app.command()
def audit(
    run: str = typer.Argument(None, help="run directory"),
    ledger: str = typer.Option(None, "--ledger", help="instead of RUN: the run's SQLite ledger file, or evm:CONTRACT@RPC_URL"),
    store: str = typer.Option(None, "--store", help="with --ledger: the run's store, a path or fsspec URL (s3://, memory://...)"),
    run_id: str = typer.Option(None, "--run-id", help="with --ledger: which run (needed for an EVM contract)"),
    replay: int = typer.Option(0, "--replay", help="also re-run up to N of the sampled replay audits"),
    device: str = typer.Option("cpu", "--device", help="recompute replays and loss gains on 'cpu' or 'cuda' "
                               "(a GPU run's exact replays reproduce on the same kind of GPU)"),
) -> None:
    """Re-verify a run offline: manifest, corpus, ledger, signatures, verdicts, every outer step.

    From its directory (RUN), or from a ledger and a store (--ledger, --store) it was published to."""
    import torch

    from .audit import AuditInputError, audit_published, audit_run, write_audit
    from .ledger import LedgerError

    if replay < 0:
        fail(f"--replay must be >= 0, got {replay}")
    if device not in ("cpu", "cuda"):
        fail(f"--device must be cpu or cuda, got {device!r}")
    if device == "cuda":
        from .task import require_gpu

        try:
            require_gpu("--device cuda")
        except ValueError as e:
            fail(str(e))
    if run is not None and (ledger or store or run_id):
        fail("give a run directory, or --ledger and --store, not both")
    if run is None and not (ledger and store):
        fail("give a run directory, or both --ledger LEDGER and --store URL")
    torch.set_num_threads(1)  # as each worker ran: replays are bit-exact, and small ops are faster
    try:
        report = audit_run(run, replay, device) if run is not None \
            else audit_published(ledger, store, run_id, replay, device)
    except (*user_errors(), AuditInputError, LedgerError) as e:
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    if run is not None:
        write_audit(run, report)
    on = ""  # the machine training it, where that is not this one (a shared run directory)
    if run is not None and report.in_progress is not None:
        from .records import RunDir

        host = RunDir(run).holder_host()
        on = f" on {host}" if host else ""
    c = report.checked
    if report.ok:
        typer.echo(
            f"audit ok: {report.rounds} rounds, {c.get('ledger_entries', 0)} ledger entries "
            f"(root {report.ledger_root}), {c.get('signatures', 0)} signatures, {c.get('bundles', 0)} "
            f"bundles, {c.get('checkpoints', 0)} checkpoints recomputed"
            + (f" ({c['checkpoints_pruned']} pruned from the store: run.keep_checkpoints)" if c.get("checkpoints_pruned") else "")
            + f", {c.get('replays', 0)} replays, "
            f"{c.get('corpus_chunks', 0)} "
            f"corpus chunks, in {report.seconds:.1f}s"
            + (f" (a run in progress, pid {report.in_progress}{on}: its rounds recorded so far)"
               if report.in_progress is not None else
               "" if report.signed else
               f" (not signed: {report.rounds} of {report.planned_rounds} rounds recorded, so the recorder's signed "
               "checkpoint manifest, which a complete run writes, does not cover the records' other fields)")
        )
        return
    typer.echo(f"audit FAILED: {report.first_failure}", err=True)
    raise typer.Exit(1)


@app.command()
def prove(run: str = typer.Argument(..., help="run directory"), round: int = typer.Argument(..., help="round")) -> None:
    """Print an RFC 9162 inclusion proof of ROUND's entry in the run's ledger (and check it)."""
    import json

    from .audit import open_run_ledger
    from .ledger import LedgerError
    from .ledger.merkle import leaf_hash, verify_inclusion

    try:
        ledger = open_run_ledger(run)
    except (*user_errors(), LedgerError) as e:  # LedgerError: a ledger.sqlite that is no database
        fail(str(e).splitlines()[0])
    try:
        n = ledger.size()
        if not 0 <= round < n:
            fail(f"round {round} is not in the ledger (it has rounds 0..{n - 1})")
        proof, root = ledger.inclusion_proof(round), ledger.root()
        leaf = leaf_hash(ledger.entry_bytes(round))
    except LedgerError as e:
        fail(f"ledger: {str(e).splitlines()[0]}", code=1)
    finally:
        ledger.close()
    ok = verify_inclusion(leaf, round, n, proof, root)
    typer.echo(json.dumps({"round": round, "tree_size": n, "root": root, "leaf_hash": leaf.hex(),
                           "proof": proof, "verified": ok}, indent=2))
    if not ok:
        raise typer.Exit(1)


@app.command()
def report(run: str = typer.Argument(..., help="run directory")) -> None:
    """Write RUN/report.html: one self-contained page (plots embedded) of what the run did."""
    from .records import RunDirError
    from .report import write_report

    try:
        typer.echo(str(write_report(run)))
    except (RunDirError, OSError) as e:  # no manifest, or not one a run wrote; a report.html it cannot write
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)


@app.command()
def export(
    run: str = typer.Argument(..., help="run directory"),
    out: str = typer.Option(..., "--out", help="new directory for the model"),
    round: int = typer.Option(None, "--round", help="the global params after this round (default: the last)"),
) -> None:
    """Write the run's global params as a model directory (transformers archs: from_pretrained).

    For a transformers arch, config.json and model.safetensors, which AutoModelForCausalLM.from_pretrained
    loads; for the GPT, model.safetensors and model.json; with [data] tokenizer, its tokenizer.json too;
    for a user's Task (train_task), model.safetensors alone, for its module's load_state_dict."""
    from .export import export_run

    try:
        path, r = export_run(run, out, round)
    except user_errors() as e:
        fail(str(e).splitlines()[0])
    from .records import RunDir, users_task

    check = "veriloco.audit_task(task, RUN)" if users_task(RunDir(run).read_manifest()) else f"veriloco audit {run}"
    typer.echo(f"wrote {path}: the global params after round {r} (check the run first: {check})")


@app.command("sample")
def sample_text(
    run: str = typer.Argument(..., help="run directory"),
    prompt: str = typer.Option("", "--prompt", help="text to continue (default: a newline)"),
    tokens: int = typer.Option(200, "--tokens", help="how many tokens to generate (bytes for a byte-level run)"),
    temperature: float = typer.Option(0.8, "--temperature", help="softmax temperature; 0 = greedy"),
    top_k: int = typer.Option(0, "--top-k", help="sample among the k likeliest tokens; 0 = all"),
    seed: int = typer.Option(0, "--seed", help="the sampler's seed: the same seed prints the same text"),
    round: int = typer.Option(None, "--round", help="the global params after this round (default: the last)"),
) -> None:
    """Print text the run's model writes after --prompt, as it is written.

    The params after a round, checked against its record; the run's own tokenizer, or bytes."""
    from .sample import sample

    started: list[bool] = []

    def show(piece: str) -> None:  # the prompt once the model is loaded (bad input prints nothing on stdout)
        if not started:
            started.append(True)
            sys.stdout.write(prompt)
        sys.stdout.write(piece)
        sys.stdout.flush()

    try:
        sample(run, prompt, tokens, temperature, top_k, seed, round, on_text=show)
    except user_errors() as e:
        fail(str(e).splitlines()[0])
    except KeyboardInterrupt:
        if started:  # what was printed stays; the interrupt's line goes under it
            sys.stdout.write("\n")
            sys.stdout.flush()
        raise
    if not started:
        sys.stdout.write(prompt)
    sys.stdout.write("\n")
    sys.stdout.flush()


@app.command()
def tokenize(
    source: str = typer.Argument(..., help="'stdlib', a text file, or a directory of text files"),
    tokenizer: str = typer.Option(..., "--tokenizer", help="a tokenizers tokenizer.json (a local file)"),
    out: str = typer.Option(..., "--out", help="the new token file (name ending in .bin)"),
    eos: str = typer.Option("", "--eos", help="a token put after each document (each file), e.g. '<|endoftext|>'"),
) -> None:
    """Tokenize a text source into a token .bin, one document at a time.

    For a corpus too large to tokenize in memory: train on it with --data.source=OUT
    --data.bin_dtype=<the dtype printed> --data.tokenizer=T (kept with the run, not rerun)."""
    from .data import tokenize_to_bin

    try:
        n, dtype = tokenize_to_bin(source, tokenizer, out, eos)
    except user_errors() as e:
        fail(str(e).splitlines()[0])
    typer.echo(f"wrote {out}: {n} tokens as {dtype} (train with --data.source={out} --data.bin_dtype={dtype} "
               f"--data.tokenizer={tokenizer})")


@app.command()
def keygen(
    out: str = typer.Option(..., "--out", help="directory for worker-<w>.key / .pub"),
    workers: int = typer.Option(None, "--workers", help="how many workers: keys for workers 0..N-1"),
    worker: int = typer.Option(None, "--worker", help="one worker's key only (a party that holds its own)"),
) -> None:
    """Ed25519 keys: worker-<w>.key (private, 0600) and worker-<w>.pub, for each of --workers N,
    or for --worker W alone (each party makes its own and hands out only the .pub)."""
    from .records import RunDirError, make_dirs, remove_dirs
    from .verify.identity import IdentityError, generate_key, public_key_hex, save_private_key

    if (workers is None) == (worker is None):
        fail("keygen takes one of --workers N (keys for workers 0..N-1) and --worker W (worker W's key alone)")
    if workers is not None and workers < 1:
        fail(f"--workers must be >= 1, got {workers}")
    if worker is not None and worker < 0:
        fail(f"--worker must be >= 0, got {worker}")
    ids = list(range(workers)) if workers is not None else [worker]
    if not out.strip():  # Path("") is the current directory
        fail("--out must name a directory, got ''")
    d = Path(out)
    try:
        taken = [p for w in ids for p in (d / f"worker-{w}.key", d / f"worker-{w}.pub") if p.exists() or p.is_symlink()]
    except OSError as e:  # a name past the OS's limit
        fail(f"--out {out!r:.80}: {e.strerror or e}")
    if taken:  # before any key is written: a key lost is an identity lost, and half a set is no set
        fail(f"{taken[0]} already exists; keygen writes new keys into a directory without them")
    try:
        made = make_dirs(d)
    except RunDirError as e:
        fail(str(e))
    written: list[Path] = []
    try:
        for w in ids:
            private, _ = generate_key()
            key, pub = d / f"worker-{w}.key", d / f"worker-{w}.pub"
            written.append(key)
            save_private_key(key, private)
            written.append(pub)
            pub.write_text(public_key_hex(private) + "\n")
    except (IdentityError, OSError) as e:  # all the keys or none: the ones written go again
        for path in written:
            path.unlink(missing_ok=True)
        remove_dirs(made)
        fail(str(e).splitlines()[0] if isinstance(e, IdentityError) else f"cannot write {written[-1]}: {e.strerror or e}")
    if worker is None:
        typer.echo(f"wrote {workers} key pairs to {d} (set [verify] key_dir = \"{d}\")")
    else:
        typer.echo(f"wrote worker {worker}'s key pair to {d}: hand out {d / f'worker-{worker}.pub'} only; "
                   f"the run's key_dir on each machine holds every worker's .pub and that machine's workers' .key")


@app.command("config")
def config_reference() -> None:
    """Print every config section and key with its type, default and meaning."""
    typer.echo(describe())


_INTERRUPT_SAID: list[bool] = []  # train and join say how a Ctrl-C ended them (their own line): main() adds none


def _interrupted(e: KeyboardInterrupt, rest: str) -> NoReturn:
    """Ctrl-C (exit 130) or SIGTERM (procs.Terminated, exit 143) ended a command that ran workers:
    one line, `rest` saying what became of them."""
    terminated = getattr(e, "terminated", False)
    typer.echo(("veriloco: terminated (SIGTERM)" if terminated else "veriloco: interrupted") + rest, err=True)
    _INTERRUPT_SAID.append(True)
    raise typer.Exit(143 if terminated else 130) from None


def main() -> None:
    """The `veriloco` script. Usage errors (an unknown option, a missing or malformed argument)
    print one line and exit 2, as every other bad input does, instead of click's usage box."""
    _INTERRUPT_SAID.clear()
    try:
        code = app(prog_name="veriloco", standalone_mode=False)
        if code == 130 and not _INTERRUPT_SAID:  # Ctrl-C in a command (typer: Exit(130)) ended it silently
            typer.echo("veriloco: interrupted", err=True)
    except Exception as e:
        # matched by what it has, not its class: typer vendors its own copy of click
        kind = type(e).__name__
        if kind == "NoArgsIsHelpError":  # `veriloco` alone: the help, as typer prints it
            app(prog_name="veriloco")
        if kind == "Abort":  # Ctrl-C
            typer.echo("veriloco: aborted", err=True)
            sys.exit(130)
        if getattr(e, "exit_code", None) != 2 or not callable(getattr(e, "format_message", None)):
            raise
        ctx = getattr(e, "ctx", None)
        where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        typer.echo(f"veriloco: error: {e.format_message()}{where}", err=True)
        sys.exit(2)
    sys.exit(code or 0)


if __name__ == "__main__":
    sys.exit(main())
