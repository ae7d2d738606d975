"""train.py end to end on the built-in task: presets, bad input, gradient-accumulation invariance,
loading a model by path. (Learning tests live in tests/test_learning.py.)"""
import json

import pytest
import torch

import train
from nanorl import build, scoring, update
from nanorl.config import PRESETS, Config, parse_args
from nanorl.losses import AGG_MODES
from nanorl.rollout import HFEngine, SamplingConfig, stop_token_ids
from nanorl.trajectory import collate

TINY = ["--steps", "2", "--prompts-per-step", "4", "--samples-per-prompt", "4", "--eval-every", "0",
        "--eval-limit", "8", "--quiet", "--pass-k", "2"]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """One built-in task + warm-started model shared by every test here (built once, ~seconds)."""
    out = tmp_path_factory.mktemp("task")
    from nanorl.task import make_default
    return make_default(str(out), seed=0)


def args(task_dir, tmp_path, *extra):
    return ["--model", task_dir["model"], "--train-data", task_dir["train"], "--test-data", task_dir["test"],
            "--out-dir", str(tmp_path), *TINY, *extra]


def test_presets_listed_and_flags_override():
    cfg = parse_args(["--algo", "dapo", "--clip-high", "0.3"])
    assert cfg.dapo.filter_groups and cfg.clip_high == 0.3 and cfg.loss_agg == "token-mean"
    assert parse_args(["--algo", "ppo"]).vf_coef > 0
    with pytest.raises(SystemExit):
        parse_args(["--algo", "nope"])
    with pytest.raises(ValueError, match="valid: grpo, dr_grpo"):
        Config.from_flags(algo="nope")
    with pytest.raises(ValueError, match="top_p must be in"):
        Config.from_flags(top_p=0.0)
    with pytest.raises(ValueError, match="gae needs a critic"):
        Config.from_flags(advantage="gae")
    with pytest.raises(ValueError, match="gae_chunked needs a critic"):  # issue 19: was not checked
        Config.from_flags(advantage="gae_chunked")
    with pytest.raises(ValueError, match="gamma does nothing with advantage grpo"):
        Config.from_flags(gamma=0.9)
    with pytest.raises(ValueError, match="sapo_tau_pos needs policy_loss sapo"):
        Config.from_flags(sapo_tau_pos=2.0)


@pytest.mark.parametrize("algo", list(PRESETS))
def test_every_preset_runs(algo, task_dir, tmp_path):
    # DAPO drops groups whose rewards are all equal: 8 samples per group keep some (seed 0: both steps train)
    filtered = PRESETS[algo][1].get("filter_groups")
    extra = ("--samples-per-prompt", "8") if filtered else ()
    if PRESETS[algo][1].get("advantage") == "opd":  # distillation needs a teacher: the policy's own copy
        extra += ("--teacher", task_dir["model"], "--no-skip-zero-advantage")  # (its advantages are 0)
    res = train.main(args(task_dir, tmp_path, "--algo", algo, *extra))
    assert res["step"] == 2
    lines = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    steps = [x for x in lines if "train/loss" in x]
    # a filter that trains on nothing fails
    assert len(steps) == 2 or (filtered and len(steps) >= 1), len(steps)
    if filtered:
        kept = [x["rollout/groups_kept_frac"] for x in lines if "rollout/groups_kept_frac" in x]
        assert len(kept) == 2 and max(kept) > 0, kept
    for x in steps:  # every logged number is finite and the phases are timed
        assert all(v == v and abs(v) != float("inf") for v in x.values() if isinstance(v, float))
        assert {"perf/time/generate", "perf/time/reward", "perf/time/train", "perf/time/sync"} <= set(x)
    assert "accuracy before:" not in json.dumps(lines)  # printed, not logged as text


def test_bad_input_errors(task_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{not json}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        train.main(args(task_dir, tmp_path, "--train-data", str(bad)))
    nokey = tmp_path / "nokey.jsonl"
    nokey.write_text('{"question": "1+1=", "answer": "2"}\n')
    with pytest.raises(ValueError, match="no key 'prompt'; keys present"):
        train.main(args(task_dir, tmp_path, "--train-data", str(nokey)))


def test_nonfinite_gradient_skips_update(task_dir, tmp_path, monkeypatch):
    real = update.micro_step

    def poisoned(run, mb, lcfg, n_tok, n_seq):
        loss, m = real(run, mb, lcfg, n_tok, n_seq)
        return loss * float("nan"), m
    monkeypatch.setattr(update, "micro_step", poisoned)
    res = train.main(args(task_dir, tmp_path))
    assert res["counters"]["skipped_updates"] == 2 and res["step"] == 2


def _grads(run, batch, rows_list, lcfg):
    for p in run.model.parameters():
        p.grad = None
    mask = batch.response_mask
    n_tok, n_seq = float((mask > 0).sum()), float((mask > 0).any(-1).sum())
    for rows in rows_list:
        loss, _ = update.micro_step(run, batch.select(rows), lcfg, n_tok, n_seq)
        loss.backward()
    return [p.grad.clone() for p in run.model.parameters() if p.grad is not None]


@pytest.mark.parametrize("mode", AGG_MODES)
def test_gradient_accumulation_invariance(mode, task_dir, tmp_path):
    """One optimizer step's gradient is the same whether its batch is one micro-batch or several
    (TRL #3021): denominators come from the whole step, not from each micro-batch."""
    cfg = parse_args(args(task_dir, tmp_path, "--loss-agg", mode, "--kl-coef", "0.01", "--entropy-coef",
                          "0.01",
                          "--max-new-tokens", "6"))
    run = train.setup(cfg)
    samples = run.engine.generate([p.ids for p in run.loader.next_batch()], 4, SamplingConfig(
        max_new_tokens=6, stop_token_ids=stop_token_ids(run.model, run.tokenizer)))
    for i, s in enumerate(samples):
        s.reward = float(i % 3 == 0)
    batch = collate(samples, run.tokenizer.pad_token_id)
    assert len({s.response_length for s in samples}) > 1  # ragged lengths make the test meaningful
    with torch.no_grad():
        batch.tensors.ref_logprobs = run.ref(batch, None)[0]
        batch.tensors.old_logprobs = scoring.forward(run.cfg, run.model, batch, None)[0] - 0.05
    batch.tensors.advantages = torch.randn_like(batch.rollout_logprobs)
    lcfg = update.loss_config(run)
    whole = _grads(run, batch, [list(range(16))], lcfg)
    split = _grads(run, batch, [[0, 5, 9], [1, 2, 3, 4, 6], [7, 8], [10, 11, 12, 13, 14, 15]], lcfg)
    assert len(whole) == len(split) > 0  # the same parameters got gradients (zip would hide a missing one)
    for a, b in zip(whole, split):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), (a - b).abs().max()


def test_model_saved_loads_with_transformers(task_dir, tmp_path):
    res = train.main(args(task_dir, tmp_path, "--steps", "1"))
    from transformers import AutoModelForCausalLM
    path = sorted((tmp_path / "checkpoints").glob("step_*"))[-1]
    m = AutoModelForCausalLM.from_pretrained(path)
    assert m.config.hidden_size == 128 and res["step"] == 1


def test_engine_sleeps_through_training_and_wakes_for_the_sync(task_dir, tmp_path, monkeypatch):
    """Issue 4: an engine with a sleep mode (vLLM on GPU) gives its memory back from after the rollout
    until the weight sync: generate → sleep → train → update_weights, every step. update_weights wakes
    the engine itself, weights first and KV cache after the stream (tests/test_vllm_engine.py)."""
    events = []

    class SleepyEngine(HFEngine):
        def generate(self, *a, **k):
            assert not events or events[-1] != "sleep", "generated while asleep"
            events.append("generate")
            return super().generate(*a, **k)

        def sleep(self, level):
            events.append(f"sleep{level}")

        def wake_up(self):
            events.append("wake_up")

        def update_weights(self, model, version):
            events.append("update_weights")
            super().update_weights(model, version)

    real_train = train.train_on
    monkeypatch.setattr(build, "HFEngine", SleepyEngine)
    monkeypatch.setattr(train, "train_on", lambda run,
                        batch: events.append("train") or real_train(run, batch))
    train.main(args(task_dir, tmp_path, "--sleep-level", "2"))
    step = ["generate", "sleep2", "train", "update_weights"]
    evaluation = ["generate", "generate"]  # held-out greedy + pass@k, before and after, engine awake
    assert events == ["update_weights"] + evaluation + step + step + evaluation  # first: setup's sync


def _metrics(tmp_path):
    return [x for x in map(json.loads, open(tmp_path / "metrics.jsonl")) if "train/loss" in x]


def _weights(tmp_path):
    from safetensors.torch import load_file
    path = sorted((tmp_path / "checkpoints").glob("step_*"))[-1]
    return load_file(str(next(path.glob("*.safetensors"))))


def test_kl_in_the_reward_reaches_grpo_and_is_logged(task_dir, tmp_path):
    """Issue 19: `--algo grpo --kl-in-reward` used to train with no KL at all (grpo swallowed the token
    rewards) and log none. Step 1 starts at π = π_ref (KL 0); at step 2 the KL is logged, and the
    update differs from a β ≈ 0 run (1e-12: below float resolution next to the 0/1 scores)."""
    runs = {}
    for beta in ("0.1", "1e-12"):
        out = tmp_path / beta
        train.main(args(task_dir, out, "--algo", "grpo", "--kl-in-reward", "--kl-coef", beta, "--threads",
                        "1"))
        runs[beta] = (_metrics(out), _weights(out))
    steps = runs["0.1"][0]
    assert (steps[0]["train/kl_ref"] == 0.0 and steps[1]["train/kl_ref"] > 0.0
            and steps[1]["train/kl_loss"] == 0.0)
    w_kl, w_0 = runs["0.1"][1], runs["1e-12"][1]
    assert any(not torch.equal(w_kl[k], w_0[k]) for k in w_kl)


@pytest.mark.parametrize("placement", [("--kl-in-reward",), ()], ids=["in_reward", "in_loss"])
def test_kl_target_raises_beta_when_kl_exceeds_it(placement, task_dir, tmp_path):
    """`--kl-target` read the loss KL (0 with the KL in the reward), so β shrank every step. Step 1:
    KL 0 < target, β falls; step 2: KL > target, β rises — in both placements."""
    train.main(args(task_dir, tmp_path, "--algo", "grpo", "--kl-coef", "0.1", "--kl-target", "1e-9",
                    "--threads", "1", *placement))
    steps = _metrics(tmp_path)
    assert steps[1]["train/kl_ref"] > 1e-9
    assert steps[0]["train/kl_beta"] < 0.1 and steps[1]["train/kl_beta"] > steps[0]["train/kl_beta"]


def _otb_by_hand(G, logp, ssq, mask, index):
    """OTB with a Python loop over groups and timesteps (right-padded rows): W_t = Σ_{j≤t} w_j,
    w_j = 1 − 2π_j + Σπ²_j; B_t = Σ_i G W / Σ_i W over the live samples; a lone timestep gets 0."""
    B, T = mask.shape
    w = (1 - 2 * logp.exp() + ssq).clamp(min=0) * mask
    W = w.cumsum(1)
    out = torch.zeros(B, T)
    for g in index.unique():
        rows = (index == g).nonzero().flatten().tolist()
        for t in range(T):
            live = [i for i in rows if mask[i, t] > 0]
            if len(live) < 2:
                continue
            den = sum(float(W[i, t]) for i in live)
            base = (sum(float(G[i, t] * W[i, t]) for i in live) / den if den > 1e-6
                    else sum(float(G[i, t]) for i in live) / len(live))
            for i in live:
                out[i, t] = G[i, t] - base
    return out


def test_otb_reads_sum_sq_probs_from_the_logprob_pass(task_dir, tmp_path, monkeypatch):
    """Issue 19: the otb preset fell back to w = 1 (no Σπ², no old logprobs). Now the recompute pass
    returns Σ_v π_v² (fused, no extra forward): it matches the materialised softmax, and the
    advantage matches a hand OTB and differs from the w = 1 fallback."""
    seen = []
    monkeypatch.setattr(train, "train_on", lambda run, batch: seen.append((run, batch)) or {})
    train.main(args(task_dir, tmp_path, "--algo", "otb", "--steps", "1", "--threads", "1"))
    run, batch = seen[0]
    td, mask = batch.tensors, batch.response_mask
    P, T = batch.prompt_width, mask.shape[1]
    with torch.no_grad():
        logits = run.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                           position_ids=batch.position_ids).logits[:, P - 1:P - 1 + T].float()
    p = (logits / run.cfg.sampling.temperature).softmax(-1)
    valid = mask > 0
    assert torch.allclose(td.sum_sq_probs[valid], (p * p).sum(-1)[valid], atol=1e-5)
    assert torch.allclose(td.old_logprobs[valid],
                          p.gather(-1, batch.response_ids[..., None])[..., 0].log()[valid], atol=1e-4)
    G = batch.rewards[:, None] * mask
    hand = _otb_by_hand(G, td.old_logprobs, td.sum_sq_probs, mask, batch.group_ids)
    assert torch.allclose(td.advantages, hand, atol=1e-5)
    from nanorl.advantage import otb
    fallback, _ = otb(mask=mask, index=batch.group_ids, scores=batch.rewards)  # w = 1
    assert not torch.allclose(td.advantages, fallback, atol=1e-3)


@pytest.mark.parametrize("name", ["gae", "gae_chunked"])
def test_both_gae_estimators_are_whitened(name, task_dir, tmp_path, monkeypatch):
    """Issue 19: `gae_chunked` chosen as the advantage skipped the whitening (train.py tested == "gae")."""
    seen = []
    monkeypatch.setattr(train, "train_on", lambda run, batch: seen.append(batch) or {})
    train.main(args(task_dir, tmp_path, "--algo", "ppo", "--advantage", name, "--steps", "1", "--threads",
                    "1"))
    adv, mask = seen[0].tensors.advantages, seen[0].response_mask
    v = adv[mask > 0]
    assert abs(float(v.mean())) < 1e-5 and abs(float(v.var()) - 1) < 1e-3


def test_off_policy_flags_reach_the_step(task_dir, tmp_path):
    """TIS with a lower clip at sequence level, OPSM and the IS-corrected KL, wired end to end: the
    weight metrics are logged, and --unbiased-kl changes the KL of the off-policy second epoch."""
    kl = {}
    for extra in ((), ("--unbiased-kl",)):
        out = tmp_path / ("u" if extra else "plain")
        train.main(args(task_dir, out, "--kl-coef", "0.1", "--ppo-epochs", "2", "--tis-cap", "1.5",
                        "--tis-low",
                        "0.5", "--is-level", "sequence", "--opsm-delta", "1e-6", "--threads", "1", *extra))
        steps = _metrics(out)
        assert {f"train/{k}" for k in ("is_weight_mean", "is_weight_max", "is_clipfrac", "is_ess",
                                       "is_ratio_var",
                "is_ratio_tail", "opsm_maskfrac", "kl_ref", "mismatch/ratio_ess")} <= set(steps[0])
        kl[bool(extra)] = steps[0]["train/kl_ref"]
    assert kl[True] != kl[False]
