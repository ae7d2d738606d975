"""Run by tests/test_multirank.py under a 2-process launcher: does --fsdp read the checkpoint into
host memory on rank 0 alone, and does every rank still start from the checkpoint's values?

    torchrun --nproc_per_node 2 tests/fsdp_load_check.py MODEL DATA OUT [extra train.py flags]

train.setup runs as train.py runs it, with two functions observed (nanorl/build.py `load_policy`,
nanorl/distributed.py `receive_from_rank0`): whether the policy `load_policy` returns holds its
parameters on the meta device, and whether each module handed to `receive_from_rank0` (the HF
engine's copy, the reference, policy + critic) holds them there before it is filled. Not the
resident memory: from_pretrained maps the safetensors file, so even the reading rank's RSS grows by
a few MB over the load (measured: 6 MB for a 96 MiB model) and tells nothing. After set-up, every
tensor of the policy, critic, reference and engine copy is gathered in full and compared bit for bit
with the checkpoint's safetensors file (the reference and the engine copy: its cast to the compute
dtype; the critic's body: the policy's body, its head zero), every buffer and every tie (the
embeddings) with a model loaded from the path. Each rank writes what it saw to
OUT/fsdp_load_rank{R}.json (a file: two ranks' printed lines can interleave).
"""
import json
import os
import sys

import torch

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])
import train  # noqa: E402
from nanorl import build, distributed  # noqa: E402
from nanorl.config import parse_args  # noqa: E402
from nanorl.policy import load_model  # noqa: E402


def tied(module: torch.nn.Module, prefix: str = "") -> list[list[str]]:
    """The parameter names of `module` that are one tensor (tied embeddings), in groups, each name
    given `prefix`."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(prefix + name)
    return sorted(sorted(group) for group in names.values() if len(group) > 1)


def local(p: torch.Tensor) -> torch.Tensor:
    # a DTensor's own shard
    return p.to_local() if hasattr(p, "to_local") else p


model, data, out, *extra = sys.argv[1:]
cfg = parse_args(["--model", model, "--train-data", data, "--test-data", data, "--out-dir", out,
                  "--threads", "1", "--quiet", "--fsdp", "--engine", "hf", *extra])
seen: dict = {"received": []}
load_policy, receive_from_rank0 = build.load_policy, distributed.receive_from_rank0


def observed_load_policy(cfg, device, dtype):
    policy, tokenizer = load_policy(cfg, device, dtype)
    seen["policy_on_meta"] = sorted({p.is_meta for p in policy.parameters()})
    return policy, tokenizer


def observed_receive(module, device, full=None):
    # [True]: every parameter on the meta device; [False]: none
    seen["received"].append((type(module).__name__,
                             sorted({local(p).is_meta for p in module.parameters()})))
    return receive_from_rank0(module, device, full)


build.load_policy, distributed.receive_from_rank0 = observed_load_policy, observed_receive
run = train.setup(cfg)
build.load_policy, distributed.receive_from_rank0 = load_policy, receive_from_rank0

from safetensors.torch import load_file  # noqa: E402

saved = load_file(os.path.join(model, "model.safetensors"))
plain = load_model(model)[0]
# the tied lm_head is not in the file: the loaded model's is the file's embedding
known = {**plain.state_dict(), **saved}
buffers = dict(plain.named_buffers())
modules = {"trained": run.trained, "reference": run.ref, "engine": run.engine.model}


def plain_name(name: str) -> str:
    """The plain model's name for a tensor of policy + critic (Trained), the reference or the engine."""
    if name.startswith("critic.body."):
        return "model." + name[len("critic.body."):]
    return name[len("policy."):] if name.startswith("policy.") else name


mismatch, compared, policy_names = [], 0, set()
for what, module in modules.items():
    if module is None:
        continue
    dtype = torch.float32 if what == "trained" else run.trained.compute_dtype
    for name, value in distributed.iter_full_tensors(module):
        # PPO's value head starts at zero; everything else is the checkpoint, in the module's dtype
        want = (torch.zeros_like(value) if name.startswith("critic.head.")
                else known[plain_name(name)].to(dtype))
        compared += 1
        if what == "trained" and name.startswith("policy."):
            policy_names.add(plain_name(name))
        if value.dtype != want.dtype or not torch.equal(value, want):
            mismatch.append(f"{what}:{name}")
    # the same ties as the loaded model (a broken tie would train two tensors where rank 0 trains one)
    compared += 1
    if tied(distributed.unwrap(module)) != tied(plain, "" if what == "engine" else "policy."):
        mismatch.append(f"{what}: ties {tied(distributed.unwrap(module))}")
    for name, buf in distributed.unwrap(module).named_buffers():
        compared += 1
        if not torch.equal(buf, buffers[plain_name(name)]):
            mismatch.append(f"{what}:{name}")
params = list(run.trained.parameters())
# this rank's share of policy + critic
held = sum(local(p).numel() for p in params) / sum(p.numel() for p in params)
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, f"fsdp_load_rank{run.rank}.json"), "w") as f:
    json.dump({"rank": run.rank, "policy_on_meta": seen["policy_on_meta"], "received": seen["received"],
               "compared": compared, "mismatch": mismatch, "unchecked": sorted(set(saved) - policy_names),
               "held": held, "reference": run.ref is not None, "critic": run.critic is not None}, f)
run.rewards.close()
distributed.end_process()
