"""`[model] init`: a run that starts from weights on disk (a veriloco export, a transformers directory)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY, cli, rounds_of, tiny

from veriloco.audit import audit_run
from veriloco.config import ConfigError
from veriloco.export import export_run
from veriloco.model import build_model
from veriloco.run import train
from veriloco.store import LocalStore
from veriloco.weights import read_init

LLAMA = ("--model.arch=llama", "--model.n_layer=2", "--model.d_model=32", "--model.n_head=4", "--model.kv_heads=2")


def test_a_run_continues_from_an_export_bit_for_bit(tmp_path):
    first, _ = train(tiny("--train.rounds=2"), str(tmp_path / "a"), quiet=True)
    export_run(first.root, tmp_path / "a-final")
    then, summary = train(tiny("--train.rounds=2", f"--model.init={tmp_path / 'a-final'}"), str(tmp_path / "b"), quiet=True)
    a, b = rounds_of(first.root), rounds_of(then.root)
    assert b[0]["eval_loss_start"] == a[-1]["eval_loss"]  # G_0 is the first run's last G, exactly
    assert summary["eval_loss_end"] < a[-1]["eval_loss"]
    manifest = json.loads((then.root / "manifest.json").read_text())
    assert manifest["model_init_hash"] == a[-1]["params_hash"] and "init" in manifest
    assert LocalStore(then.store_dir).get(manifest["init"])  # the run directory holds its starting weights
    report = audit_run(then.root)
    assert report.ok, report.first_failure

    # the audit starts from the stored weights: a run whose stored init was swapped is caught
    blob = LocalStore(then.store_dir).path_of(manifest["init"])
    blob.write_bytes(blob.read_bytes()[:-4] + b"\0\0\0\0")
    report = audit_run(then.root)
    assert not report.ok and "the starting weights it names (initial_params) do not load from the store" in report.first_failure


def test_pipelined_and_ddp_runs_start_from_the_weights_too(tmp_path):
    pytest.importorskip("transformers")
    first, _ = train(tiny(*LLAMA, "--train.rounds=1"), str(tmp_path / "a"), quiet=True)
    export_run(first.root, tmp_path / "w")
    start = rounds_of(first.root)[-1]["eval_loss"]
    init = f"--model.init={tmp_path / 'w' / 'model.safetensors'}"  # the file itself, not its directory
    piped, _ = train(tiny(*LLAMA, "--train.rounds=1", "--topology.stages=2", init), str(tmp_path / "s2"), quiet=True)
    assert abs(rounds_of(piped.root)[0]["eval_loss_start"] - start) <= 1e-6 * start  # the pipeline sums in its order
    report = audit_run(piped.root)
    assert report.ok, report.first_failure
    ddp, _ = train(tiny(*LLAMA, "--train.rounds=1", "--train.mode=ddp", init), str(tmp_path / "ddp"), quiet=True)
    assert rounds_of(ddp.root)[0]["eval_loss_start"] == start


def test_a_transformers_directory_with_tied_embeddings_and_shards(tmp_path):
    transformers = pytest.importorskip("transformers")
    from veriloco.hf import hf_config

    cfg = tiny(*LLAMA)
    hf_cfg = hf_config(cfg.model)
    hf_cfg.tie_word_embeddings = True
    torch.manual_seed(7)
    theirs = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    theirs.save_pretrained(tmp_path / "hf", max_shard_size="20KB")  # several model-0000x-of-0000y files
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    ours = build_model(cfg.model, 0)
    params = read_init(tiny(*LLAMA, f"--model.init={tmp_path / 'hf'}").model, ours)
    assert torch.equal(params["lm_head.weight"], params["model.embed_tokens.weight"])  # the tied head, copied
    ours.load_state_dict(params)
    x = torch.randint(0, 256, (2, cfg.model.ctx))
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(input_ids=x).logits)


def test_weights_that_do_not_fit_are_one_line(tmp_path, monkeypatch, capsys):
    transformers = pytest.importorskip("transformers")
    from veriloco.hf import hf_config

    cfg = tiny(*LLAMA)
    theirs = transformers.AutoModelForCausalLM.from_config(hf_config(cfg.model))
    theirs.save_pretrained(tmp_path / "hf")

    def init_of(path, *more):
        return read_init(tiny(*LLAMA, f"--model.init={path}", *more).model, build_model(tiny(*LLAMA, *more).model, 0))

    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 500000.0
    config["rms_norm_eps"] = 1e-5
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"config.json rope_theta = 500000.0 but model.rope_theta = 10000.0; "
                                          r"config.json rms_norm_eps = 1e-05 but model.norm_eps = 1e-06"):
        init_of(tmp_path / "hf")
    assert init_of(tmp_path / "hf", "--model.rope_theta=500000.0", "--model.norm_eps=1e-5")  # as the message says
    with pytest.raises(ConfigError, match=r"model.layers.0.mlp.gate_proj.weight has shape \(96, 32\), this \[model\] "
                                          r"makes \(64, 32\): set \[model\] to the checkpoint's sizes"):
        init_of(tmp_path / "hf" / "model.safetensors", "--model.ffn=64")
    with pytest.raises(ConfigError, match=r"does not hold this \[model\]'s parameters: missing model.layers.2"):
        init_of(tmp_path / "hf" / "model.safetensors", "--model.n_layer=3")
    with pytest.raises(ConfigError, match="model.init not found"):
        init_of(tmp_path / "nothing")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match="junk.safetensors is not a safetensors file"):
        init_of(tmp_path / "junk.safetensors")
    # the GPT: a veriloco export's model.json says what no shape shows (n_head)
    run, _ = train(tiny("--train.rounds=1"), str(tmp_path / "gpt"), quiet=True)
    export_run(run.root, tmp_path / "gpt-w")
    with pytest.raises(ConfigError, match=r"model.json: n_head = 2 but model.n_head = 4"):
        read_init(tiny(f"--model.init={tmp_path / 'gpt-w'}", "--model.n_head=4").model,
                  build_model(tiny("--model.n_head=4").model, 0))

    # through the CLI: one line, exit 2, no run directory
    out = tmp_path / "run"
    code, lines, _ = cli(monkeypatch, capsys, "train", str(TINY), f"--model.init={tmp_path / 'junk.safetensors'}", "--out", str(out))
    assert code == 2 and len(lines) == 1 and "is not a safetensors file" in lines[0], lines
    assert not out.exists()
