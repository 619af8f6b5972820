"""`[model] arch`: transformers architectures (Llama, Mistral, Qwen2, Qwen3, OLMo 2, SmolLM3) built from the config.

The model must compute exactly what `transformers` computes, cut into stages that chain to the
whole model, train through every part of the engine (stages, replays, the audit), and come out as
a directory `AutoModelForCausalLM.from_pretrained` loads (`veriloco export`)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import cli, rounds_of, tiny

from veriloco import audit as audit_mod
from veriloco.audit import audit_run
from veriloco.config import ConfigError
from veriloco.export import ExportError, export_run, run_params
from veriloco.hf import HF_ARCHS, ffn_width, hf_config
from veriloco.model import build_model
from veriloco.run import train
from veriloco.store import LocalStore
from veriloco.task import model_init_hash
from veriloco.topology import build_stage_model

transformers = pytest.importorskip("transformers")

SMALL = ("--model.n_layer=3", "--model.d_model=32", "--model.n_head=4", "--model.kv_heads=2")
SIZES = {"smollm3": ("--model.n_layer=4",)}  # SmolLM3's 4th layer is its first without rotary (NoPE)
REPLAYED = ("--train.inner_state=reset", "--verify.replay_probability=1.0", "--verify.trace_every=5",
            "--verify.loss_gain_batches=1")


@pytest.mark.parametrize("arch", HF_ARCHS)
def test_the_model_is_transformers_own_and_its_stages_chain_to_it(arch):
    cfg = tiny(f"--model.arch={arch}", *SMALL, *SIZES.get(arch, ()))
    model = build_model(cfg.model, cfg.run.seed)
    reference = transformers.AutoModelForCausalLM.from_config(hf_config(cfg.model))
    reference.load_state_dict(model.state_dict())  # strict: the same names and shapes as transformers'
    assert model_init_hash(build_model(cfg.model, cfg.run.seed)) == model_init_hash(model)  # G_0 from the seed
    assert model_init_hash(build_model(cfg.model, cfg.run.seed + 1)) != model_init_hash(model)
    x = torch.randint(0, 256, (2, cfg.model.ctx))
    with torch.no_grad():
        logits = model(x)
        assert torch.equal(logits, reference(input_ids=x).logits)
        h, names = x, []
        for s in range(3):
            stage = build_stage_model(cfg.model, cfg.run.seed, s, 3)
            names += [n for n, _ in stage.named_parameters()]
            h = stage(h)
    assert torch.equal(h, logits)
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())  # each parameter in one stage


def test_an_olmo2_checkpoint_starts_a_run_as_it_is(tmp_path):
    """OLMo 2's layers norm after attention and MLP and norm q and k: a saved OLMo 2 (its own
    config.json, save_pretrained) read by `[model] init` gives transformers' logits exactly."""
    from veriloco.model import build_meta, model_from
    from veriloco.weights import read_init

    cfg = tiny("--model.arch=olmo2", *SMALL, "--model.rope_theta=500000", f"--model.init={tmp_path / 'olmo2'}")
    theirs_cfg = hf_config(cfg.model)
    torch.manual_seed(5)
    theirs = transformers.AutoModelForCausalLM.from_config(theirs_cfg)
    assert type(theirs).__name__ == "Olmo2ForCausalLM" and theirs_cfg.eos_token_id is None  # 50279 is outside 256 ids
    theirs.save_pretrained(tmp_path / "olmo2")
    ours = model_from(cfg.model, read_init(cfg.model, build_meta(cfg.model)))
    x = torch.randint(0, 256, (2, cfg.model.ctx))
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(input_ids=x).logits)
    with pytest.raises(ConfigError, match=r"config.json rope_theta = 500000.0 but model.rope_theta = 10000.0"):
        read_init(tiny("--model.arch=olmo2", *SMALL, f"--model.init={tmp_path / 'olmo2'}").model, build_meta(cfg.model))
    config = json.loads((tmp_path / "olmo2" / "config.json").read_text())
    (tmp_path / "olmo2" / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))  # a shape no check sees
    with pytest.raises(ConfigError, match=r"config.json hidden_act = 'gelu' but veriloco's olmo2 has 'silu' "
                                          r"\(no \[model\] key sets it\)"):
        read_init(cfg.model, build_meta(cfg.model))


@pytest.mark.parametrize("arch", HF_ARCHS)
def test_every_token_of_the_vocabulary_trains(arch):
    """No padding row: OLMo 2's default pad id (1) and SmolLM3's would leave that row of the
    embedding zero and without gradient, though it is a real token of the run's vocabulary."""
    from veriloco.model import lm_loss

    cfg = tiny(f"--model.arch={arch}", *SMALL)
    model = build_model(cfg.model, cfg.run.seed)
    x = torch.arange(256).reshape(8, 32)  # every byte once
    lm_loss(model(x), x.roll(-1, 1)).backward()
    embedding = model.get_submodule("model.embed_tokens").weight
    assert embedding.abs().sum(1).min() > 0 and embedding.grad.abs().sum(1).min() > 0


def test_smollm3s_nope_layers_export_and_start_a_run_as_they_are(tmp_path):
    """SmolLM3 attends without rotary in every 4th layer (NoPE; transformers' default
    no_rope_layers): veriloco's export is a SmolLM3 that from_pretrained loads with the same logits,
    it starts a run as it is, and a config.json with other NoPE layers (or sliding layers) is one line."""
    from veriloco.hf import save_hf
    from veriloco.model import build_meta, model_from
    from veriloco.weights import read_init

    cfg = tiny("--model.arch=smollm3", *SMALL, "--model.n_layer=4", f"--model.init={tmp_path / 'smol'}")
    ours = build_model(cfg.model, cfg.run.seed)
    (tmp_path / "smol").mkdir()
    save_hf(dict(ours.named_parameters()), cfg.model, tmp_path / "smol")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "smol")
    assert type(theirs).__name__ == "SmolLM3ForCausalLM" and theirs.config.no_rope_layers == [1, 1, 1, 0]
    x = torch.randint(0, 256, (2, cfg.model.ctx))
    with torch.no_grad():
        logits = ours(x)
        assert torch.equal(theirs(input_ids=x).logits, logits)
        assert torch.equal(model_from(cfg.model, read_init(cfg.model, build_meta(cfg.model)))(x), logits)
        all_rope = transformers.AutoModelForCausalLM.from_config(
            type(theirs.config)(**{**theirs.config.to_dict(), "no_rope_layers": [1, 1, 1, 1]}))
        all_rope.load_state_dict(theirs.state_dict())
        assert not torch.equal(all_rope(input_ids=x).logits, logits)  # the NoPE layer computes another thing
    config = json.loads((tmp_path / "smol" / "config.json").read_text())
    for change, message in (
        ({"no_rope_layers": [1, 1, 1, 1]}, r"config.json no_rope_layers has NoPE layers \[\] but veriloco's smollm3 "
                                           r"has \[3\] \(no \[model\] key sets them\)$"),
        ({"no_rope_layers": None, "no_rope_layer_interval": 2}, r"no_rope_layers has NoPE layers \[1, 3\] but"),
        ({"layer_types": ["sliding_attention"] * 4, "sliding_window": 8},
         r"config.json layer_types has sliding_attention layers, which veriloco's smollm3 does not run"),
    ):
        (tmp_path / "smol" / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ConfigError, match=message) as e:
            read_init(cfg.model, build_meta(cfg.model))
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_a_qwen_checkpoint_with_sliding_layers_is_one_line(tmp_path, arch):
    """Qwen's attention takes each layer's window from config.json's layer_types, whatever
    use_sliding_window says: a checkpoint with sliding layers computes what veriloco does not."""
    from veriloco.hf import save_hf
    from veriloco.model import build_meta
    from veriloco.weights import read_init

    cfg = tiny(f"--model.arch={arch}", *SMALL, f"--model.init={tmp_path}")
    save_hf(dict(build_model(cfg.model, cfg.run.seed).named_parameters()), cfg.model, tmp_path)
    read_init(cfg.model, build_meta(cfg.model))  # as exported: full attention in every layer
    config = json.loads((tmp_path / "config.json").read_text())
    sliding = ["full_attention", "sliding_attention"]
    (tmp_path / "config.json").write_text(json.dumps({**config, "layer_types": sliding, "sliding_window": 8}))
    with pytest.raises(ConfigError, match=f"config.json layer_types has sliding_attention layers, which veriloco's "
                                          f"{arch} does not run \\(full_attention only\\)$"):
        read_init(cfg.model, build_meta(cfg.model))


def test_mistrals_sliding_window_is_transformers_own(tmp_path):
    """`[model] sliding_window` (Mistral 7B v0.1's 4096, here 8 of a 32-token context): the logits
    equal transformers' own, three stages chain to them, and a saved Mistral with its window
    starts a run only with the same window."""
    from veriloco.model import build_meta
    from veriloco.weights import read_init

    cfg = tiny("--model.arch=mistral", *SMALL, "--model.sliding_window=8")
    model = build_model(cfg.model, cfg.run.seed)
    reference = transformers.AutoModelForCausalLM.from_config(hf_config(cfg.model))
    assert reference.config.sliding_window == 8
    reference.load_state_dict(model.state_dict())
    x = torch.randint(0, 256, (2, cfg.model.ctx))
    full = tiny("--model.arch=mistral", *SMALL)
    with torch.no_grad():
        logits = model(x)
        assert torch.equal(logits, reference(input_ids=x).logits)
        assert not torch.equal(logits, build_model(full.model, cfg.run.seed)(x))  # the window changes them
        h = x
        for s in range(3):
            h = build_stage_model(cfg.model, cfg.run.seed, s, 3)(h)
    assert torch.equal(h, logits)
    reference.save_pretrained(tmp_path / "mistral")
    init = f"--model.init={tmp_path / 'mistral'}"
    assert len(read_init(tiny("--model.arch=mistral", *SMALL, "--model.sliding_window=8", init).model, build_meta(cfg.model)))
    with pytest.raises(ConfigError, match=r"config.json sliding_window = 8 but model.sliding_window = 0 \(at model.ctx = 32\)"):
        read_init(tiny("--model.arch=mistral", *SMALL, init).model, build_meta(cfg.model))
    with pytest.raises(ConfigError, match=r"model.sliding_window is for arch mistral \(its every layer\); model.arch is 'llama'"):
        tiny(*SMALL, "--model.arch=llama", "--model.sliding_window=8")
    with pytest.raises(ConfigError, match=r"model.sliding_window must be >= 0, got -1"):
        tiny("--model.arch=mistral", *SMALL, "--model.sliding_window=-1")


def test_activation_checkpointing_gives_the_same_gradients():
    grads = []
    for flag in ("false", "true"):
        cfg = tiny("--model.arch=llama", *SMALL, f"--model.checkpoint={flag}")
        model = build_model(cfg.model, 0)
        x = torch.randint(0, 256, (2, cfg.model.ctx), generator=torch.Generator().manual_seed(0))
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


@pytest.mark.parametrize("override, message", [
    ("--model.arch=gpt2", "model.arch must be gpt, llama, mistral, qwen2, qwen3, olmo2, smollm3, got 'gpt2'"),
    ("--model.norm_eps=1e-5", "model.kv_heads, model.head_dim, model.ffn, model.rope_theta, model.rope_scaling and model.norm_eps are for "
     "transformers archs"),
])
def test_arch_settings_are_checked(override, message):
    with pytest.raises(ConfigError, match=message):
        tiny(override)
    with pytest.raises(ConfigError, match=r"model.n_head \(4\) must be divisible by model.kv_heads \(3\)"):
        tiny("--model.arch=llama", "--model.n_head=4", "--model.kv_heads=3")
    with pytest.raises(ConfigError, match=r"head width \(5; model.head_dim, or d_model / n_head\) must be even"):
        tiny("--model.arch=qwen2", "--model.d_model=20", "--model.n_head=4")


def test_a_missing_transformers_is_one_line(monkeypatch):
    import veriloco.hf

    monkeypatch.setattr(veriloco.hf, "transformers_version", lambda: None)
    with pytest.raises(ConfigError, match=r"model.arch = 'llama' needs transformers>=5,<6 \(pip install 'veriloco\[hf\]'\); it is not installed"):
        tiny("--model.arch=llama")


def test_ffn_default_is_llamas_rounding():
    assert ffn_width(tiny("--model.arch=llama").model) == 96  # 8/3 x 32 = 85.3 -> 96
    assert ffn_width(tiny("--model.arch=llama", "--model.ffn=50").model) == 50


def test_a_pipelined_llama_trains_replays_audits_and_exports(tmp_path, monkeypatch):
    """W=2 x S=2 against W=2 x S=1 on the same seed (as tests/test_engine.py does for the GPT), every
    worker replayed every round, the offline audit re-running every replay, then `export`."""
    arch = ("--model.arch=llama", "--model.kv_heads=1", "--train.rounds=2")
    flat, _ = train(tiny(*arch, *REPLAYED), str(tmp_path / "s1"), quiet=True)
    piped, summary = train(tiny(*arch, *REPLAYED, "--topology.stages=2", "--topology.microbatches=2"),
                           str(tmp_path / "s2"), quiet=True)
    a, b = rounds_of(flat.root), rounds_of(piped.root)
    assert summary["stages"] == 2 and b[-1]["eval_loss"] < b[0]["eval_loss_start"]
    for ra, rb in zip(a, b, strict=True):
        assert rb["verdicts"] == ["accept"] * 2
        assert abs(ra["eval_loss"] - rb["eval_loss"]) <= 1e-5 * ra["eval_loss"]  # STAGES_LOSS_RTOL
    manifest = json.loads((piped.root / "manifest.json").read_text())
    assert manifest["transformers_version"] == transformers.__version__
    from veriloco.report import write_report

    html = write_report(piped.root).read_text()
    assert "llama · 2 layers · 32 d_model · 2 heads · 1 kv heads" in html and transformers.__version__ in html
    report = audit_run(piped.root, replay=100)
    assert report.ok, report.first_failure
    assert report.checked["replays"] == 4  # 2 workers x 2 rounds, each through the emulated pipeline

    # another transformers version may compute another forward: the audit says so, not "replay mismatch"
    monkeypatch.setattr(audit_mod, "transformers_version", lambda: "5.0.0")
    report = audit_run(piped.root)
    assert not report.ok and "ran on transformers" in report.first_failure and "this machine has 5.0.0" in report.first_failure
    monkeypatch.undo()

    # export: the stage checkpoints merged, loadable by transformers, the same logits as the run's model
    out, r = export_run(piped.root, tmp_path / "hf")
    assert r == 1 and sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    cfg, params, _ = run_params(piped.root)
    ours = build_model(cfg.model, cfg.run.seed)
    ours.load_state_dict(params)
    x = torch.randint(0, 256, (2, cfg.model.ctx))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=x).logits, ours(x))
    with pytest.raises(ExportError, match="already exists"):
        export_run(piped.root, out)
    with pytest.raises(ExportError, match=r"round 5 is not in .* \(it has rounds 0..1\)"):
        export_run(piped.root, tmp_path / "x", round=5)


def test_export_of_the_gpt_and_its_bad_input(tmp_path, monkeypatch, capsys):
    from safetensors.torch import load_file

    from veriloco.config import ModelConfig
    from veriloco.model import GPT

    run, _ = train(tiny("--train.rounds=2"), str(tmp_path / "run"), quiet=True)
    out, r = export_run(run.root, tmp_path / "gpt", round=0)
    model = GPT(ModelConfig(**json.loads((out / "model.json").read_text())))
    model.load_state_dict(load_file(out / "model.safetensors"))
    assert r == 0 and model_init_hash(model) == rounds_of(run.root)[0]["params_hash"]

    # a checkpoint that does not match its record: one line, exit 2, nothing written
    rec = rounds_of(run.root)[-1]
    blob = LocalStore(run.store_dir).path_of(rec["checkpoint"])
    blob.write_bytes(blob.read_bytes()[:-8] + b"\0" * 8)
    for args, message in (
        ((str(run.root), "--out", str(tmp_path / "bad")), "checkpoint of stage 0 does not load"),
        ((str(tmp_path / "nothing"), "--out", str(tmp_path / "bad")), "is not a run directory"),
        ((str(run.root), "--out", str(out)), "already exists"),
    ):
        code, lines, _ = cli(monkeypatch, capsys, "export", *args)
        assert code == 2 and len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad.*"))
    # a record that names no checkpoint (rounds.jsonl is the run's own file, not trusted to be whole)
    rows = rounds_of(run.root)
    rows[-1]["checkpoint"] = 123
    (run.root / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ExportError, match="round 1: its record does not name a checkpoint and params hash"):
        export_run(run.root, tmp_path / "bad")


def test_the_fine_tuning_example_runs(tmp_path, monkeypatch, capsys):
    """examples/finetune_hf.py: a transformers model and tokenizer on disk -> DiLoCo -> audit -> export ->
    transformers loads it and generates."""
    import runpy
    import sys

    from conftest import ROOT

    # as `python examples/finetune_hf.py DIR` runs it, in this process (torch and transformers are imported
    # here already; its run is the built-in task's, whose workers import nothing from the script)
    example = ROOT / "examples" / "finetune_hf.py"
    monkeypatch.setattr(sys, "argv", [str(example), str(tmp_path / "ft")])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(example), run_name="__main__")
    stdout = capsys.readouterr().out
    assert done.value.code == 0, stdout[-2000:]
    assert "audit ok" in stdout and "['config.json', 'model.safetensors', 'tokenizer.json']" in stdout
    start, end = (float(x) for x in stdout.split("eval loss ")[1].split(" in ")[0].split(" -> "))
    assert end < start and "generated: 'def " in stdout
    manifest = json.loads((tmp_path / "ft" / "run" / "manifest.json").read_text())
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ft" / "base")
    from veriloco.task import model_init_hash
    assert manifest["model_init_hash"] == model_init_hash(base)  # the run started from the model on disk


def test_every_shipped_config_loads():
    from conftest import ROOT

    from veriloco.config import load_config

    configs = sorted((ROOT / "configs").glob("*.toml"))
    assert {p.name for p in configs} >= {"default.toml", "llama.toml", "tiny.toml", "verified.toml"}
    for path in configs:
        load_config(path)
    assert load_config(ROOT / "configs" / "llama.toml").model.arch == "llama"
