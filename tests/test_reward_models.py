"""Reward models (nanorl/reward_models.py): a tiny Bradley–Terry RM trained in code on the built-in task
prefers the right sum on held-out problems; batching and micro-batching change no score; the RM's
chat template renders the conversation; a classifier with two labels is refused.

The RM is a real Qwen2ForSequenceClassification with nanorl.task's character tokenizer, saved with
save_pretrained and loaded back by RewardModel (AutoConfig / AutoTokenizer / AutoModel...), so the
real loading path runs. `make_rm(tmp_path)` is reusable: it trains and saves the preference RM (~1.5 min).

The learning test (`test_grpo_rewarded_only_by_the_rm_raises_held_out_accuracy`) is RLHF in small:
the RM is trained on the policy's OWN mistakes and starts from a stronger model than the policy, as
real RMs do. Measured with weaker recipes first (GRPO 100-300 steps, the RM's score the only reward):
an RM trained on random wrong sums from the policy's own 90-step start, 76.5% -> 60.0% and 76.0% ->
78.0% (the policy learned the off-by-one sums the RM misjudged: it preferred 21 of the 44 wrong greedy
answers left at the end over the right ones); from a 60-step start 27.5% -> 30.0%.
"""
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nanorl import task
from nanorl.reward_models import RewardModel
from nanorl.weight_broadcast import free_port

# every sum of three digits
SUMS = range(28)


def wrong_sum(item: dict, rng: random.Random) -> str:
    """A wrong sum: half the time a near miss (off by 1-3, the policy's usual mistake), else any other
    of SUMS."""
    right = int(item["answer"])
    if rng.random() < 0.5:
        near = [v for v in range(right - 3, right + 4) if v != right and v in SUMS]
        return str(rng.choice(near))
    return str(rng.choice([v for v in SUMS if v != right]))


def preference_pairs(items: list[dict], seed: int = 0) -> list[tuple[str, str, str]]:
    """(prompt, chosen, rejected), one per problem: chosen = the right sum, rejected = a wrong one."""
    rng = random.Random(seed)
    return [(x["prompt"], x["answer"], wrong_sum(x, rng)) for x in items]


def every_wrong_sum(items: list[dict]) -> list[tuple[str, str, str]]:
    """(prompt, right sum, wrong sum) for each of the 27 wrong sums (SUMS) of every problem."""
    return [(x["prompt"], x["answer"], str(v)) for x in items for v in SUMS if v != int(x["answer"])]


def _rows(tokenizer, texts: list[str], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [tokenizer(t)["input_ids"] for t in texts]
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)  # [N, S] right-padded
    mask = torch.zeros((len(rows), width), dtype=torch.long)  # [N, S]
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
    return ids, mask


def train_preference_rm(model, tokenizer, pairs, steps: int, lr: float, batch_size: int = 128,
                        warmup: int = 20, seed: int = 0) -> None:
    """Bradley–Terry: minimise −log σ(r(prompt+chosen) − r(prompt+rejected)) over random mini-batches
    of pairs, AdamW with `warmup` steps of linear warm-up then linear decay to 0. Scores are read at
    the last real token (the pair texts never end in the pad id, so the model's own pad-id pooling
    reads the token RewardModel reads)."""
    width = max(len(tokenizer(p + a)["input_ids"]) for p, c, r in pairs for a in (c, r))
    chosen = _rows(tokenizer, [p + c for p, c, _ in pairs], width)
    rejected = _rows(tokenizer, [p + r for p, _, r in pairs], width)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * (1 - s / steps))
    model.train()
    for _ in range(steps):
        pick = torch.randint(len(pairs), (batch_size,), generator=gen)
        # chosen and rejected in one forward (same width: both are right-padded to the longest text)
        ids = torch.cat([chosen[0][pick], rejected[0][pick]])  # [2b, S]
        mask = torch.cat([chosen[1][pick], rejected[1][pick]])  # [2b, S]
        r = model(input_ids=ids, attention_mask=mask).logits[:, 0]  # [2b]
        loss = -F.logsigmoid(r[:batch_size] - r[batch_size:]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    model.eval()


def build_rm(num_labels: int = 1, seed: int = 0, hidden: int = 64, layers: int = 2):
    """A tiny randomly initialised Qwen2 sequence classifier over nanorl.task's character vocabulary."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tokenizer = task.build_tokenizer()
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=1,
                         num_labels=num_labels)
    return Qwen2ForSequenceClassification(config), tokenizer


def policy_mistakes(model_dir: str, items: list[dict], n: int, seed: int) -> list[tuple[str, str, str]]:
    """(prompt, right sum, wrong response): the policy's own wrong samples, n per prompt at temperature
    1, decoded as the trainer hands them to the RM (special tokens skipped)."""
    from transformers import AutoModelForCausalLM

    tok = task.build_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    ids = torch.tensor([tok(x["prompt"])["input_ids"] for x in items]).repeat_interleave(n, 0)  # [N*n, 6]
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                             do_sample=True, temperature=1.0, top_k=0, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)
    pairs = []
    for k, row in enumerate(out[:, ids.shape[1]:].tolist()):
        x, text = items[k // n], tok.decode(row, skip_special_tokens=True)
        if text != x["answer"]:
            pairs.append((x["prompt"], x["answer"], text))
    return pairs


def make_rm(tmp_path, steps: int = 400, lr: float = 1e-3, seed: int = 0) -> str:
    """Train the preference RM and save it (model + tokenizer) under tmp_path/rm; returns the directory,
    loadable by RewardModel(path, ...). As real RMs do, it starts from a STRONGER model than the policy
    it will judge (nanorl.task's 200-step warm start, 98% held-out, vs the policy's 90-step 76%) with a
    fresh scalar head, and is trained on the TRAIN problems only: the 90-step policy's own wrong samples
    (8 per problem at temperature 1, ~4700 pairs) and every wrong sum of every problem (27 each, 21,600
    pairs). It ranks the right sum above the 90-step policy's wrong samples on 99.8% of held-out pairs,
    above random wrong sums on 100% (2-core AMD EPYC, 1 thread; ~100 s to build). With 3 random wrong
    sums per problem instead of all 27 it ranked them 98.0% and 99.5% there, but misranked small sums
    ("0+1+0=": "2" over "1") in 27 of the 90-step policy's samples on 300 train problems (now 6), and
    GRPO on its reward found them: held-out accuracy 76.5% -> 76.5, 78.5, 79.5, 76.5% (seeds 0-3; an
    Intel Xeon had gained 11-21 points with it). Fewer steps or the 90-step model as the start also
    left holes that GRPO exploited (150 steps: 95.4%; from the 90-step model, 300 steps: 96.5%)."""
    from transformers import Qwen2ForSequenceClassification
    from transformers.utils import logging

    policy = task.make_default(str(tmp_path / "task"))["model"]
    stronger = task.make_default(str(tmp_path / "task"), sft_steps=200)["model"]
    train_items, _ = task.problems(seed=0)
    pairs = policy_mistakes(policy, train_items, n=8, seed=seed) + every_wrong_sum(train_items)
    verbosity = logging.get_verbosity()
    # the fresh score head's "newly initialized" report is expected here
    logging.set_verbosity_error()
    try:
        torch.manual_seed(seed)
        model = Qwen2ForSequenceClassification.from_pretrained(stronger, num_labels=1)
    finally:
        logging.set_verbosity(verbosity)
    tokenizer = task.build_tokenizer()
    train_preference_rm(model, tokenizer, pairs, steps=steps, lr=lr, seed=seed)
    path = str(tmp_path / "rm")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("rm")


@pytest.fixture(scope="module")
def trained_rm(rm_dir):
    """The preference RM (~1.5 min to train): for the tests that need its judgement (the slow tier)."""
    return make_rm(rm_dir)


@pytest.fixture(scope="module")
def rm_path(rm_dir):
    """An untrained RM saved as a real checkpoint, its score head scaled so that scores spread (~0.3):
    enough for the plumbing tests (batching, pooling, templates, dtypes), which need no judgement."""
    model, tokenizer = build_rm(seed=0)
    with torch.no_grad():
        model.score.weight.mul_(100.0)
    path = str(rm_dir / "plain_rm")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def held_out_accuracy(rm: RewardModel, pairs) -> float:
    chosen = rm.score([p for p, _, _ in pairs], [c for _, c, _ in pairs])
    rejected = rm.score([p for p, _, _ in pairs], [r for _, _, r in pairs])
    return sum(c > r for c, r in zip(chosen, rejected)) / len(pairs)


@pytest.mark.slow
def test_rm_prefers_the_right_sum_on_held_out_problems(trained_rm, rm_dir):
    """The 200 held-out problems were never trained on: random wrong sums (seed 1), and the policy's own
    wrong samples there (another sampling seed)."""
    rm = RewardModel(trained_rm, "cpu")
    _, test_items = task.problems(seed=0)
    random_acc = held_out_accuracy(rm, preference_pairs(test_items, seed=1))
    policy = task.make_default(str(rm_dir / "task"))["model"]
    policy_acc = held_out_accuracy(rm, policy_mistakes(policy, test_items, n=8, seed=1))
    print(f"held-out preference accuracy: random wrong sums {random_acc:.3f}, policy's mistakes "
          f"{policy_acc:.3f}")
    assert random_acc > 0.9 and policy_acc > 0.97, (random_acc, policy_acc)


def samples():
    """Held-out prompts with responses of mixed lengths (1 to 9 tokens, one empty)."""
    _, test_items = task.problems(seed=0)
    responses = ["16", "7", "", "123456789", "27", "3", "10-1", "0", "99", "5"]
    return [x["prompt"] for x in test_items[:len(responses)]], responses


def test_batched_equals_one_by_one_and_micro_batching_changes_nothing(rm_path):
    """Right padding keeps every real token's inputs and positions; the score is gathered at the last
    real token. Equal to float rounding (rel 1e-5; measured 1.4e-6 on a score of 4.7 on one CPU, 2.2e-6
    on 2.16 on an AVX-512 Xeon; a padding or gather bug moves a score by > 1e-2), not bitwise: a padded
    batch runs attention through a masked kernel over a wider matrix, whose float sums are ordered
    differently from an unpadded row's."""
    rm = RewardModel(rm_path, "cpu")
    prompts, responses = samples()
    alone = [rm.score([p], [r])[0] for p, r in zip(prompts, responses)]
    batched = rm.score(prompts, responses)
    assert batched == pytest.approx(alone, rel=1e-5, abs=1e-6)
    # the scores differ from each other: equality above is not a constant model
    assert max(alone) - min(alone) > 0.1
    longest = max(len(rm.encode(p, r)) for p, r in zip(prompts, responses))
    for budget in (longest, 2 * longest):
        tiny = RewardModel(rm_path, "cpu", max_tokens_per_batch=budget)
        assert tiny.score(prompts, responses) == pytest.approx(alone, rel=1e-5, abs=1e-6), budget
    # results come back in the input order
    order = [3, 0, 9, 1, 8, 2, 7, 4, 6, 5]
    assert rm.score([prompts[i] for i in order], [responses[i] for i in order]) == pytest.approx(
        [alone[i] for i in order], rel=1e-5, abs=1e-6)
    assert rm.score([], []) == []
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        rm.score(prompts[:2], responses[:1])


def test_score_is_read_at_the_last_real_token_even_when_it_is_the_pad_id(rm_path):
    """Hugging Face's Qwen2ForSequenceClassification pools at the rightmost token != pad_token_id, so a
    row that really ends in the pad id (here the <pad> token; in real RMs pad = eos) is read a token
    early. RewardModel reads the last real token, alone and in a batch."""
    rm = RewardModel(rm_path, "cpu")
    ids = rm.encode("3+4+9=", "16<pad>")
    assert ids[-1] == rm.model.config.pad_token_id
    with torch.no_grad():
        x = torch.tensor([ids])
        last = rm.model.score(rm.model.model(input_ids=x).last_hidden_state[:, -1])[0, 0].item()
        hf = rm.model(input_ids=x).logits[0, 0].item()
    alone = rm.score(["3+4+9="], ["16<pad>"])[0]
    # the head over every position ([1, S, H]) vs over one ([1, H]): another GEMM shape, fp32 rounding
    assert alone == pytest.approx(last, rel=1e-6, abs=1e-6) and abs(hf - last) > 1e-3
    prompts, responses = samples()
    assert rm.score(prompts + ["3+4+9="], responses + ["16<pad>"])[-1] == pytest.approx(alone, rel=1e-6,
                                                                                         abs=1e-6)


TEMPLATE = ("{% for m in messages %}{{ ('-' if m['role'] == 'user' else '=') + m['content'] }}{% endfor %}"
            "{{ eos_token }}")


def test_chat_template_renders_the_conversation(rm_path, tmp_path):
    """An RM whose tokenizer has a chat template scores the sample re-rendered as [user: prompt,
    assistant: response] by that template; template=False and a tokenizer without one use plain text."""
    from transformers import AutoTokenizer

    path = tmp_path / "rm_chat"
    tok = AutoTokenizer.from_pretrained(rm_path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    RewardModel(rm_path, "cpu").model.save_pretrained(path)
    chat = RewardModel(str(path), "cpu")
    assert chat.template
    assert chat.render("3+4+9=", "16") == "-3+4+9==16<eos>"
    plain = RewardModel(str(path), "cpu", template=False)
    assert plain.render("3+4+9=", "16") == "3+4+9=16"
    # the same model on the rendered text: the template decides what is scored
    prompts, responses = samples()
    assert chat.score(prompts, responses) == pytest.approx(
        plain.score(["-" + p for p in prompts], ["=" + r + "<eos>" for r in responses]), abs=1e-6)
    assert not RewardModel(rm_path, "cpu").template
    with pytest.raises(ValueError, match="no chat template"):
        RewardModel(rm_path, "cpu", template=True)


def test_a_model_with_two_labels_or_a_causal_lm_is_refused(rm_path, tmp_path):
    model, tokenizer = build_rm(num_labels=2)
    model.save_pretrained(tmp_path / "two")
    tokenizer.save_pretrained(tmp_path / "two")
    with pytest.raises(ValueError, match="num_labels == 1.*num_labels=2"):
        RewardModel(str(tmp_path / "two"), "cpu")
    # the policy checkpoint the RM started from: a causal LM, no scalar head
    with pytest.raises(ValueError, match="num_labels == 1"):
        RewardModel(task.make_default(str(Path(rm_path).parent / "task"))["model"], "cpu")


def test_bf16_compute_dtype(rm_path):
    """Stored in the compute dtype (it never trains) and run under autocast: close to the fp32 scores."""
    fp32, bf16 = RewardModel(rm_path, "cpu"), RewardModel(rm_path, "cpu", dtype=torch.bfloat16)
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    prompts, responses = samples()
    a, b = fp32.score(prompts, responses), bf16.score(prompts, responses)
    spread = max(a) - min(a)
    assert all(isinstance(s, float) for s in b)
    assert max(abs(x - y) for x, y in zip(a, b)) < 0.1 * spread, (a, b)


def test_close_frees_the_model(rm_path):
    rm = RewardModel(rm_path, "cpu")
    rm.close()
    assert rm.model is None
    with pytest.raises(RuntimeError, match="after close"):
        rm.score(["1+2+3="], ["6"])


def greedy_accuracy(model_dir: str) -> float:
    """Greedy exact-match accuracy on the 200 held-out problems, checked against the labels here, apart
    from the trainer's own evaluation. Every prompt "a+b+c=" is 6 tokens: one unpadded batch."""
    from transformers import AutoModelForCausalLM

    tok = task.build_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    _, test_items = task.problems(seed=0)
    ids = torch.tensor([tok(x["prompt"])["input_ids"] for x in test_items])  # [N, 6]
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                             do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    hits = 0
    for row, x in zip(out[:, ids.shape[1]:].tolist(), test_items):
        # the answer then EOS, as the exact reward wants
        hits += tok.eos_token_id in row and tok.decode(row[:row.index(tok.eos_token_id)]) == x["answer"]
    return hits / len(test_items)


@pytest.mark.slow
def test_grpo_rewarded_only_by_the_rm_raises_held_out_accuracy(trained_rm, rm_dir, tmp_path):
    """RLHF in small: GRPO from the 90-step policy with `--reward-model` and `--reward-weights
    correct=0,rm=1`, so the RM's score is the whole reward; the exact-match rule still runs and is
    logged (rollout/reward/correct, eval/accuracy read --reward's verdict, not the RM's), which is how
    the gain is seen. A KL penalty to the reference (β = 0.05; InstructGPT's ~0.02) holds the policy
    near the samples the RM was trained on, as it does in real RLHF: with the grpo preset's β = 0.001 an
    earlier, weaker RM was exploited (run-on answers, "9" -> "913", and off-by-one sums it misranked;
    one seed in four on an Intel Xeon: 76.0% -> 80.0%). With make_rm's RM and β = 0.05, seeds 0-3
    (2-core AMD EPYC, 1 thread): 76.5% -> 90.5, 93.0, 92.0, 89.0% (with its weaker predecessor, see
    make_rm: 76.5, 78.5, 79.5, 76.5% here, 87.0-97.0% on the Xeon). Two seeds run here, each must gain
    and their mean gain be ≥ 8 points. Red check: an RM trained for 1 step instead of 400 went 76.5% ->
    0.0% (seed 0, this EPYC). The trainer's held-out accuracy is cross-checked by
    `greedy_accuracy` on the saved policy."""
    import train

    task_files = task.make_default(str(rm_dir / "task"))
    gains = []
    for seed in (0, 1):
        out = tmp_path / f"seed{seed}"
        res = train.main(["--algo", "grpo", "--model", task_files["model"],
                          "--train-data", task_files["train"], "--test-data", task_files["test"],
                          "--reward-model", trained_rm,
                          "--reward-weights", "correct=0,rm=1", "--kl-coef", "0.05", "--seed", str(seed),
                          "--steps", "300", "--eval-every", "0", "--quiet", "--out-dir", str(out)])
        before, after = res["before"]["eval/accuracy"], res["after"]["eval/accuracy"]
        print(f"seed {seed}: GRPO on the RM's reward only: held-out accuracy {before:.3f} -> {after:.3f}")
        assert "rollout/reward/rm" in res["last"] and "rollout/reward/correct" in res["last"]
        assert after > before, (seed, before, after)
        saved = sorted((out / "checkpoints").iterdir())[-1]
        assert abs(greedy_accuracy(str(saved)) - after) <= 0.02
        gains.append(after - before)
    assert sum(gains) / len(gains) >= 0.08, gains


@pytest.mark.slow
def test_a_sharded_rm_scores_as_the_whole_one_with_unequal_ranks(tmp_path):
    """--fsdp: the RM's weights are sharded over 2 gloo ranks (each holds about half); each forward
    all-gathers, so the rank with fewer micro-batches runs unread ones until both have run as many —
    without them the ranks hang (red check: the test's timeout). Scores equal the unsharded RM's."""
    import os
    import re
    import subprocess
    import sys

    model, tokenizer = build_rm()
    model.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    repo = Path(__file__).resolve().parent.parent
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--master_port", str(free_port()), "tests/rm_shard_check.py", str(tmp_path / "rm")],
                         cwd=repo, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    found = re.findall(r"rank (\d) max\|Δscore\| (\S+) held ([0-9.]+)", res.stdout)
    assert sorted(r for r, *_ in found) == ["0", "1"], res.stdout
    for _, diff, held in found:
        assert float(diff) <= 1e-5 and 0.4 < float(held) < 0.6, res.stdout
