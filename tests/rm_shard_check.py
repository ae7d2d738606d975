"""Run by tests/test_reward_models.py under a 2-process launcher: does a reward model sharded over the
ranks (--fsdp) score what the unsharded one scores, when the ranks hold different numbers of samples?

    torchrun --nproc_per_node 2 tests/rm_shard_check.py RM_DIR

Each rank loads RM_DIR twice, whole and sharded (FSDP2), with a small token budget so that the ranks
need different numbers of micro-batches: rank 0 scores 7 samples, rank 1 two, then rank 0 three and
rank 1 none. Prints one line per rank: "rank R max|Δscore| X held F" (F: its share of the weights).
"""
import sys

import torch

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])
from nanorl import distributed  # noqa: E402
from nanorl.reward_models import RewardModel  # noqa: E402

path = sys.argv[1]
torch.set_num_threads(1)
rank, world, device = distributed.init()
whole = RewardModel(path, device, max_tokens_per_batch=24)
sharded = RewardModel(path, device, max_tokens_per_batch=24, shard=True)
texts = ["16", "7", "", "123456789", "27", "3", "10-1", "0", "99", "5"]
calls = [(texts[:7], texts[7:]), (texts[3:6], [])]
diff = 0.0
for ours in (c[rank] for c in calls):
    prompts = ["3+4+9="] * len(ours)
    got, want = sharded.score(prompts, ours), whole.score(prompts, ours)
    assert len(got) == len(ours)
    diff = max([diff] + [abs(a - b) for a, b in zip(got, want)])
params = list(sharded.model.parameters())
local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)  # this rank's share
held = local / sum(p.numel() for p in whole.model.parameters())
print(f"\nrank {rank} max|Δscore| {diff:.3e} held {held:.3f}", flush=True)
distributed.end_process()  # without the teardown that can abort a gloo rank at exit
