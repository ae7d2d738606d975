"""Run by tests/test_multirank.py under a 2-process launcher: is the DDP (or FSDP) gradient the
gradient one process computes on the whole batch?

    torchrun --nproc_per_node 2 tests/ddp_check.py MODEL TRAIN TEST OUT [extra train.py flags, e.g. --fsdp]

Both ranks build the same run and sample the same 16 responses (same seed). The reference: the whole
batch's gradient on a plain copy of the model loaded from the same path, no wrapper, one process.
Then each rank takes half of the rows through the wrapped `run.trained` exactly as nanorl/update.py
does (global denominators, loss_scale, no_sync on all but the last micro-batch). After the synced
backward every rank must hold the reference gradient (FSDP: its shards, gathered in full here).
Prints one line per rank: "rank R max|Δgrad| X max|grad| Y".
"""
import sys

import torch

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])
import functools  # noqa: E402

import train  # noqa: E402
from nanorl import distributed, lora, moe_replay, scoring, update  # noqa: E402
from nanorl.config import parse_args  # noqa: E402
from nanorl.policy import ValueModel, load_model  # noqa: E402
from nanorl.rollout import SamplingConfig, stop_token_ids  # noqa: E402
from nanorl.trajectory import collate  # noqa: E402

model, train_data, test_data, out, *extra = sys.argv[1:]
cfg = parse_args(["--model", model, "--train-data", train_data, "--test-data", test_data, "--out-dir", out,
                  "--max-new-tokens", "6", "--threads", "1", "--quiet", *extra])
run = train.setup(cfg)
rank, world = run.rank, run.world
prompts = run.loader.prompts[:4]  # the same 4 prompts on every rank
samples = run.engine.generate([p.ids for p in prompts], 4, SamplingConfig(
    max_new_tokens=6, stop_token_ids=stop_token_ids(run.model, run.tokenizer), seed=123))
for i, s in enumerate(samples):
    s.reward = float(i % 3 == 0)
batch = collate(samples, run.tokenizer.pad_token_id)
with torch.no_grad():
    if run.ref is not None:
        batch.tensors.ref_logprobs = run.ref(batch, None)[0]
    old, _, values = run.trained(batch, None)
    batch.tensors.old_logprobs = old - 0.05
    if values is not None:
        batch.tensors.old_values = values + 0.1
gen = torch.Generator().manual_seed(7)
batch.tensors.advantages = torch.randn(batch.rollout_logprobs.shape, generator=gen)
batch.tensors.returns = torch.randn(batch.rollout_logprobs.shape, generator=gen)
lcfg = update.loss_config(run)
params = [p for g in run.optimizer.param_groups for p in g["params"]]


def denominators(b):
    return float((b.response_mask > 0).sum()), float((b.response_mask > 0).any(-1).sum())


# Reference: the whole batch on this process alone, on a plain model loaded from the same path.
wrapped = run.trained
policy = load_model(cfg.model)[0]
if cfg.memory.routing_replay:  # MoE: replay the rollout's experts in the reference forward too
    moe_replay.patch(policy)
if cfg.lora.rank:  # LoRA: the same adapters (A is randomly initialised), the base frozen
    from peft import get_peft_model_state_dict
    lora.apply(policy, cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.target_modules)
    lora.load_adapters(policy, get_peft_model_state_dict(lora.peft_of(run.model)))
critic = ValueModel(policy) if run.critic is not None else None
run.trained, run.world = distributed.Trained(policy, critic, functools.partial(scoring.forward, cfg)), 1
loss, _ = update.micro_step(run, batch, lcfg, *denominators(batch))
loss.backward()
# what the optimizer holds (LoRA: the adapters only)
reference = [p for p in list(policy.parameters()) + (list(critic.parameters()) if critic else [])
             if p.requires_grad]
reference = [p.grad if p.grad is not None else torch.zeros_like(p) for p in reference]  # unused: no grad

# DDP / FSDP: this rank's half, in two micro-batches, global denominators, one synced backward; twice,
# as a training loop would (DDP reports parameters left without a gradient only in the NEXT step).
run.trained, run.world = wrapped, world
mine = batch.select(list(range(rank, len(samples), world)))
n_tok, n_seq = distributed.all_reduce(torch.tensor(denominators(mine))).tolist()
groups = [[0, 1, 2], list(range(3, len(samples) // world))]
diff = 0.0
for _ in range(2):
    run.optimizer.zero_grad(set_to_none=True)
    for i, rows in enumerate(groups):
        with distributed.sync_gradients_after(run.trained, last=i == len(groups) - 1):
            loss, _ = update.micro_step(run, mine.select(rows), lcfg, n_tok, n_seq)
            (loss * distributed.loss_scale(world)).backward()
    full = [torch.zeros(p.shape) if p.grad is None else p.grad.full_tensor() if hasattr(p.grad, "full_tensor")
            else p.grad for p in params]  # FSDP: shards gathered
    assert len(full) == len(reference) and all(f.shape == r.shape for f, r in zip(full, reference))
    diff = max([diff] + [float((f - r).abs().max()) for f, r in zip(full, reference)])
scale = max(float(r.abs().max()) for r in reference)
held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)  # this rank's share
print(f"\nrank {rank} max|Δgrad| {diff:.3e} max|grad| {scale:.3e} held "
      f"{held / sum(r.numel() for r in reference):.3f}",
      flush=True)
distributed.end_process()  # without the teardown that can abort a gloo rank at exit
