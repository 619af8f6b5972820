"""Topology arithmetic, stage models, and pipelined inner steps (DiLoCoX) against the unsplit loop.

The multi-process tests run gloo on loopback with one thread per process and a 2-layer,
d_model 32, ctx 16 GPT, so they fit on two cores (~20 s together, mostly process start-up).

Why the pipeline is compared within a tolerance and not bit for bit: with micro-batches the
gradient is summed per micro-batch and then added (and divided by their number), and the global
grad norm is summed per stage; both round differently from one backward over the whole batch.
Measured on this configuration (torch 2.13 CPU): losses agree to 9e-8 relative, the eval loss to
4e-8, params after 6 AdamW steps to 1.5e-6 absolute (4.5e-6 with other batches), whereas clipping
each stage by its own grad norm instead of the global one moved params by ~4e-3 and fails this
test. GPipe and 1F1B run the same micro-batch backwards in the same order: bit-identical.
"""

from __future__ import annotations

import math
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from veriloco.config import ModelConfig, TrainConfig
from veriloco.inner import InnerLoop
from veriloco.model import build_model, lm_loss
from veriloco.pipeline import EmulatedPipeline, PipelineInnerLoop, pipeline_eval_loss
from veriloco.procs import start_workers
from veriloco.topology import Topology, build_stage_model, layers_of_stage

MODEL = ModelConfig(n_layer=2, n_head=2, d_model=32, ctx=16)
# grad_clip 0.1 is below every step's grad norm (~1-1.5), so the global-norm clip always acts.
TRAIN = TrainConfig(lr=3e-3, warmup_steps=2, grad_clip=0.1, batch_size=4)
SEED, STEPS, MICROBATCHES = 0, 6, 2
LOSS_RTOL = 1e-5  # relative, per step (measured 9e-8)
PARAM_ATOL = 5e-5  # absolute, after STEPS steps (measured 1.5e-6; per-stage clipping: ~4e-3)


def batch_of(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch of random bytes (no corpus needed)."""
    g = torch.Generator().manual_seed(1000 * (worker + 1) + step)
    t = torch.randint(0, MODEL.vocab_size, (TRAIN.batch_size, MODEL.ctx + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def eval_set() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [batch_of(99, s) for s in range(2)]


def _full_loss(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return lm_loss(m(x), y)


def unsplit_run(worker: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference: the same steps with the plain InnerLoop on the whole model."""
    model = build_model(MODEL, SEED)
    loop = InnerLoop(model, TRAIN, STEPS, _full_loss)
    result = loop.run(lambda s: batch_of(worker, s), STEPS)
    return result.losses, {k: v.detach() for k, v in model.named_parameters()}


# ---------------------------------------------------------------------------------- topology


def test_topology_rank_arithmetic():
    topo = Topology(workers=3, stages=2, world_size=6)
    assert topo.world_size == 6
    assert [(topo.worker_of(r), topo.stage_of(r)) for r in range(6)] == [
        (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)
    ]
    assert all(topo.rank_of(topo.worker_of(r), topo.stage_of(r)) == r for r in range(6))
    assert topo.worker_ranks(1) == [2, 3]
    assert topo.stage_ranks(1) == [1, 3, 5]
    assert Topology(4, 1).stage_ranks(0) == [0, 1, 2, 3]  # plain DiLoCo: one stage group of all


def test_topology_rejects_bad_numbers_and_says_which():
    with pytest.raises(ValueError, match=r"workers \(2\) x stages \(2\) = 4 but world size is 3"):
        Topology(2, 2, world_size=3)
    with pytest.raises(ValueError, match=r"workers \(0\)"):
        Topology(0, 2)
    with pytest.raises(ValueError, match=r"stages \(0\)"):
        Topology(2, 0)
    topo = Topology(2, 2)
    with pytest.raises(ValueError, match="rank 4"):
        topo.worker_of(4)
    with pytest.raises(ValueError, match="stage 2"):
        topo.rank_of(0, 2)
    with pytest.raises(RuntimeError, match="initialised"):
        topo.build_groups()  # no process group in this process


def test_layers_split_evenly_and_contiguously():
    assert [layers_of_stage(s, 5, 3) for s in range(3)] == [[0, 1], [2, 3], [4]]
    assert [layers_of_stage(s, 4, 2) for s in range(2)] == [[0, 1], [2, 3]]
    assert Topology(1, 2).layers_of_stage(1, 2) == [1]
    with pytest.raises(ValueError, match=r"stages \(3\) > n_layer \(2\)"):
        layers_of_stage(0, 2, 3)
    with pytest.raises(ValueError, match="stage 2"):
        layers_of_stage(2, 4, 2)


@pytest.mark.parametrize("n_layer,stages", [(2, 2), (3, 2), (3, 3), (2, 1)])
def test_stage_models_are_exactly_the_full_models_params(n_layer, stages):
    cfg = ModelConfig(n_layer=n_layer, n_head=2, d_model=32, ctx=16)
    full = dict(build_model(cfg, SEED).named_parameters())
    parts = [dict(build_stage_model(cfg, SEED, s, stages).named_parameters()) for s in range(stages)]
    names = [n for p in parts for n in p]
    assert len(names) == len(set(names)) and set(names) == set(full)  # a partition by name
    for p in parts:
        assert all(torch.equal(v, full[k]) for k, v in p.items())
    assert "tok_emb.weight" in parts[0] and "lm_head.weight" in parts[-1]
    # run one after the other, the stages compute exactly what the full model does
    x = batch_of(0, 0)[0]
    h = x
    with torch.no_grad():
        for s in range(stages):
            h = build_stage_model(cfg, SEED, s, stages)(h)
        assert torch.equal(h, build_model(cfg, SEED)(x))


# --------------------------------------------------------------------------- multi-process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(fn, nprocs: int, tmp_path: Path) -> list[dict]:
    """Run fn(rank, port, out) in `nprocs` processes (veriloco's own: from its forkserver, torch
    preloaded); what each saved as rank<r>.pt, in rank order."""
    start_workers(fn, (_free_port(), str(tmp_path)), nprocs)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(nprocs)]


def _init(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=60),
    )


def _one_worker_two_stages(rank: int, port: int, out: str) -> None:
    """W=1, S=2: both schedules from the same G_0, then the pipelined eval."""
    _init(rank, 2, port)
    try:
        topo = Topology(1, 2, world_size=2)
        worker_group, _ = topo.build_groups(timeout=timedelta(seconds=60))
        stage = topo.stage_of(rank)
        res = {}
        for schedule in ("gpipe", "1f1b"):
            model = build_stage_model(MODEL, SEED, stage, 2)
            loop = PipelineInnerLoop(
                model, TRAIN, STEPS, stage=stage, stages=2, group=worker_group,
                microbatches=MICROBATCHES, schedule=schedule,
            )
            r = loop.run(lambda s: batch_of(0, s), STEPS, trace_every=3)
            res[schedule] = {
                "losses": r.losses, "trace": r.trace, "tokens": r.tokens, "step_count": loop.step_count,
                "params": {k: v.detach().clone() for k, v in model.named_parameters()},
            }
        eval_model = build_stage_model(MODEL, SEED, stage, 2)  # G_0: compare with the full model
        res["eval"] = pipeline_eval_loss(
            eval_model, eval_set(), worker_group, stage=stage, stages=2, microbatches=MICROBATCHES
        )
        torch.save(res, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_stage_pipeline_matches_unsplit_inner_loop(tmp_path):
    got = _spawned(_one_worker_two_stages, 2, tmp_path)
    ref_losses, ref_params = unsplit_run(worker=0)

    # the global-norm clip is exercised: the unsplit grad norm at step 0 is above grad_clip
    model = build_model(MODEL, SEED)
    _full_loss(model, *batch_of(0, 0)).backward()
    assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)) > 5 * TRAIN.grad_clip

    for schedule in ("gpipe", "1f1b"):
        stage0, stage1 = got[0][schedule], got[1][schedule]
        # every stage of the worker reports the same losses and the same worker-wide trace
        assert stage0["losses"] == stage1["losses"]
        assert stage0["trace"] == stage1["trace"] and len(stage0["trace"]) == 3
        assert stage0["step_count"] == STEPS and stage0["tokens"] == STEPS * TRAIN.batch_size * MODEL.ctx
        for a, b in zip(stage0["losses"], ref_losses, strict=True):
            assert abs(a - b) <= LOSS_RTOL * abs(b), (schedule, stage0["losses"], ref_losses)
        params = stage0["params"] | stage1["params"]
        assert set(params) == set(ref_params)
        gap = max(float((params[k] - ref_params[k]).abs().max()) for k in params)
        assert gap <= PARAM_ATOL, f"{schedule}: params differ from the unsplit run by {gap:.2e}"
    # GPipe and 1F1B do the same arithmetic in the same order
    assert got[0]["gpipe"]["trace"] == got[0]["1f1b"]["trace"]

    # one process emulates the two-stage pipeline bit for bit (the audit's replayer), unlike the
    # unsplit loop above
    torch.set_num_threads(1)  # as the stage processes ran
    emu = EmulatedPipeline([build_stage_model(MODEL, SEED, s, 2) for s in range(2)], TRAIN, STEPS,
                           microbatches=MICROBATCHES)
    r = emu.run(lambda s: batch_of(0, s), STEPS, trace_every=3)
    assert r.trace == got[0]["gpipe"]["trace"] and r.losses == got[0]["gpipe"]["losses"]
    assert all(torch.equal(p, params[k]) for k, p in emu.named_parameters())
    assert any(not torch.equal(params[k], ref_params[k]) for k in params)  # the unsplit loop is not exact
    emu_g0 = EmulatedPipeline([build_stage_model(MODEL, SEED, s, 2) for s in range(2)], TRAIN, STEPS,
                              microbatches=MICROBATCHES)
    assert emu_g0.eval_loss(eval_set()) == got[0]["eval"]  # and its eval is the pipeline's, bit for bit

    with torch.no_grad():
        full = build_model(MODEL, SEED)
        ref_eval = sum(float(_full_loss(full, x, y)) for x, y in eval_set()) / len(eval_set())
    assert got[0]["eval"] == got[1]["eval"]
    assert abs(got[0]["eval"] - ref_eval) <= LOSS_RTOL * ref_eval


def _two_workers_two_stages(rank: int, port: int, out: str) -> None:
    """W=2, S=2: check the groups, take a few pipelined steps, average each slice in its stage group."""
    _init(rank, 4, port)
    try:
        topo = Topology(2, 2, world_size=4)
        worker_group, stage_group = topo.build_groups(timeout=timedelta(seconds=60))
        worker, stage = topo.worker_of(rank), topo.stage_of(rank)
        ids = torch.tensor([rank])
        dist.all_reduce(ids, group=stage_group)
        in_worker = torch.tensor([rank])
        dist.all_reduce(in_worker, group=worker_group)
        model = build_stage_model(MODEL, SEED, stage, 2)
        loop = PipelineInnerLoop(
            model, TRAIN, STEPS, stage=stage, stages=2, group=worker_group,
            microbatches=MICROBATCHES, schedule="1f1b",
        )
        steps = 3
        r = loop.run(lambda s: batch_of(worker, s), steps)
        # the outer exchange of this slice: mean over the workers holding the same stage
        averaged = {}
        for k, p in model.named_parameters():
            t = p.detach().clone()
            dist.all_reduce(t, group=stage_group)
            averaged[k] = t / topo.workers
        torch.save({
            "stage_sum": int(ids), "worker_sum": int(in_worker),
            "stage_ranks": dist.get_process_group_ranks(stage_group),
            "worker_ranks": dist.get_process_group_ranks(worker_group),
            "rank_in_stage_group": dist.get_rank(stage_group),
            "losses": r.losses, "averaged": averaged,
        }, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_workers_two_stages_groups_and_steps(tmp_path):
    got = _spawned(_two_workers_two_stages, 4, tmp_path)
    topo = Topology(2, 2)
    for rank, g in enumerate(got):
        worker, stage = topo.worker_of(rank), topo.stage_of(rank)
        assert g["stage_ranks"] == topo.stage_ranks(stage) == [stage, stage + 2]
        assert g["worker_ranks"] == topo.worker_ranks(worker) == [2 * worker, 2 * worker + 1]
        assert g["stage_sum"] == sum(topo.stage_ranks(stage))  # 2 on stage 0, 4 on stage 1
        assert g["worker_sum"] == sum(topo.worker_ranks(worker))  # 1 on worker 0, 5 on worker 1
        assert g["rank_in_stage_group"] == worker
    # each worker trained on its own batches; its stages agree; it matches the unsplit loop
    for worker in range(2):
        a, b = got[topo.rank_of(worker, 0)], got[topo.rank_of(worker, 1)]
        assert a["losses"] == b["losses"] and len(a["losses"]) == 3
        ref = InnerLoop(build_model(MODEL, SEED), TRAIN, STEPS, _full_loss).run(
            lambda s, w=worker: batch_of(w, s), 3
        )
        assert all(abs(x - y) <= LOSS_RTOL * y for x, y in zip(a["losses"], ref.losses, strict=True))
    assert got[0]["losses"] != got[2]["losses"]
    # after the per-stage exchange both workers hold the same slice
    for stage in range(2):
        w0, w1 = got[topo.rank_of(0, stage)]["averaged"], got[topo.rank_of(1, stage)]["averaged"]
        assert all(torch.equal(w0[k], w1[k]) for k in w0)


# ------------------------------------------------------------------- [model] tie across stages

TIED = ModelConfig(n_layer=3, n_head=2, d_model=32, ctx=16, tie=True)
TIED_MB = 4  # 1F1B wants at least one micro-batch per stage


def _one_worker_three_tied_stages(rank: int, port: int, out: str) -> None:
    """W=1, S=3, tied embeddings, 1F1B: the first stage owns the embedding, the last stage's head uses a
    copy (pipeline.TiedEnds); a middle stage holds neither."""
    _init(rank, 3, port)
    try:
        worker_group, _ = Topology(1, 3, world_size=3).build_groups(timeout=timedelta(seconds=60))
        res = {}
        for schedule in ("1f1b",):  # GPipe runs the same backwards in the same order (the untied test above)
            model = build_stage_model(TIED, SEED, rank, 3)
            loop = PipelineInnerLoop(model, TRAIN, STEPS, stage=rank, stages=3, group=worker_group,
                                     microbatches=TIED_MB, schedule=schedule)
            r = loop.run(lambda s: batch_of(0, s), STEPS, trace_every=3)
            res[schedule] = {"losses": r.losses, "trace": r.trace,
                             "params": {k: v.detach().clone() for k, v in model.named_parameters()}}
        # the eval refreshes the head's copy: the last stage's still holds step 5's embedding here
        res["eval"] = pipeline_eval_loss(model, eval_set(), worker_group, stage=rank, stages=3,
                                         microbatches=TIED_MB)
        torch.save(res, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_tied_embeddings_across_three_stages_train_as_the_whole_model(tmp_path):
    got = _spawned(_one_worker_three_tied_stages, 3, tmp_path)
    names = [sorted(n for n in g["1f1b"]["params"] if not n.startswith("blocks.")) for g in got]
    assert names == [["pos_emb.weight", "tok_emb.weight"], [], ["ln_f.bias", "ln_f.weight"]]  # the head is named once

    full = build_model(TIED, SEED)
    ref = InnerLoop(full, TRAIN, STEPS, _full_loss).run(lambda s: batch_of(0, s), STEPS)
    ref_params = {k: v.detach() for k, v in full.named_parameters()}
    for schedule in ("1f1b",):
        assert got[0][schedule]["losses"] == got[2][schedule]["losses"]
        assert got[0][schedule]["trace"] == got[1][schedule]["trace"] == got[2][schedule]["trace"]
        for a, b in zip(got[0][schedule]["losses"], ref.losses, strict=True):
            assert abs(a - b) <= LOSS_RTOL * abs(b)
        params = {k: v for g in got for k, v in g[schedule]["params"].items()}
        assert set(params) == set(ref_params)
        gap = max(float((params[k] - ref_params[k]).abs().max()) for k in params)
        assert gap <= PARAM_ATOL, f"{schedule}: tied params differ from the unsplit tied run by {gap:.2e}"

    # the audit's one-process emulation is the pipeline bit for bit, tie included
    torch.set_num_threads(1)
    emu = EmulatedPipeline([build_stage_model(TIED, SEED, s, 3) for s in range(3)], TRAIN, STEPS,
                           microbatches=TIED_MB)
    r = emu.run(lambda s: batch_of(0, s), STEPS, trace_every=3)
    assert r.trace == got[0]["1f1b"]["trace"] and r.losses == got[0]["1f1b"]["losses"]
    assert all(torch.equal(p, params[k]) for k, p in emu.named_parameters())
    assert emu.eval_loss(eval_set()) == got[0]["eval"] == got[2]["eval"]
    with torch.no_grad():
        whole = sum(float(_full_loss(full, x, y)) for x, y in eval_set()) / len(eval_set())
    assert abs(got[0]["eval"] - whole) <= 10 * LOSS_RTOL * whole  # the 1f1b run's params, through the stages

    # the head's gradient reaching the embedding is what keeps the stages on the whole model's
    # path: without it the params end far outside PARAM_ATOL
    import veriloco.pipeline as pipeline

    dropped = EmulatedPipeline([build_stage_model(TIED, SEED, s, 3) for s in range(3)], TRAIN, STEPS,
                               microbatches=TIED_MB)
    take = pipeline._take_grad
    try:
        pipeline._take_grad = lambda copy, mb: torch.zeros_like(take(copy, mb))
        dropped.run(lambda s: batch_of(0, s), STEPS)
    finally:
        pipeline._take_grad = take
    assert max(float((p.detach() - ref_params[k]).abs().max()) for k, p in dropped.named_parameters()) > 100 * PARAM_ATOL
