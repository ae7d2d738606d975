"""Built-in tool environments: a calculator on the built-in task, and a Python tool for real models.

Environments for the multi-turn driver (nanorl/episodes.py): they shape link 1 (rollout, as episodes of
model and tool turns) and link 2 (the reward). `--env calc` (`CalcEnv`): the built-in task (sums of three
one-digit numbers) with a calculator the model may call before answering; `make_calc_task(out_dir)` writes its
data, tokenizer and model (train.py builds it for `--env calc` when no --model is given).
`--env python_tool` (`PythonToolEnv`): ChatML-style (Qwen2.5 / Hermes) tool calls for real chat models,
answered with a Python expression's value, the final answer graded by the math reward. Key choice: the
expression runs through an AST walker (numbers, arithmetic, a few math functions) in a worker process
with a timeout — a guard against accidents, not a sandbox for hostile code. How train.py finds and wires
an environment (the end of this file): `load_env` (a built-in name, `module:Class` or
`file.py:Class`), and `episode_runner` (the driver with the run's caps, tool timeout and prompt format;
nanorl/config.py checks the --env flags). An episode of each: the class docstrings.

Test: python -m pytest tests/test_env.py -q
"""
from __future__ import annotations

import ast
import json
import math
import operator
import os
import random
import re
from dataclasses import replace

import torch

from nanorl import task
from nanorl.env import Env, Step
from nanorl.episodes import EpisodeRunner
from nanorl.plugins import load_object

# ----------------------------------------------------------------------------- the calculator task
CALL = re.compile(r"calc\(([0-9+\-]{1,32})\)")
EXPR = re.compile(r"-?\d+(?:[+-]\d+)*")
# the default characters keep their ids; six appended
CALC_CHARS = task.CHARS + list("cal()>")
# The model's turns end with <eos>; a tool message is ">" + value + "=" (the "=" hands the turn back,
# as it ends the prompt); a user message is its content (so prompts are the default task's "a+b+c=").
CALC_TEMPLATE = ("{%- for m in messages -%}{%- if m['role'] == 'assistant' -%}{{ m['content'] + '<eos>' }}"
                 "{%- elif m['role'] == 'tool' -%}{{ '>' + m['content'] + '=' }}"
                 "{%- else -%}{{ m['content'] }}{%- endif -%}{%- endfor -%}")


def calc(expression: str) -> int:
    """The calculator: a sum/difference of integers, e.g. "3+4+9" → 16 (raises ValueError otherwise)."""
    if not EXPR.fullmatch(expression):
        raise ValueError(f"calc: not a +/- expression of integers: {expression!r}")
    return sum(int(x) for x in re.findall(r"[+-]?\d+", expression))


class CalcEnv(Env):
    """The built-in task with a calculator. Reward 1 for the exact sum, else 0. An episode on "3+4+9=":

        3+4+9=  calc(3+4+9)<eos>  >16=  16<eos>
        prompt  model turn 1      tool  model turn 2 (the answer; reward 1 if it is the sum, else 0)

    A turn that is a call `calc(<digits and + ->)` gets the value back as a tool message (">16=" is how
    this task's chat template frames one); any other turn is the final answer. The tiny model gets
    three-number sums right about a fifth of the time on its own but copies well, so a call that hands
    it the sum measurably pays off: RL raises the tool-use rate and, with it, the accuracy
    (tests/test_env_learning.py). The calculator takes any +/- expression, so calling it on two of the
    numbers and adding the third in the head is a policy too (a worse one). The task variant needs
    letters and parentheses, so it has its own tokenizer (the default task's tokenizer and model are
    unchanged) and its own warm start: most SFT transcripts answer directly, `tool_fraction` of them
    call the calculator first — as a real model knows a tool format before RL teaches it when to use
    it."""
    # calc is a trusted pure function: in-process, no worker round trip per call
    tool_timeout = 0.0

    def reset(self, prompt):
        self.label = str(prompt.label).strip()
        # the prompt as the data pipeline rendered it: "a+b+c="
        return None

    def step(self, action):
        text = action.text.strip()
        call = CALL.fullmatch(text)
        if call is not None:
            try:
                value = str(self.call(calc, call.group(1)))
            # e.g. "calc(3++4)": the tool says so, the model may try again
            except ValueError:
                value = "-"
            return Step(value, 0.0, False, {"tool_calls": 1})
        return Step(None, 1.0 if text == self.label else 0.0, True, {})


def build_calc_tokenizer():
    """The default task's character tokenizer plus the letters of calc( ) and ">", with CALC_TEMPLATE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([task.PAD, task.EOS] + CALC_CHARS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=task.PAD))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=task.PAD, eos_token=task.EOS)
    tok.chat_template = CALC_TEMPLATE
    return tok


def calc_chat(item: dict, use_tool: bool) -> list[dict]:
    """One SFT transcript: the direct answer, or a calculator call on the whole sum, then the answer."""
    asst = [{"role": "assistant", "content": item["answer"]}]
    if use_tool:
        asst = [{"role": "assistant", "content": f"calc({item['prompt'].rstrip('=')})"},
                {"role": "tool", "content": str(calc(item["prompt"].rstrip("=")))}] + asst
    return [{"role": "user", "content": item["prompt"]}] + asst


def warm_start_chats(model, tokenizer, chats: list[list[dict]], steps: int, batch_size: int = 128,
                     lr: float = 1e-3, seed: int = 0) -> None:
    """SFT on chat transcripts, cross-entropy on assistant tokens only (tool messages are context:
    the same loss mask RL uses, nanorl/trajectory.py chat_tokens_and_mask). Each batch runs as two
    forwards, short and long rows, each trimmed to its own longest (direct answers are a third of a
    tool transcript's length); the loss is the mean over all the batch's trained tokens."""
    from nanorl.trajectory import chat_tokens_and_mask

    rows = [chat_tokens_and_mask(c, tokenizer) for c in chats]
    width = max(len(ids) for ids, _ in rows)
    lengths = torch.tensor([len(ids) for ids, _ in rows])  # [N]
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)  # [N, S] right-padded
    labels = torch.full((len(rows), width), -100)                 # [N, S] -100 = not trained on
    for i, (r, m) in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        labels[i, :len(r)] = torch.where(torch.tensor(m) > 0, torch.tensor(r), -100)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    split = (int(lengths.min()) + int(lengths.max())) // 2
    model.train()
    for _ in range(steps):
        pick = torch.randint(len(rows), (batch_size,), generator=gen)
        total, count = 0.0, int((labels[pick] != -100).sum())
        for part in (pick[lengths[pick] <= split], pick[lengths[pick] > split]):
            if part.numel() == 0:
                continue
            w = int(lengths[part].max())
            x, y = ids[part, :w], labels[part, :w]  # [b, w]
            logits = model(input_ids=x, attention_mask=(x != tokenizer.pad_token_id).long()).logits[:, :-1]
            total = total + torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                              y[:, 1:].flatten(),
                                                              ignore_index=-100, reduction="sum")
        opt.zero_grad()
        (total / count).backward()
        opt.step()
    model.eval()


def make_calc_task(out_dir: str, seed: int = 0, sft_steps: int = 60, tool_fraction: float = 0.35,
                   hidden: int = 128) -> dict:
    """The calculator variant of the built-in task under `out_dir`: the same train/test problems
    (nanorl/task.py problems), the calc tokenizer, a tiny Qwen2 warm-started on transcripts of which
    `tool_fraction` call the calculator. {"model", "train", "test"}; an existing model is reused."""
    model_dir = os.path.join(out_dir, f"qwen2-calc-h{hidden}-sft{sft_steps}-tool{tool_fraction:g}-seed{seed}")
    paths = {"model": model_dir, "train": os.path.join(out_dir, "train.jsonl"),
             "test": os.path.join(out_dir, "test.jsonl")}
    train, test = task.problems(seed=0)
    os.makedirs(out_dir, exist_ok=True)
    for split, items in (("train", train), ("test", test)):
        with open(paths[split], "w") as f:
            f.writelines(json.dumps(x) + "\n" for x in items)
    if os.path.exists(os.path.join(model_dir, "config.json")):
        return paths
    tokenizer = build_calc_tokenizer()
    model = task.build_model(len(tokenizer), seed=seed, hidden=hidden)
    rng = random.Random(seed)
    warm_start_chats(model, tokenizer, [calc_chat(x, rng.random() < tool_fraction) for x in train],
                     steps=sft_steps, seed=seed)
    task.save_model_dir(model, tokenizer, model_dir)
    return paths


# ----------------------------------------------------------------------------- a Python tool, ChatML
TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
PYTHON_TOOL_PROMPT = ('You can evaluate a Python arithmetic expression by writing\n<tool_call>\n{"name": '
                      '"python", '
                      '"arguments": {"expression": "..."}}\n</tool_call>\nand you will get its value. When '
                      'you '
                      'know the answer, give it in \\boxed{}.\n\n')
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}
_FUNCS = {"sqrt": math.sqrt, "log": math.log, "exp": math.exp, "sin": math.sin, "cos": math.cos,
          "factorial": math.factorial, "abs": abs, "round": round, "min": min, "max": max}


def python_expression(expression: str) -> str:
    """The value of an arithmetic Python expression (numbers, + - * / // % **, a few math functions)."""
    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value,
                                                         (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.operand))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS
                and not node.keywords):
            return _FUNCS[node.func.id](*[walk(a) for a in node.args])
        raise ValueError(f"not allowed in an expression: {ast.dump(node)[:60]}")
    return repr(walk(ast.parse(expression, mode="eval")))


class PythonToolEnv(Env):
    """A Python-expression tool with ChatML-style calls; the final answer is graded by the math reward.

    A ChatML-style (Qwen2.5 / Hermes) tool call

        <tool_call>
        {"name": "python", "arguments": {"expression": "37 * 43 + 2**10"}}
        </tool_call>

    is answered with the expression's value as a `tool` message (the chat template frames it: Qwen2.5
    renders `<|im_start|>user\\n<tool_response>\\n2615\\n</tool_response><|im_end|>\\n`); a turn without
    a call is the final answer, graded by the math reward (nanorl/math_grader.py) against the label.
    The expression is evaluated by an AST walker that allows numbers, arithmetic and a few math
    functions — no names, attributes or calls beyond those — in a worker process with a timeout
    (`9**9**9` runs for minutes: the process is killed). It is a guard against accidents, not a
    sandbox for hostile code: run that in a container."""
    # model-written expressions can run for minutes (9**9**9): bounded, in a worker
    tool_timeout = 5.0

    def reset(self, prompt):
        self.question, self.label = prompt.text, str(prompt.label)
        # rendered by the run's prompt format (chat template)
        return PYTHON_TOOL_PROMPT + prompt.text

    def step(self, action):
        from nanorl.rewards import math_reward

        found = TOOL_CALL.search(action.text)
        # no call: this is the answer
        if found is None:
            return Step(None, float(self.call(math_reward, self.question, action.text, self.label)), True, {})
        try:
            call = json.loads(found.group(1))
            if call.get("name") != "python":
                raise ValueError(f"unknown tool {call.get('name')!r}; the only tool is 'python'")
            value = self.call(python_expression, str(call["arguments"]["expression"]))
        # the model's mistake: tell it
        except (SyntaxError, ValueError, KeyError, TypeError, ArithmeticError) as e:
            value = f"error: {type(e).__name__}: {e}"
        return Step(value, 0.0, False, {"tool_calls": 1})


# ----------------------------------------------------------------------------- --env: finding and wiring one
BUILTIN_ENVS = {"calc": CalcEnv, "python_tool": PythonToolEnv}


def episode_runner(cfg, engine, tokenizer, fmt, log=print) -> EpisodeRunner:
    """train.py's driver for --env: its episode caps, tool timeout and prompt format (a text that reset
    returns is a whole user message: the run's format without --prompt-template)."""
    reset_fmt = replace(fmt, template="")
    return EpisodeRunner(engine, load_env(cfg.env), tokenizer, max_turns=cfg.episode.env_max_turns,
                         max_tokens=cfg.episode_tokens,
                         tool_timeout=None if cfg.episode.tool_timeout < 0 else cfg.episode.tool_timeout,
                         render=lambda text: reset_fmt.render(text, tokenizer)[0],
                         template_kwargs=cfg.chat_template_dict, log=log)


def load_env(spec: str):
    """A built-in name (BUILTIN_ENVS), `package.module:Name` or `path/to/file.py:Name` → a factory
    (usually the Env class) called with no arguments once per episode."""
    if spec in BUILTIN_ENVS:
        return BUILTIN_ENVS[spec]
    if ":" not in spec:
        raise ValueError(f"env {spec!r}: expected one of {sorted(BUILTIN_ENVS)}, 'module:Class' or "
                         "'file.py:Class'")
    return load_object(spec, "env")
