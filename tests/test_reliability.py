"""Reliability: atomic checkpoints, exact resume, signals, and faults that must not end a run.

Every run here is tiny (4 prompts x 4 samples, naive logprobs, a reward with signal in every group)
and goes through `train.main` in-process, except the two signal tests, which need a real process
to kill. Run: python -m pytest tests/test_reliability.py -q
"""
import errno
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import train
from nanorl import build, checkpoint, ckpt_atomic, logger, update
from nanorl.checkpoint import CheckpointError
from nanorl.config import ConfigError, parse_args
from nanorl.logger import RunDirError
from nanorl.rollout import HFEngine
from nanorl.task import make_default

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A reward with variance in every group whatever the model says, so every step really trains.
DIGITS = "def digits(prompt, response, label):\n    return sum(c.isdigit() for c in response) / 4\n"
FAULTY = '''import math, os, sys, time
def faulty(prompt, response, label):
    if label == "raise": raise RuntimeError("boom")
    if label == "nan": return math.nan
    if label == "none": return None
    if label == "str": return "1.0"
    if label == "nested": return {"a": {"b": 1.0}}
    if label == "exit": sys.exit(3)
    if label == "hang": time.sleep(60)
    if label == "crash": os._exit(1)
    return 1.0
'''


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    d = tmp_path_factory.mktemp("task")
    paths = make_default(str(d), seed=0, sft_steps=5)
    (d / "digits.py").write_text(DIGITS)
    paths["reward"] = f"{d / 'digits.py'}:digits"
    return paths


def args(task, out, *extra):
    return ["--model", task["model"], "--train-data", task["train"], "--test-data", task["test"],
            "--reward", task["reward"], "--prompts-per-step", "4", "--samples-per-prompt", "4",
            "--eval-every", "0", "--eval-limit", "8", "--pass-k", "2", "--logprob-impl", "naive",
            "--warmup-steps", "1", "--lr", "1e-3", "--quiet", "--threads", "1", "--out-dir", str(out), *extra]


def train_lines(out) -> list[dict]:
    """The per-step training metrics of a run, without wall-clock figures."""
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return [{k: v for k, v in r.items() if not k.startswith(("perf/", "eval/"))}
            for r in rows if "rollout/reward_mean" in r]


def ckpt(out, step):
    return os.path.join(out, "checkpoints", f"step_{step:06d}")


# ----------------------------------------------------------------------------- exact resume


def test_exact_resume_ppo_with_critic_kl_and_eval(task, tmp_path):
    """2N steps == N steps + resume + N steps, metric by metric and weight by weight. PPO covers the
    critic and GAE, --kl-target the adaptive KL controller, --mini-batches the per-step shuffle, and
    --eval-every 1 evaluates at different steps in the two runs (it must not shift the RNG)."""
    # A constant schedule: a cosine one depends on the planned total (--steps), so a 2-step run is not
    # the first half of a 4-step run (an interrupted 4-step run is: the SIGTERM test below).
    extra = ("--algo", "ppo", "--kl-coef", "0.01", "--kl-target", "0.05", "--mini-batches", "2",
             "--eval-every", "1", "--save-every", "1", "--keep-checkpoints", "2", "--schedule", "constant")
    a, b = tmp_path / "a", tmp_path / "b"
    train.main(args(task, a, "--steps", "4", *extra))
    train.main(args(task, b, "--steps", "2", *extra))
    res = train.main(args(task, b, "--steps", "4", "--resume", "latest", *extra))
    assert res["step"] == 4
    la, lb = train_lines(a), train_lines(b)
    assert [r["step"] for r in lb] == [1, 2, 3, 4]  # the resumed log has no duplicated step
    assert la == lb
    assert all(r["train/grad_norm"] > 0 for r in la) and len({r["rollout/reward_mean"] for r in la}) > 1
    assert la[-1]["train/kl_beta"] != 0.01  # the adaptive controller moved, and its state was resumed
    assert sorted(os.listdir(b / "checkpoints")) == ["step_000003", "step_000004"]  # last K kept
    wa = checkpoint.load_file(os.path.join(ckpt(a, 4), "model.safetensors"))
    wb = checkpoint.load_file(os.path.join(ckpt(b, 4), "model.safetensors"))
    w0 = checkpoint.load_file(os.path.join(task["model"], "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa) and not all(torch.equal(wa[k], w0[k]) for k in wa)
    sa = json.load(open(os.path.join(ckpt(a, 4), "trainer_state.json")))
    sb = json.load(open(os.path.join(ckpt(b, 4), "trainer_state.json")))
    for key in ("loader", "kl_ctl", "counters", "reward_faults"):
        assert sa[key] == sb[key], key
    ra, rb = (torch.load(os.path.join(ckpt(o, 4), "trainer_state.pt"), weights_only=True)["rng"][0]
              for o in (a, b))
    assert torch.equal(ra["engine"], rb["engine"]) and ra["python"] == rb["python"]


# ----------------------------------------------------------------------------- checkpoint files


@pytest.fixture(scope="module")
def saved(task, tmp_path_factory):
    """A 3-step run with a checkpoint after every step."""
    out = tmp_path_factory.mktemp("saved")
    train.main(args(task, out, "--steps", "3", "--save-every", "1", "--keep-checkpoints", "3"))
    return out


def copy_run(saved, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(saved, out)
    return out


def setup_run(task, out, *extra):
    return train.setup(parse_args(args(task, out, "--steps", "10", "--resume", "latest", *extra)))


def test_checkpoint_is_hf_loadable_and_holds_the_whole_state(saved):
    from transformers import AutoModelForCausalLM
    path = ckpt(saved, 3)
    files = set(checkpoint.verify(path)["files"])
    assert {"model.safetensors", "config.json", "trainer_state.json", "trainer_state.pt"} <= files
    model = AutoModelForCausalLM.from_pretrained(path)
    saved_w = checkpoint.load_file(os.path.join(path, "model.safetensors"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved_w.items())
    state = json.load(open(os.path.join(path, "trainer_state.json")))
    assert state["step"] == 3 and state["loader"] == {"epoch": 0, "pos": 12}
    assert state["config"]["steps"] == 3 and "skipped_updates" in state["counters"]
    # tensors + plain containers only
    rest = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=True)
    assert set(rest["rng"][0]) >= {"python", "numpy", "torch", "engine"}
    assert float(rest["optimizer"]["state"][0]["step"]) == 3.0 and rest["scheduler"]["last_epoch"] == 3


def corrupt(path, kind):
    if kind == "flipped_byte":
        p = os.path.join(path, "model.safetensors")
        data = bytearray(open(p, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(p, "wb").write(bytes(data))
    elif kind == "truncated":
        p = os.path.join(path, "trainer_state.pt")
        os.truncate(p, os.path.getsize(p) // 2)
    elif kind == "no_manifest":  # as if the save died before its last file
        os.remove(os.path.join(path, checkpoint.MANIFEST))
    elif kind == "garbage_manifest":
        open(os.path.join(path, checkpoint.MANIFEST), "w").write("{not json")
    elif kind == "missing_file":
        os.remove(os.path.join(path, "trainer_state.json"))


@pytest.mark.parametrize("kind", ["flipped_byte", "truncated", "no_manifest", "garbage_manifest",
                                  "missing_file"])
def test_corrupt_checkpoint_is_skipped_for_the_previous(task, saved, tmp_path, kind, capsys):
    out = copy_run(saved, tmp_path)
    corrupt(ckpt(out, 3), kind)
    run = setup_run(task, out)
    try:
        assert train.resume_run(run, "latest") == ckpt(out, 2)
        assert run.step == 2 and run.loader.state_dict() == {"epoch": 0, "pos": 8}
        assert "skipping checkpoint" in capsys.readouterr().out
        with pytest.raises(CheckpointError, match="step_000003"):  # named explicitly: an error, no fallback
            train.resume_run(run, ckpt(out, 3))
        for s in (1, 2):
            corrupt(ckpt(out, s), kind)
        with pytest.raises(CheckpointError, match="no valid checkpoint"):
            train.resume_run(run, "latest")
    finally:
        run.logger.close()


def test_resume_latest_without_checkpoint_starts_fresh_and_mismatch_is_clear(task, saved, tmp_path):
    run = setup_run(task, tmp_path / "empty")
    try:
        assert train.resume_run(run, "latest") is None and run.step == 0
    finally:
        run.logger.close()
    run = setup_run(task, copy_run(saved, tmp_path), "--algo", "ppo")  # a critic the checkpoint lacks
    try:
        with pytest.raises(CheckpointError, match="has no critic"):
            train.resume_run(run, "latest")
    finally:
        run.logger.close()


@pytest.mark.parametrize("where", ["trainer_state", "model_weights"])
def test_disk_full_keeps_previous_checkpoint(task, saved, tmp_path, monkeypatch, where):
    out = copy_run(saved, tmp_path)
    run = setup_run(task, out)
    try:
        train.resume_run(run, "latest")
        before = open(os.path.join(ckpt(out, 3), checkpoint.MANIFEST)).read()

        def full(*a, **k):
            raise OSError(errno.ENOSPC, "No space left on device")
        if where == "trainer_state":
            monkeypatch.setattr(ckpt_atomic, "write_json", full)
        else:
            monkeypatch.setattr(run.model, "save_pretrained", full)
        for step in (4, 3):  # a new step, and the same step again (which replaces by rename)
            run.step = step
            with pytest.raises(CheckpointError, match="No space left.*previous checkpoint"):
                checkpoint.save(train.checkpoint_state(run), run.cfg, run.logger)
        monkeypatch.undo()
        names = os.listdir(out / "checkpoints")
        assert sorted(names) == ["step_000001", "step_000002", "step_000003"]  # no temp dir left
        assert open(os.path.join(ckpt(out, 3), checkpoint.MANIFEST)).read() == before
        checkpoint.verify(ckpt(out, 3))
        assert train.resume_run(run, "latest") == ckpt(out, 3)
    finally:
        run.logger.close()


# ----------------------------------------------------------------------------- signals (subprocesses)


@pytest.fixture
def spawn(task):
    """Start train.py in a subprocess (up to 1000 steps); whatever is still running is killed after."""
    procs = []

    def start(out, *extra, env=None):
        env = {**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
               **(env or {})}
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(REPO, "train.py"), *args(task, out, "--steps", "1000", *extra)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        return procs[-1]
    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.communicate()


def wait_for(cond, proc, timeout=120.0):
    end = time.time() + timeout
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"train.py exited early ({proc.returncode}):\n{proc.stdout.read()[-3000:]}")
        if time.time() > end:
            raise AssertionError("timed out waiting for train.py")
        time.sleep(0.05)


def test_sigterm_finishes_step_saves_and_resumes(task, tmp_path, spawn):
    out = tmp_path / "run"
    proc = spawn(out)
    metrics = out / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and "rollout/reward_mean" in metrics.read_text(), proc)
    proc.send_signal(signal.SIGTERM)
    text, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, text[-3000:]
    assert "--resume latest" in text
    step = max(s for s, _ in checkpoint.list_checkpoints(str(out / "checkpoints")))
    checkpoint.verify(ckpt(out, step))
    assert [r["step"] for r in train_lines(out)] == list(range(1, step + 1))  # the step was finished
    res = train.main(args(task, out, "--steps", str(step + 1), "--resume", "latest"))
    assert res["step"] == step + 1
    assert [r["step"] for r in train_lines(out)] == list(range(1, step + 2))


def test_sigkill_while_saving_leaves_previous_checkpoint(task, tmp_path, spawn):
    out = tmp_path / "run"
    root = out / "checkpoints"
    proc = spawn(out, "--save-every", "2", env={checkpoint.PAUSE_ENV: "1.5"})
    # NANORL_CHECKPOINT_PAUSE holds every save between its weights and its manifest: kill it there,
    # after at least one checkpoint is complete.
    half = lambda: [n for n in os.listdir(root) if n.startswith(".tmp-")
                    and os.path.exists(root / n / "model.safetensors")] if root.exists() else []
    wait_for(lambda: checkpoint.list_checkpoints(str(root)) and half(), proc)
    proc.kill()  # SIGKILL: no handler, no cleanup, mid-save
    proc.communicate(timeout=60)
    dead = int(half()[0].split("_")[1].split("-")[0])
    good = [s for s, _ in checkpoint.list_checkpoints(str(root))]
    assert good[0] == dead - 2 and not (root / f"step_{dead:06d}").exists()
    run = setup_run(task, out)
    try:
        assert train.resume_run(run, "latest") == ckpt(out, good[0]) and run.step == good[0]
        # steps logged after that checkpoint died with the process: the log is cut back to it
        assert [r["step"] for r in train_lines(out)] == list(range(1, good[0] + 1))
        # the next save clears the dead one's leftovers
        checkpoint.save(train.checkpoint_state(run), run.cfg, run.logger)
        assert not [n for n in os.listdir(root) if n.startswith(".")]
    finally:
        run.logger.close()


# ----------------------------------------------------------------------------- faults


def test_reward_faults_keep_the_run_going_and_are_counted(task, tmp_path, capsys):
    kinds = ["ok", "raise", "nan", "none", "str", "nested", "exit", "hang", "crash"]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": k}) + "\n"
                            for i, k in enumerate(kinds)))
    test = tmp_path / "test.jsonl"
    test.write_text(json.dumps({"prompt": "1+2=", "answer": "ok"}) + "\n")
    (tmp_path / "faulty.py").write_text(FAULTY)
    out = tmp_path / "run"
    t0 = time.time()
    res = train.main(args(task, out, "--steps", "1", "--train-data", str(data), "--test-data", str(test),
                          "--prompts-per-step", "9", "--samples-per-prompt", "2", "--reward-timeout", "0.5",
                          "--reward", f"{tmp_path / 'faulty.py'}:faulty"))
    assert res["step"] == 1 and time.time() - t0 < 60
    line = train_lines(out)[0]
    faults = {k.split("/", 2)[2]: v for k, v in line.items() if k.startswith("rollout/reward_faults/")}
    assert faults == {"RuntimeError": 2, "ValueError": 2, "TypeError": 6, "SystemExit": 2, "Timeout": 2,
                      "WorkerCrash": 2}
    # the 16 faulted samples left the step (status reward_fault): what trains is the two "ok" samples
    assert line["rollout/dropped/reward_fault"] == 16
    assert line["rollout/dropped_frac"] == pytest.approx(16 / 18)
    assert line["rollout/reward_mean"] == 1.0
    assert capsys.readouterr().out.count("reward function failed") == 1  # first traceback only


def weight_changes(monkeypatch) -> list[bool]:
    """Whether each optimizer step (update.sync_and_step) changed a parameter, filled as the run goes."""
    step, changed = update.sync_and_step, []

    def watched(run, params):
        before = [p.detach().clone() for p in params]
        norm = step(run, params)
        changed.append(any(not torch.equal(b, p) for b, p in zip(before, params)))
        return norm
    monkeypatch.setattr(update, "sync_and_step", watched)
    return changed


def test_non_finite_gradient_skips_the_update(task, tmp_path, monkeypatch):
    micro = update.micro_step

    def nan_loss(run, *a):
        loss, m = micro(run, *a)
        return (loss * math.nan if run.step == 1 else loss), m

    monkeypatch.setattr(update, "micro_step", nan_loss)
    changed = weight_changes(monkeypatch)
    out = tmp_path / "run"
    res = train.main(args(task, out, "--steps", "3"))
    assert changed == [True, False, True]
    assert res["counters"]["skipped_updates"] == 1
    lines = train_lines(out)
    assert [r["train/skipped_updates"] for r in lines] == [0, 1, 1]
    assert math.isnan(lines[1]["train/grad_norm"]) and math.isfinite(lines[2]["train/grad_norm"])


# issue 47: the guard is nanorl/update.py's (train_on: NaN the gradients of a non-finite loss, so that
# sync_and_step's norm check skips the step on every rank)
def test_non_finite_loss_with_finite_gradients_skips_the_update(task, tmp_path, monkeypatch):
    """A NaN loss whose gradients are finite (a NaN outside the graph: a NaN clamp bound, a user loss
    adding a detached NaN term) must not reach the weights either — the norm check alone lets it by."""
    micro = update.micro_step

    def nan_loss(run, *a):
        loss, m = micro(run, *a)
        if run.step != 1:
            return loss, m
        return loss + math.nan, {**m, "loss": m["loss"] + math.nan}  # the value NaN, the gradient untouched

    monkeypatch.setattr(update, "micro_step", nan_loss)
    changed = weight_changes(monkeypatch)
    out = tmp_path / "run"
    res = train.main(args(task, out, "--steps", "3"))
    lines = train_lines(out)
    assert math.isnan(lines[1]["train/loss"]) and math.isfinite(lines[2]["train/loss"])
    assert changed == [True, False, True]
    assert res["counters"]["skipped_updates"] == 1
    assert [r["train/skipped_updates"] for r in lines] == [0, 1, 1]


def test_engine_sync_failure_is_a_clear_error(task, tmp_path, monkeypatch):
    def broken(self, model, version):
        if version == 2:
            raise ConnectionError("engine went away")
    monkeypatch.setattr(HFEngine, "update_weights", broken)
    with pytest.raises(RuntimeError, match="step 2: the hf engine failed to load the new weights.*went away"):
        train.main(args(task, tmp_path / "run", "--steps", "3"))


def test_safety_nothing_unpickled_nothing_executed(tmp_path):
    src = open(checkpoint.__file__).read()
    loads = re.findall(r"torch\.load\(.*", src)  # every call, to the end of its line
    assert "pickle" not in src.replace("unpickled",
                                       "") and loads and all("weights_only=True" in c for c in loads)
    from nanorl import rewards
    marker = tmp_path / "pwned"
    evil = f"__import__('os').system('touch {marker}')"
    runner = rewards.RewardRunner(rewards.math_format)
    runner([evil], [evil + " \\boxed{" + evil + "}"], [evil])
    assert not marker.exists() and not runner.faults
    with pytest.raises(ValueError, match="expected one of"):
        rewards.load_reward_fn(evil)  # a reward is code only when named as module:function / file.py:function


# ----------------------------------------------------------------------------- the run directory


def run_dir_state(out) -> dict:
    """Every file of a run directory with its bytes (what a refused run must leave as it was)."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name != logger.LOCK_FILE}  # the lock file names its last claimant


def test_a_new_run_in_an_earlier_runs_out_dir_is_refused_and_nothing_is_lost(task, saved, tmp_path):
    out = copy_run(saved, tmp_path)
    before = run_dir_state(out)
    rows = len(open(out / "metrics.jsonl").readlines())
    for extra in ((), ("--resume", str(tmp_path / "elsewhere" / "checkpoints" / "step_000002"))):
        earlier = rf"holds an earlier run \(metrics.jsonl \({rows} rows\), 3 checkpoints\)"
        with pytest.raises(RunDirError, match=earlier):
            train.main(args(task, out, "--steps", "2", *extra))
    assert run_dir_state(out) == before  # not one byte truncated, no checkpoint rotated away
    # --resume latest continues it; --overwrite starts over, with nothing of the earlier run left
    res = train.main(args(task, out, "--steps", "1", "--overwrite"))
    assert res["step"] == 1 and [r["step"] for r in train_lines(out)] == [1]
    assert sorted(os.listdir(out / "checkpoints")) == ["step_000001"]
    logger.claim_run_dir(str(out), "latest").release()  # the run's end released its lock


def test_a_second_run_on_a_locked_out_dir_is_refused(task, tmp_path, spawn):
    out = tmp_path / "run"
    proc = spawn(out)
    metrics = out / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and "rollout/reward_mean" in metrics.read_text(), proc)
    # even as a resume (which an earlier run's directory allows): the first run is still writing there
    with pytest.raises(RunDirError, match=rf"is in use by another run \(pid {proc.pid} on "):
        train.main(args(task, out, "--steps", "1", "--resume", "latest"))
    wait_for(lambda: len(train_lines(out)) >= 2, proc)  # the first run goes on, its log its own
    proc.kill()
    proc.communicate(timeout=60)
    steps = [r["step"] for r in train_lines(out)]
    assert steps == list(range(1, len(steps) + 1))
    logger.claim_run_dir(str(out), "latest").release()  # a killed run leaves no lock behind


def test_resume_with_another_lr_applies_it(task, saved, tmp_path, monkeypatch, capsys):
    """The schedule continues from the new base rate at the restored step, exactly as a run started
    with it would run there (not the checkpoint's base rate restored with the optimizer)."""
    out = copy_run(saved, tmp_path)
    used, step = [], update.sync_and_step

    def watched(run, params):
        used.append([g["lr"] for g in run.optimizer.param_groups])
        return step(run, params)
    monkeypatch.setattr(update, "sync_and_step", watched)
    argv = args(task, out, "--steps", "5", "--resume", "latest", "--lr", "5e-4")
    train.main(argv)
    cfg = parse_args(argv)
    assert cfg.lr == 5e-4 and cfg.optim.schedule == "cosine" and cfg.optim.warmup_steps == 1
    assert used == [[5e-4 * build.lr_factor(cfg, 3)], [5e-4 * build.lr_factor(cfg, 4)]]  # steps 4 and 5
    assert [r["train/lr"] for r in train_lines(out)][3:] == [5e-4 * build.lr_factor(cfg, s) for s in (4, 5)]
    assert "--lr 0.0005 applied (the checkpoint's run had 0.001)" in capsys.readouterr().out


def test_adam_flags_reach_the_optimizer_and_a_resume(task, saved, tmp_path, monkeypatch):
    """--adam-beta1/--adam-beta2/--adam-eps/--weight-decay set AdamW's groups at start, and a resume
    that names other values trains with them (the restored groups would carry the checkpoint's)."""
    out = copy_run(saved, tmp_path)
    seen, step = [], update.sync_and_step

    def watched(run, params):
        seen.append([(g["betas"], g["eps"], g["weight_decay"]) for g in run.optimizer.param_groups])
        return step(run, params)
    monkeypatch.setattr(update, "sync_and_step", watched)
    fresh = train.setup(parse_args(args(task, tmp_path / "fresh", "--adam-beta1", "0.8", "--adam-beta2",
                                        "0.95", "--adam-eps", "1e-6")))
    assert [(g["betas"], g["eps"]) for g in fresh.optimizer.param_groups] == [((0.8, 0.95), 1e-6)]
    fresh.logger.close()
    fresh.rewards.close()
    train.main(args(task, out, "--steps", "4", "--resume", "latest", "--adam-beta1", "0.5", "--adam-beta2",
                    "0.9", "--adam-eps", "1e-5", "--weight-decay", "0.1"))
    assert seen == [[((0.5, 0.9), 1e-5, 0.1)]]
    with pytest.raises(ConfigError, match=r"adam_beta2 must be in \[0, 1\), got 1.0"):
        parse_args(["--adam-beta2", "1"])
