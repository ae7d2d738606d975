"""A real tokenizer where the built-in character tokenizer hides bugs: SmolLM2-135M-Instruct's (byte-level
BPE, 49152 ids, a ChatML chat template, EOS = pad = <|im_end|> id 2), read from its GGUF file (the
`smollm2` fixture, tests/conftest.py). Stop tokens, chat-template prompts, the response mask when the pad
id is also the EOS that ended a response, detokenized rewards, rollout dumps, the token-in/token-out
frame of an environment turn, and where DCPO's confidence (examples/dcpo.py) starts among the tokens.
"""
from pathlib import Path

import pytest

from nanorl import dump, rewards
from nanorl.data import PromptFormat, build_prompts
from nanorl.episodes import ChatTurns
from nanorl.plugins import load_file
from nanorl.rollout import stop_token_ids
from nanorl.trajectory import Sample, collate

pytest.importorskip("gguf")
QUESTION = "Calculate 12 + 7."
TEMPLATE = "{prompt} Reply with only the final number."


@pytest.fixture(scope="module")
def tok(smollm2):
    from nanorl.gguf_model import load_tokenizer
    return load_tokenizer(smollm2)


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_the_prompt_is_the_chat_template_with_its_generation_prompt(tok):
    rows = [{"question": QUESTION, "answer": "19"}]
    prompts, _ = build_prompts(rows, tok, "question", "answer", 256, source="t",
                               fmt=PromptFormat(template=TEMPLATE))
    want = tok.apply_chat_template([{"role": "user", "content": TEMPLATE.format(prompt=QUESTION)}],
                                   add_generation_prompt=True, tokenize=False)
    assert tok.decode(prompts[0].ids) == want and want.endswith("<|im_start|>assistant\n")
    assert prompts[0].ids == encode(tok, want)  # the rendered text encoded once, specials whole
    assert prompts[0].label == "19"


def test_the_response_ends_at_im_end_and_the_mask_keeps_that_eos_although_it_is_the_pad_id(tok):
    class Model:  # the GGUF's generation config: eos <|im_end|>
        generation_config = type("G", (), {"eos_token_id": 2})()
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id == tok.eos_token_id == 2
    assert stop_token_ids(Model(), tok) == (2,)
    prompt = encode(tok, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    long = Sample(prompt_ids=prompt, response_ids=encode(tok, "The sum is 19.") + [2])
    short = Sample(prompt_ids=prompt, response_ids=encode(tok, "19") + [2])
    batch = collate([long, short], pad_id=tok.pad_token_id)
    # row 1 is right-padded with id 2, the same id as its real EOS: only the real one is a response token
    assert batch.response_mask[0].tolist() == [1] * long.response_length
    want = [1] * short.response_length + [0] * (long.response_length - short.response_length)
    assert batch.response_mask[1].tolist() == want


def test_rewards_read_the_detokenized_text_without_the_eos(tok):
    """Multi-digit numbers split into several BPE pieces and a leading space of its own: the reward sees
    the decoded text, specials dropped."""
    prompts, _ = build_prompts([{"q": QUESTION, "a": "1234"}], tok, "q", "a", 256, source="t",
                               fmt=PromptFormat())
    samples = [Sample(prompt_ids=prompts[0].ids, response_ids=encode(tok, text) + [2])
               for text in (" 1234", "1234", "12 34", "The answer is 1234.")]
    assert len(encode(tok, " 1234")) > 1  # several pieces
    runner = rewards.RewardRunner(rewards.BUILTIN["exact"], log=lambda s: None)
    assert rewards.score_samples(runner, tok, prompts, samples) == [1.0, 1.0, 0.0, 0.0]
    math = rewards.RewardRunner(rewards.BUILTIN["math"], timeout=10.0, log=lambda s: None)
    assert rewards.score_samples(math, tok, prompts, samples[3:]) == [1.0]
    math.close()


def test_a_dump_holds_each_bpe_piece_and_they_join_to_the_response(tok):
    text = "Sure! 12 + 7 = 19, so the answer is 19."
    ids = encode(tok, text) + [2]
    s = Sample(prompt_ids=encode(tok, "<|im_start|>assistant\n"), response_ids=ids,
               rollout_logprobs=[-0.5] * len(ids))
    rec = dump.records([s], tok, step=1)[0]
    pieces = rec["tokens"]["text"]
    assert len(pieces) == len(ids) > len(text.split())  # one piece per token, not per word
    assert "".join(pieces) == text + "<|im_end|>" == rec["response"]
    assert pieces[-1] == "<|im_end|>" and any(p.startswith(" ") for p in pieces)


def test_an_environment_turn_is_framed_as_the_chat_template_frames_it(tok):
    """Token-in/token-out: prompt ids + the sampled turn + the environment message's ids (encoded once,
    alone) decode to exactly the template's rendering of the conversation."""
    user, reply, observation = "What is 37 * 43?", "Let me compute. calc(37*43)", "1591"
    prompt = tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                     tokenize=False)
    ids = encode(tok, prompt) + encode(tok, reply) + [2]  # the model ends its turn with <|im_end|>
    ids += ChatTurns(tok).encode(observation, "tool", stop_id=2)
    turns = [{"role": "user", "content": user}, {"role": "assistant", "content": reply},
             {"role": "tool", "content": observation}]
    want = tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    assert tok.decode(ids) == want
    # and the sampled tokens are kept as sampled, never re-encoded with their neighbours
    assert ids[len(encode(tok, prompt)):][:len(encode(tok, reply))] == encode(tok, reply)


def test_dcpo_places_the_confidence_on_the_token_where_it_starts(tok, monkeypatch):
    """DCPO's reward parses the text (a character index) and must hand on a token index: a BPE word is one
    token of several characters, so the character index would point past the digit (the one token per
    character rule gave these responses no calibration signal at all)."""
    dcpo = load_file(str(Path(__file__).resolve().parents[1] / "examples" / "dcpo.py"))
    ids = encode(tok, "The answer is 42-9") + [2]
    with pytest.raises(ValueError, match="DCPO_TOKENIZER"):  # the default, character, tokenizer's decode
        dcpo.reward("3+4+9=", "The answer is 42-9", "16", Sample(prompt_ids=[1], response_ids=ids))
    monkeypatch.setattr(dcpo, "tokenizer", lambda: tok)  # what $DCPO_TOKENIZER=<the GGUF> loads
    for text in ("16-7", " 1234-5", "The answer is 42-9", "Sure: 3+4+9 = 16 -8", "The answer is 42"):
        ids = encode(tok, text) + [2]  # + <|im_end|>
        char = dcpo.parse(text)[2]
        raw = dcpo.reward("3+4+9=", text, "16", Sample(prompt_ids=[1], response_ids=ids))
        pos = int(raw["_dcpo/conf_pos"])
        assert tok.decode(ids[:pos], skip_special_tokens=True) == text[:char], text
        if char < len(text):  # the digit starts the token at `pos`
            digit = text[char:]
            assert tok.decode(ids[pos:], skip_special_tokens=True).startswith(digit), text
            assert digit not in tok.decode(ids[:pos]), text
        else:  # no confidence: the span is where it belongs, the <|im_end|>
            assert pos == len(ids) - 1, text
        # SmolLM2 splits digits (and a leading space) one per token: only the words move the position
        assert (pos == char) == (text in ("16-7", " 1234-5")), text
