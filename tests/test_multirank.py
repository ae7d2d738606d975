"""Two ranks on CPU over gloo (torchrun): identical parameters at the end, one metrics line per step.

Each rank samples its own disjoint shard of the prompts (nanorl/data.py PromptLoader, tested in
tests/test_data.py) and GRPO groups never cross ranks; loss denominators and gradients are summed over
ranks, so both ranks apply the same update. train.py itself all-gathers a checksum of every
parameter at the end and raises if the ranks differ.
"""
import json
import os
import subprocess
import sys

from nanorl.task import make_default


def test_two_ranks_stay_identical(tmp_path):
    task = make_default(str(tmp_path / "task"), seed=0)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
           "train.py", "--model", task["model"], "--train-data", task["train"], "--test-data", task["test"],
           "--steps", "3", "--prompts-per-step", "8", "--samples-per-prompt", "4", "--eval-every", "0",
           "--eval-limit", "16", "--quiet", "--threads", "1", "--out-dir", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, cwd=os.path.dirname(os.path.dirname(__file__)), env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ranks in sync: parameters identical on 2 ranks" in res.stdout
    lines = [json.loads(x) for x in open(out / "metrics.jsonl")]
    steps = [x["step"] for x in lines if "loss" in x]
    assert steps == [1, 2, 3]  # logged once, by rank 0
    assert res.stdout.count("accuracy after:") == 1
