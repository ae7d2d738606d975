"""GGUF files as the starting policy (nanorl/gguf_model.py): a tiny Llama GGUF these tests write
themselves (the `gguf` package's GGUFWriter, 8-bit quantized, a byte-level tokenizer and a ChatML
template in its metadata) loads as the model it was written from, trains a step and exports a plain
Hugging Face directory; the real SmolLM2-135M-Instruct file does the same when it is on this machine
(tests/conftest.py `smollm2`: $NANORL_SMOLLM2_GGUF or ~/.cache/nanorl/, else the test skips saying how to
fetch it, `bash .ci/fetch-smollm2`, or fails where NANORL_REQUIRE_SMOLLM2=1).

What transformers needs in a GGUF's metadata (found by writing one): the architecture's keys
(llama.context_length, block_count, embedding_length, feed_forward_length, attention.head_count[_kv],
rope.dimension_count, attention.layer_norm_rms_epsilon), tokenizer.ggml.model "gpt2" with tokens,
token_type (3 = control: special tokens kept whole) and a NON-EMPTY merges list (an empty one is not
written and the loader then wants `scores`), the bos/eos/padding ids and tokenizer.chat_template. The
q/k weights are stored permuted as llama.cpp's converter does (transformers undoes it); no output.weight
means tied embeddings.
"""
import json
import os

import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("reasoning_gym")

import train  # noqa: E402
from nanorl import export, gguf_model  # noqa: E402
from nanorl.policy import load_model  # noqa: E402

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# HF Llama module → GGUF tensor name
TENSORS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
           "post_attention_layernorm": "ffn_norm"}
TASK = "reasoning_gym:basic_arithmetic?min_terms=2&max_terms=2&max_digits=1"


def llama_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf layout of a q/k projection (its rotary pairs interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: str, quantize: bool = True):
    """A 2-layer Llama (hidden 64, 4 heads, 2 KV heads, tied embeddings, seed 0) written to `path` as
    GGUF, its 2-D weights Q8_0 when `quantize`; returns the HF model it was written from."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    # the specials, the 256 bytes, and two merges' tokens
    tokens = SPECIAL + list(bytes_to_unicode().values()) + ["Ġt", "he"]
    cfg = LlamaConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=2, pad_token_id=2,
                      rms_norm_eps=1e-5)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny")
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(2)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_dimension_count(16)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL)))
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(CHATML)

    def add(name, t):
        t = t.detach().float().numpy()
        if quantize and t.ndim == 2:
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(t, q8), raw_dtype=q8)
        else:
            w.add_tensor(name, t)
    add("token_embd.weight", model.model.embed_tokens.weight)
    add("output_norm.weight", model.model.norm.weight)
    for i, layer in enumerate(model.model.layers):
        for module, name in TENSORS.items():
            t = layer.get_submodule(module).weight
            heads = {"attn_q": 4, "attn_k": 2}.get(name)
            add(f"blk.{i}.{name}.weight", llama_permute(t, heads) if heads else t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(path of the tiny 8-bit GGUF, the fp32 HF model it was written from)."""
    path = str(tmp_path_factory.mktemp("gguf") / "tiny.Q8_0.gguf")
    return path, write_tiny_gguf(path)


def chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_tiny_gguf_loads_dequantized_with_its_tokenizer(tiny, tmp_path):
    path, ref = tiny
    model, tok = load_model(path)
    # an ordinary fp32 model: nothing left of the GGUF quantizer, every weight trainable
    assert model.dtype == torch.float32 and not model.is_quantized and model.hf_quantizer is None
    assert not hasattr(model.config, "quantization_config")
    assert all(p.requires_grad for p in model.parameters())
    ids = chat_ids(tok, "Calculate 2 + 3. héllo the")
    want = "<|im_start|>user\nCalculate 2 + 3. héllo the<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids) == want
    assert (tok.eos_token, tok.pad_token_id) == ("<|im_end|>", 2)
    # the same function as the model it was written from, up to 8-bit rounding
    with torch.no_grad():
        a, b = ref(torch.tensor([ids])).logits, model(torch.tensor([ids])).logits
    assert (a - b).abs().max() < 0.05 * a.abs().max(), (a - b).abs().max()
    # unquantized, the round trip is exact (the q/k permutation is undone)
    exact = str(tmp_path / "f32" / "tiny.gguf")
    os.makedirs(os.path.dirname(exact))
    ref32 = write_tiny_gguf(exact, quantize=False)
    # a directory holding one GGUF file loads as that file
    model32, _ = load_model(os.path.dirname(exact))
    with torch.no_grad():
        assert torch.equal(ref32(torch.tensor([ids])).logits, model32(torch.tensor([ids])).logits)


def test_gguf_mistakes_are_one_line(tiny, tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match=r"nope.gguf: no such GGUF file"):
        gguf_model.locate(str(tmp_path / "nope.gguf"))
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(b"")
    with pytest.raises(ValueError, match=r"holds 2 GGUF files \(a.gguf, b.gguf\); name one"):
        gguf_model.locate(str(two))
    # a HF directory is never read as GGUF; a hub name neither
    (two / "config.json").write_text("{}")
    assert gguf_model.locate(str(two)) == (str(two), {}) and not gguf_model.is_gguf("Qwen/Qwen3-0.6B")
    real = gguf_model.importlib.util.find_spec
    monkeypatch.setattr(gguf_model.importlib.util, "find_spec", lambda n: None if n == "gguf" else real(n))
    with pytest.raises(ImportError, match=r"needs the gguf package \(pip install gguf\)$"):
        gguf_model.locate(tiny[0])


def run_one_step(model: str, out, *extra) -> dict:
    """train.main for one small step on a reasoning-gym task, with a held-out set, checkpoint at the end."""
    return train.main(["--model", model, "--train-data", f"{TASK}&size=32&seed=1",
                       "--test-data", f"{TASK}&size=4", "--reward", "reasoning_gym", "--steps", "1",
                       "--prompts-per-step", "2", "--samples-per-prompt", "2", "--max-new-tokens", "4",
                       "--eval-every", "0", "--pass-k", "1", "--threads", "1", "--quiet",
                       "--out-dir", str(out), *extra])


def exported(run_dir, out):
    """The run's checkpoint exported (python -m nanorl.export) and loaded back with plain transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export.main([str(run_dir), str(out)])
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(str(out))


def test_tiny_gguf_trains_a_step_and_exports(tiny, tmp_path, capsys):
    path, ref = tiny
    # a random model scores 0 everywhere: the entropy bonus alone gives the step a gradient
    res = run_one_step(path, tmp_path / "run", "--lr", "1e-3", "--no-skip-zero-advantage",
                       "--entropy-coef", "0.01")
    assert res["step"] == 1 and "eval/accuracy" in res["after"]
    # the held-out set was checked against the train set (nanorl/reasoning_tasks.py drop_seen)
    assert "questions that are in the train set" in capsys.readouterr().out
    model, tok = exported(tmp_path / "run", tmp_path / "hf")
    assert type(model).__name__ == "LlamaForCausalLM"
    start, _ = load_model(path)
    # trained: the exported weights moved from the GGUF's
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, start.get_parameter(n))]
    assert moved, "one step at lr 1e-3 changed no weight"
    assert chat_ids(tok, "2 + 3 = ?") == chat_ids(load_model(path)[1], "2 + 3 = ?")


def test_a_reasoning_gym_agent_trains_a_step_through_the_endpoint(tiny, tmp_path):
    """examples/agents/reasoning_gym_agent.py (the plain openai client, reasoning-gym's own checker) on
    reasoning_gym: data with the tiny GGUF's BPE tokenizer and ChatML template: every episode is one chat
    call through the endpoint, none fails, and the step trains on them (the SmolLM2 run of this recipe:
    docs/bench_results.md)."""
    res = train.main(["--model", tiny[0], "--train-data", f"{TASK}&size=32&seed=1",
                      "--agent", "examples/agents/reasoning_gym_agent.py:run", "--steps", "1",
                      "--prompts-per-step", "2", "--samples-per-prompt", "2", "--max-new-tokens", "4",
                      "--eval-every", "0", "--pass-k", "1", "--threads", "1", "--quiet", "--lr", "1e-3",
                      "--no-skip-zero-advantage", "--entropy-coef", "0.01", "--out-dir", str(tmp_path)])
    row = [json.loads(x) for x in open(tmp_path / "metrics.jsonl") if '"rollout/agent/episodes"' in x]
    assert res["step"] == 1 and len(row) == 1
    assert row[0]["rollout/agent/episodes"] == 4 and row[0]["rollout/agent/calls_per_episode"] == 1
    assert row[0]["rollout/agent/failed_frac"] == 0 and "train/loss" in row[0]


def test_the_reasoning_gym_agent_scores_as_the_reward_does():
    """The example agent's scoring (reasoning-gym's checker on the reply's final answer) equals
    --reward reasoning_gym's on right, wrong, tagged and empty replies."""
    from examples.agents import reasoning_gym_agent as agent
    from nanorl import reasoning_tasks

    row = reasoning_tasks.load_rows(TASK.split(":", 1)[1] + "&size=2&seed=3", "train")[0]
    answer = json.loads(row["answer"])["answer"]
    # the last number, not the first; the tag before any number
    replies = [answer, f"2 and 9 make {answer}.", f"<answer>{answer}</answer>, not {int(answer) + 1}",
               str(int(answer) + 1), "", "no"]
    got = [agent.score(r, row["answer"]) for r in replies]
    assert got == [reasoning_tasks.reward(row["prompt"], r, row["answer"]) for r in replies]
    assert got[:3] == [1.0, 1.0, 1.0] and got[3] == 0.0


@pytest.mark.slow
def test_smollm2_samples_trains_and_exports(smollm2, tmp_path):
    model, tok = load_model(smollm2)
    assert (model.config.num_hidden_layers, model.config.hidden_size, len(tok)) == (30, 576, 49152)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id == 2
    ids = torch.tensor([chat_ids(tok, "What is 17 + 25?")])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=True)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    # greedy, it restates the sum (FACTS.md: "17 + 25 = 32.")
    assert "17" in answer and "25" in answer, answer
    res = run_one_step(smollm2, tmp_path / "run")
    assert res["step"] == 1
    hf, hf_tok = exported(tmp_path / "run", tmp_path / "hf")
    assert type(hf).__name__ == "LlamaForCausalLM" and chat_ids(hf_tok, "hi") == chat_ids(tok, "hi")


LAPTOP = "<!-- laptop recipe: tests/test_gguf.py runs this line (sizes aside) -->"
SMALL = ["--steps", "1", "--prompts-per-step", "2", "--samples-per-prompt", "2", "--max-new-tokens", "4",
         "--eval-limit", "3", "--eval-every", "0", "--threads", "1", "--quiet"]


def readme_laptop_line() -> list[str]:
    """The README's laptop-recipe `python train.py` line (after its marker), continuation lines joined."""
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert LAPTOP in text, "README's laptop recipe lost its marker"
    block = text.split(LAPTOP, 1)[1].split("```bash", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    lines = [shlex.split(x, comments=True) for x in block.splitlines()]
    found = [x for x in lines if x[:2] == ["python", "train.py"]]
    assert len(found) == 1, block
    return found[0][2:]


@pytest.mark.slow
def test_the_readmes_laptop_recipe_runs_as_written(smollm2, tmp_path, capsys):
    """The README's real-model line itself, on the GGUF where .ci/fetch-smollm2 put it, sizes shrunk:
    it trains a step and prints the before/after accuracy on the held-out set it drew."""
    argv = readme_laptop_line()
    model = argv.index("--model") + 1
    assert argv[model].endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and "reasoning_gym" in argv
    argv[model] = smollm2
    res = train.main(argv + SMALL + ["--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert res["step"] == 1 and "accuracy before: " in out and "accuracy after: " in out
    # the held-out set lost the train set's questions, and said how many
    assert "questions that are in the train set" in out
