"""One outer round, top to bottom: the only module where the parts meet.

Commands (see also `veriloco --help`):
    veriloco train                                  # configs/default.toml: 4 workers, this machine
    veriloco train configs/tiny.toml --train.rounds=3 --out runs/try
    veriloco train --resume runs/<run-id>           # continue from the last complete round
    veriloco train --train.mode=ddp                 # the all-reduce-every-step baseline
Several machines (every node runs the same command; RUN_DIR is local to each node):
    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        -m veriloco.run CONFIG.toml --out RUN_DIR

A round r on worker w (DiLoCo, Douillard et al. 2023, arXiv 2311.08105):
    1. inner:     H AdamW steps from G_r on batches data.batch(seed, w, r, step)
    2. encode:    delta = G_r - theta_local  ->  codec  ->  packet (safetensors)  ->  store
    3. exchange:  every worker's packet reaches every worker, each kept separate
    4. decode:    every received packet is decoded and checked against the model's shapes
    5. aggregate: mean of the deltas; outer Nesterov step  G_{r+1} = outer(G_r, mean)
    6. record:    checkpoint -> store; eval; one line in rounds.jsonl (rank 0)
All workers run 4-6 on the same inputs, so all derive the same G_{r+1}; step 6 checks it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .compress import codec_from_spec
from .config import Config
from .exchange import Exchange, ExchangeError
from .hashing import tensors_hash
from .inner import InnerLoop
from .outer import OuterOptimizer
from .packet import PacketError, decode_packet, encode_packet
from .records import RunDir, atomic_write
from .store import LocalStore
from .task import Task


@dataclass
class Worker:
    """Everything one worker process holds across rounds."""

    cfg: Config
    rank: int
    world: int
    task: Task
    run: RunDir
    store: LocalStore
    model: torch.nn.Module
    inner: InnerLoop
    outer: OuterOptimizer
    exchange: Exchange
    codecs: dict
    eval_set: list
    started: float = field(default_factory=time.perf_counter)
    bytes_sent: int = 0
    bytes_received: int = 0

    @property
    def is_recorder(self) -> bool:
        return self.rank == 0


def setup_worker(cfg: Config, rank: int, world: int, task: Task, run_dir: str, resume_round: int) -> Worker:
    """Build one worker's state: model, optimizers, exchange; restore it when resuming."""
    torch.set_num_threads(cfg.train.threads)
    run = RunDir(run_dir)
    store = LocalStore(run.store_dir)
    model = task.make_model()
    total_steps = cfg.train.rounds * cfg.train.inner_steps
    inner = InnerLoop(model, cfg.train, total_steps, task.loss)
    outer = OuterOptimizer(dict(model.named_parameters()), cfg.outer)
    timeout = timedelta(seconds=cfg.run.timeout_s)
    group = dist.new_group(list(range(world)), timeout=timeout)  # the exchange's own group
    exchange = Exchange(group, cfg.run.max_packet_bytes, link=None)
    shapes = {k: tuple(v.shape) for k, v in outer.params.items()}
    codec = codec_from_spec(cfg.compress.codec)  # stateful codecs key their state by tensor name
    codecs = {k: codec for k in shapes}
    eval_set = task.eval_batches()[rank::world]
    w = Worker(cfg, rank, world, task, run, store, model, inner, outer, exchange, codecs, eval_set)
    if resume_round > 0:
        restore(w, resume_round)
    return w


def restore(w: Worker, next_round: int) -> None:
    """Load G, outer state and this worker's inner state as of the end of round next_round-1."""
    record = w.run.rounds()[next_round - 1]
    ckpt = st_load(w.store.get(record["checkpoint"]))
    params = {k[len("param/"):]: v for k, v in ckpt.items() if k.startswith("param/")}
    if tensors_hash(params) != record["params_hash"]:
        raise RuntimeError(f"checkpoint of round {next_round - 1} does not match its record")
    w.outer = OuterOptimizer(params, w.cfg.outer)
    w.outer.load_state_tensors(ckpt)
    state_path = w.run.worker_dir(w.rank) / f"state-{next_round - 1}.safetensors"
    w.inner.load_state_tensors(st_load(state_path.read_bytes()))


def evaluate(w: Worker) -> float:
    """Held-out loss of the global params, averaged over all workers' shares of the eval set."""
    load_params(w.model, w.outer.params)
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for x, y in w.eval_set:
            total[0] += float(w.task.loss(w.model, x, y)) * y.numel()
            total[1] += y.numel()
    dist.all_reduce(total)
    return float(total[0] / total[1])


def load_params(model: torch.nn.Module, params: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(params[k])


def one_round(w: Worker, r: int) -> dict:
    """Run round r on this worker; returns the round's record (complete on rank 0)."""
    cfg, t0 = w.cfg, time.perf_counter()
    G = w.outer.params

    # 1. inner: H local steps from G_r on this worker's deterministic batches
    load_params(w.model, G)
    result = w.inner.run(lambda step: w.task.batch(w.rank, r, step), cfg.train.inner_steps)

    # 2. encode: the pseudo-gradient delta = G_r - theta_local, as a content-addressed packet
    with torch.no_grad():
        delta = {k: G[k] - p.detach() for k, p in w.model.named_parameters()}
    packet = encode_packet(delta, w.codecs)
    packet_hash = w.store.put(packet)

    # 3. exchange: all packets to all workers, each kept whole
    handle = w.exchange.start(packet)
    packets = handle.wait()
    w.bytes_sent += handle.stats.bytes_sent
    w.bytes_received += handle.stats.bytes_received

    # 4. decode every packet; one that does not decode is left out of the aggregate
    shapes = {k: tuple(v.shape) for k, v in G.items()}
    deltas, verdicts, hashes = [], [], []
    for src, data in enumerate(packets):
        hashes.append(w.store.put(data))
        try:
            deltas.append(decode_packet(data, shapes, cfg.run.max_packet_bytes))
            verdicts.append("accept")
        except PacketError as e:
            verdicts.append(f"reject:malformed:{str(e)[:80]}")
    if hashes[w.rank] != packet_hash:
        raise ExchangeError(f"worker {w.rank}: its own packet came back altered")
    if not deltas:
        raise ExchangeError(f"round {r}: no packet decoded; nothing to apply")

    # 5. aggregate (mean) and outer step: G_{r+1}
    aggregate = {k: torch.stack([d[k] for d in deltas]).mean(dim=0) for k in shapes}
    w.outer.step(aggregate)

    # 6. record: checkpoint, private state, agreement check, eval, one line per round
    ckpt = {f"param/{k}": v for k, v in G.items()} | w.outer.state_tensors()
    ckpt_digest = w.store.put(st_save(ckpt, metadata={"round": str(r)}))
    params_hash = tensors_hash(G)
    state_dir = w.run.worker_dir(w.rank)
    state_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(state_dir / f"state-{r}.safetensors", st_save(w.inner.state_tensors()))
    stale = state_dir / f"state-{r - 2}.safetensors"  # keep two: the record of r may not exist yet
    if stale.exists():
        stale.unlink()
    agree = _all_hashes_agree(params_hash, w.world)
    if not agree:
        raise RuntimeError(f"round {r}: workers disagree on G_{r + 1}; refusing to continue")
    stats = torch.tensor(
        [result.mean_loss, result.losses[-1], result.seconds, handle.stats.bytes_sent,
         handle.stats.bytes_received, handle.stats.seconds],
        dtype=torch.float64,
    )
    gathered = [torch.zeros_like(stats) for _ in range(w.world)]
    dist.all_gather(gathered, stats)
    is_last = r == cfg.train.rounds - 1
    eval_loss = evaluate(w) if (r + 1) % cfg.train.eval_every == 0 or is_last else None
    g = torch.stack(gathered)
    return {
        "round": r,
        "packets": hashes,
        "packet_bytes": [len(p) for p in packets],
        "verdicts": verdicts,
        "codec": cfg.compress.codec,
        "aggregate_hash": tensors_hash(aggregate),
        "params_hash": params_hash,
        "checkpoint": ckpt_digest,
        "hashes_agree": agree,
        "train_loss": [float(x) for x in g[:, 0]],
        "train_loss_last": [float(x) for x in g[:, 1]],
        "eval_loss": eval_loss,
        "bytes_sent": [int(x) for x in g[:, 3]],
        "bytes_received": [int(x) for x in g[:, 4]],
        "inner_s": [round(float(x), 4) for x in g[:, 2]],
        "exchange_s": [round(float(x), 4) for x in g[:, 5]],
        "round_s": round(time.perf_counter() - t0, 4),
        "tokens": int(result.tokens * w.world),
    }


def _all_hashes_agree(digest_hex: str, world: int) -> bool:
    mine = torch.frombuffer(bytearray(bytes.fromhex(digest_hex)), dtype=torch.uint8).clone()
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    return all(torch.equal(mine, other) for other in everyone)


def progress_line(rec: dict, rounds: int, elapsed: float, tokens_per_s: float) -> str:
    """One dense line per round (nanochat style)."""
    left = rounds - rec["round"] - 1
    eta = elapsed / (rec["round"] + 1) * left if rec["round"] >= 0 else 0.0
    ev = f"{rec['eval_loss']:.4f}" if rec["eval_loss"] is not None else "   -  "
    acc = sum(v == "accept" for v in rec["verdicts"])
    mb = sum(rec["bytes_sent"]) / len(rec["bytes_sent"]) / 1e6
    train = sum(rec["train_loss"]) / len(rec["train_loss"])
    return (
        f"round {rec['round'] + 1:>4}/{rounds} | eval {ev} | train {train:.4f} | "
        f"{tokens_per_s / 1e3:6.1f}k tok/s | sent {mb:7.3f} MB/worker | "
        f"accepted {acc}/{len(rec['verdicts'])} | {rec['round_s']:.2f}s | eta {eta:5.0f}s"
    )


def train_worker(
    cfg: Config, rank: int, world: int, task: Task, run_dir: str, start_round: int,
    quiet: bool = False, stop_after: int | None = None,
) -> dict | None:
    """The whole run on one worker (dist already initialised). Rank 0 writes the records.

    `stop_after`: stop cleanly once that many rounds are recorded (a preemption point)."""
    w = setup_worker(cfg, rank, world, task, run_dir, start_round)
    prior = w.run.rounds()[:start_round] if w.is_recorder else []
    eval_start = evaluate(w) if start_round == 0 else prior[0]["eval_loss_start"] if prior else None
    wall0 = time.perf_counter() - sum(p["round_s"] for p in prior)
    tokens0 = sum(p["tokens"] for p in prior)
    end = cfg.train.rounds if stop_after is None else min(stop_after, cfg.train.rounds)
    for r in range(start_round, end):
        rec = one_round(w, r)
        rec["eval_loss_start"] = eval_start
        if w.is_recorder:
            elapsed = time.perf_counter() - wall0
            tokens0 += rec["tokens"]
            w.run.append_round(rec)
            w.run.append_metrics({
                "round": r, "eval_loss": rec["eval_loss"], "train_loss": rec["train_loss"],
                "tokens": tokens0, "elapsed_s": round(elapsed, 3),
                "tokens_per_s": round(tokens0 / elapsed, 1),
                "utilisation": round(sum(rec["inner_s"]) / len(rec["inner_s"]) / rec["round_s"], 4),
            })
            if not quiet:
                print(progress_line(rec, cfg.train.rounds, elapsed, tokens0 / elapsed), flush=True)
    if not w.is_recorder:
        return None
    records = w.run.rounds()
    wall = time.perf_counter() - wall0
    last = records[-1]
    evals = [p["eval_loss"] for p in records if p["eval_loss"] is not None]
    return {
        "eval_loss_start": eval_start,
        "eval_loss_end": evals[-1] if evals else None,
        "tokens": sum(p["tokens"] for p in records),
        "rounds": len(records),
        "workers": world,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(sum(p["tokens"] for p in records) / wall, 1),
        "bytes_sent_per_worker": int(sum(sum(p["bytes_sent"]) for p in records) / world),
        "final_checkpoint": last["checkpoint"],
        "final_params_hash": last["params_hash"],
        "mode": "diloco",
        "complete": len(records) == cfg.train.rounds,
    }


def init_distributed(cfg: Config, rank: int, world: int, init_method: str) -> None:
    backend = cfg.run.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world,
        timeout=timedelta(seconds=cfg.run.timeout_s),
    )

