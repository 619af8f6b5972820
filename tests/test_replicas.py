"""`[topology] replicas`: a worker on several processes, each running one of an inner step's
grad_accum parts (with stages: its micro-batches, through the replica's own pipeline), the parts'
gradients summed in part order (`inner.Replicas`). With one part each the run is the one-process
run bit for bit; either way its replays (one process, or the auditor's replica 0s) reproduce it."""

from __future__ import annotations

import pytest
from conftest import ROOT, rounds_of, tiny

from veriloco.audit import audit_run
from veriloco.config import ConfigError
from veriloco.run import resume, train

BASE = ("--topology.workers=2", "--train.grad_accum=2", "--run.timeout_s=60")


def _trained(tmp_path, name: str, *overrides: str, stop_after: int | None = None) -> list[dict]:
    train(tiny(*BASE, *overrides), str(tmp_path / name), quiet=True, stop_after=stop_after)
    return rounds_of(tmp_path / name)


def _same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) and a
    for x, y in zip(a, b, strict=True):
        assert (x["params_hash"], x["eval_loss"], x["train_loss"]) == (y["params_hash"], y["eval_loss"], y["train_loss"])


def test_replicas_with_delay_1_are_the_one_process_run_and_their_replays_pass(tmp_path):
    """Delay 1 (the start point corrected by the worker's own delta), inner state reset every
    round, every worker replayed every round by the other; 3 replicas, so the order the parts are
    added in matters (two floats add the same either way round, three need not). Their reduce
    runs in 2 KB buckets, started inside the backward (`[topology] bucket_mb`)."""
    on = ("--train.rounds=3", "--outer.delay=1", "--train.inner_state=reset", "--verify.replay_probability=1.0",
          "--verify.trace_every=5", "--train.batch_size=6", "--train.grad_accum=3")
    one = _trained(tmp_path, "one", *on)
    two = _trained(tmp_path, "two", *on, "--topology.replicas=3", "--topology.bucket_mb=0.002")
    _same(one, two)
    assert all(v == "accept" for rec in two for v in rec["verdicts"])
    assert all(sorted(rec["evidence"]) == ["0", "1"] and all("replayed" in ev for ev in rec["evidence"].values())
               for rec in two)  # each worker replayed by the other, every round, and accepted
    report = audit_run(tmp_path / "two", replay=100)
    assert report.ok and report.checked["replays"] == 6, report


def test_replicas_with_several_parts_each_are_replayed_in_one_process(tmp_path):
    """grad_accum = 4 on 2 replicas: each adds its 2 parts up, then the two sums are added, which
    is not the one-process order; the replays and the audit (one process) add them up the same way.
    Segments from sent states (`replay_extent = "state"`): a segment past the first starts from the
    state replica 0 hashed and kept at its trace point, the other replica's optimizer part included."""
    rounds = _trained(tmp_path, "two", "--train.rounds=4", "--train.grad_accum=4", "--topology.replicas=2",
                      "--train.inner_steps=10", "--train.inner_state=reset", "--verify.replay_probability=1.0",
                      "--verify.trace_every=5", "--verify.replay_extent=state")
    assert all(v == "accept" for rec in rounds for v in rec["verdicts"]) and all(rec["evidence"] for rec in rounds)
    assert any(ev["replayed"]["segment"] == 1 for rec in rounds for ev in rec["evidence"].values())
    report = audit_run(tmp_path / "two", replay=100)
    assert report.ok and report.checked["replays"] == 8, report


@pytest.mark.parametrize("delay", [0, 1])
def test_replicas_keep_the_inner_state_across_rounds_and_a_resume(tmp_path, delay):
    """AdamW's moments kept across rounds (DiLoCo), sharded over the replicas, a stop after 2 rounds
    and a resume: the state saved (gathered from the replicas after the round's steps; with delay
    1, before the next round's) resumes on every replica, each keeping its part, and the run goes
    on as the one-process one."""
    on = ("--train.rounds=4", f"--outer.delay={delay}", "--outer.momentum=0.5")
    one = _trained(tmp_path, "one", *on)
    assert len(_trained(tmp_path, "two", *on, "--topology.replicas=2", stop_after=2)) == 2
    resume(str(tmp_path / "two"), quiet=True)
    _same(one, rounds_of(tmp_path / "two"))


def test_replicas_take_a_late_update_that_lands_inside_the_round(tmp_path):
    """`[outer] overlap_steps`: round r-1's update lands on replica 0 after 2 of round r's steps;
    the other replicas take the moved params at the same step, and the run is the one-process one."""
    on = ("--train.rounds=3", "--outer.delay=1", "--outer.overlap_steps=2", "--outer.momentum=0.5")
    _same(_trained(tmp_path, "one", *on), _trained(tmp_path, "two", *on, "--topology.replicas=2"))


def test_replicas_follow_an_adaptive_h_and_are_replayed(tmp_path):
    """Adaptive H (`[train] inner_steps_max`) on a link too slow for H = 5: the replicas run each
    round's grown H with replica 0, and every replay and the audit pass. (At 10 Mbit/s the
    exchange hid under 5 steps slowed by a machine at load 4: H did not grow; at 2 Mbit/s it
    needs steps of 100 ms to hide.)"""
    rounds = _trained(tmp_path, "two", "--train.rounds=4", "--topology.replicas=2", "--outer.delay=1",
                      "--outer.momentum=0.5", "--link.bandwidth=2mbit", "--link.latency=20ms",
                      "--train.inner_steps_max=20", "--verify.trace_every=5", "--train.inner_state=reset",
                      "--verify.replay_probability=1.0")
    assert max(rec.get("inner_steps", 5) for rec in rounds) > 5  # H grew
    assert all(v == "accept" for rec in rounds for v in rec["verdicts"]) and all(rec["evidence"] for rec in rounds)
    report = audit_run(tmp_path / "two", replay=100)
    assert report.ok and report.checked["replays"] == 8, report


@pytest.mark.parametrize("attack", ["wrong_data", "skim"])
def test_an_adversary_on_replicas_trains_as_on_one_process(tmp_path, attack):
    """An adversary whose batch hook changes the data (reversed sequences; half of each batch) does
    so on every replica: the replicas' run, verdicts included, is the one-process run's."""
    on = ("--train.rounds=2", f"--adversary.1={attack}", "--train.inner_state=reset", "--verify.replay_probability=1.0",
          "--verify.trace_every=5")
    one, two = _trained(tmp_path, "one", *on), _trained(tmp_path, "two", *on, "--topology.replicas=2")
    _same(one, two)
    assert [(rec["verdicts"], rec["evidence"]) for rec in one] == [(rec["verdicts"], rec["evidence"]) for rec in two]
    assert any(rec["verdicts"][1] != "accept" for rec in two)  # (a rejected delta leaves G as it was: the
    # evidence, which holds what the checks measured of worker 1's own round, tells the runs apart)


@pytest.mark.parametrize("count", [2, 3, 4])
def test_each_replica_owns_about_its_share_of_the_optimizer(count):
    """`[topology] replicas` shard AdamW (ZeRO-1): each param's summed gradient, state and update
    belong to one replica. On the `make run` model every replica owns within one embedding-sized
    tensor of 1/R of the elements, and every param has exactly one owner, the same each time."""
    from veriloco.config import load_config
    from veriloco.inner import Replicas
    from veriloco.model import build_meta

    cfg = load_config(ROOT / "configs" / "default.toml", [])
    params = list(build_meta(cfg.model).parameters())
    owners = Replicas(None, 0, count, shard=True).owners(params)
    assert owners == Replicas(None, 1, count, shard=True).owners(params)
    loads = [sum(p.numel() for p, o in zip(params, owners, strict=True) if o == i) for i in range(count)]
    total, largest = sum(loads), max(p.numel() for p in params)
    assert sum(loads) == sum(p.numel() for p in params) and max(loads) - min(loads) <= largest
    assert max(loads) <= total / count + largest


STAGED = ("--topology.stages=2", "--train.grad_accum=1", "--train.rounds=2", "--verify.trace_every=5")


def test_replicas_of_pipeline_stages_are_the_pipelined_run_and_their_replays_pass(tmp_path):
    """2 workers x 2 stages x 2 replicas: replica i of every stage runs its own pipeline on micro-batch
    i, each stage's gradients summed over its replicas. One micro-batch each is the 2-stage run with
    2 micro-batches bit for bit; its replays (on the auditor's replica 0 pipeline) and the audit (one
    process) run the replicas' groups in turn."""
    on = (*STAGED, "--topology.microbatches=2", "--train.inner_state=reset", "--verify.replay_probability=1.0")
    one = _trained(tmp_path, "one", *on)
    two = _trained(tmp_path, "two", *on, "--topology.replicas=2")
    _same(one, two)
    assert all(v == "accept" for rec in two for v in rec["verdicts"])
    assert all(sorted(part["evidence"]) == ["0", "1"] and all("replayed" in ev for ev in part["evidence"].values())
               for rec in two for part in rec["stages"])  # every stage of each worker replayed by the other
    report = audit_run(tmp_path / "two", replay=100)
    assert report.ok and report.checked["replays"] == 4, report


def test_replicas_of_tied_1f1b_stages_are_replayed(tmp_path):
    """Tied embeddings (the head's gradient returned on every replica's pipeline) and 1F1B with 2
    micro-batches per replica: every replay accepted, and the audit's."""
    rounds = _trained(tmp_path, "tied", *STAGED, "--model.tie=true", "--topology.schedule=1f1b",
                      "--topology.microbatches=4", "--topology.replicas=2", "--train.inner_state=reset",
                      "--verify.replay_probability=1.0")
    assert all(v == "accept" for rec in rounds for v in rec["verdicts"])
    assert all(part["evidence"] for rec in rounds for part in rec["stages"])
    report = audit_run(tmp_path / "tied", replay=100)
    assert report.ok and report.checked["replays"] == 4, report


def test_replicas_of_stages_keep_the_inner_state_across_a_resume(tmp_path):
    """AdamW's moments kept, a stop after a round and a resume: every stage's other replica takes
    its slice's state from replica 0, and the run is the uninterrupted 2-stage run."""
    on = (*STAGED, "--train.rounds=3", "--topology.microbatches=2")
    one = _trained(tmp_path, "one", *on)
    assert len(_trained(tmp_path, "two", *on, "--topology.replicas=2", stop_after=1)) == 1
    resume(str(tmp_path / "two"), quiet=True)
    _same(one, rounds_of(tmp_path / "two"))


@pytest.mark.parametrize("overrides, message", [
    ((*STAGED, "--topology.replicas=2", "--topology.microbatches=3", "--train.batch_size=6"),
     r"splits topology.microbatches among the replicas' pipelines: set topology.microbatches to a multiple of 2 \(got 3\)"),
    ((*STAGED, "--topology.replicas=2", "--topology.microbatches=2", "--topology.schedule=1f1b"),
     r"1f1b' needs each replica's topology.microbatches / replicas \(1\) >= topology.stages \(2\)"),
    (("--topology.replicas=2", "--train.grad_accum=3", "--train.batch_size=6"), r"topology.replicas = 2 splits train.grad_accum's parts "
                                                         r"among the replicas: set train.grad_accum to a multiple "
                                                         r"of 2 \(got 3\)"),
    (("--topology.replicas=0",), r"topology.replicas must be >= 1, got 0"),
    (("--topology.replicas=2", "--train.grad_accum=2", "--train.mode=ddp"), r"needs train.mode = 'diloco'"),
])
def test_what_replicas_do_not_run_yet_is_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        tiny(*overrides)
    assert "\n" not in str(e.value)


def _buckets_in_the_backward(rank: int, port: int, out: str) -> None:
    """Two replicas of a 4-layer MLP, 2 parts each: the bucketed reduce (small buckets, started
    by the backward's hooks) against the reduce after the backward, sharded and not."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from veriloco.inner import Replicas

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    res = {}
    for shard in (True, False):
        for bucket in (0, 2000):
            torch.manual_seed(0)  # the same model on both replicas; each its own data
            model = torch.nn.Sequential(*(torch.nn.Linear(24, 24) for _ in range(4)))
            replicas = Replicas(dist.group.WORLD, rank, 2, shard=shard, bucket_bytes=bucket)
            gen = torch.Generator().manual_seed(1 + rank)
            if bucket:
                replicas.watch(model, 2)
            for _ in range(2):
                model(torch.randn(8, 24, generator=gen)).square().mean().backward()
            started = len(replicas._watched.started) if bucket else 0  # reduces already under way
            replicas.combine(model, torch.zeros(1))
            res[f"{shard}-{bucket}"] = [p.grad.clone() if p.grad is not None else torch.zeros(0) for p in model.parameters()]
            res[f"{shard}-{bucket}-started"] = torch.tensor([started, len(replicas._watched.buckets) if bucket else 0])
    torch.save(res, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_the_bucketed_reduce_starts_in_the_backward_and_sums_the_same_floats(tmp_path):
    """`[topology] bucket_mb`: every bucket's reduce has started by the end of the backward (its
    hooks started them, none was left for `combine`), and each replica's summed gradients are
    the reduce-after-the-backward's, bit for bit, with the optimizer sharded and not."""
    import socket

    import torch

    from veriloco.procs import start_workers

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start_workers(_buckets_in_the_backward, (port, str(tmp_path)), 2)
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for shard in (True, False):
            started, buckets = res[f"{shard}-2000-started"].tolist()
            assert buckets >= 4 and started == buckets, (started, buckets)
            for a, b in zip(res[f"{shard}-0"], res[f"{shard}-2000"], strict=True):
                assert torch.equal(a, b)
            if shard:  # each replica keeps the summed gradients of the params it owns, the others none
                assert 0 < sum(g.numel() > 0 for g in res[f"{shard}-0"]) < 8
