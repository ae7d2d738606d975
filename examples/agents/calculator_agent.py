"""A calculator agent written against the plain `openai` client: nothing in it knows about nanorl.

    python train.py --algo grpo --agent examples/agents/calculator_agent.py:run

nanorl calls `run` once per episode with the endpoint that serves the policy. The model may ask for a
calculation, as `calc(3+4+9)` (the built-in task's tiny model knows this form) or `<calc>3*4</calc>`;
the agent answers with the value as a `tool` message, and the model's next reply without a call is its
answer: reward 1 if it equals the row's label, else 0. Any OpenAI-compatible server runs it the same
way (point base_url at it).
"""
import ast
import operator
import re

from openai import OpenAI

CALL = re.compile(r"calc\((.{1,64})\)|<calc>(.{1,64})</calc>", re.S)
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """The value of + - * / arithmetic on numbers ("-" for anything else)."""
    def walk(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
            return OPS[type(node.op)](walk(node.operand))
        raise ValueError(expression)
    try:
        value = walk(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError):
        return "-"
    return str(int(value)) if value == int(value) else str(value)


def run(base_url: str, api_key: str, episode_id: str, row: dict, max_turns: int = 3) -> float:
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(max_turns):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=16)
        text = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        call = CALL.fullmatch(text.strip())
        if call is None:
            return float(text.strip() == str(row["label"]).strip())
        messages.append({"role": "tool", "content": calculate(call.group(1) or call.group(2))})
    return 0.0
