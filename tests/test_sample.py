"""`veriloco sample RUN`: text from a run's params, reproducible by seed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import cli, tiny

from veriloco.export import ExportError, run_params
from veriloco.model import build_model
from veriloco.run import train
from veriloco.sample import sample


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run, _ = train(tiny("--train.rounds=2"), str(tmp_path_factory.mktemp("s") / "run"), quiet=True)
    return run.root


def test_greedy_sampling_is_the_models_argmax(run_dir):
    text, r = sample(run_dir, "def ", tokens=12, temperature=0)
    cfg, params, _ = run_params(run_dir)
    model = build_model(cfg.model, cfg.run.seed)
    model.load_state_dict(params)
    ids = list(b"def ")
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids[-cfg.model.ctx:]]))[0, -1].argmax()))
    assert r == 1 and text == bytes(ids[4:]).decode("utf-8", errors="replace")


def test_the_same_seed_prints_the_same_text(run_dir):
    a = sample(run_dir, "import ", tokens=40, seed=3)[0]
    assert a == sample(run_dir, "import ", tokens=40, seed=3)[0]
    assert a != sample(run_dir, "import ", tokens=40, seed=4)[0]
    assert sample(run_dir, "import ", tokens=40, seed=3, round=0)[0] != a  # round 0's params
    assert sample(run_dir, "import ", tokens=40, seed=3, top_k=1)[0] == sample(run_dir, "import ", tokens=40, temperature=0)[0]


def test_bad_input_is_one_line(run_dir, tmp_path, monkeypatch, capsys):
    for args, message in (((str(run_dir), "--tokens", "0"), "--tokens must be >= 1, got 0"),
                          ((str(run_dir), "--temperature", "-1"), "--temperature must be a number >= 0"),
                          ((str(run_dir), "--temperature", "nan"), "--temperature must be a number >= 0, got nan"),
                          ((str(run_dir), "--seed", str(1 << 64)), "--seed must be in [-2^63, 2^64)"),
                          ((str(run_dir), "--round", "7"), "round 7 is not in"),
                          ((str(tmp_path),), "is not a run directory")):
        code, lines, _ = cli(monkeypatch, capsys, "sample", *args)
        assert code == 2 and len(lines) == 1 and message in lines[0], lines
    code, _, out = cli(monkeypatch, capsys, "sample", str(run_dir), "--prompt", "def ", "--tokens", "5", "--temperature", "0")
    assert code == 0 and out == "def " + sample(run_dir, "def ", 5, temperature=0)[0] + "\n"
    # token ids from a .bin file and no tokenizer: nothing to decode them with
    tokens = tmp_path / "t.bin"
    np.random.default_rng(0).integers(0, 300, 40000, dtype=np.uint16).tofile(tokens)
    run, _ = train(tiny("--train.rounds=1", f"--data.source={tokens}", "--model.vocab_size=300"), str(tmp_path / "bin"),
                   quiet=True)
    with pytest.raises(ExportError, match="keeps no tokenizer"):
        sample(run.root)


def test_ctrl_c_in_a_command_says_so_in_one_line(run_dir):
    """Ctrl-C in a command other than train (which names the resume) ended it with exit 130 and
    nothing on stderr: typer turns KeyboardInterrupt into a bare Exit(130)."""
    import signal
    import subprocess
    import sys
    import threading

    p = subprocess.Popen([sys.executable, "-m", "veriloco.cli", "sample", str(run_dir), "--tokens", "10000000"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # the Ctrl-C lands once the command streams text (the model loaded, every import done). Sent
    # while an import still ran (a loaded CI machine, a fixed sleep after torch was mapped), it hit
    # a dataclass's exec'd source, which CPython remembers as an unhandled KeyboardInterrupt: the
    # line was said, then the interpreter killed itself with SIGINT at exit (-2, not 130)
    first: list[str] = []
    reader = threading.Thread(target=lambda: first.append(p.stdout.read(1)), daemon=True)
    reader.start()
    reader.join(timeout=120)
    assert first and first[0], "sample printed nothing within 120 s"
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and [ln for ln in err.splitlines() if ln.strip()] == ["veriloco: interrupted"], err


def test_the_byte_stream_adds_up_to_the_whole_decode_whatever_the_bytes():
    """Every byte sequence, valid UTF-8 or not (a byte-level model writes any byte), streams to
    what the one decode of all of them gives: a character split across bytes is held back, not
    shown as U+FFFD and then again."""
    from veriloco.sample import _ByteStream

    rng = np.random.default_rng(0)
    cases = [list("héllo wörld ✓ 🙂".encode()), [0xF0, 0x9F, 0x99], [0xFF, 0x41, 0xC3], [0xE2, 0x82, 0x41, 0xAC]]
    cases += [rng.integers(0, 256, 200).tolist() for _ in range(50)]
    cases += [list("".join(rng.choice(list("aé✓🙂"), 60)).encode()) for _ in range(5)]
    for ids in cases:
        stream, pieces = _ByteStream(), []
        for i in range(len(ids)):
            pieces.append(stream.push(ids[:i + 1]))
        pieces.append(stream.end(ids))
        assert "".join(pieces) == bytes(ids).decode("utf-8", errors="replace"), ids
    stream = _ByteStream()
    assert [stream.push(list("✓".encode())[:i]) for i in (1, 2, 3)] == ["", "", "✓"]  # shown once complete


def test_the_token_stream_adds_up_to_the_tokenizers_decode(tmp_path):
    """A byte-level BPE: each prefix's text extends the last one's, except where a token holds
    part of a character; streamed, the pieces are the decode of all the ids, and no piece ends in
    a half character."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from veriloco.sample import _TokenStream

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = "naïve café ✓ done\nthe end 🙂 of it\n" * 40
    tok.train_from_iterator([text], trainer)
    rng = np.random.default_rng(1)
    for ids in [tok.encode(text[:300]).ids, *(rng.integers(0, tok.get_vocab_size(), 120).tolist() for _ in range(20))]:
        stream, pieces = _TokenStream(tok.decode), []
        for i in range(len(ids)):
            pieces.append(stream.push(ids[:i + 1]))
        pieces.append(stream.end(ids))
        assert "".join(pieces) == tok.decode(ids), ids
        assert not any(p.endswith("\ufffd") for p in pieces[:-1])


def test_the_cli_prints_as_it_writes(run_dir):
    """`veriloco sample` shows its text while it is still writing: the prompt and the first
    characters are on stdout long before the last token (before, nothing until the end)."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", "veriloco.cli", "sample", str(run_dir), "--prompt", "def ",
                          "--tokens", "10000000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        first = p.stdout.read(20)  # blocks until 20 bytes have been written
        assert p.poll() is None and first.startswith(b"def "), first
    finally:
        p.kill()
        p.communicate(timeout=60)
