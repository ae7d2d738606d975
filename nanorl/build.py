"""What train.py's set-up builds, one function per piece: the task files, the policy, the rollout
engine, the sample source over it (--env's episodes, --agent's endpoint), the trained modules (critic,
reference, the DDP/FSDP wrapper) and the optimizer.

Read train.py's `setup` first: it calls these in chain order. Key choices: the HF engine samples from
the policy module itself (no copy, no sync) unless --fsdp shards it; vLLM holds its own copy of the
weights, loaded from the same path and synced after every step; the reference model is a frozen
copy that exists only when a KL term is on; --fsdp over several ranks reads the checkpoint on rank 0
alone, the others' copies start on the meta device and get rank 0's values once sharded
(`load_on_rank0`); AdamW is fused (one kernel over every tensor). --lora-rank:
PEFT adapters are injected into the policy, the optimizer holds only them and the reference is the
policy with its adapters off (nanorl/lora.py). On CUDA, `load_policy` prints the run's memory plan and
refuses a run that cannot fit the GPU (nanorl/memory_plan.py), and an async run's rollout device is
checked before anything loads (nanorl/weight_broadcast.py `check_devices`).
"""
from __future__ import annotations

import functools
import importlib.util
import math
import os

import torch

from nanorl import distributed, gguf_model, lora, memory_plan, moe_replay, precision, weight_broadcast
from nanorl.agent import AgentRunner
from nanorl.config import Config
from nanorl.distributed import Trained
from nanorl.plugins import load_object, plugin_task
from nanorl.policy import ValueModel, frozen_copy, layout, load_empty_model, load_model
from nanorl.rollout import HFEngine, RolloutEngine
from nanorl.scoring import forward
from nanorl.sources import Agents, Episodes, Source
from nanorl.task import make_default
from nanorl.tool_envs import episode_runner, make_calc_task


def with_task_files(cfg: Config, rank: int, world: int) -> Config:
    """Without --model or --train-data: the built-in task's files and model, made in code by rank 0
    (--plugin's make_task, else --env calc's or --agent's tool-using variant, else the arithmetic task)."""
    if cfg.model and cfg.train_data:
        return cfg
    make = make_calc_task if cfg.env == "calc" or cfg.agent else make_default
    if cfg.plugin:
        make = plugin_task(cfg.plugin) or make
    default = make(os.path.join(cfg.out_dir, "task")) if rank == 0 else None
    if world > 1:  # rank 0 builds, the others read the same files
        box = [default]
        torch.distributed.broadcast_object_list(box, src=0)
        default = box[0]
    return cfg.replace(model=cfg.model or default["model"], train_data=cfg.train_data or default["train"],
                       test_data=cfg.test_data or default["test"])


def load_policy(cfg: Config, device, dtype):
    """The policy (fp32 master weights, train mode) and its tokenizer, with the flags that patch it
    (--lora-rank last: PEFT's adapters in place, the base frozen); on CUDA, checked against the GPU's
    memory (`check_memory`) before anything else is built."""
    if cfg.pipeline.async_steps:  # a rollout device that cannot work fails here, before minutes of loading
        weight_broadcast.check_devices(device, cfg.pipeline.rollout_device,
                                       broadcast=engine_class(cfg, device).holds_own_weights)
    if distributed.rank0_reads(cfg.memory.fsdp):
        model, tokenizer = load_on_rank0(cfg, dtype)
    else:
        # --fsdp on one rank: loaded (and copied) in host memory, fully_shard moves it to the device;
        # else (DDP, one process) loaded on the device
        model, tokenizer = load_model(cfg.model, distributed.load_device(cfg.memory.fsdp, device), dtype)
    if cfg.memory.routing_replay:
        if not moe_replay.is_moe(model):
            raise ValueError("--routing-replay needs a mixture-of-experts model")
        moe_replay.patch(model)
    if cfg.memory.fp32_lm_head:
        precision.keep_lm_head_fp32(model)
    if cfg.memory.gradient_checkpointing:
        precision.enable_gradient_checkpointing(model, routing_replay=cfg.memory.routing_replay)
    if cfg.lora.rank:
        lora.apply(model, cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.target_modules)
    model.train()  # Hugging Face checkpoints only in train mode; dropout is off (policy.dropout_off)
    if torch.device(device).type == "cuda":
        check_memory(cfg, model, torch.device(device))
    return model, tokenizer


def load_on_rank0(cfg: Config, dtype):
    """--fsdp over several ranks (`distributed.rank0_reads`): (policy, tokenizer) with the checkpoint read
    into host memory by rank 0 alone. Every other rank builds the same model from rank 0's config,
    its parameters on the meta device (nanorl/policy.py `load_empty_model`); sharding fills them
    (`make_trained`). Rank 0's model layout comes with its config: a rank that built another one (an
    architecture that from_config builds differently) stops with the difference, never a silent mix."""
    rank = torch.distributed.get_rank()
    # on the CPU, as load_device puts it: fully_shard moves only each rank's shards to the device
    model, tokenizer = load_model(cfg.model, "cpu", dtype) if rank == 0 else (None, None)
    box = [(model.config, model.generation_config, layout(model)) if rank == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    if rank == 0:
        return model, tokenizer
    config, generation_config, theirs = box[0]
    model, tokenizer = load_empty_model(cfg.model, config, generation_config, dtype)
    mine = layout(model)
    if mine != theirs:
        # the first entry that differs, else the counts (one list is the other's start)
        here, there = next(((a, b) for a, b in zip(mine, theirs) if a != b),
                           (f"{len(mine)} entries", f"{len(theirs)}"))
        raise RuntimeError(f"--fsdp: --model {cfg.model} built on rank {rank} without its weights differs "
                           f"from rank 0's loaded model: {here} here, {there} on rank 0")
    return model, tokenizer


def engine_of(cfg: Config, device) -> str:
    """The engine --engine names, auto resolved (train.setup, and the checks before it): vLLM on a GPU
    when importable, not for GGUF files (vLLM is not given them: nanorl/gguf_model.py)."""
    if cfg.engine != "auto":
        return cfg.engine
    cuda = torch.device(device).type == "cuda"
    return "vllm" if cuda and vllm_importable() and not gguf_model.is_gguf(cfg.model) else "hf"


def model_shape(model) -> memory_plan.Shape:
    """What the memory plan reads of a loaded model: parameter counts, and its sizes from the config."""
    c = model.config.get_text_config()  # a multimodal config nests the language model's
    # Architectures differ here: head_dim is absent where it is hidden / heads; MoE configs name the
    # expert width and experts per token (Qwen3-MoE: moe_intermediate_size; Mixtral: intermediate_size)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    width = (getattr(c, "moe_intermediate_size", None) or getattr(c, "intermediate_size", None)
             or 4 * c.hidden_size)
    params = list(model.parameters())  # tied parameters once
    return memory_plan.Shape(params=sum(p.numel() for p in params),
                             trainable=sum(p.numel() for p in params if p.requires_grad),
                             layers=c.num_hidden_layers, hidden=c.hidden_size,
                             intermediate=width * (getattr(c, "num_experts_per_tok", None) or 1),
                             vocab=c.vocab_size, kv_width=kv_heads * head_dim)


def check_memory(cfg: Config, model, device: torch.device) -> memory_plan.Plan:
    """Print the memory plan of this GPU (rank 0), and raise a ValueError naming the levers when it
    exceeds the GPU's memory: a 7B GRPO run with default flags would otherwise fail at its first step,
    or when vLLM first wakes up (nanorl/memory_plan.py)."""
    joined = torch.distributed.is_initialized()
    rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if joined else (0, 1)
    # the async worker runs beside rank 0, on its GPU unless --rollout-device names another
    here = cfg.pipeline.async_steps > 0 and rank == 0 and \
        weight_broadcast.physical_id(cfg.pipeline.rollout_device or device) \
        == weight_broadcast.physical_id(device)
    plan = memory_plan.estimate(model_shape(model), cfg, vllm=engine_of(cfg, device) == "vllm", world=world,
                                device_bytes=torch.cuda.get_device_properties(device).total_memory,
                                worker_here=here)
    if rank == 0:
        print(f"nanorl: {plan.line()}", flush=True)
    if not plan.fits():
        raise ValueError(f"--model {cfg.model}: {plan.refusal()}")
    return plan


def engine_class(cfg: Config, device) -> type[RolloutEngine]:
    """The class of the engine --engine names (auto resolved: `engine_of`), whose declarations
    (nanorl/rollout.py RolloutEngine) a caller reads before one exists: the async worker's channel."""
    if engine_of(cfg, device) == "vllm":
        from nanorl.vllm_engine import VLLMEngine
        return VLLMEngine
    return HFEngine


def worker_engine(cfg: Config, kind: type[RolloutEngine], model, pad_id: int, dtype, longest_prompt: int):
    """The async rollout worker's engine of class `kind` (`engine_class` on the worker's device,
    nanorl/rollout_worker.py): vLLM, never asleep (the trainer trains elsewhere), or the HF engine on the
    worker's own model copy (--routing-replay: recording each sample's experts, as the trainer's does)."""
    if kind.holds_own_weights:
        return vllm_engine(cfg, longest_prompt, rank=0, sleep=False)
    return HFEngine(model, pad_id=pad_id, compute_dtype=dtype, record_routing=cfg.memory.routing_replay)


def sample_source(cfg: Config, engine, tokenizer, fmt, log=print) -> tuple[object | None, Source]:
    """Where a process's samples come from over its `engine`, chosen once: (the episode driver, the
    source). --env: its multi-turn driver (the environment answers between turns and scores the
    episode); --agent: the user's agent per episode, the engine behind an OpenAI-compatible endpoint
    (nanorl/agent.py); else (None, the engine itself). train.py's setup and the async rollout worker
    (nanorl/rollout_worker.py, over its own engine) both choose here, so the worker samples a run's
    episodes as the synchronous step would."""
    if cfg.env:
        episodes = episode_runner(cfg, engine, tokenizer, fmt, log=log)
        return episodes, Episodes(episodes)
    if cfg.agent:
        runner = AgentRunner(engine, load_object(cfg.agent, "agent"), tokenizer,
                             template_kwargs=cfg.chat_template_dict, log=log)
        return runner, Agents(runner)
    return None, Source(engine)


def make_engine(cfg: Config, model, tokenizer, prompts, device, dtype, rank: int):
    """The rollout engine: vLLM with its own copy of the weights (loaded from the same path, synced after
    every step), or the HF engine sampling from the policy module itself (--fsdp: from a full copy)."""
    # --async-steps: vLLM runs in the rollout worker (nanorl/pipeline.py); the trainer's own engine, for
    # evaluation, is the HF engine on its module
    if cfg.engine == "vllm" and not cfg.pipeline.async_steps:
        return vllm_engine(cfg, max(len(p.ids) for p in prompts), rank, sleep=cfg.vllm.sleep_level > 0)
    sampler = model
    if cfg.memory.fsdp:
        sampler = frozen_copy(model, dtype)
        if not distributed.rank0_reads(cfg.memory.fsdp):
            sampler = sampler.to(device)
        else:
            # rank > 0 holds the policy on the meta device (load_policy), and so this copy: it gets
            # memory on the device and rank 0's values there
            sampler = distributed.receive_from_rank0(sampler.to(device) if rank == 0 else sampler, device)
    engine = HFEngine(sampler, pad_id=tokenizer.pad_token_id, record_routing=cfg.memory.routing_replay,
                      compute_dtype=dtype)
    engine.generator.manual_seed(cfg.seed * 1000 + rank)
    return engine


def vllm_engine(cfg: Config, longest_prompt: int, rank: int, sleep: bool):
    """The VLLMEngine of a run: in the trainer's process (synchronous) or the async rollout worker's."""
    if gguf_model.is_gguf(cfg.model):
        raise ValueError(f"--engine vllm with the GGUF model {cfg.model}: not supported (vLLM is not given "
                         "GGUF files); use --engine hf")
    from nanorl.engine_weights import AdapterSync
    from nanorl.vllm_engine import VLLMEngine
    # the run's longest request, not the model's context (an episode: its prompt + every turn)
    longest = longest_prompt + max(cfg.max_new_tokens, cfg.evaluation.eval_max_new_tokens, cfg.episode_tokens)
    # a resume: prompt + tokens so far + the batch's longest budget left
    if cfg.pipeline.partial_rollout == "abort":
        longest += cfg.max_new_tokens
    # kv_cache_bytes None: vLLM's share of the GPU, or its CPU default
    return VLLMEngine(cfg.model, dtype=cfg.memory.dtype, seed=cfg.seed * 1000 + rank,
                      max_model_len=cfg.vllm.max_model_len or longest,
                      kv_cache_bytes=int(cfg.vllm.kv_cache_gb * 2**30) or None,
                      gpu_memory_utilization=cfg.vllm.gpu_memory_utilization,
                      enforce_eager=cfg.vllm.enforce_eager,
                      record_routing=cfg.memory.routing_replay, sleep_mode=sleep,
                      adapters=AdapterSync(cfg.lora.rank) if cfg.lora.sync == "adapter" else None)


def make_trained(cfg: Config, model, device, dtype):
    """(critic, reference, trained): the critic when --vf-coef > 0, the frozen reference when a KL term
    is on (LoRA: the policy with its adapters off), and policy + critic behind one forward wrapped for
    DDP / FSDP (nanorl/distributed.py). A LoRA policy's critic copies its adapted body: the critic
    trains its own adapters and head."""
    critic = ValueModel(model).to(model.device) if cfg.vf_coef > 0 else None
    score = functools.partial(forward, cfg)  # padded or packed scoring, MoE replay (nanorl/scoring.py)
    ref = None
    if cfg.uses_reference and lora.is_lora(model):
        ref = lora.Reference(lora.peft_of(model), Trained(model, None, score, dtype))
    elif cfg.uses_reference:
        ref = Trained(frozen_copy(model, dtype), None, score, dtype)
    # --fsdp over several ranks: rank > 0 built the policy, and so these copies, on the meta device
    # (load_policy); each rank's shards are filled with rank 0's values
    once = distributed.rank0_reads(cfg.memory.fsdp)
    if ref is not None and cfg.memory.fsdp:
        ref = distributed.shard(ref, device, from_rank0=once)
    accelerator = distributed.make_accelerator(find_unused_parameters=moe_replay.is_moe(model))
    return critic, ref, distributed.wrap(accelerator, Trained(model, critic, score, dtype),
                                         fsdp=cfg.memory.fsdp, from_rank0=once)


def make_optimizer(cfg: Config, model, critic):
    """AdamW over the policy (and critic) parameters — after sharding, which swaps in sharded ones —
    and the learning-rate schedule. Fused: one kernel over all tensors, no full-size temporaries (10x
    faster than foreach on a 166M-parameter CPU model here); FSDP's DTensors keep the default."""
    params = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    if critic is not None:
        params.append({"params": [p for p in critic.parameters() if p.requires_grad]})
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.optim.adam_beta1, cfg.optim.adam_beta2),
                                  eps=cfg.optim.adam_eps,
                                  weight_decay=cfg.optim.weight_decay, fused=not cfg.memory.fsdp)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(cfg, s))


def vllm_importable() -> bool:
    return importlib.util.find_spec("vllm") is not None


def lr_factor(cfg: Config, step: int) -> float:
    """Linear warm-up, then constant or cosine decay to 10%."""
    if step < cfg.optim.warmup_steps:
        return (step + 1) / (cfg.optim.warmup_steps + 1)
    if cfg.optim.schedule == "constant":
        return 1.0
    progress = (step - cfg.optim.warmup_steps) / max(1, cfg.steps - cfg.optim.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def scorer_names(cfg: Config) -> list[str]:
    """The reward components --reward-model and --judge add beside --reward (`make_scorers`' keys)."""
    return [name for name, on in (("rm", cfg.scorers.reward_model), ("judge", cfg.scorers.judge)) if on]


def make_scorers(cfg: Config, device, dtype, log=print) -> dict:
    """The reward components scored beside --reward, each a scorer with
    .score(prompts, responses, labels) -> list[float | None] (None: a failed call) and .close():
    `rm`, a reward model on the trainer's device in its compute dtype, sharded like it with --fsdp
    (--reward-model), and `judge`,
    an LLM judge behind an OpenAI-compatible endpoint (--judge-url) or in-process (--judge-model)."""
    scorers = {}
    if cfg.scorers.reward_model:
        from nanorl.reward_models import RewardModel
        rm = RewardModel(cfg.scorers.reward_model, device, dtype=dtype,
                         max_tokens_per_batch=cfg.memory.max_tokens_per_micro_batch or 8192,
                         shard=cfg.memory.fsdp)
        scorers["rm"] = _Unlabelled(rm)
    if cfg.scorers.judge:
        from nanorl.judges import Judge, read_template
        template = read_template(cfg.scorers.judge)
        if cfg.scorers.judge_url:
            scorers["judge"] = Judge(template, cfg.scorers.judge_url, cfg.scorers.judge_model,
                                     parse=cfg.scorers.judge_parse, log=log,
                                     concurrency=cfg.scorers.judge_concurrency,
                                     timeout_s=cfg.scorers.judge_timeout,
                                     retries=cfg.scorers.judge_retries)
        else:
            model, tokenizer = load_model(cfg.scorers.judge_model, device, dtype)
            engine = HFEngine(model.eval(), pad_id=tokenizer.pad_token_id, compute_dtype=dtype)
            scorers["judge"] = Judge.local(engine, tokenizer, template, parse=cfg.scorers.judge_parse,
                                           log=log)
    return scorers


class _Unlabelled:
    """A scorer that reads no label (a reward model) behind the scorers' common call."""

    def __init__(self, scorer):
        self.scorer, self.faults = scorer, {}

    def score(self, prompts, responses, labels):
        return self.scorer.score(prompts, responses)

    def close(self):
        self.scorer.close()


def reward_weights(cfg: Config) -> dict[str, float] | None:
    """--reward-weights as {component: weight} (None when not given: every component weighs 1)."""
    text = cfg.scorers.reward_weights
    pairs = [x.split("=") for x in text.split(",")] if text else []
    return {k.strip(): float(v) for k, v in pairs} or None
