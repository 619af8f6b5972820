"""Fine-tune a transformers model you have on disk with DiLoCo, check it, and hand it back.

    python examples/finetune_hf.py [WORK_DIR]

Offline from start to end. This machine has no model hub, so the script first makes the model
"you have": a small Qwen3 saved with `save_pretrained` and a byte-level BPE tokenizer trained on
a few standard-library modules. With a real model, skip step 1 and point `--model.init` and
`--data.tokenizer` at its directory (and `[model]` at its sizes: the run refuses, in one line
naming the key, any that disagree with its config.json).

1. the model and tokenizer on disk (WORK_DIR/base);
2. train (as `veriloco train` would) with `--model.init` (start from those weights), `--data.tokenizer` and
   `--data.eos` (each file of the corpus a document ended by <|endoftext|>): 2 workers, 3 rounds;
3. audit it (`veriloco audit`: signatures, verdicts, every outer step, the starting weights in the store);
4. export it (`veriloco export`: WORK_DIR/tuned: config.json, model.safetensors, tokenizer.json);
5. transformers loads it back and generates, greedily, after a prompt.
"""

import subprocess
import sys
from pathlib import Path

SIZES = ["--model.arch=qwen3", "--model.n_layer=2", "--model.d_model=64", "--model.n_head=4",
         "--model.kv_heads=2", "--model.ctx=64", "--model.vocab_size=512", "--model.tie=true"]  # tied, as small Qwen3s are


def make_base(base: Path) -> None:
    """The model and tokenizer you would have downloaded: made here, as transformers saves them."""
    import os

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM

    from veriloco.config import load_config
    from veriloco.hf import hf_config

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    corpus = [Path(os.__file__).read_text(encoding="utf-8"), Path(subprocess.__file__).read_text(encoding="utf-8")]
    tok.train_from_iterator(corpus, trainer)
    base.mkdir(parents=True)
    tok.save(str(base / "tokenizer.json"))
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(hf_config(load_config(overrides=SIZES).model))
    model.save_pretrained(base)


if __name__ == "__main__":  # worker processes import this file: keep the launch under the guard
    from veriloco import load_config, train
    from veriloco.audit import audit_run
    from veriloco.export import export_run

    work = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/finetune-hf")
    base, tuned = work / "base", work / "tuned"
    make_base(base)
    # the same as: veriloco train --model.arch=qwen3 ... --model.init=BASE --data.tokenizer=BASE/tokenizer.json ...
    cfg = load_config(overrides=[
        *SIZES, f"--model.init={base}", f"--data.tokenizer={base / 'tokenizer.json'}", "--data.eos=<|endoftext|>",
        "--data.max_bytes=400000", "--topology.workers=2", "--train.rounds=3", "--train.inner_steps=10",
        "--train.batch_size=8", "--train.warmup_steps=10", "--train.eval_batches=4"])
    run, summary = train(cfg, str(work / "run"), quiet=True)
    print(f"trained: eval loss {summary['eval_loss_start']:.4f} -> {summary['eval_loss_end']:.4f} in {run.root}")
    report = audit_run(run.root)  # veriloco audit RUN
    print(f"audit {'ok' if report.ok else 'FAILED: ' + str(report.first_failure)}")
    export_run(run.root, tuned)  # veriloco export RUN --out TUNED
    print(f"exported: {sorted(p.name for p in tuned.iterdir())}")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tuned)
    model = AutoModelForCausalLM.from_pretrained(tuned)
    ids = tokenizer("def ", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=30, do_sample=False, pad_token_id=0)
    print("generated:", repr(tokenizer.decode(out[0])))
    sys.exit(0 if report.ok else 1)
