"""The teacher of on-policy distillation: a frozen model that scores the student's own samples.
Link 3 of the chain (recompute): the step's plan asks for it when the estimator reads
`teacher_logprobs` (--advantage opd, the distill preset) or --distill-coef mixes it into a task reward.

    python train.py --algo distill --teacher Qwen/Qwen2.5-7B-Instruct --model Qwen/Qwen2.5-0.5B-Instruct ...
    python train.py --algo grpo --teacher PATH --distill-coef 0.5       # task reward + distillation

The student samples, the teacher scores those very tokens (log π_teacher(a_t | s_t), teacher-forced),
and the advantage is log π_teacher − log π_old per token (nanorl/advantage.py opd): a dense, per-token
signal of the reverse KL on the student's own distribution of states — why it is the student's, not
the teacher's, samples: docs/tour.md "On-policy distillation". Start at `load_teacher`, then
`teacher_logprobs`. Key choices: the teacher must share the policy's tokenizer (it scores the student's
token ids; a different vocabulary fails at start, naming both); it is a frozen copy in the compute
dtype scored exactly as the reference is — the same micro-batches, padded or packed forward, at the
sampling temperature, on the kept sampling support (nanorl/scoring.py score_batch), so the two
log-probs it is compared with are computed alike. Not built: vLLM prompt-logprob scoring of the teacher.
Test: python -m pytest tests/test_distill.py -q
"""
from __future__ import annotations

import functools

import torch

from nanorl import distributed
from nanorl.distributed import Trained
from nanorl.policy import frozen_copy, load_model
from nanorl.scoring import forward, score_batch


def check_vocabulary(policy_tokenizer, teacher_tokenizer, policy: str, teacher: str, ids: int) -> None:
    """Raise unless both tokenizers map every token id the student can sample (0..ids-1, its LM head's
    rows) to the same token: the teacher scores the student's ids, so one id must mean one token to
    both. Ids past the head (a loader's added <|endoftext|>) are never sampled, so never compared. The
    message names both vocabularies."""
    mine = {t: i for t, i in policy_tokenizer.get_vocab().items() if i < ids}
    theirs = {t: i for t, i in teacher_tokenizer.get_vocab().items() if i < ids}
    if mine == theirs:
        return
    diff = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda kv: (kv[1], kv[0]))
    token = diff[0][0]
    where = (f"token {token!r} is id {mine.get(token, 'absent')} in the policy's and "
             f"{theirs.get(token, 'absent')} in the teacher's")
    raise ValueError(
        f"--teacher {teacher}: its vocabulary ({type(teacher_tokenizer).__name__}, {len(theirs)} tokens "
        f"below id {ids}) differs from the policy {policy}'s ({type(policy_tokenizer).__name__}, "
        f"{len(mine)} tokens): {where}. On-policy distillation scores the student's token ids under the "
        "teacher, so both must share one tokenizer (e.g. one model family).")


def load_teacher(cfg, policy, policy_tokenizer, device, dtype) -> torch.nn.Module | None:
    """--teacher as a frozen module behind the scoring forward (logprobs, entropy, None), like the
    reference; None without --teacher. Its vocabulary is checked against the policy's first."""
    if not cfg.distill.teacher:
        return None
    model, tokenizer = load_model(cfg.distill.teacher, distributed.load_device(cfg.memory.fsdp, device),
                                  dtype)
    rows = policy.get_output_embeddings().weight.shape[0]  # the ids the student can sample
    check_vocabulary(policy_tokenizer, tokenizer, cfg.model, cfg.distill.teacher, rows)
    theirs = model.get_output_embeddings().weight.shape[0]
    if theirs < rows:
        raise ValueError(f"--teacher {cfg.distill.teacher}: its LM head has {theirs} rows, fewer than the "
                         f"policy's {rows}: a sampled id would have no teacher logit")
    # the student's MoE routing is the student's: never replayed into the teacher (nanorl/moe_replay.py)
    score = functools.partial(forward, cfg.replace(routing_replay=False))
    teacher = Trained(frozen_copy(model, dtype), None, score, dtype)  # compute dtype, no master copy
    del model
    return distributed.shard(teacher, device) if cfg.memory.fsdp else teacher


@torch.no_grad()
def teacher_logprobs(run, batch, support) -> torch.Tensor:
    """log π_teacher of every response token of the batch [B, T] (0 on padding): one no-gradient
    forward per micro-batch, the splits training uses (nanorl/scoring.py score_batch)."""
    return score_batch(run, run.teacher, batch, support)[0]
