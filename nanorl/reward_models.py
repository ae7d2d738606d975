"""Reward models, link 2 of the chain (reward), the RLHF kind: a model trained on preferences — a
Bradley–Terry reward model, P(a ≻ b) = σ(r(a) − r(b)) — reads the conversation and returns one number,
the reward component `rm` (--reward-model, nanorl/build.py make_scorers).

Any Hugging Face `AutoModelForSequenceClassification` with `num_labels == 1` loads, with its OWN
tokenizer and chat template (the sample re-rendered as [user: prompt, assistant: response]). Start at
`RewardModel.score`. Key choices: the score is read at the last REAL token, found from the attention
mask, never from the pad id (why: `RewardModel._forward`); right padding, so batching changes no input
of a real token; micro-batches by a padded-token budget, results in input order; weights in the compute
dtype (it never trains), run under no_grad and the run's autocast. Test: tests/test_reward_models.py.
"""
from __future__ import annotations

import gc

import torch

from nanorl.batching import make_padded_micro_batches
from nanorl.policy import best_attn_implementation
from nanorl.precision import autocast


class RewardModel:
    """A frozen scalar reward model and its tokenizer.

    path: a Hugging Face name or local directory holding a sequence classifier with num_labels == 1.
    device, dtype: where and in what compute dtype it runs (the trainer's device and --dtype).
    max_tokens_per_batch: cap on rows × longest row of one forward (a longer sample runs alone).
    template: True = render with the RM tokenizer's chat template (error if it has none), False = plain
        prompt + response text, None = the template when the tokenizer has one.
    shard: --fsdp: the RM's weights sharded over the ranks like the trainer's (FSDP2, each transformer
        block a unit: nanorl/distributed.py shard); every rank must then call `score` at the same time
        (each with its own samples: the ranks run the same number of forwards, see `score`).
    """

    def __init__(self, path: str, device, dtype: torch.dtype = torch.float32,
                 max_tokens_per_batch: int = 8192, template: bool | None = None, shard: bool = False):
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
        from transformers.modeling_layers import GenericForSequenceClassification

        if max_tokens_per_batch < 1:
            raise ValueError(f"reward model: max_tokens_per_batch must be >= 1, got {max_tokens_per_batch}")
        config = AutoConfig.from_pretrained(path)
        if getattr(config, "num_labels", None) != 1:
            raise ValueError(f"reward model {path!r}: needs a sequence classifier with one output "
                             f"(num_labels == 1), got num_labels={getattr(config, 'num_labels', None)} "
                             f"({type(config).__name__}); a causal LM or a multi-class classifier is not "
                             "a scalar reward model")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        if template and not has_template:
            raise ValueError(f"reward model {path!r}: template=True but its tokenizer has no chat template")
        self.template = has_template if template is None else bool(template)
        self.device, self.dtype = torch.device(device), dtype
        self.max_tokens = int(max_tokens_per_batch)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=dtype, attn_implementation=best_attn_implementation(dtype))
        self.model.to(self.device)
        self.model.requires_grad_(False)
        self.model.eval()
        # scoring never decodes: no KV cache
        self.model.config.use_cache = False
        self.generic = isinstance(self.model, GenericForSequenceClassification)
        # padding value of input_ids: masked out for the generic classes; for the others, their
        # own pooling may look for it, so it is the config's pad id when there is one
        pad = self.model.config.pad_token_id
        self.pad_id = pad if pad is not None else (self.tokenizer.pad_token_id or 0)
        if self.generic and pad is None:
            # the generic forward's own pooling (whose result `_forward` does not read) refuses a batch
            # of 2+ rows without a pad id
            self.model.config.pad_token_id = self.pad_id
        self.sharded = bool(shard)
        if self.sharded:
            from nanorl import distributed
            if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
                raise ValueError("reward model: shard=True needs the trainer's process group (--fsdp)")
            if not self.generic:
                # another class may run one forward per row (see _forward): no fixed count per rank
                raise ValueError(f"reward model {path!r}: --fsdp shards Hugging Face's decoder "
                                 f"classifiers (GenericForSequenceClassification), not "
                                 f"{type(self.model).__name__}")
            self.model = distributed.shard(self.model, self.device, dtype)

    def render(self, prompt: str, response: str) -> str:
        """The text the RM reads: its chat template over [user: prompt, assistant: response], or
        prompt + response."""
        if not self.template:
            return prompt + response
        conversation = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        return self.tokenizer.apply_chat_template(conversation, tokenize=False)

    def encode(self, prompt: str, response: str) -> list[int]:
        """Token ids of one sample. A rendered template already holds its special tokens (BOS), so
        none are added; plain text gets the tokenizer's usual ones."""
        ids = self.tokenizer(self.render(prompt, response), add_special_tokens=not self.template)["input_ids"]
        if not ids:
            raise ValueError(f"reward model: sample renders to no tokens (prompt {prompt!r}, "
                             f"response {response!r})")
        return ids

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        """One scalar per (prompt, response), in the input order, scored in token-budget micro-batches."""
        if len(prompts) != len(responses):
            raise ValueError(f"reward model: {len(prompts)} prompts but {len(responses)} responses")
        if self.model is None:
            raise RuntimeError("reward model: score() after close()")
        rows = [self.encode(p, r) for p, r in zip(prompts, responses)]
        out = [0.0] * len(rows)
        lengths = [len(r) for r in rows]
        mbs = make_padded_micro_batches(lengths, [0] * len(rows), self.max_tokens) if rows else []
        forwards = len(mbs)
        if self.sharded:
            # each forward all-gathers every rank's shards: the ranks agree on the count first, and a
            # rank with fewer micro-batches (fewer or shorter samples) then runs one-token forwards,
            # unread, until it has run as many
            count = torch.tensor([forwards], device=self.device)
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
            forwards = int(count)
        for k in range(forwards):
            if k >= len(mbs):
                self._forward([[self.pad_id]])
                continue
            for i, s in zip(mbs[k], self._forward([rows[i] for i in mbs[k]])):
                out[i] = s
        return out

    @torch.no_grad()
    def _forward(self, rows: list[list[int]]) -> list[float]:
        """Scores of token rows, batched. Hugging Face's decoder classifiers
        (GenericForSequenceClassification, transformers 5.19: Qwen2, Llama, Mistral, Gemma, ...) pool
        at "the rightmost token that is not pad_token_id": a row that really ends in the pad id (pad =
        eos, or an unknown character mapped to the pad id) is then read one token early, and with no
        pad_token_id any batch of 2+ rows raises. For those classes the model's forward runs with the
        mask and the score head's output (a per-position linear layer) is read at each row's last real
        token, whatever its own pooling picked; any other classifier (an encoder's [CLS] pooler) runs
        its own forward on right-padded rows, which is what it was trained on."""
        # the generic path reads its own position; another class with no pad id cannot take a batch
        if not self.generic and self.model.config.pad_token_id is None and len(rows) > 1:
            return [s for r in rows for s in self._forward([r])]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)  # [B, S] right-padded
        mask = torch.zeros((len(rows), width), dtype=torch.long)  # [B, S] 1 = real token
        for b, r in enumerate(rows):
            ids[b, :len(r)] = torch.tensor(r)
            mask[b, :len(r)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        with autocast(self.device, self.dtype):
            if self.generic:
                # the score head (a per-position linear layer) read at every position, through the
                # model's own forward (so --fsdp's hooks gather each unit's weights), then gathered here
                captured = {}
                hook = self.model.score.register_forward_hook(lambda m, i, o: captured.update(o=o))
                try:
                    self.model(input_ids=ids, attention_mask=mask, use_cache=False)
                finally:
                    hook.remove()
                last = mask.sum(-1) - 1  # [B] index of each row's last real token
                logits = captured["o"][torch.arange(len(rows), device=self.device), last]  # [B, 1]
            else:
                logits = self.model(input_ids=ids, attention_mask=mask).logits  # [B, 1]
        return logits[:, 0].float().cpu().tolist()

    def close(self) -> None:
        """Free the model (and its device memory)."""
        self.model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
