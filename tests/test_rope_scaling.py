"""`[model] rope_scaling`: Llama 3's (and linear) rotary scaling, computed by transformers, so a
Llama 3.x checkpoint (tied, rope_theta 500000, llama3 scaling) starts a run as it is."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny

from veriloco.config import ConfigError
from veriloco.model import build_model
from veriloco.topology import build_stage_model
from veriloco.weights import read_init

transformers = pytest.importorskip("transformers")

LLAMA3 = json.dumps({"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192})
SMALL = ("--model.arch=llama", "--model.n_layer=3", "--model.d_model=64", "--model.n_head=4", "--model.kv_heads=2")


YARN = json.dumps({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})  # Qwen3's, at ctx 32
YARN_DEEPSEEK = json.dumps({"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 16, "beta_fast": 32,
                            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "truncate": False})


@pytest.mark.parametrize("scaling", [LLAMA3, '{"rope_type": "linear", "factor": 4}', YARN, YARN_DEEPSEEK])
def test_scaled_rotary_is_transformers_own_and_stages_chain(scaling):
    from veriloco.hf import hf_config

    cfg = tiny(*SMALL, "--model.rope_theta=500000", f"--model.rope_scaling={scaling}")
    model = build_model(cfg.model, cfg.run.seed)
    plain = build_model(tiny(*SMALL, "--model.rope_theta=500000").model, cfg.run.seed)
    assert not torch.equal(model.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq)  # the scaling is applied
    reference = transformers.AutoModelForCausalLM.from_config(hf_config(cfg.model))
    assert reference.config.rope_parameters["rope_type"] == json.loads(scaling)["rope_type"]
    reference.load_state_dict(model.state_dict())
    x = torch.randint(0, 256, (2, cfg.model.ctx), generator=torch.Generator().manual_seed(0))
    params = dict(model.named_parameters())
    with torch.no_grad():
        logits = model(x)
        assert torch.equal(logits, reference(input_ids=x).logits)
        h = x
        for s in range(3):  # each stage built from params on the meta device recomputes the scaled tables
            h = build_stage_model(cfg.model, 0, s, 3, params)(h)
    assert torch.equal(h, logits)


def test_a_llama_3_checkpoint_starts_a_run_as_it_is(tmp_path):
    from veriloco.hf import hf_config

    theirs_cfg = hf_config(tiny(*SMALL).model)  # what a Llama 3.2 config.json says, at this size
    theirs_cfg.tie_word_embeddings = True
    theirs_cfg.rope_parameters = {**json.loads(LLAMA3), "rope_theta": 500000.0}
    theirs_cfg.max_position_embeddings = 131072
    torch.manual_seed(3)
    theirs = transformers.AutoModelForCausalLM.from_config(theirs_cfg)
    theirs.save_pretrained(tmp_path / "llama3")

    def init(*more):
        cfg = tiny(*SMALL, f"--model.init={tmp_path / 'llama3'}", *more)
        return cfg, read_init(cfg.model, build_model(cfg.model, 0))

    cfg, params = init("--model.tie=true", "--model.rope_theta=500000", f"--model.rope_scaling={LLAMA3}")
    ours = build_model(cfg.model, 0)
    ours.load_state_dict(params, strict=False)  # the tied head is the embedding
    x = torch.randint(0, 256, (2, cfg.model.ctx))
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(input_ids=x).logits)
    with pytest.raises(ConfigError, match=r"^model.init: .*config.json's rope scaling is \{\"rope_type\": \"llama3\", "
                                          r".*\} but model.rope_scaling = ''$"):
        init("--model.tie=true", "--model.rope_theta=500000")
    linear = '{"rope_type": "linear", "factor": 2.0}'
    with pytest.raises(ConfigError, match=r"rope scaling is .* but model.rope_scaling = '" + linear):
        init("--model.tie=true", "--model.rope_theta=500000", f"--model.rope_scaling={linear}")


@pytest.mark.parametrize("value, message", [
    ("{rope_type: llama3}", "model.rope_scaling is not JSON"),
    ('{"rope_type": "dynamic", "factor": 4.0}', "rope_type must be linear, llama3 or yarn (what veriloco runs), got 'dynamic'"),
    ('{"rope_type": "yarn", "factor": 4.0}', "rope_type 'yarn' takes factor, original_max_position_embeddings and may "
                                              "take attention_factor, beta_fast, beta_slow, mscale, mscale_all_dim, truncate; got factor"),
    ('{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "truncate": 1}',
     "truncate must be true or false, got 1"),
    ('{"rope_type": "linear"}', "rope_type 'linear' takes factor; got nothing"),
    ('{"rope_type": "linear", "factor": -2}', "factor must be a finite number > 0, got -2"),
    ('{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, '
     '"original_max_position_embeddings": 8192.5}', "original_max_position_embeddings must be an integer > 0"),
    ('["linear"]', "rope_type must be linear, llama3 or yarn"),
])
def test_bad_scalings_are_one_line(value, message):
    with pytest.raises(ConfigError) as e:
        tiny(*SMALL, f"--model.rope_scaling={value}")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_gpt_takes_no_rope_scaling():
    with pytest.raises(ConfigError, match="model.rope_scaling and model.norm_eps are for transformers archs"):
        tiny('--model.rope_scaling={"rope_type": "linear", "factor": 2.0}')
