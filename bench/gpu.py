"""GPU benchmark: inner-step throughput / MFU of a ~350M GPT, and codec encode/decode speed.

On the GPU machine (one H200; needs only torch and this repository, no network, no .venv):

    PYTHONPATH=src python bench/gpu.py --out $OUT/gpu.json

It should take 2-4 minutes on an H200; `--budget-s` (default 300) skips whatever is left
once that much time has passed, and the JSON is rewritten after every row, so a run that is cut
short still leaves what it measured. Here, on CPU, the same code path with a tiny model:

    PYTHONPATH=src python bench/gpu.py --smoke --out /tmp/gpu.json

Without CUDA and without --smoke it exits 2 ("no CUDA device: run with --smoke on CPU").

1. Training. GPT(n_layer=28, d_model=1024, n_head=16, ctx=1024, vocab=256): 354.3M parameters
   (printed exactly). Precision: fp32 master parameters, fp32 gradients and fp32 AdamW state;
   forward and backward under torch.autocast(bfloat16); attention is the model's own
   F.scaled_dot_product_attention (`--sdpa flash` forces the flash kernel). Variants:
     inner  veriloco's InnerLoop.step as the workers run it: AdamW(foreach=False),
            clip_grad_norm_(foreach=False), the loss read back to the host every step;
     bare   the same model and loss with torch's AdamW(fused=True) and clipping (foreach), no
            per-step host read-back: what a GPU-tuned loop gets.
   After `--warmup` steps, `--steps` steps are timed between two torch.cuda.synchronize().
   tokens/s = steps * batch * ctx / seconds. The inner variant then times its trace hash
   (`InnerLoop.trace_hash`: params and AdamW moments copied to the host and hashed with sha256 on
   one core, the best of 2): `trace_hash_s`, and `trace_hash_steps`, that in steps; a worker pays
   it every `[verify] trace_every` steps (README "On GPUs": estimated from this CPU's sha256 rate,
   never measured on a GPU).
   FLOPs per token = 6 * N + 12 * n_layer * d_model * ctx, N = parameters that take part in a
   matmul (all but the token and position embedding tables, whose lookup costs no FLOPs); the
   second term is attention's QK^T and AV (forward + backward, causal mask not discounted: the
   PaLM appendix B convention). MFU = FLOPs per token * tokens/s / peak, with the peak taken as
   989 TFLOP/s (H200 SXM dense bf16, no sparsity), an assumption, `--peak-tflops` to change it.
   `--compile` wraps the model in torch.compile (off by default; compile time is reported
   separately as the warmup time).
2. Codecs. For each codec spec, two targets: one 8192 x 8192 fp32 matrix (256 MiB) and the
   whole delta of the 350M model (one tensor per parameter, as a round encodes it), values
   ~N(0, 1e-3), resident on the GPU. Two paths, both measured end to end from the fp32 tensor on
   the GPU to parts on the host (what encode_packet serialises) and back:
     device  encode on the GPU tensor, then copy the parts to the host; decode: parts copied to
             the GPU, decoded there. If a codec moves data to the CPU internally, that is what it
             costs (`enc_parts_dev` says where encode left its parts); if it fails on GPU
             tensors, the row carries the error.
     host    copy the tensor to the host, encode on the CPU; decode on the CPU, copy the result
             to the GPU (what the codecs cost with a GPU model today, with no GPU support).
   Each timing is bracketed by torch.cuda.synchronize(); one untimed warmup, then `--repeats`
   (matrix) or `--delta-repeats` (model delta) repeats, the median reported. GB/s = fp32 input
   bytes (4 per element) / seconds. `rel_err` is ||decode(encode(x)) - x|| / ||x|| and `ratio`
   the encoded bytes over the fp32 bytes.
   Expected from reading compress/ (when this was written, never run on a GPU): the casts and
   fp32 run on the GPU; int8/int4 encode copy into a CPU buffer (so they run on the CPU) and
   their decode mixes CPU and GPU tensors and fails; topk and lowrank encode fail (CPU helper
   tensors: bit shifts, the random warm start). The device path's errors are the finding.
3. Engine (`--engine`): the round engine itself with `[run] device = "cuda"` (written in the
   eighteenth session, never run on a GPU then): `veriloco.run.train` of configs/default.toml's model,
   4 workers as 4 processes on the one GPU, `--engine-rounds` rounds of H = 30, once in fp32
   and once with `[train] precision = "bf16"`, replays on (`inner_state = "reset"`,
   `replay_probability = 1`, `replay_match = "distance"`, the GPU setting) and then
   `veriloco.audit.audit_run` on the GPU, re-running every replay (`veriloco audit --device cuda
   --replay 100`). A row per run: the verdicts, eval loss, tokens/s and
   whether the audit passed, or the first line of the error. A third run (fp32) puts 2 workers
   of 2 stages x 2 replicas on the GPU: 8 processes on one GPU, so the pipeline's activations and
   the replicas' gradient combine (`all_to_all`) travel over gloo with CUDA tensors, which gloo
   may refuse (the row's error would say so). It needs the package's runtime
   dependencies (safetensors, cryptography, typer, ...), which the GPU machine may lack: carry
   wheels and install them with `pip install --no-index`. With --smoke the same runs use the
   tiny config on the CPU.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
H200_PEAK_TFLOPS = 989.0  # H200 SXM, dense bf16 (no 2:4 sparsity): NVIDIA's datasheet figure
SPECS = (
    "fp32",
    "fp16",
    "bf16",
    "int8:block=64",
    "int4:block=64",
    "topk:density=0.01,bits=8",
    "lowrank:rank=4",
)
FULL = {"n_layer": 28, "d_model": 1024, "n_head": 16, "ctx": 1024, "vocab_size": 256}
SMOKE = {"n_layer": 2, "d_model": 64, "n_head": 4, "ctx": 64, "vocab_size": 256}


def import_veriloco() -> dict[str, types.ModuleType]:
    """The modules this bench needs (model, inner, config, compress: torch only), from src/. The
    package's __init__ imports none of the training runtime (its exports load on first use), so
    these import on a GPU machine that lacks the runtime's dependencies (safetensors,
    cryptography, ...)."""
    if str(SRC) not in sys.path:
        sys.path.insert(0, str(SRC))
    return {n: importlib.import_module(f"veriloco.{n}") for n in ("config", "model", "inner", "compress")}


_VL = import_veriloco()
ModelConfig = _VL["config"].ModelConfig
TrainConfig = _VL["config"].TrainConfig
build_model = _VL["model"].build_model
lm_loss = _VL["model"].lm_loss
InnerLoop = _VL["inner"].InnerLoop
build_codecs = _VL["compress"].build_codecs


# ---------------------------------------------------------------------------------------------
# helpers


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()[0]
    return text[:240]


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "host": platform.node(),
        "cpu_threads": torch.get_num_threads(),
        "git_commit": git_commit(),
        "device": str(device),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            device_name=props.name,
            device_capability=f"{props.major}.{props.minor}",
            device_memory_gib=round(props.total_memory / 2**30, 1),
            device_sms=props.multi_processor_count,
            flash_sdp_enabled=torch.backends.cuda.flash_sdp_enabled(),
            mem_efficient_sdp_enabled=torch.backends.cuda.mem_efficient_sdp_enabled(),
            tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
        )
    else:
        env.update(device_name=platform.processor() or platform.machine())
    return env


class Budget:
    """Wall-clock budget: once spent, the remaining measurements are skipped (and listed)."""

    def __init__(self, seconds: float) -> None:
        self.t0, self.seconds = time.perf_counter(), seconds
        self.skipped: list[str] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def allows(self, what: str) -> bool:
        if self.elapsed() < self.seconds:
            return True
        self.skipped.append(what)
        print(f"  skipped (time budget of {self.seconds:.0f}s spent): {what}", flush=True)
        return False


# ---------------------------------------------------------------------------------------------
# 1. training throughput


def param_counts(model: nn.Module) -> tuple[int, int]:
    """(all parameters, parameters used in matmuls = all but the embedding tables)."""
    total = sum(p.numel() for p in model.parameters())
    tables = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("tok_emb.", "pos_emb.")))
    return total, total - tables


def flops_per_token(n_matmul: int, mcfg: Any) -> int:
    return 6 * n_matmul + 12 * mcfg.n_layer * mcfg.d_model * mcfg.ctx


@contextmanager
def sdpa_backend(name: str) -> Iterator[None]:
    """Force one scaled_dot_product_attention backend ('auto' = torch's own choice)."""
    if name == "auto":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }[name]
    with sdpa_kernel(backend):
        yield


def make_step(
    variant: str, model: nn.Module, device: torch.device, total_steps: int
) -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor | float], str, Callable[[], str] | None]:
    """A function (x, y) -> loss doing one optimizer step, a description of the optimizer, and
    (the InnerLoop only) its trace hash: what a worker computes every `trace_every` steps."""
    amp = torch.autocast(device_type=device.type, dtype=torch.bfloat16)

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with amp:
            return lm_loss(m(x), y)

    if variant == "inner":
        loop = InnerLoop(model, TrainConfig(lr=3e-4, warmup_steps=1), total_steps, loss_fn)
        return (loop.step, "veriloco InnerLoop: AdamW(foreach=False), clip(foreach=False), loss.item() per step",
                loop.trace_hash)
    if variant != "bare":
        raise ValueError(f"unknown variant {variant!r}")
    cfg = TrainConfig()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    kind = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=3e-4,
        betas=(cfg.beta1, cfg.beta2),
        **kind,
    )

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, x, y)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip, foreach=True)
        opt.step()
        return loss.detach()

    how = "fused" if device.type == "cuda" else "foreach"
    return step, f"torch AdamW({how}=True), clip(foreach=True), no per-step host read-back", None


def bench_train(
    variant: str,
    model: nn.Module,
    mcfg: Any,
    args: argparse.Namespace,
    device: torch.device,
    fpt: int,
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "variant": variant,
        "compile": args.compile,
        "sdpa": args.sdpa,
        "batch": args.batch,
        "ctx": mcfg.ctx,
        "precision": "fp32 master params/grads/AdamW state, bf16 autocast forward+backward",
        "warmup_steps": args.warmup,
        "steps": args.steps,
    }
    gen = torch.Generator(device="cpu").manual_seed(0)
    batches = [
        torch.randint(0, mcfg.vocab_size, (args.batch, mcfg.ctx + 1), generator=gen).to(device)
        for _ in range(4)
    ]
    step = None
    try:
        step, row["optimizer"], trace_hash = make_step(variant, model, device, args.warmup + args.steps)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        losses: list[float] = []
        with sdpa_backend(args.sdpa):
            sync(device)
            t0 = time.perf_counter()
            for s in range(args.warmup):
                b = batches[s % len(batches)]
                losses.append(float(step(b[:, :-1], b[:, 1:])))
            sync(device)
            t1 = time.perf_counter()
            out = []
            for s in range(args.steps):
                b = batches[s % len(batches)]
                out.append(step(b[:, :-1], b[:, 1:]))
            sync(device)
            t2 = time.perf_counter()
            hashes = []
            for _ in range(2 if trace_hash is not None else 0):  # params + AdamW moments, copied to the host, sha256
                t3 = time.perf_counter()
                trace_hash()
                hashes.append(time.perf_counter() - t3)
        losses += [float(v) for v in out]
    except Exception as e:  # OOM, a missing kernel, a compile failure: record it, go on
        row["error"] = first_line(e)
        return row
    finally:
        del step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    seconds = t2 - t1
    tps = args.steps * args.batch * mcfg.ctx / seconds
    row.update(
        warmup_s=round(t1 - t0, 3),
        seconds=round(seconds, 4),
        step_ms=round(1e3 * seconds / args.steps, 2),
        tokens_per_s=round(tps, 1),
        achieved_tflops=round(fpt * tps / 1e12, 2),
        mfu=float(f"{fpt * tps / (args.peak_tflops * 1e12):.4g}"),
        loss_first=round(losses[0], 4),
        loss_last=round(losses[-1], 4),
    )
    if hashes:  # one trace entry's cost, in steps: a worker pays it every trace_every steps (README: On GPUs)
        row.update(trace_hash_s=round(min(hashes), 4), trace_hash_steps=round(min(hashes) / (seconds / args.steps), 2))
    if device.type == "cuda":
        row["max_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return row


# ---------------------------------------------------------------------------------------------
# 2. codecs


def part_bytes(parts: dict[str, dict[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for p in parts.values() for t in p.values())


def timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> tuple[Any, list[float]]:
    """One untimed call (its result is returned), then `repeats` timed calls."""
    result = fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return result, times


def bench_codec(
    spec: str,
    target: str,
    delta: dict[str, torch.Tensor],
    path: str,
    device: torch.device,
    repeats: int,
) -> dict[str, Any]:
    numel = sum(t.numel() for t in delta.values())
    row: dict[str, Any] = {"target": target, "spec": spec, "path": path, "numel": numel, "tensors": len(delta)}
    shapes = {k: tuple(t.shape) for k, t in delta.items()}
    codecs = build_codecs(spec, shapes)
    host = torch.device("cpu")
    where: set[str] = set()

    def encode() -> dict[str, dict[str, torch.Tensor]]:
        out = {}
        for k, t in delta.items():
            parts = codecs[k].encode(k, t if path == "device" else t.to(host))
            where.update(str(v.device) for v in parts.values())
            out[k] = {p: v.to(host) for p, v in parts.items()}
        return out

    try:
        parts, enc_times = timed(encode, device, repeats)
    except Exception as e:
        row["error"] = f"encode: {first_line(e)}"
        return row
    row["enc_parts_dev"] = ",".join(sorted(where))

    def decode() -> dict[str, torch.Tensor]:
        if path == "device":
            return {
                k: codecs[k].decode({p: v.to(device) for p, v in parts[k].items()}, shapes[k])
                for k in delta
            }
        return {k: codecs[k].decode(parts[k], shapes[k]).to(device) for k in delta}

    try:
        decoded, dec_times = timed(decode, device, repeats)
    except Exception as e:
        row["error"] = f"decode: {first_line(e)}"
        decoded, dec_times = None, []
    in_bytes = 4 * numel
    enc = statistics.median(enc_times)
    row.update(
        out_bytes=part_bytes(parts),
        ratio=round(part_bytes(parts) / in_bytes, 5),
        encode_s=round(enc, 5),
        encode_gbps=round(in_bytes / enc / 1e9, 3),
    )
    if decoded is not None:
        dec = statistics.median(dec_times)
        err = sum(float((decoded[k].to(torch.float32) - delta[k]).pow(2).sum()) for k in delta)
        ref = sum(float(delta[k].pow(2).sum()) for k in delta)
        row.update(
            decode_s=round(dec, 5),
            decode_gbps=round(in_bytes / dec / 1e9, 3),
            rel_err=float(f"{math.sqrt(err / ref):.4g}"),
        )
    return row


def random_delta(shapes: dict[str, tuple[int, ...]], device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    return {k: 1e-3 * torch.randn(s, device=device, generator=gen) for k, s in shapes.items()}


# ---------------------------------------------------------------------------------------------
# output


REPLICAS_LAYOUT = ("--topology.workers=2", "--topology.stages=2", "--topology.replicas=2", "--topology.microbatches=2")


def bench_engine(precision: str, args: argparse.Namespace, where: Path, layout: tuple[str, ...] = ()) -> dict[str, Any]:
    """One engine run on the device (part 3 of the module docstring), then its offline audit.
    `layout`: topology overrides (REPLICAS_LAYOUT: 8 processes sharing the one GPU, so the
    pipelines' activations and the replicas' gradient combine go over gloo with CUDA tensors)."""
    row: dict[str, Any] = {"precision": precision, "layout": " ".join(layout) or "default"}
    try:
        import tempfile

        from veriloco.audit import audit_run
        from veriloco.config import load_config
        from veriloco.run import train

        config = ROOT / "configs" / ("tiny.toml" if args.smoke else "default.toml")
        rounds = args.engine_rounds or (1 if args.smoke else 3)
        overrides = [f"--run.device={'cpu' if args.smoke else 'cuda'}", f"--train.precision={precision}",
                     f"--train.rounds={rounds}", "--train.inner_state=reset", "--verify.replay_probability=1.0",
                     "--verify.replay_match=distance", "--compress.error_feedback=false", "--ledger.backend=sqlite",
                     *layout]
        cfg = load_config(config, overrides)
        row.update(config=config.name, overrides=overrides, workers=cfg.topology.workers)
        with tempfile.TemporaryDirectory(dir=where if where.exists() else None) as tmp:
            run, summary = train(cfg, str(Path(tmp) / "run"), quiet=True)
            records = [json.loads(line) for line in run.rounds_path.read_text().splitlines()]
            report = audit_run(run.root, replay=100, device="cpu" if args.smoke else "cuda")
        row.update(eval_loss_start=summary["eval_loss_start"], eval_loss_end=summary["eval_loss_end"],
                   tokens_per_s=summary["tokens_per_s"], wall_s=summary["wall_s"],
                   verdicts=sorted({v for rec in records for v in rec["verdicts"]}),
                   peak_gpu_mb=max((x for rec in records for x in rec.get("peak_gpu_mb", [])), default=None),
                   audit_ok=report.ok, audit_failure=report.first_failure)
    except Exception as e:  # noqa: BLE001 - the row carries what failed: the finding on a new device
        row["error"] = first_line(e)
    return row


def write(out: Path, result: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, out)


def train_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | compile | sdpa | batch | step ms | tokens/s | TFLOP/s | MFU | max mem GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | {r['compile']} | {r['sdpa']} | {r['batch']} | error: {r['error']} |||||")
            continue
        lines.append(
            f"| {r['variant']} | {r['compile']} | {r['sdpa']} | {r['batch']} | {r['step_ms']:.1f} | "
            f"{r['tokens_per_s']:,.0f} | {r['achieved_tflops']:.1f} | {100 * r['mfu']:.1f}% | "
            f"{r.get('max_mem_gib', '-')} |"
        )
    return "\n".join(lines)


def codec_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| target | spec | path | enc parts on | ratio | encode GB/s | decode GB/s | rel err | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        def g(key: str, fmt: str, r: dict[str, Any] = r) -> str:
            return format(r[key], fmt) if key in r else "-"

        lines.append(
            f"| {r['target']} | {r['spec']} | {r['path']} | {r.get('enc_parts_dev', '-')} | "
            f"{g('ratio', '.4f')} | {g('encode_gbps', '.3f')} | {g('decode_gbps', '.3f')} | "
            f"{g('rel_err', '.3g')} | {r.get('error', '')} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny model and tensors on the CPU (tests this script)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu.json"))
    ap.add_argument("--n-layer", type=int, default=None, help="override the model's n_layer")
    ap.add_argument("--d-model", type=int, default=None, help="override the model's d_model")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default 16; smoke 4)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; smoke 1)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 20; smoke 3)")
    ap.add_argument("--variants", default="inner,bare", help="comma-separated: inner, bare")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--sdpa", default="auto", choices=("auto", "flash", "efficient", "cudnn", "math"))
    ap.add_argument("--peak-tflops", type=float, default=H200_PEAK_TFLOPS,
                    help=f"peak dense bf16 TFLOP/s for MFU (default {H200_PEAK_TFLOPS}: H200 SXM)")
    ap.add_argument("--codecs", default=";".join(SPECS), help="';'-separated codec specs")
    ap.add_argument("--paths", default="device,host", help="comma-separated codec paths: device, host")
    ap.add_argument("--matrix", type=int, default=None, help="side of the square codec matrix (default 8192; smoke 256)")
    ap.add_argument("--no-model-delta", action="store_true", help="skip the codecs on the whole model delta")
    ap.add_argument("--repeats", type=int, default=None, help="timed codec repeats on the matrix (default 5; smoke 2)")
    ap.add_argument("--delta-repeats", type=int, default=None,
                    help="timed codec repeats on the model delta (default 2; smoke 1)")
    ap.add_argument("--budget-s", type=float, default=300.0, help="skip what is left after this many seconds")
    ap.add_argument("--engine", action="store_true", help="also train with the round engine on the device (part 3)")
    ap.add_argument("--engine-rounds", type=int, default=None, help="rounds per engine run (default 3; smoke 1)")
    args = ap.parse_args(argv)
    defaults = (4, 1, 3, 256, 2, 1) if args.smoke else (16, 3, 20, 8192, 5, 2)
    names = ("batch", "warmup", "steps", "matrix", "repeats", "delta_repeats")
    for name, d in zip(names, defaults, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, d)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --smoke on CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.smoke else "cuda")
    budget = Budget(args.budget_s)
    out = Path(args.out)

    mdict = dict(SMOKE if args.smoke else FULL)
    if args.n_layer is not None:
        mdict["n_layer"] = args.n_layer
    if args.d_model is not None:
        mdict["d_model"] = args.d_model
    mcfg = ModelConfig(**mdict)
    model = build_model(mcfg, seed=0)
    n_total, n_matmul = param_counts(model)
    fpt = flops_per_token(n_matmul, mcfg)
    result: dict[str, Any] = {
        "bench": "gpu",
        "smoke": args.smoke,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "env": environment(device),
        "model": {
            **mdict,
            "params_total": n_total,
            "params_matmul": n_matmul,
            "flops_per_token": fpt,
            "flops_formula": "6 * params_matmul + 12 * n_layer * d_model * ctx "
                             "(params_matmul = all but tok_emb/pos_emb tables)",
        },
        "peak_tflops": args.peak_tflops,
        "peak_assumption": (
            f"MFU against {args.peak_tflops:g} TFLOP/s"
            + (" = H200 SXM dense bf16 (datasheet, no sparsity)" if args.peak_tflops == H200_PEAK_TFLOPS else "")
            + (" -- meaningless on the CPU (smoke run)" if args.smoke else "")
        ),
        "train": [],
        "codecs": [],
    }
    env = result["env"]
    print(f"device {env['device_name']} ({device}), torch {env['torch']}, CUDA {env['cuda']}, "
          f"{env['date_utc']}", flush=True)
    print(f"model n_layer={mcfg.n_layer} d_model={mcfg.d_model} n_head={mcfg.n_head} ctx={mcfg.ctx} "
          f"vocab={mcfg.vocab_size}: {n_total:,} parameters ({n_matmul:,} in matmuls)", flush=True)
    print(f"FLOPs/token = 6*{n_matmul:,} + 12*{mcfg.n_layer}*{mcfg.d_model}*{mcfg.ctx} = {fpt:,}; "
          f"MFU peak assumption: {result['peak_assumption']}", flush=True)
    write(out, result)

    # 1. training
    model = model.to(device)
    trained: nn.Module = torch.compile(model) if args.compile else model  # type: ignore[assignment]
    for variant in [v for v in args.variants.split(",") if v]:
        if not budget.allows(f"train {variant}"):
            continue
        row = bench_train(variant, trained, mcfg, args, device, fpt)
        result["train"].append(row)
        write(out, result)
        msg = row.get("error") or (f"{row['step_ms']:.1f} ms/step, {row['tokens_per_s']:,.0f} tokens/s, "
                                   f"MFU {100 * row['mfu']:.1f}%"
                                   + (f", a trace hash {row['trace_hash_s']:.3f} s = {row['trace_hash_steps']:g} steps"
                                      if "trace_hash_s" in row else ""))
        print(f"  train {variant:5s} batch {args.batch}: {msg}", flush=True)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    del trained, model
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # 2. codecs
    specs = [s.strip() for s in args.codecs.split(";") if s.strip()]
    paths = [p for p in args.paths.split(",") if p]
    targets = [(f"matrix {args.matrix}x{args.matrix}", {"matrix": (args.matrix, args.matrix)}, args.repeats)]
    if not args.no_model_delta:
        targets.append((f"model delta ({n_total / 1e6:.1f}M)", shapes, args.delta_repeats))
    for ti, (target, tshapes, repeats) in enumerate(targets):
        delta = random_delta(tshapes, device, seed=1 + ti)
        for path in paths:
            for spec in specs:
                if not budget.allows(f"codec {spec} {path} on {target}"):
                    continue
                row = bench_codec(spec, target, delta, path, device, repeats)
                result["codecs"].append(row)
                write(out, result)
                msg = row.get("error") or ""
                if "encode_gbps" in row:
                    msg = (f"encode {row['encode_gbps']:.3f} GB/s, decode {row.get('decode_gbps', '-')} GB/s, "
                           f"ratio {row['ratio']:.4f} {msg}")
                print(f"  codec {spec:26s} {path:6s} {target}: {msg}", flush=True)
        del delta
        if device.type == "cuda":
            torch.cuda.empty_cache()

    # 3. the round engine on the device
    if args.engine:
        result["engine"] = []
        for precision, layout in (("fp32", ()), ("bf16", ()), ("fp32", REPLICAS_LAYOUT)):
            name = f"{precision} {' '.join(layout) or 'default'}"
            if not budget.allows(f"engine {name}"):
                continue
            row = bench_engine(precision, args, out.parent, layout)
            result["engine"].append(row)
            write(out, result)
            msg = row.get("error") or (f"eval {row['eval_loss_start']:.4f} -> {row['eval_loss_end']:.4f}, "
                                       f"{row['tokens_per_s']:,.0f} tokens/s, verdicts {row['verdicts']}, "
                                       f"audit {'ok' if row['audit_ok'] else row['audit_failure']}")
            print(f"  engine {name}: {msg}", flush=True)

    result["skipped"] = budget.skipped
    result["elapsed_s"] = round(budget.elapsed(), 1)
    write(out, result)
    print()
    print(train_table(result["train"]))
    print()
    print(codec_table(result["codecs"]))
    print(f"\n{result['elapsed_s']}s, {len(budget.skipped)} skipped -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
