"""checkpoint.py, evaluation.py, dump.py and update.py take the objects they use (issue 31), not
train.py's Run: each public function is called here with the documented objects, built in the test,
and no Run.

- checkpoint: save a State (a tiny Qwen2, AdamW after one step, scheduler, loader, KL controller,
  counters, reward faults, engine sampler), resume it into a fresh State with other weights: every
  tensor and value equal, the random streams back at the save, metrics.jsonl cut back, the engine
  synced at the saved step; isolated_rng seeds the engine and puts every stream back;
- evaluation: evaluate with a scripted engine and EvalSampling: the metrics, the sampling each call
  got, a rank's slice, and a clear error when nothing can score the samples;
- dump: due(every, step); rollouts of a collated batch writes the batch's tensors, only when due and
  on rank 0; without a batch the trainer's fields are null; a cut is reported through `log`;
- update: train_on on a SimpleNamespace of exactly update.Learner's attributes takes the trainer's step.

Run: python -m pytest tests/test_module_inputs.py -q
"""
import dataclasses
import random
from collections import Counter
from types import SimpleNamespace

import pytest
import test_eval
import torch

from nanorl import checkpoint, dump
from nanorl.config import Config
from nanorl.data import Prompt, PromptLoader
from nanorl.evaluation import EvalSampling, EvalSet, evaluate
from nanorl.kl import AdaptiveKLController
from nanorl.rewards import RewardRunner, exact
from nanorl.rollout import RolloutEngine, SamplingConfig
from nanorl.task import build_model, build_tokenizer
from nanorl.trajectory import Sample, collate

# ----------------------------------------------------------------------------- checkpoint


class SyncedEngine(RolloutEngine):
    """An engine as checkpoint sees it: a sampler generator (`rng`), and update_weights recorded."""

    def __init__(self):
        self.generator = torch.Generator().manual_seed(11)
        self.synced = []

    def rng(self):
        return self.generator

    def update_weights(self, model, version):
        self.synced.append((model, version))


def tiny_state(seed: int) -> checkpoint.State:
    tok = build_tokenizer()
    model = build_model(len(tok), seed=seed, hidden=64, layers=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    prompts = [Prompt(ids=[i + 2], text=str(i), label=str(i)) for i in range(6)]
    return checkpoint.State(model=model, tokenizer=tok, optimizer=opt, scheduler=sched,
                            loader=PromptLoader(prompts, batch_size=2, seed=0),
                            kl_ctl=AdaptiveKLController(0.1, target=6.0, horizon=1000),
                            engine=SyncedEngine(), rewards=SimpleNamespace(faults=Counter()))


def advance(state: checkpoint.State) -> None:
    """One training step's worth of state: an AdamW step, the scheduler, a batch, the KL controller."""
    ids = torch.tensor([[2, 3, 4, 5]])
    state.model(input_ids=ids).logits.float().pow(2).mean().backward()
    state.optimizer.step()
    state.scheduler.step()
    state.loader.next_batch()
    state.kl_ctl.update(9.0, 64)
    state.counters.update(skipped_updates=2)
    state.rewards.faults["Timeout"] += 1
    torch.rand(3, generator=state.engine.generator)
    state.step = 3


def test_checkpoint_save_resume_with_a_state_and_no_run(tmp_path, capsys):
    cfg = Config.from_flags(out_dir=str(tmp_path), keep_checkpoints=2)
    a = tiny_state(seed=0)
    advance(a)
    metrics = tmp_path / "metrics.jsonl"
    logger = SimpleNamespace(file=open(metrics, "a"), print=lambda *x: None)
    logger.file.write('{"step": 3}\n')
    path = checkpoint.save(a, cfg, logger)
    assert path == str(tmp_path / "checkpoints" / "step_000003")
    files = set(checkpoint.verify(path)["files"])
    assert {"model.safetensors", "trainer_state.json", "trainer_state.pt"} <= files
    # what each stream draws next, from the save on
    nxt = (random.random(), torch.rand(2), torch.rand(2, generator=a.engine.generator))
    logger.file.write('{"step": 4}\n')

    b = tiny_state(seed=1)
    assert not torch.equal(b.model.lm_head.weight, a.model.lm_head.weight)
    assert checkpoint.resume(b, cfg, "latest", logger) == path
    logger.file.close()
    # the weights, AdamW's moments and step, the scheduler, loader, KL β, counters, faults: a's
    assert all(torch.equal(v, b.model.state_dict()[k]) for k, v in a.model.state_dict().items())
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert sorted(sa) == sorted(sb) and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
    assert float(sb[0]["step"]) == 1.0
    assert b.scheduler.state_dict()["last_epoch"] == 1
    assert b.optimizer.param_groups[0]["lr"] == pytest.approx(2e-4)
    assert b.loader.state_dict() == {"epoch": 0, "pos": 2} and b.kl_ctl.beta == a.kl_ctl.beta != 0.1
    assert b.counters == {"skipped_updates": 2} and b.rewards.faults == Counter({"Timeout": 1})
    assert b.step == 3 and b.engine.synced == [(b.model, 3)]
    # every random stream is where it was at the save
    assert random.random() == nxt[0] and torch.equal(torch.rand(2), nxt[1])
    assert torch.equal(torch.rand(2, generator=b.engine.generator), nxt[2])
    # metrics.jsonl cut back to the checkpoint: the step logged after it is gone
    assert metrics.read_text() == '{"step": 3}\n'

    # no logger: the notes go to stdout; a missing checkpoint named "latest" starts from scratch
    c = tiny_state(seed=2)
    assert checkpoint.resume(c, Config.from_flags(out_dir=str(tmp_path / "none")),
                             "latest") is None and c.step == 0
    assert "no checkpoint" in capsys.readouterr().out


def test_isolated_rng_seeds_the_engine_and_restores_every_stream():
    engine = SyncedEngine()
    torch.manual_seed(5)
    want = (torch.rand(2), torch.rand(2, generator=engine.generator))
    torch.manual_seed(5)
    engine.generator.manual_seed(11)
    with checkpoint.isolated_rng(engine, seed=7):
        got = torch.rand(3, generator=engine.generator)
        torch.rand(4)
    assert torch.equal(got, torch.rand(3, generator=torch.Generator().manual_seed(7)))
    assert torch.equal(torch.rand(2), want[0])
    assert torch.equal(torch.rand(2, generator=engine.generator), want[1])


# ----------------------------------------------------------------------------- evaluation


# the scripted engine and digit tokenizer of tests/test_eval.py (the same evaluation, without a Run)
ScriptedEngine, DigitTok = test_eval.ScriptedEngine, test_eval.Tok


def eval_prompts(ids):
    return [Prompt(ids=[i], text=str(i), label=str(i)) for i in ids]


def test_evaluate_with_objects_and_no_run():
    sets = [EvalSet("a", eval_prompts([0, 1, 2, 3])), EvalSet("b", eval_prompts([4, 6, 7]))]
    sampling = EvalSampling(max_new_tokens=5, stop_token_ids=(0,), pass_k=3, temperature=0.7, top_k=4)
    engine = ScriptedEngine()
    m = evaluate(sets, engine, sampling, seed=0, rewards=RewardRunner(exact), tokenizer=DigitTok())
    assert m["eval/a/accuracy"] == 0.5 and m["eval/b/accuracy"] == pytest.approx(2 / 3)
    assert m["eval/accuracy"] == pytest.approx(4 / 7) and m["eval/pass@3"] == 1.0
    assert m["eval/a/response_length_mean"] == pytest.approx((1 + 2 + 3 + 1) / 4)
    (_, k0, greedy), (_, k1, sampled) = engine.calls[:2]
    assert (k0, greedy.temperature, greedy.max_new_tokens, greedy.stop_token_ids) == (1, 0.0, 5, (0,))
    assert (k1, sampled.temperature, sampled.top_k, sampled.max_new_tokens) == (3, 0.7, 4, 5)
    # rank 1 of 2 scores prompts 1, 3 of "a"
    engine = ScriptedEngine()
    m = evaluate(sets[:1], engine, sampling, seed=0, rewards=RewardRunner(exact), tokenizer=DigitTok(),
                 rank=1, world=2)
    assert engine.calls[0][0] == 2 and m["eval/a/accuracy"] == 0.0
    assert evaluate([], engine, sampling, seed=0) == {}
    with pytest.raises(ValueError, match="needs rewards and tokenizer"):
        evaluate(sets, engine, sampling, seed=0)


def test_eval_sampling_from_config_zero_means_trainings():
    cfg = Config.from_flags(pass_k=2, max_new_tokens=6, temperature=0.9, top_p=0.8)
    assert EvalSampling.from_config(cfg, [1]) == EvalSampling(6, (1,), 2, 0.9, 0, 0.8)
    cfg = Config.from_flags(pass_k=2, max_new_tokens=6, eval_max_new_tokens=12, eval_temperature=0.5)
    assert EvalSampling.from_config(cfg, (1, 2)) == EvalSampling(12, (1, 2), 2, 0.5, 0, 1.0)


# ----------------------------------------------------------------------------- dump


class CharTokenizer:
    vocab = ["<pad>", "<eos>", "a", "b", " ", "é", "<b>"]

    def decode(self, ids):
        return "".join(self.vocab[i] for i in ids)

    def batch_decode(self, seqs):
        return [self.decode(s) for s in seqs]


def dump_batch():
    samples = [Sample(prompt_ids=[2, 3], response_ids=[2, 4, 5, 1], rollout_logprobs=[-0.1, -1.5, -2.2, -0.3],
                      reward=1.0, group_id=0, weight_version=3),
               Sample(prompt_ids=[2], response_ids=[6, 1], rollout_logprobs=[-0.7, -0.01], loss_mask=[0, 1],
                      reward=0.0, group_id=0, weight_version=3)]
    batch = collate(samples, pad_id=0)
    g = torch.Generator().manual_seed(0)
    # [B, T] as rl_step attaches them (the recompute ran: every row scored)
    batch.tensors.update(**{k: torch.randn(2, 4, generator=g) for k in ("advantages", "trainer_logprobs",
                                                                         "trainer_entropy")})
    return samples, batch


def test_dump_rollouts_of_a_batch_with_objects_and_no_run(tmp_path):
    assert dump.due(2, 4) and not dump.due(2, 3) and not dump.due(0, 4)
    samples, batch = dump_batch()
    kw = dict(tokenizer=CharTokenizer(), every=2, out_dir=str(tmp_path), max_mb=1.0)
    assert dump.rollouts(samples, batch, step=3, **kw) is None
    assert dump.rollouts(samples, batch, step=4, rank=1, **kw) is None
    assert not (tmp_path / "rollouts").exists()
    path = dump.rollouts(samples, batch, step=4, **kw)
    assert path == str(tmp_path / "rollouts" / "step_000004.jsonl")
    back = dump.read(path)
    assert [r["response"] for r in back] == ["a é<eos>", "<b><eos>"] and [r["step"] for r in back] == [4, 4]
    valid = batch.attention_mask[:, batch.prompt_width:].bool()
    td = batch.tensors
    for field, want in (("advantage", td.advantages), ("trainer_logprob", td.trainer_logprobs),
                        ("entropy", td.trainer_entropy), ("loss_mask", batch.response_mask),
                        ("rollout_logprob", batch.rollout_logprobs)):
        assert torch.equal(dump.as_tensor(back, field, 4)[valid], want.float()[valid]), field
    assert back[1]["tokens"]["loss_mask"] == [0, 1]

    # --debug-rollout-only: no batch, the trainer's fields are null; a cut is told through `log`
    told = []
    path = dump.rollouts(samples, None, step=6, **{**kw, "max_mb": 600 / 2**20}, log=told.append)
    back = dump.read(path)
    assert len(back) == 1 and back[0]["tokens"]["trainer_logprob"] is None
    assert back[0]["tokens"]["rollout_logprob"] == samples[0].rollout_logprobs
    assert len(told) == 1 and "cut at 1 of 2 samples" in told[0]


# ----------------------------------------------------------------------------- update


def test_train_on_with_a_learner_and_no_run(tmp_path):
    """update.train_on given an update.Learner record built by hand from the run's parts (not train.py's
    Run, nor its learner_of) takes the very step the trainer takes: the same weights, bit for bit."""
    import train
    from nanorl import update
    from nanorl.config import parse_args
    from nanorl.task import make_default
    task = make_default(str(tmp_path / "task"), seed=0)
    argv = ["--model", task["model"], "--train-data", task["train"], "--test-data", task["test"],
            "--prompts-per-step", "2", "--samples-per-prompt", "4", "--threads", "1", "--quiet",
            "--kl-coef", "0.05", "--no-skip-zero-advantage", "--ppo-epochs", "2"]
    weights = []
    for lift in (False, True):
        run = train.setup(parse_args(argv + ["--out-dir", str(tmp_path / str(lift))]))
        samples = run.engine.generate([p.ids for p in run.loader.next_batch()], 4,
                                      SamplingConfig(max_new_tokens=6, seed=5))
        batch = collate(samples, run.tokenizer.pad_token_id)
        g = torch.Generator().manual_seed(0)
        batch.tensors.advantages = torch.randn(batch.response_mask.shape, generator=g) * batch.response_mask
        batch.tensors.ref_logprobs = run.ref(batch, None)[0].detach()
        fields = [f.name for f in dataclasses.fields(update.Learner)]
        learner = update.Learner(**{k: getattr(run, k) for k in fields}) if lift else train.learner_of(run)
        metrics = update.train_on(learner, batch)
        assert metrics["grad_norm"] > 0 and metrics["kl_loss"] != 0  # a real step, the KL term in it
        weights.append([p.detach().clone() for p in run.model.parameters()])
        run.logger.close()
    assert all(torch.equal(a, b) for a, b in zip(*weights))
