"""`[model] tie`: the output head is the token embedding, one parameter, through training,
packets, checkpoints, the audit, export and `[model] init`."""

from __future__ import annotations

import pytest
import torch
from conftest import rounds_of, tiny

from veriloco.audit import audit_run
from veriloco.config import ConfigError
from veriloco.export import export_run, run_params
from veriloco.model import build_model, model_from
from veriloco.run import train
from veriloco.weights import read_init

LLAMA = ("--model.arch=llama", "--model.n_layer=2", "--model.d_model=32", "--model.n_head=4", "--model.kv_heads=2")
REPLAYED = ("--train.inner_state=reset", "--verify.replay_probability=1.0", "--verify.trace_every=5")


def _embedding(arch: str) -> str:
    return "tok_emb.weight" if arch == "gpt" else "model.embed_tokens.weight"


@pytest.mark.parametrize("arch", ["gpt", "llama", "qwen3"])
def test_the_head_is_the_embedding(arch):
    if arch != "gpt":
        pytest.importorskip("transformers")
    cfg = tiny(f"--model.arch={arch}", "--model.tie=true")
    model = build_model(cfg.model, cfg.run.seed)
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names and _embedding(arch) in names
    untied = [n for n, _ in build_model(tiny(f"--model.arch={arch}").model, cfg.run.seed).named_parameters()]
    assert sorted(untied) == sorted([*names, "lm_head.weight"])
    again = model_from(cfg.model, dict(model.named_parameters()))  # built on meta and given memory: tied again
    assert again.lm_head.weight is dict(again.named_parameters())[_embedding(arch)]
    x = torch.randint(0, 256, (2, cfg.model.ctx))
    with torch.no_grad():
        assert torch.equal(again(x), model(x))
    if arch != "gpt":  # transformers' own tied model computes the same logits
        import transformers

        from veriloco.hf import hf_config

        reference = transformers.AutoModelForCausalLM.from_config(hf_config(cfg.model))
        assert reference.config.tie_word_embeddings
        reference.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert torch.equal(reference(input_ids=x).logits, model(x))


@pytest.mark.parametrize("stages", [1, 2])
def test_a_tied_run_trains_replays_audits_and_exports(tmp_path, stages):
    """stages = 2: the first stage owns the embedding, the last stage's head a copy of it
    (pipeline.TiedEnds); the live replays and the audit's emulated pipeline reproduce it bit for bit."""
    transformers = pytest.importorskip("transformers")
    cfg = tiny(*LLAMA, "--model.tie=true", "--train.rounds=2", *REPLAYED, f"--topology.stages={stages}",
               f"--topology.microbatches={stages}")
    run, summary = train(cfg, str(tmp_path / "run"), quiet=True)
    rounds = rounds_of(run.root)
    assert summary["eval_loss_end"] < rounds[0]["eval_loss_start"]
    assert all(r["verdicts"] == ["accept"] * cfg.topology.workers for r in rounds)  # every worker replayed, bit for bit
    report = audit_run(run.root, replay=100)
    assert report.ok, report.first_failure
    assert report.checked["replays"] == 2 * cfg.topology.workers
    _, params, _ = run_params(run.root)
    assert "lm_head.weight" not in params
    from veriloco.report import write_report

    assert "2 kv heads · 32 ctx · 256 vocab · tied embeddings" in write_report(run.root).read_text()

    export_run(run.root, tmp_path / "out")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    ours = model_from(cfg.model, params)
    x = torch.randint(0, 256, (2, cfg.model.ctx))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=x).logits, ours(x))

    if stages > 1:  # starting from an export is the same for either (below, unsplit)
        return
    # the export starts a tied run where this one ended (tests/test_init.py unties a tied checkpoint)
    then, _ = train(tiny(*LLAMA, "--model.tie=true", "--train.rounds=1", f"--model.init={tmp_path / 'out'}"),
                    str(tmp_path / "then"), quiet=True)
    assert rounds_of(then.root)[0]["eval_loss_start"] == rounds[-1]["eval_loss"]


def test_a_tied_gpt_export_loads_as_the_docs_say(tmp_path):
    import json

    from veriloco.config import ModelConfig
    from veriloco.model import GPT

    run, _ = train(tiny("--model.tie=true", "--train.rounds=1"), str(tmp_path / "run"), quiet=True)
    export_run(run.root, tmp_path / "out")
    from safetensors.torch import load_file

    model = GPT(ModelConfig(**json.loads((tmp_path / "out" / "model.json").read_text())))
    model.load_state_dict(load_file(tmp_path / "out" / "model.safetensors"))
    assert model.lm_head.weight is model.tok_emb.weight
    _, params, _ = run_params(run.root)
    assert torch.equal(model.tok_emb.weight, params["tok_emb.weight"])


def test_what_cannot_be_tied_is_one_line(tmp_path):
    transformers = pytest.importorskip("transformers")
    from veriloco.hf import hf_config

    cfg = tiny(*LLAMA)
    transformers.AutoModelForCausalLM.from_config(hf_config(cfg.model)).save_pretrained(tmp_path / "untied")
    tied = tiny(*LLAMA, "--model.tie=true", f"--model.init={tmp_path / 'untied'}")
    with pytest.raises(ConfigError, match=r"has a head of its own \(lm_head.weight is not its embedding\): "
                                          r"set model.tie = false"):
        read_init(tied.model, build_model(tied.model, 0))
