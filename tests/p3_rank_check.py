"""Run by tests/test_gpu_part3.py under torchrun (2 CPU ranks, gloo), one case per launch:

    torchrun --nproc_per_node 2 tests/p3_rank_check.py probes   # N4: check_sync under FSDP2
    torchrun --nproc_per_node 2 tests/p3_rank_check.py scaler   # m6: fp16 loss scale over ranks

probes: a tiny Qwen2 sharded with FSDP2 (nanorl/distributed.py shard) and a VLLMEngine whose `llm` is
FakeLLM below (vLLM 0.32's generate outputs, scored by an unsharded fp32 copy of the same weights).
Rank 0's last rollout holds 4 probe sequences, rank 1's one — as the multi-turn driver's last generate
call leaves them — and both ranks run check_sync as train.py does (inside root_gathered). Each FSDP
forward all-gathers every block, so unequal probe forward counts hang (the test's timeout fails it).
Prints "probes rank R forwards F max_diff D".
scaler: fp32 masters, a GradScaler, the gradient of rank 1 only set to inf, two update.sync_and_step
calls (the first overflows on rank 1, the second is finite everywhere). Prints "scaler rank R scale S
skipped K weights W" (W: a checksum of the weights).
"""
import copy
import sys
import types
from types import SimpleNamespace

import torch

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])


# ----------------------------------------------------------------------------- a vLLM stand-in

class SamplingParams:
    """The fields of vLLM 0.32's SamplingParams that check_sync sets."""

    def __init__(self, temperature=1.0, max_tokens=16, logprobs=None, prompt_logprobs=None, **_):
        self.temperature, self.max_tokens = temperature, max_tokens
        self.logprobs, self.prompt_logprobs = logprobs, prompt_logprobs


def fake_vllm_modules() -> dict:
    """sys.modules entries that make `from vllm import SamplingParams` and `from vllm.inputs import
    TokensPrompt` work without vLLM (TokensPrompt is a TypedDict: a dict)."""
    vllm, inputs = types.ModuleType("vllm"), types.ModuleType("vllm.inputs")
    vllm.SamplingParams, inputs.TokensPrompt, vllm.inputs = SamplingParams, dict, inputs
    return {"vllm": vllm, "vllm.inputs": inputs}


class FakeLLM:
    """llm.generate as vLLM 0.32 returns it (outputs[0].token_ids / .logprobs, prompt_logprobs), from
    an fp32 model: greedy decoding, or prompt logprobs when asked. Records each prompt's length."""

    def __init__(self, model):
        self.model, self.lengths = model.eval(), []

    @torch.no_grad()
    def _logprobs(self, ids):  # [S] -> [S-1, V]
        return self.model(input_ids=torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)

    def generate(self, prompts, params, use_tqdm=False):
        params = params if isinstance(params, list) else [params] * len(prompts)
        outs = []
        for prompt, sp in zip(prompts, params):
            ids = list(prompt["prompt_token_ids"])
            self.lengths.append(len(ids))
            if sp.prompt_logprobs is not None:
                lp = self._logprobs(ids)
                prompt_lps = [None] + [{t: SimpleNamespace(logprob=float(lp[i, t]))}
                                       for i, t in enumerate(ids[1:])]
                outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0], logprobs=None)],
                                            prompt_logprobs=prompt_lps))
                continue
            gen, lps = [], []
            for _ in range(sp.max_tokens):
                lp = self._logprobs(ids + gen + [0])[-1]  # the next token's distribution
                t = int(lp.argmax())
                gen.append(t)
                lps.append({t: SimpleNamespace(logprob=float(lp[t]))})
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=gen, logprobs=lps)],
                                        prompt_logprobs=None))
        return outs


def fake_engine(reference, rollout, block_size=16, max_model_len=4096):
    """A VLLMEngine around FakeLLM(reference) whose last rollout was `rollout` [(prompt, response)]."""
    from nanorl.vllm_engine import VLLMEngine

    eng = VLLMEngine.__new__(VLLMEngine)
    eng.llm, eng.dtype, eng.block_size = FakeLLM(reference), torch.float32, block_size
    eng.vocab_size, eng.max_model_len = reference.config.vocab_size, max_model_len
    eng.version, eng._last_rollout, eng.model_runner = 0, list(rollout), "v1"
    return eng


def tiny_qwen2(seed=0, vocab=64):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg).float()


# ----------------------------------------------------------------------------- the cases

def probes(rank):
    from nanorl import distributed

    model = tiny_qwen2()
    reference = copy.deepcopy(model)
    trained = distributed.shard(distributed.Trained(model, None, None), torch.device("cpu"))
    gen = torch.Generator().manual_seed(rank)
    n = 4 if rank == 0 else 1  # the multi-turn driver's last generate call differs per rank
    rollout = [(torch.randint(0, 64, (6 + i,), generator=gen).tolist(),
                torch.randint(0, 64, (5,), generator=gen).tolist()) for i in range(n)]
    sys.modules.update(fake_vllm_modules())
    engine = fake_engine(reference, rollout)
    calls = []
    model.model.register_forward_pre_hook(lambda *a: calls.append(1))
    with distributed.root_gathered(trained):
        stats = engine.check_sync(model)
    diff = stats["max_abs_logprob_diff"]
    # one write, led by a newline: two ranks share the launcher's stdout, and a line that runs into
    # the other rank's ("...weights 1.5scaler rank 1 ...", seen on CI) would hide a rank from the test
    print(f"\nprobes rank {rank} forwards {len(calls)} max_diff {diff:.3g}", flush=True)


def scaler(rank):
    from nanorl import update
    from nanorl.config import Config

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    run = SimpleNamespace(scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 10), optimizer=opt,
                          cfg=Config.from_flags(grad_clip=0.0), counters={"skipped_updates": 0},
                          logger=SimpleNamespace(print=lambda *a: None), step=0,
                          scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    params = list(model.parameters())
    for step in range(2):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        run.scaler.scale(model(x).square().mean()).backward()
        if step == 0 and rank == 1:  # an overflow in this rank's (shard of the) gradient only
            model.weight.grad[0, 0] = float("inf")
        update.sync_and_step(run, params)
    weights = sum(float(p.double().sum()) for p in params)
    print(f"\nscaler rank {rank} scale {run.scaler.get_scale()} skipped {run.counters['skipped_updates']} "
          f"weights {weights:.12g}", flush=True)


if __name__ == "__main__":
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    {"probes": probes, "scaler": scaler}[sys.argv[1]](dist.get_rank())
    dist.barrier()
    from nanorl import distributed
    distributed.end_process()  # destroys the group, then exits without the teardown that can abort
