"""Typed configuration: one dataclass per TOML section, `--section.key=value` overrides.

Precedence: command line > config file > defaults. An unknown section or key, or a value of the
wrong type, raises `ConfigError` with one line that names the key and lists the valid ones; the
CLI turns it into exit code 2.

Every field carries its documentation in the `doc` metadata, which `veriloco config --help`
style listings and the README's config reference are generated from (`describe()`).
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .codecspec import DEFAULT_LADDER


class ConfigError(ValueError):
    """Bad configuration: one line naming the key and what is wrong."""


def _f(default: Any, doc: str) -> Any:
    return field(default=default, metadata={"doc": doc})


HF_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "olmo2", "smollm3")  # [model] arch, besides gpt: hf.py
TRANSFORMERS_NEEDED = "transformers>=5,<6"
MAX_TRAIN_THREADS = 1024  # train.threads at most (a number past int64 overflowed in torch, 100000 exhausted the OS)
MAX_TIMEOUT_S = 604800.0  # run.timeout_s at most, a week: torch.distributed holds it as int milliseconds


@dataclass
class ModelConfig:
    """[model] the small byte-level GPT (model.py), or a Hugging Face architecture (hf.py)."""

    arch: str = _f(
        "gpt",
        "'gpt' (the built-in GPT, model.py) or a transformers architecture built from these fields, "
        "nothing downloaded: 'llama', 'mistral', 'qwen2', 'qwen3', 'olmo2', 'smollm3' (hf.py; pip install 'veriloco[hf]')",
    )
    n_layer: int = _f(4, "number of transformer blocks")
    n_head: int = _f(4, "attention heads per block")
    kv_heads: int = _f(0, "transformers archs: key/value heads (grouped-query attention); 0 = n_head")
    head_dim: int = _f(0, "transformers archs: width of one attention head; 0 = d_model / n_head")
    ffn: int = _f(0, "transformers archs: MLP width (intermediate_size); 0 = 8/3 d_model rounded up to 32")
    rope_theta: float = _f(10000.0, "transformers archs: rotary embedding base")
    rope_scaling: str = _f(
        "", "transformers archs: rotary scaling as JSON, config.json's rope_parameters less rope_theta: "
        "'{\"rope_type\": \"llama3\", \"factor\": 32.0, \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, "
        "\"original_max_position_embeddings\": 8192}' (Llama 3.1-3.3), '{\"rope_type\": \"yarn\", \"factor\": 4.0, "
        "\"original_max_position_embeddings\": 32768}' (Qwen3's long context; attention_factor, beta_fast, beta_slow, "
        "mscale, mscale_all_dim, truncate as transformers takes them) or '{\"rope_type\": \"linear\", \"factor\": 2.0}'; "
        "'' = none (hf.py)",
    )
    norm_eps: float = _f(1e-6, "transformers archs: RMSNorm epsilon (rms_norm_eps)")
    init: str = _f(
        "", "start from these weights instead of run.seed's: a safetensors file or a directory of them (a veriloco "
        "export, a transformers model directory); read once, checked against [model], kept in the run's store (weights.py)",
    )
    d_model: int = _f(128, "embedding width")
    ctx: int = _f(128, "context length in tokens")
    vocab_size: int = _f(256, "vocabulary size; 256 = bytes; a token .bin file may need more")
    tie: bool = _f(
        False,
        "the output head is the token embedding, one matrix (weight tying: GPT-2's, transformers' "
        "tie_word_embeddings); with topology.stages > 1 the first stage owns it and the last stage's "
        "head uses a copy sent each step, its gradient sent back",
    )
    sliding_window: int = _f(
        0, "arch mistral: each token attends to the last this many tokens only (config.json's sliding_window, "
        "Mistral 7B v0.1's 4096); 0 = the whole context (hf.py)",
    )
    checkpoint: bool = _f(
        False,
        "activation checkpointing: keep only each block's input for the backward and recompute the rest "
        "(less activation memory for one more forward per block; the same numbers, replays included)",
    )


@dataclass
class DataConfig:
    """[data] where tokens come from (data.py)."""

    source: str = _f(
        "stdlib",
        "'stdlib' (the embedded corpus: this Python's standard library source), "
        "a text file, a directory of text files, a token .bin file (flat, as nanoGPT's, or with llm.c's header), "
        "or a directory of .bin shards (FineWeb's as llm.c and modded-nanogpt write them), read in name order",
    )
    bin_dtype: str = _f("uint16", "element type of token .bin files: uint16 or uint32 (an llm.c header must agree)")
    tokenizer: str = _f(
        "", "a tokenizers tokenizer.json (a local file, nothing downloaded) that turns a text source into "
        "token ids once, when the run is prepared; with a token .bin source, the tokenizer that made its ids "
        "(`veriloco tokenize`), kept with the run for export and sample, not rerun; '' = bytes (data.py; "
        "pip install 'veriloco[hf]')",
    )
    eos: str = _f(
        "", "with data.tokenizer: a token of it (e.g. '<|endoftext|>') put after each document (each file of the "
        "source), which is then tokenized without the '# file:' headers; '' = the files as one text with headers",
    )
    eval_fraction: float = _f(0.05, "fraction of the corpus (its tail) held out for eval")
    chunk_bytes: int = _f(65536, "corpus chunk size for the Merkle tree and the store")
    max_bytes: int = _f(0, "use only the first max_bytes of the corpus; 0 = all of it")


@dataclass
class TrainConfig:
    """[train] the inner loop (inner.py) and the run length."""

    mode: str = _f("diloco", "'diloco' (outer rounds) or 'ddp' (all-reduce every step, baseline)")
    rounds: int = _f(30, "number of outer rounds")
    inner_steps: int = _f(50, "H in DiLoCo: local AdamW steps per round")
    batch_size: int = _f(16, "sequences per inner step per worker")
    lr: float = _f(3e-3, "peak inner learning rate (AdamW)")
    warmup_steps: int = _f(50, "linear warmup steps of the inner LR")
    min_lr_ratio: float = _f(0.1, "cosine decay floor as a fraction of lr")
    weight_decay: float = _f(0.1, "AdamW weight decay")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    grad_clip: float = _f(1.0, "clip the gradient norm to this; 0 = no clipping")
    grad_accum: int = _f(
        1,
        "gradient accumulation: each inner step's batch_size sequences run forward and backward in this many "
        "equal parts (less activation memory, the same step up to float rounding; replays do the same). "
        "topology.stages = 1 (stages split a step with topology.microbatches)",
    )
    eval_batches: int = _f(8, "held-out batches per eval (split across workers)")
    eval_every: int = _f(1, "eval the global params every this many rounds (and at the end)")
    threads: int = _f(1, "torch threads per process")
    precision: str = _f(
        "fp32",
        "'fp32', or 'bf16': each inner step's forward and loss (and every eval, loss gain and replay of "
        "them) under torch.autocast(bfloat16) on run.device (with pipeline stages, each stage's forward); "
        "params, grads, AdamW state and deltas stay fp32",
    )
    inner_state: str = _f(
        "keep",
        "'keep' the AdamW moments across rounds (DiLoCo) or 'reset' them every round, which makes a "
        "worker's round a function of public data so others can replay it (verify.replay_probability)",
    )
    inner_steps_max: int = _f(
        0,
        "adaptive H: with outer.delay = 1 and a [link], a round's H may grow (never shrink) up to this "
        "so that the exchange it overlaps hides under its compute (the records' hide_steps); 0 = H stays "
        "inner_steps. Rounds stay train.rounds; the LR schedule is re-aimed each round at the steps taken "
        "plus the rounds left at the current H. With run.membership = 'elastic' every member (a healed one "
        "too) takes each round's H from the records",
    )
    round_warmup_steps: int = _f(
        0,
        "diloco: ramp the inner LR linearly over the first this many steps of every round (on top of "
        "the run's schedule); 0 = off. Meant for inner_state = 'reset', whose first steps from empty "
        "AdamW moments are sign steps at the full LR. Of those tried, 10 (about 1 / (1 - beta1)) did best "
        "at H = 30 (against 5) and at H = 90 (against 30) (bench/reset_ramp.py); it hurts with the moments kept",
    )


@dataclass
class OuterConfig:
    """[outer] the outer optimizer applied to the averaged pseudo-gradient (outer.py)."""

    lr: float = _f(0.7, "outer learning rate (DiLoCo: 0.7)")
    momentum: float = _f(0.9, "outer momentum (DiLoCo: 0.9)")
    nesterov: bool = _f(True, "Nesterov momentum (DiLoCo); false = heavy ball")
    delay: int = _f(
        0,
        "0: wait for the exchange, then step (DiLoCo); 1: the exchange of round r runs during "
        "round r+1's inner steps and its update lands one round late (DiLoCoX)",
    )
    correction: str = _f(
        "eager",
        "delay 1: 'eager' (Kale et al. 2025: a worker starts from G plus its own newest delta's share, "
        "c/W), 'local' (its own newest delta stands in for the whole missing average, c; measured "
        "closer to delay 0 here, README), or 'naive' (start from G)",
    )
    lookahead: bool = _f(
        False,
        "delay 1, eager/local: start from a dry run of the outer step on G and its momentum, with the "
        "correction's estimate standing in for the missing average (the momentum part of the update "
        "G still lacks is known exactly). Measured (bench/delay.py, README): helps local (+2.28% vs "
        "+2.65% at momentum 0.9), hurts eager (+48.9% vs +29.9%); off by default for eager's sake",
    )
    overlap_steps: int = _f(
        0,
        "delay 1: the exchange of round r runs under only this many of round r+1's inner steps; then "
        "round r's update lands: G moves, and the worker's params move by as much (Streaming DiLoCo's "
        "tau, arXiv 2501.18512), so round r+1's delta is taken from the new G. 0: under the whole "
        "round (it lands one round late). Must be < train.inner_steps",
    )


@dataclass
class TopologyConfig:
    """[topology] workers x pipeline stages x replicas (topology.py, pipeline.py): workers * stages * replicas processes."""

    workers: int = _f(4, "number of workers (DiLoCo replicas, one signing key each)")
    stages: int = _f(
        1,
        "pipeline stages per worker (DiLoCoX): a worker is this many processes, each holding a "
        "contiguous slice of the model's blocks with its own inner and outer optimizer; the outer "
        "exchange of a slice runs only among the workers' processes that hold it, and each builds only its "
        "slice (from G_0 in the run's store). The built-in task only ([model]: the GPT or a transformers arch)",
    )
    microbatches: int = _f(1, "stages > 1: micro-batches per inner step (all replicas' together); must divide "
                              "train.batch_size")
    schedule: str = _f(
        "gpipe", "stages > 1: pipeline schedule, 'gpipe' or '1f1b' (1f1b needs microbatches / replicas >= stages)"
    )
    replicas: int = _f(
        1,
        "data-parallel processes per worker (on its fast local links): each inner step's "
        "train.grad_accum parts (with stages: its topology.microbatches; a multiple of replicas) run in "
        "equal groups of consecutive parts, one per replica (with stages: through the replica's own "
        "pipeline), the groups' gradients summed in replica order; with one part each the run is bit for "
        "bit the one-process run (with stages: the S-stage run, untied), and replays reproduce it either "
        "way; replica 0 takes part in the round. Needs train.mode 'diloco'; under elastic membership a "
        "worker's process starts its replicas itself, on its machine, and they live and die with it",
    )
    bucket_mb: float = _f(
        25.0,
        "replicas > 1, stages = 1: a step's gradients go to their owners in buckets of about this many "
        "MB (float32), the params in reverse order as DDP's reducer groups them; each bucket's reduce "
        "starts as soon as the backward has made all of its gradients, so it overlaps the rest of the "
        "backward. 0 = all of them at once after the backward. The same run bit for bit either way",
    )
    shard_optimizer: bool = _f(
        True,
        "replicas > 1: each replica keeps the AdamW state of about 1/replicas of the params (of its "
        "stage's slice) and updates only those (ZeRO-1: their summed gradients go to it alone, and it "
        "broadcasts them after the step); replica 0 gathers the rest at trace points and for "
        "checkpoints. false: every replica holds and steps the whole optimizer. The same run bit for "
        "bit either way",
    )


@dataclass
class CompressConfig:
    """[compress] how a delta becomes a packet (compress/)."""

    codec: str = _f(
        "fp32",
        "codec spec for every tensor (fp32, fp16, bf16, int8:block=64, int4:block=64, "
        "topk:density=0.01,bits=8, lowrank:rank=4), or 'adaptive' (a codec per tensor per round "
        "chosen to fit the byte budget)",
    )
    error_feedback: bool = _f(False, "keep what the codec dropped and add it to the next delta")
    ladder: str = _f(
        "",
        "adaptive only: ';'-separated codec specs to choose from ('' = the built-in ladder)",
    )
    budget_bytes: int = _f(
        0,
        "adaptive only: packet byte budget per round; 0 = from [link] and the measured inner-step "
        "time, so the exchange hides under the next round's compute",
    )
    safety: float = _f(0.9, "adaptive only: fraction of the compute time the exchange may use")


@dataclass
class LinkConfig:
    """[link] the emulated link between workers (link.py)."""

    bandwidth: str = _f("", "e.g. '1gbit', '100mbit'; '' = unlimited (no emulation)")
    latency: str = _f("0ms", "one-way latency added to every exchange, e.g. '50ms'")
    shaping: str = _f(
        "emulated",
        "'emulated': each exchange is paced in software to latency + bytes / bandwidth (link.py); 'kernel': "
        "elastic runs, root only: every worker in its own network namespace, its veth shaped to bandwidth by "
        "tc tbf and every frame held for the latency by a userspace delay line (netns.py), so the bytes cross a "
        "real rate-limited, long link through TCP (slow start and window included)",
    )


@dataclass
class VerifyConfig:
    """[verify] commitments, signatures, screening and robust aggregation (verify/)."""

    key_dir: str = _f(
        "",
        "directory with worker-<w>.key files from `veriloco keygen`; '' = keys derived from the "
        "run seed (local demo runs only: anyone who knows the seed can sign as any worker)",
    )
    trace_every: int = _f(
        10, "k: hash the inner state (params + AdamW state) every k inner steps; with exact replays it must divide "
        "train.inner_steps; 0 = once per round (k = H)",
    )
    screen: bool = _f(True, "screen deltas: norm and cosine to a robust centre, copies, replays")
    aggregator: str = _f("mean", "mean | trimmed_mean | median | centered_clip | geometric_median")
    trim_fraction: float = _f(0.25, "trimmed_mean: fraction trimmed from each end")
    clip_tau: float = _f(0.0, "centered_clip: radius; 0 = the median distance to the centre")
    loss_gain_batches: int = _f(
        0,
        "screen: test that a delta lowers the loss of G on this many of the worker's own batches of the round, "
        "drawn after it committed (Templar's Gauntlet; see loss_gain_action); costs 2 forward passes per batch "
        "per worker; 0 = off",
    )
    loss_gain_action: str = _f(
        "audit",
        "what a delta failing the loss-gain screen gets: 'audit' = replayed this round, and the replay "
        "decides (the screen alone false-rejects honest workers now and then); 'reject' = rejected. "
        "With replay_probability = 0 there is no replay to decide, so it is rejected either way",
    )
    loss_gain_floor: float = _f(
        0.25,
        "loss-gain screen: the least gain on its own batches a delta must show, as a share of the round's "
        "median delta's gain (with 3+ deltas; with fewer, more than nothing). Higher flags more subtle lazy "
        "workers and more honest deltas (each flagged one is replayed under 'audit'); in [0, 1)",
    )
    loss_gain_checkers: int = _f(
        1,
        "how many workers compute each packet's loss gain (drawn per round, never its sender); the "
        "others take their number, and recompute it themselves only when it fails, is missing or "
        "the checkers disagree (a checker whose number does not reproduce is convicted false_report). "
        "0 = every worker computes every packet's gain (2 forward passes per batch per packet per "
        "worker). Only with loss_gain_action = 'audit' and replays on; otherwise every worker computes "
        "all. With stages a checker computes the gain through its whole pipeline",
    )
    ban: bool = _f(
        True,
        "refuse every later packet of a worker convicted of replay_mismatch, equivocation, false_report or unrevealed",
    )
    replay_probability: float = _f(
        0.0,
        "chance that a worker's round is replayed by another worker; needs "
        "train.inner_state = 'reset' (with topology.stages > 1 the auditor's pipeline replays)",
    )
    replay_match: str = _f(
        "exact",
        "'exact': the replayed trace hashes must equal the committed ones (deterministic kernels: "
        "CPU, same torch and thread count); 'distance': replay the whole round and accept when "
        "norm(replayed delta - committed delta) <= replay_tolerance * norm(committed delta), L2 "
        "(nondeterministic kernels, e.g. GPUs; needs compress.error_feedback = false)",
    )
    replay_extent: str = _f(
        "round",
        "exact mode: how far a drawn replay runs. 'round' (all H steps, then the packet is checked "
        "too) or 'segment' (steps 0 .. the end of a segment drawn at random, k/H to all of a round's "
        "cost). A lazy worker does its first steps honestly and skips the last, so only replays "
        "that reach the skipped ones catch it: 'segment' catches a worker skipping a share s of its "
        "steps in about s of its drawn replays, at (1 + k/H) / 2 of a whole replay's cost on average. "
        "'state': only the drawn segment, from its start state, which the audited worker sends the "
        "auditor (params + AdamW moments, 3x the model's bytes, recorded as state_bytes_sent; its hash "
        "must be the trace's entry, or the worker is convicted): k/H of a round's compute per "
        "replay, and a worker skipping a share s of its steps is caught in about s of them "
        "(with topology.stages > 1 each stage's slice goes to the auditor's same stage). Suspects "
        "are always replayed whole",
    )
    keep_states: str = _f(
        "memory",
        "replay_extent = 'state': where a worker keeps the state behind each trace entry until its round "
        "is checked (it cannot know which segment will be drawn): H/k + 1 states of 3x the model per round "
        "in flight (two rounds under outer.delay = 1). 'memory' = host memory, reused round after round; "
        "'disk' = a file per round in the worker's directory of the run, read back only for a drawn "
        "segment and deleted once the round is checked",
    )
    replay_tolerance: float = _f(
        0.01,
        "distance mode: the largest accepted norm(replayed - committed) / norm(committed). A security "
        "parameter: loose thresholds let a worker pass off work it did not do (Fang et al. 2023, "
        "arXiv 2208.03567). 0.01 is 3x the largest honest distance measured under simulated "
        "nondeterminism (3.0e-3) and below every cheat measured (skipping 1 of 20 steps: >= 0.026), "
        "on the tiny GPT; measure yours (README: Verification)",
    )


@dataclass
class LedgerConfig:
    """[ledger] where round entries go (ledger/)."""

    backend: str = _f("sqlite", "'sqlite' (RUN/ledger.sqlite), 'evm' (any EVM RPC), or 'none'")
    rpc_url: str = _f("", "evm: the JSON-RPC URL of the chain")
    contract: str = _f("", "evm: the LineageLedger contract address")
    key_file: str = _f("", "evm: file with the recorder's hex private key (chmod 600)")


@dataclass
class RunConfig:
    """[run] seeds, backend, timeouts, output."""

    seed: int = _f(0, "run seed: model init and every batch derive from it")
    device: str = _f(
        "cpu",
        "'cpu', or 'cuda': each process trains on cuda:(its local index mod the GPUs it sees) - the model, "
        "inner steps, evals, loss gains and replays; G, the outer step, codecs, packets and hashes stay on "
        "the CPU. Exact replays (verify.replay_match) on GPUs need identical GPUs and torch's deterministic "
        "algorithms (turned on then); else use 'distance'",
    )
    backend: str = _f(
        "auto",
        "gloo carries the CPU tensors (packets, checks, evals) in every case; with run.device = 'cuda', "
        "'auto' adds nccl for CUDA tensors (pipeline activations, DDP gradients) when the machine has a GPU "
        "per local process (NCCL refuses two ranks on one GPU), 'nccl' adds it always, 'gloo' never",
    )
    timeout_s: float = _f(120.0, "collective timeout: a dead peer is an error after this long")
    max_packet_bytes: int = _f(1 << 30, "packets larger than this are rejected before decoding")
    keep_checkpoints: int = _f(
        0, "round checkpoints the run's store keeps: 0 every round's; N >= 2 the newest N rounds', older ones "
        "deleted as rounds are recorded (a round's is G and its outer momentum: twice the model). A resume and "
        "a rejoining worker read the newest two; `veriloco audit` recomputes every round's checkpoint from the "
        "packets either way and checks the kept ones; `veriloco export --round` of a pruned round rebuilds it from "
        "the packets (one stage)",
    )
    membership: str = _f(
        "static",
        "'static': a fixed world, a dead worker stops the run; 'elastic': a quorum per round from torchft's "
        "Lighthouse, so the run goes on without dead or late workers and they rejoin (membership.py)",
    )
    min_workers: int = _f(0, "elastic: fewest active workers that may commit a round (0: a majority of topology.workers)")
    round_deadline: float = _f(
        0.0, "elastic: seconds the others wait for a live worker's packet once the first is ready; a packet later "
        "than that is recorded as late and left out (0: run.timeout_s)",
    )
    heartbeat_timeout_s: float = _f(2.0, "elastic: a worker silent this long is dead and left out of the next quorum")
    max_restarts: int = _f(
        0, "elastic: the launcher starts a worker whose process ended in failure (a crash, kill -9, the OOM killer) "
        "again, heartbeat_timeout_s later, up to this many times per worker; it heals and rejoins",
    )


@dataclass
class Config:
    """The whole configuration; each attribute is one TOML section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    compress: CompressConfig = field(default_factory=CompressConfig)
    link: LinkConfig = field(default_factory=LinkConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    adversary: dict = field(
        default_factory=dict,
        metadata={"doc": "worker id -> attacker: a built-in kind (noop, noise, scaled, sign_flip, stale, "
                  "replay, copy, lazy, skim, wrong_data, alie, ipm, malformed, forged_signature, equivocate, false_accuser), "
                  "'kind:key=value,...', or 'package.module:Class' (verify/adversary.py)"},
    )
    ledger: LedgerConfig = field(default_factory=LedgerConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict (what goes into the run manifest)."""
        return dataclasses.asdict(self)


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in fields(Config)}


def _coerce(section: str, key: str, value: Any, typ: Any) -> Any:
    where = f"{section}.{key}"
    if typ is bool:
        if isinstance(value, bool):
            return value
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):  # TOML's inf and nan: no field means anything by them
                raise ConfigError(f"{where}: expected a finite number, got {value}")
            return float(value)
    elif typ is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - every field is one of the four
        raise ConfigError(f"{where}: unsupported field type {typ}")
    raise ConfigError(f"{where}: expected {typ.__name__}, got {type(value).__name__} {value!r:.60}")


def _apply(cfg: Config, section: str, values: dict[str, Any], origin: str) -> None:
    sections = _sections()
    if section == "adversary":  # keys are worker ids, values attacker specs (for tests and red teams)
        if not isinstance(values, dict):
            raise ConfigError(f"[adversary] in {origin} must be a table of worker = \"kind\"")
        for key, value in values.items():
            if not re.fullmatch(r"[0-9]+", str(key)) or not isinstance(value, str):  # not isdigit(): '²' is one
                raise ConfigError(f"adversary.{key} in {origin}: expected adversary.<worker id> = \"<kind>\"")
            cfg.adversary[str(int(key))] = value
        return
    if section not in sections:
        raise ConfigError(
            f"unknown section [{section}] in {origin}; valid sections: {', '.join(sections)}"
        )
    if not isinstance(values, dict):
        raise ConfigError(f"[{section}] in {origin} must be a table")
    obj = getattr(cfg, section)
    hints = typing.get_type_hints(type(obj))
    names = [f.name for f in fields(obj)]
    for key, value in values.items():
        if key not in names:
            raise ConfigError(
                f"unknown key {section}.{key} in {origin}; valid keys of [{section}]: {', '.join(names)}"
            )
        setattr(obj, key, _coerce(section, key, value, hints[key]))


def _parse_override(text: str) -> tuple[str, str, Any]:
    body = text[2:] if text.startswith("--") else text
    if "=" not in body or "." not in body.split("=", 1)[0]:
        raise ConfigError(f"override {text!r} is not of the form --section.key=value")
    dotted, raw = body.split("=", 1)
    section, key = dotted.split(".", 1)
    try:  # a TOML literal (number, bool, quoted string) ...
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:  # ... or a bare string
        value = raw
    return section, key, value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict[str, dict[str, Any]] | None = None) -> Config:
    """Defaults, then the TOML file at `path` (if any), then `--section.key=value` overrides.
    `base` instead of defaults: a `Config.to_dict()` (a run manifest's config)."""
    cfg = Config()
    if base is not None:
        for (section, key), value in BEFORE_KEY.items():
            if isinstance(base.get(section), dict) and key not in base[section]:
                setattr(getattr(cfg, section), key, value)
        for section, values in base.items():
            _apply(cfg, section, values, "the manifest")
    if path is not None:
        p = Path(path)
        try:
            if not p.is_file():
                raise ConfigError(f"config file not found: {p}")
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
        except OSError as e:  # a name past the OS's limit, a file it may not read
            raise ConfigError(f"config file {str(p)[:120]}: {e.strerror or e}") from None
        for section, values in data.items():
            _apply(cfg, section, values, str(p))
    for text in overrides or []:
        section, key, value = _parse_override(text)
        hints = typing.get_type_hints(_sections()[section]) if section in _sections() and section != "adversary" else {}
        if hints.get(key) is str and not isinstance(value, str):  # --ledger.contract=0x5FbD... stays text
            value = text.split("=", 1)[1]
        _apply(cfg, section, {key: value}, "the command line")
    validate(cfg)
    return cfg


def need(ok: bool, msg: str) -> None:
    """ConfigError(msg) unless ok."""
    if not ok:
        raise ConfigError(msg)


def codec_specs(compress: CompressConfig) -> list[str]:
    """The codec specs an honest worker encodes with: `[compress] codec`, or with "adaptive" each
    rung of `[compress] ladder` (the built-in DEFAULT_LADDER when it is empty). Without torch."""
    if compress.codec != "adaptive":
        return [compress.codec]
    return [s.strip() for s in compress.ladder.split(";") if s.strip()] or list(DEFAULT_LADDER)


def validate(cfg: Config) -> None:
    """Cross-field checks that types alone cannot express."""
    m, t, d = cfg.model, cfg.train, cfg.data
    need(m.n_layer >= 1, f"model.n_layer must be >= 1, got {m.n_layer}")
    need(m.n_head >= 1, f"model.n_head must be >= 1, got {m.n_head}")
    need(m.d_model >= 1, f"model.d_model must be >= 1, got {m.d_model}")
    need(m.d_model % m.n_head == 0, f"model.d_model ({m.d_model}) must be divisible by model.n_head ({m.n_head})")
    need(m.ctx >= 2, f"model.ctx must be >= 2, got {m.ctx}")
    need(m.vocab_size >= 2, f"model.vocab_size must be >= 2, got {m.vocab_size}")
    _check_arch(m)
    need(t.mode in ("diloco", "ddp"), f"train.mode must be 'diloco' or 'ddp', got {t.mode!r}")
    need(t.rounds >= 1, f"train.rounds must be >= 1, got {t.rounds}")
    need(t.inner_steps >= 1, f"train.inner_steps must be >= 1, got {t.inner_steps}")
    need(t.batch_size >= 1, f"train.batch_size must be >= 1, got {t.batch_size}")
    need(t.lr > 0, f"train.lr must be > 0, got {t.lr}")
    need(t.warmup_steps >= 0, f"train.warmup_steps must be >= 0, got {t.warmup_steps}")
    need(t.weight_decay >= 0, f"train.weight_decay must be >= 0, got {t.weight_decay}")
    need(0 <= t.beta1 < 1 and 0 <= t.beta2 < 1,
         f"train.beta1 and train.beta2 must be in [0, 1), got {t.beta1} and {t.beta2}")
    need(t.grad_clip >= 0, f"train.grad_clip must be >= 0 (0: no clipping), got {t.grad_clip}")
    need(0 <= t.min_lr_ratio <= 1, f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")
    need(t.eval_batches >= 1, f"train.eval_batches must be >= 1, got {t.eval_batches}")
    need(t.eval_every >= 1, f"train.eval_every must be >= 1, got {t.eval_every}")
    need(1 <= t.threads <= MAX_TRAIN_THREADS, f"train.threads must be in [1, {MAX_TRAIN_THREADS}], got {t.threads}")
    need(t.grad_accum >= 1, f"train.grad_accum must be >= 1, got {t.grad_accum}")
    need(t.batch_size % t.grad_accum == 0,
         f"train.batch_size ({t.batch_size}) must split into train.grad_accum ({t.grad_accum}) equal parts")
    need(t.grad_accum == 1 or cfg.topology.stages == 1,
         "train.grad_accum needs topology.stages = 1 (with stages, topology.microbatches splits a step)")
    need(0 <= t.round_warmup_steps <= t.inner_steps,
         f"train.round_warmup_steps must be in [0, train.inner_steps = {t.inner_steps}], got {t.round_warmup_steps}")
    need(0 < d.eval_fraction < 0.5, f"data.eval_fraction must be in (0, 0.5), got {d.eval_fraction}")
    need(d.chunk_bytes >= 1024, f"data.chunk_bytes must be >= 1024, got {d.chunk_bytes}")
    need(d.max_bytes >= 0, f"data.max_bytes must be >= 0 (0: all of the corpus), got {d.max_bytes}")
    need(d.bin_dtype in ("uint16", "uint32"), f"data.bin_dtype must be uint16 or uint32, got {d.bin_dtype!r}")
    need(d.source.strip() != "", "data.source must be 'stdlib' or a path, got '' (which would read the current directory)")
    need(not d.eos or bool(d.tokenizer), "data.eos needs data.tokenizer (a byte-level corpus has no end-of-text token)")
    need(cfg.outer.lr > 0, f"outer.lr must be > 0, got {cfg.outer.lr}")
    need(0 <= cfg.outer.momentum < 1, f"outer.momentum must be in [0, 1), got {cfg.outer.momentum}")
    _check_topology(cfg)
    need(-(1 << 63) <= cfg.run.seed < 1 << 63, f"run.seed must be in [-2^63, 2^63), got {cfg.run.seed}")
    need(cfg.run.max_packet_bytes >= 1, f"run.max_packet_bytes must be >= 1, got {cfg.run.max_packet_bytes}")
    need(cfg.run.backend in ("auto", "gloo", "nccl"), f"run.backend must be auto, gloo or nccl, got {cfg.run.backend!r}")
    need(cfg.run.device in ("cpu", "cuda"), f"run.device must be 'cpu' or 'cuda', got {cfg.run.device!r}")
    need(cfg.run.backend != "nccl" or cfg.run.device == "cuda",
         "run.backend = 'nccl' needs run.device = 'cuda' (on the CPU every collective is gloo's)")
    need(t.precision in ("fp32", "bf16"), f"train.precision must be 'fp32' or 'bf16', got {t.precision!r}")
    need(cfg.outer.delay in (0, 1), f"outer.delay must be 0 or 1, got {cfg.outer.delay}")
    need(cfg.outer.correction in ("eager", "local", "naive"),
         f"outer.correction must be 'eager', 'local' or 'naive', got {cfg.outer.correction!r}")
    need(0 <= cfg.outer.overlap_steps < t.inner_steps,
         f"outer.overlap_steps must be in [0, train.inner_steps = {t.inner_steps}), got {cfg.outer.overlap_steps}")
    need(not cfg.outer.overlap_steps or cfg.outer.delay == 1,
         f"outer.overlap_steps = {cfg.outer.overlap_steps} needs outer.delay = 1")
    need(0 < cfg.compress.safety <= 1, f"compress.safety must be in (0, 1], got {cfg.compress.safety}")
    need(cfg.compress.budget_bytes >= 0, f"compress.budget_bytes must be >= 0, got {cfg.compress.budget_bytes}")
    _check_link_and_codec(cfg)
    _check_adaptive_h(cfg)
    v = cfg.verify
    need(v.trace_every >= 0, f"verify.trace_every must be >= 0, got {v.trace_every}")
    need(v.aggregator in ("mean", "trimmed_mean", "median", "centered_clip", "geometric_median"),
         f"verify.aggregator must be mean, trimmed_mean, median, centered_clip or geometric_median, got {v.aggregator!r}")
    need(0 <= v.trim_fraction < 0.5, f"verify.trim_fraction must be in [0, 0.5), got {v.trim_fraction}")
    need(v.clip_tau >= 0, f"verify.clip_tau must be >= 0, got {v.clip_tau}")
    need(cfg.train.inner_state in ("keep", "reset"), f"train.inner_state must be 'keep' or 'reset', got {cfg.train.inner_state!r}")
    need(v.loss_gain_batches >= 0, f"verify.loss_gain_batches must be >= 0, got {v.loss_gain_batches}")
    need(0.0 <= v.loss_gain_floor < 1.0, f"verify.loss_gain_floor must be in [0, 1), got {v.loss_gain_floor}")
    need(v.loss_gain_checkers >= 0, f"verify.loss_gain_checkers must be >= 0, got {v.loss_gain_checkers}")
    need(0 <= v.replay_probability <= 1, f"verify.replay_probability must be in [0, 1], got {v.replay_probability}")
    need(v.loss_gain_action in ("audit", "reject"),
         f"verify.loss_gain_action must be 'audit' or 'reject', got {v.loss_gain_action!r}")
    need(v.replay_match in ("exact", "distance"), f"verify.replay_match must be 'exact' or 'distance', got {v.replay_match!r}")
    need(v.replay_extent in ("round", "segment", "state"),
         f"verify.replay_extent must be 'round', 'segment' or 'state', got {v.replay_extent!r}")
    need(v.keep_states in ("memory", "disk"), f"verify.keep_states must be 'memory' or 'disk', got {v.keep_states!r}")
    if v.replay_probability > 0 and v.replay_extent == "state":
        need(v.replay_match == "exact", "verify.replay_extent = 'state' needs verify.replay_match = 'exact' "
             "(a segment's start state is checked by its hash in the trace)")
    # >= 1 would accept any delta scaled up enough: ||r - c|| / ||c|| -> 1 as ||c|| grows
    need(0 < v.replay_tolerance < 1, f"verify.replay_tolerance must be in (0, 1), got {v.replay_tolerance}")
    if v.replay_probability > 0:
        need(cfg.train.inner_state == "reset", "verify.replay_probability > 0 needs train.inner_state = 'reset' (a round must be replayable from public data)")
    if v.replay_probability > 0 and v.replay_match == "exact" and v.trace_every:
        # an exact replay checks whole segments of k steps, and the packet only when the last one ends the round
        need(cfg.train.inner_steps % v.trace_every == 0,
             f"verify.trace_every ({v.trace_every}) must divide train.inner_steps ({cfg.train.inner_steps}) when "
             "replays are on: otherwise the round's last steps lie in no segment and no replay checks them or the packet")
    if v.replay_probability > 0 and v.replay_match == "distance":
        need(not cfg.compress.error_feedback, "verify.replay_match = 'distance' needs compress.error_feedback = false "
             "(the packet would hold the worker's private residual, which a replay cannot reproduce)")
        from .verify.replay import checkable_codec

        bad = [x for x in codec_specs(cfg.compress) if not checkable_codec(x)]
        need(not bad, f"verify.replay_match = 'distance' cannot judge a packet under {bad[0] if bad else ''}")
    need(not cfg.adversary or cfg.train.mode == "diloco",
         f"adversary.{next(iter(cfg.adversary), '')}: an attacker needs train.mode = 'diloco' (the DDP baseline has "
         "no packets to attack or check)")
    for key, spec in cfg.adversary.items():
        need(int(key) < cfg.topology.workers, f"adversary.{key}: there are only {cfg.topology.workers} workers")
        from .verify.adversary import load_adversary

        try:
            load_adversary(spec, int(key), 0)
        except ValueError as e:
            raise ConfigError(f"adversary.{key}: {e}") from None
    need(cfg.ledger.backend in ("sqlite", "evm", "none"), f"ledger.backend must be sqlite, evm or none, got {cfg.ledger.backend!r}")
    if cfg.ledger.backend == "evm":
        need(bool(cfg.ledger.rpc_url and cfg.ledger.contract and cfg.ledger.key_file),
             "ledger.backend = 'evm' needs ledger.rpc_url, ledger.contract and ledger.key_file")
    need(0 < cfg.run.timeout_s <= MAX_TIMEOUT_S,  # torch.distributed holds it as int milliseconds
         f"run.timeout_s must be in (0, {MAX_TIMEOUT_S}] seconds, got {cfg.run.timeout_s}")
    r = cfg.run
    need(r.membership in ("static", "elastic"), f"run.membership must be 'static' or 'elastic', got {r.membership!r}")
    need(0 <= r.min_workers <= cfg.topology.workers,
         f"run.min_workers must be in [0, topology.workers = {cfg.topology.workers}], got {r.min_workers}")
    need(r.round_deadline >= 0, f"run.round_deadline must be >= 0, got {r.round_deadline}")
    need(r.heartbeat_timeout_s > 0, f"run.heartbeat_timeout_s must be > 0, got {r.heartbeat_timeout_s}")
    need(r.max_restarts >= 0, f"run.max_restarts must be >= 0, got {r.max_restarts}")
    need(r.keep_checkpoints == 0 or r.keep_checkpoints >= 2,
         f"run.keep_checkpoints must be 0 (keep all) or >= 2 (a resume reads the newest two), got {r.keep_checkpoints}")
    if r.membership == "elastic":
        need(cfg.train.mode == "diloco", "run.membership = 'elastic' needs train.mode = 'diloco' "
             "(the DDP baseline all-reduces every step over a fixed world)")
        need(cfg.topology.stages == 1, "run.membership = 'elastic' needs topology.stages = 1 (pipelined workers are not elastic yet)")
    else:
        need(r.round_deadline == 0 and r.min_workers == 0,
             "run.round_deadline and run.min_workers need run.membership = 'elastic'")
        need(r.max_restarts == 0, "run.max_restarts needs run.membership = 'elastic' (a static run stops when a "
             "worker dies; continue it with veriloco train --resume)")


def _check_arch(m: ModelConfig) -> None:
    """[model] arch and the fields only transformers archs read (hf.py, and torch, imported for those
    archs only: a gpt config loads without torch)."""
    need(m.arch in ("gpt",) + HF_ARCHS, f"model.arch must be gpt, {', '.join(HF_ARCHS)}, got {m.arch!r}")
    need(m.kv_heads >= 0 and m.ffn >= 0 and m.head_dim >= 0,
         f"model.kv_heads, model.ffn and model.head_dim must be >= 0, got {m.kv_heads}, {m.ffn} and {m.head_dim}")
    need(m.rope_theta > 0 and m.norm_eps > 0, f"model.rope_theta and model.norm_eps must be > 0, got {m.rope_theta} and {m.norm_eps}")
    need(m.sliding_window >= 0, f"model.sliding_window must be >= 0, got {m.sliding_window}")
    need(not m.sliding_window or m.arch == "mistral",
         f"model.sliding_window is for arch mistral (its every layer); model.arch is {m.arch!r}")
    if m.arch == "gpt":
        need(not (m.kv_heads or m.ffn or m.head_dim or m.rope_theta != 10000.0 or m.norm_eps != 1e-6 or m.rope_scaling),
             "model.kv_heads, model.head_dim, model.ffn, model.rope_theta, model.rope_scaling and model.norm_eps are for "
             "transformers archs; model.arch is 'gpt'")
        return
    from .hf import rope_scaling, transformers_version

    try:
        rope_scaling(m)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    head = m.head_dim or m.d_model // m.n_head
    need(head % 2 == 0, f"model.arch = {m.arch!r}: the head width ({head}; model.head_dim, or d_model / n_head) "
         "must be even (rotary embeddings)")
    need(m.n_head % (m.kv_heads or m.n_head) == 0,
         f"model.n_head ({m.n_head}) must be divisible by model.kv_heads ({m.kv_heads})")
    version = transformers_version()
    need(version is not None and version.split(".")[0] == "5",
         f"model.arch = {m.arch!r} needs {TRANSFORMERS_NEEDED} (pip install 'veriloco[hf]'); "
         + (f"found {version}" if version else "it is not installed"))


def _check_adaptive_h(cfg: Config) -> None:
    """[train] inner_steps_max: what adaptive H needs (after the link parsed)."""
    t = cfg.train
    if not t.inner_steps_max:
        return
    from .link import Link

    need(t.inner_steps_max >= t.inner_steps,
         f"train.inner_steps_max must be 0 or >= train.inner_steps = {t.inner_steps}, got {t.inner_steps_max}")
    need(t.mode == "diloco" and cfg.outer.delay == 1 and not cfg.outer.overlap_steps,
         "train.inner_steps_max (adaptive H) needs train.mode = 'diloco', outer.delay = 1 and outer.overlap_steps = 0 "
         "(H grows so the delayed exchange hides under a whole round)")
    need(not Link.from_strings(cfg.link.bandwidth, cfg.link.latency).unlimited,
         "train.inner_steps_max (adaptive H) needs a [link] (bandwidth or latency) to hide the exchange under")
    need(cfg.topology.workers >= 2, "train.inner_steps_max (adaptive H) needs topology.workers >= 2 (one worker exchanges nothing)")
    k = cfg.verify.trace_every
    need(not k or t.inner_steps_max % k == 0,
         f"verify.trace_every ({k}) must divide train.inner_steps_max ({t.inner_steps_max}): H grows in steps of it")


def _check_topology(cfg: Config) -> None:
    p, t = cfg.topology, cfg.train
    need(p.microbatches >= 1, f"topology.microbatches must be >= 1, got {p.microbatches}")  # before the % below
    checks = (
        (p.workers >= 1, f"topology.workers must be >= 1, got {p.workers}"),
        (p.stages >= 1, f"topology.stages must be >= 1, got {p.stages}"),
        (p.stages <= cfg.model.n_layer,
         f"topology.stages ({p.stages}) > model.n_layer ({cfg.model.n_layer}): every stage needs at least one block"),
        (t.batch_size % p.microbatches == 0,
         f"train.batch_size ({t.batch_size}) must be divisible by topology.microbatches ({p.microbatches})"),
        (p.schedule in ("gpipe", "1f1b"), f"topology.schedule must be 'gpipe' or '1f1b', got {p.schedule!r}"),
        (p.schedule != "1f1b" or p.microbatches >= p.stages,
         f"topology.schedule = '1f1b' needs topology.microbatches ({p.microbatches}) >= topology.stages ({p.stages})"),
        (p.stages == 1 or t.mode == "diloco",
         f"train.mode = 'ddp' runs one process per worker; topology.stages must be 1, got {p.stages}"),
        (p.replicas >= 1, f"topology.replicas must be >= 1, got {p.replicas}"),
        (math.isfinite(p.bucket_mb) and p.bucket_mb >= 0, f"topology.bucket_mb must be a number >= 0, got {p.bucket_mb}"),
    )
    if p.replicas > 1 and p.stages == 1:
        checks += ((t.grad_accum % p.replicas == 0,
                    f"topology.replicas = {p.replicas} splits train.grad_accum's parts among the replicas: set "
                    f"train.grad_accum to a multiple of {p.replicas} (got {t.grad_accum})"),)
    if p.replicas > 1 and p.stages > 1:
        checks += (
            (p.microbatches % p.replicas == 0,
             f"topology.replicas = {p.replicas} splits topology.microbatches among the replicas' pipelines: "
             f"set topology.microbatches to a multiple of {p.replicas} (got {p.microbatches})"),
            (p.schedule != "1f1b" or p.microbatches >= p.stages * p.replicas,
             f"topology.schedule = '1f1b' needs each replica's topology.microbatches / replicas "
             f"({p.microbatches // p.replicas}) >= topology.stages ({p.stages})"),
        )
    if p.replicas > 1:  # what the replicas' round is built for, so far
        checks += (
            (t.mode == "diloco", "topology.replicas > 1 needs train.mode = 'diloco'"),
        )
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)


def _check_link_and_codec(cfg: Config) -> None:
    from .codecspec import CodecError, check_spec  # no torch: a bad config answers at once
    from .link import parse_bandwidth, parse_duration

    for key, parse in (("bandwidth", parse_bandwidth), ("latency", parse_duration)):
        try:
            parse(getattr(cfg.link, key))
        except ValueError as e:
            raise ConfigError(f"link.{key}: {e}") from None
    if cfg.link.shaping not in ("emulated", "kernel"):
        raise ConfigError(f"link.shaping must be 'emulated' or 'kernel', got {cfg.link.shaping!r}")
    if cfg.link.shaping == "kernel":
        if cfg.run.membership != "elastic":
            raise ConfigError("link.shaping = 'kernel' needs run.membership = 'elastic' (its workers are programs "
                              "in network namespaces)")
        if parse_bandwidth(cfg.link.bandwidth) == float("inf"):
            raise ConfigError("link.shaping = 'kernel' needs a link.bandwidth to shape to")
    for spec in codec_specs(cfg.compress):
        try:
            check_spec(spec)
        except CodecError as e:
            raise ConfigError(f"compress.{'codec' if cfg.compress.codec != 'adaptive' else 'ladder'}: {e}") from None


# keys added after runs were recorded whose default changed what such a run did: the value that
# run had, for a manifest without the key (a drawn replay used to stop at a drawn segment)
BEFORE_KEY: dict[tuple[str, str], Any] = {("verify", "replay_extent"): "segment"}


def config_from_dict(data: dict[str, dict[str, Any]]) -> Config:
    """Rebuild a Config from `Config.to_dict()` output (e.g. a run manifest), validating it."""
    return load_config(base=data)


def config_warnings(cfg: Config) -> list[str]:
    """Valid settings that measured badly here, one line each (the CLI prints them; nothing is changed).

    The DDP baseline with [outer], [compress], [verify] or [ledger] set: it has none of them, and a
    user comparing it with the DiLoCo run of the same config should know they were not applied.

    Delay 1 with outer momentum above 0.5 and the eager or naive correction: on configs/tiny.toml
    (3 workers, H = 5) the eager run's eval loss jumps to 6.48 at round 6 of 16 where delay 0
    keeps falling, and diverges (7.47) at round 8 of 8; at momentum 0.5, or with the local
    correction and the lookahead, it falls steadily (`python bench/delay_stability.py`).

    Inner state reset without a per-round LR ramp: on configs/default.toml's job the eval loss
    ends 6.6% higher than with the moments kept (H = 30) and 1.5% higher at H = 90; a ramp over
    each round's first 10 steps closes most of it at both (`python bench/reset_ramp.py`).

    Replays from sent states with compressed packets: each drawn segment moves its start state
    (3x the model's fp32 bytes); at p = 0.38 that was 3.9 MB per worker-round beside 10.5 MB of
    fp32 packets (`python bench/state_replay.py`), so under a codec the states outweigh the
    packets the codec was chosen to shrink.

    Distance replays with trace_every < H: nothing compares the trace, and each hash reads the whole
    inner state between steps (the tensor hash's leaves on the process's CPUs: 2.8 GB/s on this
    2-core machine, so a 303M-param GPT's 3.6 GB state takes about 1.3 s a hash, `python
    bench/tensor_hash.py`), which on a GPU can outweigh the steps.

    Two workers with an attacker or a robust aggregator: the screen's norm and cosine checks need a
    robust centre, which needs 3 workers (an honest majority), and are skipped with 2; the robust
    aggregators cannot outvote either of two. On configs/tiny.toml, `--adversary.1=noise`, `scaled`,
    `sign_flip`, `alie` and `ipm` were each accepted in all 3 rounds; with the loss-gain screen on
    and rejecting, `python bench/two_workers.py` refused noise in half the rounds and alie in a
    fifth."""
    o, t, v, out = cfg.outer, cfg.train, cfg.verify, []
    ignored = [f"[{f.name}]" for f in fields(Config) if f.name in ("outer", "compress", "verify", "ledger")
               and getattr(cfg, f.name) != f.default_factory()] if t.mode == "ddp" else []
    if ignored:
        out.append(f"train.mode = 'ddp' ignores {', '.join(ignored)}: the DDP baseline all-reduces every step's fp32 "
                   "gradients, with no outer optimizer, packets, verification or ledger ([link] paces its all-reduces)")
    if t.mode == "diloco" and cfg.topology.workers == 2 and (cfg.adversary or v.aggregator != "mean"):
        out.append("topology.workers = 2: the screen's norm and cosine checks need a robust centre, which needs 3 "
                   "workers, and are skipped, and no aggregator can outvote either of two; a noisy, scaled or "
                   "sign-flipped delta passes. What still holds: signatures, base hash, batch root, equivocation, "
                   "copies, replays; turn on --verify.loss_gain_batches and --verify.replay_probability (with "
                   "--train.inner_state=reset) to check the work itself (README: Verification)")
    if t.mode == "diloco" and v.replay_match == "distance" and v.trace_every and v.trace_every < t.inner_steps:
        out.append(f"verify.replay_match = 'distance' compares deltas, not trace hashes, yet each worker still hashes "
                   f"its whole inner state (params + AdamW moments, 3x the model) {1 + t.inner_steps // v.trace_every} "
                   f"times a round between steps (trace_every = {v.trace_every}); --verify.trace_every=0 hashes it "
                   "twice (veriloco plan prints the time)")
    if t.mode == "diloco" and t.inner_state == "reset" and not t.round_warmup_steps:
        out.append("train.inner_state = 'reset' without train.round_warmup_steps cost 6.6% eval loss on the make run "
                   "job (14 rounds, H = 30) and 1.5% at H = 90; --train.round_warmup_steps=10 (about 1 / (1 - beta1) "
                   "steps, while AdamW's first moment fills) closed most of it at both (bench/reset_ramp.py)")
    if o.delay and o.correction in ("eager", "naive") and o.momentum > 0.5:
        out.append(f"outer.delay = 1 with outer.momentum = {o.momentum} and the {o.correction} correction was "
                   "unstable in bench/delay_stability.py; use --outer.momentum=0.5, or "
                   "--outer.correction=local --outer.lookahead=true (README: Delay 1 and outer momentum)")
    if v.replay_probability > 0 and v.replay_extent == "state" and cfg.compress.codec != "fp32":
        out.append(f"verify.replay_extent = 'state' moves a segment's start state (3x the model's fp32 bytes) for each "
                   f"drawn replay, about {3 * v.replay_probability:.2g} model-sizes per worker-round at "
                   f"replay_probability = {v.replay_probability:g}, uncompressed, beside packets that compress.codec = "
                   f"'{cfg.compress.codec}' shrinks; on a link the packets must be compressed for, "
                   "--verify.replay_extent=round moves nothing (bench/state_replay.py)")
    return out


def describe() -> str:
    """Markdown reference of every section and key with type, default and doc."""
    lines = []
    for name, cls in _sections().items():
        if cls is dict:
            doc = next(f for f in fields(Config) if f.name == name).metadata["doc"]
            lines.append(f"### [{name}]\n\n`--{name}.W=KIND`: {doc}\n")
            continue
        lines.append(f"### [{name}]\n\n{(cls.__doc__ or '').split('] ', 1)[-1].strip()}\n")
        lines.append("| key | type | default | meaning |\n|---|---|---|---|")
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            lines.append(f"| `{f.name}` | {hints[f.name].__name__} | `{f.default!r}` | {f.metadata.get('doc', '')} |")
        lines.append("")
    return "\n".join(lines)
