"""Config: precedence, and one clear line + exit code 2 for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import TINY, cli, tiny

from veriloco.config import ConfigError, describe, load_config


def test_precedence_cli_over_file_over_defaults():
    assert load_config().train.rounds == 30  # default
    assert load_config(TINY).train.rounds == 3  # file
    assert load_config(TINY, ["--train.rounds=7"]).train.rounds == 7  # command line
    assert load_config(TINY).train.lr == 3e-3  # untouched by the file: default


def test_a_manifest_from_before_replay_extent_audits_with_the_segments_it_drew():
    from veriloco.config import config_from_dict

    assert tiny().verify.replay_extent == "round"
    assert config_from_dict(tiny().to_dict()).verify.replay_extent == "round"
    old = tiny().to_dict()
    del old["verify"]["replay_extent"]
    assert config_from_dict(old).verify.replay_extent == "segment"


def test_override_types():
    cfg = tiny("--train.lr=0.01", "--outer.nesterov=false", "--data.source=/tmp/x.txt", '--compress.codec="fp32"')
    assert cfg.train.lr == 0.01 and cfg.outer.nesterov is False
    assert cfg.data.source == "/tmp/x.txt" and cfg.compress.codec == "fp32"
    assert tiny("--train.lr=1").train.lr == 1.0  # int accepted for float


@pytest.mark.parametrize(
    "override, needle",
    [
        ("--train.nope=1", "unknown key train.nope"),
        ("--nosection.x=1", "unknown section [nosection]"),
        ("--train.rounds=abc", "train.rounds: expected int"),
        ("--train.rounds=1.5", "train.rounds: expected int"),
        ("--outer.nesterov=3", "outer.nesterov: expected bool"),
        ("--model.d_model=31", "divisible"),
        ("train.rounds", "--section.key=value"),
        ("--verify.loss_gain_floor=1.5", "verify.loss_gain_floor must be in [0, 1), got 1.5"),
        ("--verify.loss_gain_floor=nan", "verify.loss_gain_floor: expected a finite number, got nan"),
        ("--verify.replay_extent=half", "verify.replay_extent must be 'round', 'segment' or 'state', got 'half'"),
        ("--train.round_warmup_steps=9", "train.round_warmup_steps must be in [0, train.inner_steps = 5], got 9"),
        ("--train.inner_state=reset --verify.replay_probability=0.5", "verify.trace_every (10) must divide train.inner_steps (5)"),
        # found by a sweep of every int and float field at -1 and 0 (thirty-fourth session): each of
        # these was accepted and failed later (a ZeroDivisionError, "training failed" with exit 1),
        # or ran as nothing should (a negative weight decay, a beta of 1.5: the inner AdamW, unlike
        # torch's class, checks none of its arguments)
        ("--model.n_head=0", "model.n_head must be >= 1, got 0"),
        ("--model.n_head=-2", "model.n_head must be >= 1, got -2"),
        ("--model.d_model=0", "model.d_model must be >= 1, got 0"),
        ("--topology.microbatches=0", "topology.microbatches must be >= 1, got 0"),
        ("--train.beta1=1.5", "train.beta1 and train.beta2 must be in [0, 1), got 1.5 and 0.95"),
        ("--train.beta2=-0.1", "train.beta1 and train.beta2 must be in [0, 1), got 0.9 and -0.1"),
        ("--train.weight_decay=-1", "train.weight_decay must be >= 0, got -1.0"),
        ("--train.grad_clip=-1", "train.grad_clip must be >= 0 (0: no clipping), got -1.0"),
        ("--train.warmup_steps=-1", "train.warmup_steps must be >= 0, got -1"),
        ("--data.max_bytes=-1", "data.max_bytes must be >= 0 (0: all of the corpus), got -1"),
        ("--run.seed=-9223372036854775809", "run.seed must be in [-2^63, 2^63), got -9223372036854775809"),
        ("--run.seed=36893488147419103232", "run.seed must be in [-2^63, 2^63), got 36893488147419103232"),
        ("--run.max_packet_bytes=0", "run.max_packet_bytes must be >= 1, got 0"),
        # TOML's inf and nan: `> 0` lets inf through (outer.lr = inf failed in the workers)
        ("--outer.lr=inf", "outer.lr: expected a finite number, got inf"),
        ("--train.lr=-inf", "train.lr: expected a finite number, got -inf"),
        ("--outer.momentum=nan", "outer.momentum: expected a finite number, got nan"),
        # finite, yet past what the workers' machinery takes: each failed in the workers (exit 1), with the run's
        # directory half made (an OverflowError in torch.distributed's timeout, in the link's sleep; in set_num_threads)
        ("--run.timeout_s=1e308", "run.timeout_s must be in (0, 604800.0] seconds, got 1e+308"),
        ("--link.latency=1e300s", "link.latency: bad duration '1e300s': must be at most a day (86400s)"),
        ("--link.bandwidth=1e-300bit", "link.bandwidth: bad bandwidth '1e-300bit': must be at least 1bit"),
        ("--train.threads=99999999999999999999", "train.threads must be in [1, 1024], got 99999999999999999999"),
        ("--adversary.²=noise", "adversary.² in the command line: expected adversary.<worker id>"),  # '²'.isdigit()
        ("--data.source=", "data.source must be 'stdlib' or a path, got ''"),
        ('--model.arch=llama --model.rope_scaling={"rope_type":"linear","factor":1e400}',
         "model.rope_scaling: factor must be a finite number > 0, got inf"),
        ('--model.arch=llama --model.rope_scaling={"rope_type":"llama3","factor":8.0,"low_freq_factor":4.0,'
         '"high_freq_factor":1.0,"original_max_position_embeddings":8192}',
         "llama3's high_freq_factor must be greater than its low_freq_factor, got 1.0 and 4.0"),
    ],
)
def test_bad_override_names_the_key(override, needle):
    with pytest.raises(ConfigError) as e:
        tiny(*override.split(" "))
    assert needle in str(e.value)
    if "unknown key" in needle:
        assert "valid keys of [train]: mode, rounds" in str(e.value)


def test_bad_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nround = 3\n")
    with pytest.raises(ConfigError, match="unknown key train.round in .*bad.toml"):
        load_config(bad)
    bad.write_text("[train\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.toml")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["train", str(TINY), "--train.foo=1"], "unknown key train.foo"),
        (["train", str(TINY), "--train.rounds=x"], "expected int"),
        (["train", "missing.toml"], "config file not found"),
        (["train", str(TINY), "--data.source=/no/such/file"], "data.source not found"),
        (["train", "--resume", "/no/such/run"], "not a run directory"),
    ],
)
def test_cli_exit_2_one_line(args, needle, tmp_path, monkeypatch, capsys):
    code, lines, _ = cli(monkeypatch, capsys, *args, *(["--out", str(tmp_path / "r")] if args[1] != "--resume" else []))
    assert code == 2 and len(lines) == 1 and needle in lines[0], lines
    assert not (tmp_path / "r" / "rounds.jsonl").exists()  # nothing half-written


def test_paths_the_os_refuses_exit_2_in_one_line(tmp_path, monkeypatch, capsys):
    """A name past 255 bytes, a directory where a file goes, a dangling link as --out, a place
    that cannot be written, a prompt that is not UTF-8: each stopped a command with a traceback
    (OSError and its kin were not among the CLI's user errors)."""
    from veriloco.run import train

    long = tmp_path / ("a" * 300)
    run = tmp_path / "run"
    train(tiny("--train.rounds=1"), str(run), quiet=True)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    assert cli(monkeypatch, capsys, "keygen", "--out", str(tmp_path / "keys"), "--workers", "2")[0] == 0
    (tmp_path / "keys" / "worker-1.pub").unlink()
    (tmp_path / "keys" / "worker-1.pub").mkdir()  # a directory where worker 1's public key goes
    cases = [
        (["train", str(long)], "config file "),
        (["train", str(TINY), "--out", str(long), "--quiet"], "File name too long"),
        (["report", str(long)], "File name too long"),
        (["audit", str(long)], "File name too long"),
        (["keygen", "--out", str(long), "--workers", "1"], "File name too long"),
        (["keygen", "--out", "", "--workers", "1"], "--out must name a directory, got ''"),
        (["export", str(run), "--out", str(tmp_path / "dangling")], "already exists"),
        (["sample", str(run), "--prompt", "\udcff", "--tokens", "2"], "--prompt is not UTF-8 text"),
        (["train", str(TINY), f"--verify.key_dir={tmp_path / 'keys'}", "--out", str(tmp_path / "r")],
         "worker-1.pub is not a file"),
    ]
    for args, needle in cases:
        code, lines, _ = cli(monkeypatch, capsys, *args)
        assert code == 2 and len(lines) == 1 and needle in lines[0], (args, lines)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "keys", "run"]  # nothing made, nothing half-written
    (run / "report.html").mkdir()  # a report it cannot write
    code, lines, _ = cli(monkeypatch, capsys, "report", str(run))
    assert code == 2 and len(lines) == 1 and "Is a directory" in lines[0], lines
    # a temperature so small that logits / temperature overflowed softmax into NaN: it samples the argmax
    code, lines, out = cli(monkeypatch, capsys, "sample", str(run), "--temperature", "1e-45", "--tokens", "3")
    assert code == 0, lines


def test_a_resume_of_a_run_whose_manifest_was_edited_exits_2(tmp_path, monkeypatch, capsys):
    """It trained on under the edited config (the audit then refused the run): a run goes on only
    under the config its run id names."""
    from veriloco.run import train

    run = tmp_path / "run"
    train(tiny("--train.rounds=2"), str(run), quiet=True, stop_after=1)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["config"]["train"]["lr"] = 0.1
    (run / "manifest.json").write_text(json.dumps(manifest))
    code, lines, _ = cli(monkeypatch, capsys, "train", "--resume", str(run), "--quiet")
    assert code == 2 and lines == [f"veriloco: error: {run}/manifest.json was changed since the run started (it does "
                                   "not hash to its run id): a run goes on only under the config it started with"]
    assert len((run / "rounds.jsonl").read_text().splitlines()) == 1


def test_a_file_where_a_directory_must_go_exits_2_with_nothing_made(tmp_path, monkeypatch, capsys):
    """`--out` of train and export, and keygen's, at a file or under one: one line and exit 2 (each was
    exit 1, train's "training failed: [Errno 20] Not a directory", the others' a traceback), and
    no directory is left that the command made."""
    from veriloco.run import train

    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a directory\n")
    run = tmp_path / "run"
    train(tiny("--train.rounds=1", "--train.inner_steps=1"), str(run), quiet=True)
    before = sorted(tmp_path.rglob("*"))
    for args in (["train", str(TINY), "--out", str(a_file)],
                 ["train", str(TINY), "--out", str(a_file / "deeper" / "r")],
                 ["export", str(run), "--out", str(a_file / "x")],
                 ["keygen", "--out", str(a_file), "--workers", "2"],
                 ["keygen", "--out", str(a_file / "keys"), "--workers", "2"]):
        code, lines, _ = cli(monkeypatch, capsys, *args)
        assert code == 2 and len(lines) == 1 and "is a file" in lines[0] and str(a_file) in lines[0], (args, lines)
    assert sorted(tmp_path.rglob("*")) == before


def test_keygen_writes_no_key_into_a_directory_that_has_some(tmp_path, monkeypatch, capsys):
    """A second keygen for more workers refuses before writing any (it used to fail at the first
    existing key, after writing none, but at a later one after writing the first ones)."""
    keys = tmp_path / "keys"
    assert cli(monkeypatch, capsys, "keygen", "--out", str(keys), "--workers", "2")[0] == 0
    (keys / "worker-0.key").unlink()
    (keys / "worker-0.pub").unlink()
    before = {p.name: p.read_bytes() for p in keys.iterdir()}
    code, lines, _ = cli(monkeypatch, capsys, "keygen", "--out", str(keys), "--workers", "3")
    assert code == 2 and len(lines) == 1 and "worker-1.key already exists" in lines[0], lines
    assert {p.name: p.read_bytes() for p in keys.iterdir()} == before


def test_keygen_makes_one_workers_key_or_a_set_and_says_which_it_takes(tmp_path, monkeypatch, capsys):
    """`--worker W`: a party's own key alone (a set of keys made in one place is no good among
    parties that do not trust each other); `--workers N` and `--worker W` are one or the other."""
    keys = tmp_path / "keys"
    for args, message in ((["--workers", "2", "--worker", "1"], "keygen takes one of --workers N"),
                          ([], "keygen takes one of --workers N"),
                          (["--worker", "-1"], "--worker must be >= 0, got -1")):
        code, lines, _ = cli(monkeypatch, capsys, "keygen", "--out", str(keys), *args)
        assert code == 2 and len(lines) == 1 and message in lines[0], (args, lines)
    assert not keys.exists()
    assert cli(monkeypatch, capsys, "keygen", "--out", str(keys), "--worker", "3")[0] == 0
    assert sorted(p.name for p in keys.iterdir()) == ["worker-3.key", "worker-3.pub"]
    code, lines, _ = cli(monkeypatch, capsys, "keygen", "--out", str(keys), "--worker", "3")
    assert code == 2 and "worker-3.key already exists" in lines[0], lines
    assert cli(monkeypatch, capsys, "keygen", "--out", str(keys), "--worker", "1")[0] == 0  # another party's, beside it
    assert len(list(keys.iterdir())) == 4


def test_a_resume_without_a_workers_private_key_exits_2_before_it_claims_the_run(tmp_path, monkeypatch, capsys):
    keys = tmp_path / "keys"
    assert cli(monkeypatch, capsys, "keygen", "--out", str(keys), "--workers", "2")[0] == 0
    run = tmp_path / "r"
    assert cli(monkeypatch, capsys, "train", str(TINY), f"--verify.key_dir={keys}", "--out", str(run),
               "--stop-after", "1", "--quiet")[0] == 0
    (keys / "worker-1.key").rename(tmp_path / "elsewhere.key")
    before = (run / "rounds.jsonl").read_bytes()
    code, lines, _ = cli(monkeypatch, capsys, "train", "--resume", str(run))
    assert code == 2 and len(lines) == 1 and f"worker 1 runs here and verify.key_dir {keys} has no worker-1.key" in lines[0]
    assert (run / "rounds.jsonl").read_bytes() == before and not (run / ".lock").exists()


def test_the_module_entry_exits_2_in_one_line(tmp_path):
    """`python -m veriloco.cli` in its own interpreter: the exit code and the one line (the cases
    above run `main()` in this process)."""
    p = subprocess.run([sys.executable, "-m", "veriloco.cli", "train", str(TINY), "--train.foo=1", "--out",
                        str(tmp_path / "r")], capture_output=True, text=True, timeout=120)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "unknown key train.foo" in lines[0], p.stderr


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--stop-after", "1"], "--stop-after needs train.mode = 'diloco'"),
        (["--fault", "die:1@1"], "--fault needs train.mode = 'diloco'"),
        (["--run.membership=elastic"], "run.membership = 'elastic' needs train.mode = 'diloco'"),
        (["--adversary.1=noise"], "adversary.1: an attacker needs train.mode = 'diloco'"),  # (ran a clean baseline)
        (["--resume", "/tmp"], "--resume takes no config or overrides"),  # (was two lines and exit 1)
    ],
)
def test_train_refuses_what_it_would_ignore_in_one_line(extra, needle, tmp_path):
    from typer.testing import CliRunner

    from veriloco.cli import app

    res = CliRunner().invoke(app, ["train", str(TINY), "--train.mode=ddp", "--out", str(tmp_path / "r"), *extra])
    assert res.exit_code == 2, res.output
    assert len(res.stderr.splitlines()) == 1 and needle in res.stderr, res.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("n", ["0", "-1"])
def test_stop_after_below_one_round_exits_2_before_anything_is_written(n, tmp_path):
    from typer.testing import CliRunner

    from veriloco.cli import app

    # (it was "training failed: IndexError" with exit 1, after the run directory was made)
    res = CliRunner().invoke(app, ["train", str(TINY), "--out", str(tmp_path / "r"), "--stop-after", n])
    assert res.exit_code == 2 and "--stop-after must be a number of rounds >= 1" in res.stderr, res.output
    assert len(res.stderr.splitlines()) == 1 and not (tmp_path / "r").exists()


def test_a_key_dir_without_a_key_for_every_worker_exits_2(tmp_path):
    from typer.testing import CliRunner

    from veriloco.cli import app

    assert CliRunner().invoke(app, ["keygen", "--out", str(tmp_path / "keys"), "--workers", "2"]).exit_code == 0
    res = CliRunner().invoke(app, ["train", str(TINY), "--out", str(tmp_path / "r"), "--topology.workers=3",
                                   f"--verify.key_dir={tmp_path / 'keys'}"])
    assert res.exit_code == 2 and f"verify.key_dir {tmp_path / 'keys'} has neither worker-2.pub nor worker-2.key" \
        in res.stderr, res.output  # (was exit 1; then "worker-2.key does not exist", which named no .pub)
    assert len(res.stderr.splitlines()) == 1 and not (tmp_path / "r").exists()


@pytest.mark.parametrize("pub", [b"not a key\n", b"\xff\xfe\x00"])
def test_a_malformed_public_key_file_is_named_in_one_line(pub, tmp_path, monkeypatch, capsys):
    """(The second, not UTF-8, was "training failed: 'utf-8' codec can't decode ..." with exit 1;
    the first named no file.)"""
    keys = tmp_path / "keys"
    assert cli(monkeypatch, capsys, "keygen", "--out", str(keys), "--workers", "2")[0] == 0
    (keys / "worker-1.pub").write_bytes(pub)
    code, lines, _ = cli(monkeypatch, capsys, "train", str(TINY), "--out", str(tmp_path / "r"), f"--verify.key_dir={keys}")
    assert code == 2 and len(lines) == 1, lines
    assert f"public key file {keys / 'worker-1.pub'} is neither 64 hex characters nor a PEM public key" in lines[0]
    assert not (tmp_path / "r").exists()


def test_describe_lists_every_key():
    text = describe()
    for key in ("inner_steps", "[outer]", "nesterov", "max_packet_bytes", "eval_fraction"):
        assert key in text


def test_text_settings_stay_text_on_the_command_line():
    cfg = load_config(None, ["--ledger.contract=0x5FbDB2315678afecb367f032d93F642f64180aa3", "--run.seed=7"])
    assert cfg.ledger.contract == "0x5FbDB2315678afecb367f032d93F642f64180aa3" and cfg.run.seed == 7
    with pytest.raises(ConfigError, match="run.seed: expected int"):
        load_config(None, ["--run.seed=seven"])


def test_delay_1_at_high_outer_momentum_warns_and_runs_as_configured():
    from veriloco.config import config_warnings

    (line,) = config_warnings(tiny("--outer.delay=1"))
    assert "outer.momentum = 0.9" in line and "bench/delay_stability.py" in line
    cfg = tiny("--outer.delay=1")
    assert cfg.outer.momentum == 0.9  # a warning, not a change
    assert config_warnings(tiny("--outer.delay=1", "--outer.momentum=0.5")) == []
    assert config_warnings(tiny("--outer.delay=1", "--outer.correction=local", "--outer.lookahead=true")) == []
    assert config_warnings(tiny()) == []


def test_reset_inner_state_without_a_round_ramp_warns():
    from veriloco.config import config_warnings

    (line,) = config_warnings(tiny("--train.inner_state=reset"))
    assert "round_warmup_steps" in line and "bench/reset_ramp.py" in line
    assert config_warnings(tiny("--train.inner_state=reset", "--train.round_warmup_steps=2")) == []
    assert config_warnings(tiny("--train.inner_state=reset", "--train.mode=ddp")) == []


def test_the_adversary_key_names_every_builtin_attacker():
    from veriloco.verify.adversary import BUILTIN

    line = next(ln for ln in describe().splitlines() if "worker id -> attacker" in ln)
    assert all(kind in line for kind in BUILTIN), sorted(k for k in BUILTIN if k not in line)


def test_distance_replays_with_a_trace_of_several_hashes_warn_that_nothing_compares_it():
    from veriloco.config import config_warnings

    distance = ("--train.inner_state=reset", "--train.round_warmup_steps=2", "--train.inner_steps=20",
                "--verify.replay_probability=0.1", "--verify.replay_match=distance")
    (line,) = config_warnings(tiny(*distance))
    assert "hashes its whole inner state (params + AdamW moments, 3x the model) 3 times a round" in line
    assert "--verify.trace_every=0 hashes it twice" in line
    assert config_warnings(tiny(*distance, "--verify.trace_every=0")) == []
    assert config_warnings(tiny(*distance[:4])) == []  # exact replays compare every hash


def test_state_replays_under_a_codec_warn_about_their_traffic():
    from veriloco.config import config_warnings

    state = ("--train.inner_state=reset", "--train.round_warmup_steps=2", "--verify.replay_probability=0.38",
             "--verify.replay_extent=state", "--verify.trace_every=1")
    (line,) = config_warnings(tiny(*state, "--compress.codec=adaptive"))
    assert "1.1 model-sizes per worker-round" in line and "'adaptive'" in line
    assert config_warnings(tiny(*state)) == []  # fp32 packets: the states add to them, they do not dwarf them



@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--run.max_restarts=2"], "run.max_restarts needs run.membership = 'elastic'"),
        (["--run.membership=elastic", "--run.max_restarts=-1"], "run.max_restarts must be >= 0, got -1"),
    ],
)
def test_max_restarts_is_refused_where_it_would_mean_nothing(extra, needle, tmp_path):
    from typer.testing import CliRunner

    from veriloco.cli import app

    res = CliRunner().invoke(app, ["train", str(TINY), "--out", str(tmp_path / "r"), *extra])
    assert res.exit_code == 2 and len(res.stderr.splitlines()) == 1 and needle in res.stderr, res.output
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["prove", "RUN", "-1"], "No such option: -1 (see `veriloco prove --help`)"),  # (was click's usage box)
        (["prove", "RUN"], "Missing argument 'round'"),
        (["prove", "RUN", "x"], "Invalid value for 'round'"),
        (["nosuch"], "No such command 'nosuch'"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(argv, needle, monkeypatch, capsys):
    from veriloco.cli import main

    monkeypatch.setattr(sys, "argv", ["veriloco", *argv])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.splitlines()) == 1 and needle in err, err


def test_the_script_exits_0_after_a_command_that_succeeds(monkeypatch, capsys):
    from veriloco.cli import main

    monkeypatch.setattr(sys, "argv", ["veriloco", "config"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 0 and "[run]" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--link.shaping=tc"], "link.shaping must be 'emulated' or 'kernel', got 'tc'"),
        (["--link.shaping=kernel", "--link.bandwidth=10mbit"], "link.shaping = 'kernel' needs run.membership = 'elastic'"),
        (["--link.shaping=kernel", "--run.membership=elastic"], "link.shaping = 'kernel' needs a link.bandwidth"),
    ],
)
def test_kernel_shaping_is_refused_where_it_cannot_run(extra, needle, tmp_path):
    from typer.testing import CliRunner

    from veriloco.cli import app

    res = CliRunner().invoke(app, ["train", str(TINY), "--out", str(tmp_path / "r"), *extra])
    assert res.exit_code == 2 and len(res.stderr.splitlines()) == 1 and needle in res.stderr, res.output
    assert not (tmp_path / "r").exists()


def test_two_workers_with_an_attacker_or_a_robust_aggregator_warn_that_the_screen_has_no_centre():
    from veriloco.config import config_warnings

    (line,) = config_warnings(tiny("--adversary.1=sign_flip"))
    assert "topology.workers = 2" in line and "needs 3" in line and "--verify.replay_probability" in line
    (line,) = config_warnings(tiny("--verify.aggregator=median"))
    assert "topology.workers = 2" in line
    assert config_warnings(tiny("--adversary.1=sign_flip", "--topology.workers=3")) == []
    (line,) = config_warnings(tiny("--verify.aggregator=median", "--train.mode=ddp"))
    assert line.startswith("train.mode = 'ddp' ignores [verify]:")


def test_the_ddp_baseline_warns_of_the_sections_it_ignores():
    """`--train.mode=ddp` with a codec, verification, an outer optimizer or a ledger set ran a plain
    DDP baseline and said nothing; a line now names what it does not apply."""
    from veriloco.config import config_warnings

    assert config_warnings(tiny("--train.mode=ddp")) == []
    (line,) = config_warnings(tiny("--train.mode=ddp", "--compress.codec=int8", "--outer.lr=0.5", "--ledger.backend=none"))
    assert line.startswith("train.mode = 'ddp' ignores [outer], [compress], [ledger]: the DDP baseline all-reduces")
    assert config_warnings(tiny("--compress.codec=int8", "--outer.lr=0.5")) == []
