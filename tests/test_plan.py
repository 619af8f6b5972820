"""`veriloco plan`: the layout, slices and traffic it prints are what a run then has."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, TINY, cli, rounds_of, tiny

from veriloco.config import ConfigError
from veriloco.link import Link
from veriloco.plan import format_plan, make_plan, verify_plan
from veriloco.run import torchrun_main, train
from veriloco.store import LocalStore
from veriloco.topology import build_stage_model


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_each_stage_slice_is_the_stage_model_a_run_builds(arch):
    """Parameters and tensors per stage, tied llama included (its head is the first stage's
    embedding, no parameter of the last stage), against the stage modules a worker builds."""
    cfg = tiny(f"--model.arch={arch}", "--model.n_layer=3", "--topology.stages=2", "--model.tie=true")
    plan = make_plan(cfg)
    for st in plan.stages:
        real = dict(build_stage_model(cfg.model, cfg.run.seed, st.stage, 2).named_parameters())
        assert (st.params, st.tensors) == (sum(p.numel() for p in real.values()), len(real))
    assert [st.blocks for st in plan.stages] == [[0, 1], [2]]


def test_the_traffic_it_plans_is_what_the_workers_send(tmp_path, monkeypatch, capsys):
    """int8 packets of 3 workers: each worker's bytes per round are the planned payload to its 2
    peers plus each packet's header (a name, dtype and shape per tensor and per block-scale tensor)
    and signed commitment: 8.5 KB a packet here, on a 45.6 KB payload. Every worker's round is
    replayed from a segment's start state, which is the planned state's size when a segment past
    the first is drawn. Then the plan of that run directory on another link: its config, and the
    step time it measured."""
    cfg = tiny("--topology.workers=3", "--compress.codec=int8:block=64", "--train.rounds=2", "--train.inner_state=reset",
               "--verify.replay_probability=1", "--verify.replay_extent=state", "--verify.trace_every=1")
    plan = make_plan(cfg)
    vp = verify_plan(plan)
    assert (vp.audits, vp.steps_per_audit, vp.fetched, vp.kept_states) == (3, 1, 4 / 5, 6)
    train(cfg, str(tmp_path / "run"), quiet=True)
    fetched = []
    for rec in rounds_of(tmp_path / "run"):
        for sent in rec["bytes_sent"]:
            assert 0 < sent - plan.sent_per_round <= 2 * 12_000, (sent, plan.sent_per_round)
        fetched += [n for n in rec["state_bytes_sent"] if n]
    assert fetched and set(fetched) == {plan.stages[0].state_bytes}, (fetched, plan.stages[0].state_bytes)
    recs = rounds_of(tmp_path / "run")
    store = LocalStore(tmp_path / "run" / "store", create=False)
    for rec in recs:  # what a round adds to the store: its checkpoint and bundles, plus headers and commitments
        stored = sum(store.path_of(d).stat().st_size for d in [rec["checkpoint"], *rec["bundles"]])
        assert 0 < stored - plan.store_per_round <= 3 * 12_000 + 8_000, (stored, plan.store_per_round)
        assert not any(map(store.has, rec["packets"]))  # a packet is stored inside its bundle only
    step = sorted(sum(r["inner_s"]) / 3 / 5 for r in recs)[0:2]  # two rounds: the median is their mean
    code, err, out = cli(monkeypatch, capsys, "plan", str(tmp_path / "run"), "--link.bandwidth=10mbit")
    assert code == 0 and not err, err
    assert f"{sum(step) / 2:.4f} s an inner step as it measured" in out and "(int8:block=64)" in out
    assert "exchange on the link (10 Mbit/s, 0 ms)" in out
    assert "3.00 replays a round across the 3 workers" in out and "fetched by 80% of them" in out
    state_mb = sum(map(sum, (rec["state_bytes_sent"] for rec in recs))) / 2 / 1e6
    assert "2 round(s), its own [verify]): replays " in out and f"{len(fetched)} start state(s) fetched, {state_mb:,.2f} MB a round" in out
    lines = (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()
    for bad in ("x", [0.1, "x"], [True], [float("nan")]):  # a record's step times, edited: one line, exit 2
        edited = [lines[0], json.dumps(json.loads(lines[1]) | {"inner_s": bad})]  # (was a TypeError's traceback)
        (tmp_path / "run" / "rounds.jsonl").write_text("\n".join(edited) + "\n")
        code, err, _ = cli(monkeypatch, capsys, "plan", str(tmp_path / "run"))
        assert code == 2 and len(err) == 1 and "rounds.jsonl line 2: its inner_s is not a list of seconds" in err[0], err
    fp32 = make_plan(tiny("--topology.workers=3"))
    assert fp32.sent_per_round == 2 * 4 * fp32.params  # a float32 packet is the model's bytes
    assert 3.5 < fp32.sent_per_round / plan.sent_per_round < 4  # int8: a byte a value, plus block scales


def test_the_exchange_time_and_whether_it_hides():
    cfg = tiny("--topology.workers=3", "--link.bandwidth=100mbit", "--link.latency=20ms", "--outer.delay=1")
    plan = make_plan(cfg)
    payload = plan.stages[0].payload_bytes
    assert plan.exchange_s(payload) == Link.from_strings("100mbit", "20ms").transfer_time(2 * payload, 2 * payload)
    step = plan.exchange_s(payload) / cfg.train.inner_steps
    assert "the exchange hides under 5 step(s)" in format_plan(make_plan(cfg, step * 1.01))
    assert "the exchange does NOT hide" in format_plan(make_plan(cfg, step * 0.99))
    assert f"a step of >= {step * 1e3:.1f} ms" in format_plan(plan)
    wire = int(2 * 2 / 3 * 4 * plan.params)  # DDP: a ring all-reduce of the fp32 gradient a step, 2 (W-1)/W of it
    ddp_s = Link.from_strings("100mbit", "20ms").transfer_time(wire, wire)
    assert f"DDP instead: {ddp_s:.3f} s of all-reduce a step" in format_plan(make_plan(cfg, step))
    # a 20 ms link: the figure is a lower bound over TCP, and the plan says what to set
    assert "a lower bound over TCP on a 20 ms link" in format_plan(plan)
    assert "tcp_slow_start_after_idle = 0" in format_plan(plan)
    assert "a lower bound over TCP" not in format_plan(make_plan(tiny("--topology.workers=3", "--link.bandwidth=100mbit",
                                                                      "--link.latency=5ms")))
    # elastic membership on that link: its round trips a round, apart from the exchange's bytes
    assert "elastic: the quorum" not in format_plan(plan)
    text = format_plan(make_plan(tiny("--topology.workers=3", "--link.bandwidth=100mbit", "--link.latency=20ms",
                                      "--run.membership=elastic")))
    assert "about 17 one-way latencies a round with 3 workers, 0.34 s on this link" in text
    assert "with delay 0 none of it hides" in text
    text = format_plan(make_plan(tiny("--topology.workers=4", "--link.bandwidth=100mbit", "--link.latency=50ms",
                                      "--run.membership=elastic", "--outer.delay=1")))
    assert "about 22 one-way latencies a round with 4 workers, 1.10 s on this link" in text  # measured: 1.122 s
    assert "the quorum and the exchange run under the next round's inner steps" in text


def test_the_command_prints_the_layout_and_refuses_bad_input_in_one_line(monkeypatch, capsys):
    code, err, out = cli(monkeypatch, capsys, "plan", str(TINY), "--topology.stages=2", "--topology.replicas=2",
                         "--topology.microbatches=2", "--link.bandwidth=1gbit")
    assert code == 0 and not err
    assert "worker 1: stage 0: ranks 4-5; stage 1: ranks 6-7" in out and "--nnodes=2 --nproc-per-node=4" in out
    plan = make_plan(tiny("--topology.stages=2", "--topology.replicas=2", "--topology.microbatches=2"))
    for st in plan.stages:  # a stage process holds its slice of each worker's newest decoded delta (float32)
        held = plan.topo.workers * st.params * 4 / 1e6
        assert f"+ {held:,.2f} MB on replica 0 for the {plan.topo.workers} workers' newest decoded deltas" in out
    code, err, out = cli(monkeypatch, capsys, "plan", str(TINY), "--topology.replicas=2", "--train.grad_accum=2",
                         "--run.membership=elastic")
    assert "elastic: `veriloco train` starts the workers" in out and "which starts its 1 other replica(s)" in out
    assert "torchrun" not in out
    with pytest.raises(ConfigError, match="not torchrun"):  # its launcher is veriloco's, which a plan names
        torchrun_main([str(TINY), "--run.membership=elastic"])
    code, err, out = cli(monkeypatch, capsys, "plan", str(TINY), "--topology.replicas=2", "--train.grad_accum=2")
    owned = make_plan(tiny("--topology.replicas=2", "--train.grad_accum=2")).stages[0].owned
    assert code == 0 and sum(owned) == make_plan(tiny()).params and min(owned) > 0.4 * sum(owned)
    assert f"replica 1 {owned[1] * 8 / 1e6:,.2f} MB" in out  # AdamW: two float32 moments per param it owns
    for args, message in [(("--step-s", "-1"), "--step-s must be a positive number of seconds"),
                          (("--topology.stages=9",), "topology.stages (9) > model.n_layer (2)"),
                          (("stray",), "unexpected argument 'stray'")]:
        code, err, _ = cli(monkeypatch, capsys, "plan", str(TINY), *args)
        assert code == 2 and len(err) == 1 and message in err[0], err


def test_the_verification_it_plans_follows_the_sampling_and_the_screens():
    """Replays drawn per worker with p: a whole round ('round', distance), steps 0 .. a drawn
    segment's end ('segment'); the loss-gain screen's forwards on each packet's checkers, or on
    every worker when each computes every gain; one worker has nobody to audit it."""
    base = ("--topology.workers=4", "--train.inner_steps=20", "--verify.trace_every=5", "--train.inner_state=reset")
    rnd = verify_plan(make_plan(tiny(*base, "--verify.replay_probability=0.5")))
    assert (rnd.audits, rnd.steps_per_audit, rnd.fetched, rnd.kept_states) == (2, 20, 0, 0)
    seg = verify_plan(make_plan(tiny(*base, "--verify.replay_probability=0.5", "--verify.replay_extent=segment")))
    assert seg.steps_per_audit == (5 + 10 + 15 + 20) / 4
    delayed = verify_plan(make_plan(tiny(*base, "--verify.replay_probability=0.5", "--verify.replay_extent=state",
                                         "--outer.delay=1")))
    assert (delayed.steps_per_audit, delayed.fetched, delayed.kept_states) == (5, 3 / 4, 2 * 5)
    gains = verify_plan(make_plan(tiny(*base, "--verify.replay_probability=0.5", "--verify.loss_gain_batches=3",
                                       "--verify.loss_gain_checkers=2")))
    assert gains.gain_forwards == 4 * 2 * 2 * 3
    every = verify_plan(make_plan(tiny(*base, "--verify.loss_gain_batches=3")))  # no replays: every worker computes all
    assert (every.audits, every.gain_forwards) == (0, 4 * 4 * 2 * 3)
    assert verify_plan(make_plan(tiny(*base[1:], "--topology.workers=1", "--verify.replay_probability=1"))).audits == 0
    text = format_plan(make_plan(tiny(*base)))
    assert "verification: signatures, commitments and screens only" in text
    text = format_plan(make_plan(tiny(*base, "--verify.replay_probability=0.5")))
    assert "2.00 replays a round across the 4 workers" in text and "50.0% on top of the inner steps" in text
    assert "no model-sized traffic" in text and "error feedback" not in text
    text = format_plan(make_plan(tiny(*base, "--verify.replay_probability=0.5", "--compress.codec=topk:density=0.1",
                                      "--compress.error_feedback=true")))
    assert "error feedback: a replay checks the trace, not the packet" in text


def test_the_trace_line_counts_the_state_hashes_and_says_when_nothing_compares_them(monkeypatch):
    """Each stage process hashes its whole inner state (params + AdamW moments) at a round's start
    and every trace_every steps, between steps, on the host's CPU threads: on a GPU that is the
    host's hash rate against the GPU's steps. The plan prints the hashes, the bytes and their time at this
    machine's rate (here fixed at 1 GB/s), and says when no replay compares them."""
    import veriloco.plan as plan_mod

    monkeypatch.setattr(plan_mod, "hash_rate", lambda: 1e9)
    base = ("--topology.workers=4", "--train.inner_steps=20", "--verify.trace_every=5", "--train.inner_state=reset")
    plan = make_plan(tiny(*base), step_s=0.01)
    state = plan.stages[0].state_bytes
    text = format_plan(plan)
    assert "trace: 5 state hashes a round per stage process (params + AdamW moments, " in text
    threads = plan_mod.hash_threads()
    assert f"hashed between inner steps on {threads} CPU thread{'s' if threads > 1 else ''}; here at" in text
    assert f"here at 1.00 GB/s: {5 * state / 1e9:.3f} s a round, {5 * state / 1e9 / 0.2:.1%} of the inner steps" in text
    assert "nothing compares them in this config (replay_probability = 0: no replays): --verify.trace_every=0" in text
    distance = format_plan(make_plan(tiny(*base, "--verify.replay_probability=0.5", "--verify.replay_match=distance")))
    assert "nothing compares them in this config (distance replays compare deltas)" in distance
    exact = format_plan(make_plan(tiny(*base, "--verify.replay_probability=0.5")))
    assert "trace: 5 state hashes" in exact and "nothing compares them" not in exact
    once = format_plan(make_plan(tiny(*base[:3], "--verify.trace_every=0")))
    assert "trace: 2 state hashes" in once and "nothing compares them" not in once
    monkeypatch.undo()  # this machine's own rate
    assert 1e7 < plan_mod.hash_rate(1 << 20) < 1e11


def test_a_run_whose_replays_leave_its_packets_unchecked_says_so_when_it_starts(tmp_path, monkeypatch, capsys):
    """With error feedback a packet is made from a residual only its worker has: a replay checks the
    trace alone. `veriloco plan` says so, and so does `veriloco train` on stderr as it starts; not
    for a run that replays nothing."""
    base = ("--topology.workers=3", "--train.rounds=1", "--train.inner_steps=2", "--verify.trace_every=2",
            "--train.inner_state=reset",
            "--compress.codec=topk:density=0.1", "--compress.error_feedback=true", "--quiet")
    code, err, _ = cli(monkeypatch, capsys, "train", str(TINY), "--out", str(tmp_path / "a"), *base,
                       "--verify.replay_probability=0.5")
    assert code == 0 and [ln for ln in err if "error feedback" in ln] == [
        "warning: error feedback: a replay checks the trace, not the packet (codec(delta + a residual only the worker "
        "has)): the screens and the aggregator are all that check what a packet carries"], err
    code, err, _ = cli(monkeypatch, capsys, "train", str(TINY), "--out", str(tmp_path / "b"), *base)
    assert code == 0 and not [ln for ln in err if "error feedback" in ln], err
    # a user's Task too (train_task: the review found it, and torchrun's two entry points, silent)
    from veriloco import Task, load_config, train_task

    monkeypatch.syspath_prepend(str(ROOT / "examples"))  # the workers import the Task's functions from there too
    import custom_model as cm

    cfg = load_config(overrides=[*[a for a in base if a != "--quiet"], "--train.eval_batches=2",
                                 "--verify.replay_probability=0.5"])
    train_task(Task(cm.make_model, cm.loss, cm.batch, cm.eval_batches), cfg, str(tmp_path / "c"), quiet=True)
    assert "warning: error feedback: a replay checks the trace, not the packet" in capsys.readouterr().err
