"""Issue 30 m7: the HF engine's samples on a non-CPU device come from a generator seeded by the engine's
own CPU generator, so a per-batch seed (async workers, exact resume) fixes them there too. The device
path is forced on the CPU by standing in for rollout.sampling_generator's device test."""
import torch

from nanorl import rollout
from nanorl.rollout import HFEngine, SamplingConfig
from nanorl.task import build_model, build_tokenizer

SAMPLE_NEXT = rollout.sample_next


def engine_samples(monkeypatch, seed: int):
    seen = []

    def spy(*a, generator=None, **kw):
        seen.append(generator)
        return SAMPLE_NEXT(*a, generator=generator, **kw)
    monkeypatch.setattr(rollout, "sample_next", spy)
    # what a CUDA engine takes: the device branch (device_generator), here on the CPU
    monkeypatch.setattr(rollout, "sampling_generator", lambda g, device: rollout.device_generator(g, device))
    tok = build_tokenizer()
    torch.manual_seed(0)
    eng = HFEngine(build_model(len(tok), hidden=64), pad_id=tok.pad_token_id)
    sp = SamplingConfig(max_new_tokens=4, temperature=1.0, seed=seed, stop_token_ids=(tok.eos_token_id,))
    out = eng.generate([[3, 4, 5], [6, 7]], 4, sp)
    return [s.response_ids for s in out], seen


def test_device_samples_are_fixed_by_the_batch_seed(monkeypatch):
    a, seen = engine_samples(monkeypatch, seed=7)
    b, _ = engine_samples(monkeypatch, seed=7)
    c, _ = engine_samples(monkeypatch, seed=8)
    # every decode step drew from one device generator (never None: unseeded global draws)
    assert seen and all(g is seen[0] and g is not None for g in seen)
    assert a == b and a != c


def test_cpu_sampling_uses_the_engine_generator_itself():
    g = torch.Generator().manual_seed(3)
    assert rollout.sampling_generator(g, torch.device("cpu")) is g
    state = g.get_state()
    d1 = rollout.device_generator(g, torch.device("cpu"))
    g.set_state(state)
    d2 = rollout.device_generator(g, torch.device("cpu"))
    assert torch.equal(torch.rand(5, generator=d1), torch.rand(5, generator=d2))
