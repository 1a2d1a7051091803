"""A multi-turn tool task: the model may ask a calculator before it answers.

Prompts come from ``loraflow.common.tasks.CalculatorTask`` (``"a*b+c="``). In any turn the model may write
``<calc>expression</calc>``; the turn ends there (a stop string) and the environment replies ``=value`` (or
``=error``), which joins the sequence as environment tokens. A turn that ends with end-of-sequence is the final
answer: reward 1 if its text is exactly the answer, else 0. Running out of turns scores 0.

Expressions are evaluated by walking a parsed AST that allows only numbers, + - * / // % and unary minus,
with bounds on length and magnitude: no ``eval``, nothing a model could use to reach the host.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

from loraflow.common.tasks import CalculatorTask
from loraflow.rollout_worker.envs.base import Environment, Episode, Step

CALL = re.compile(r"<calc>(.*?)</calc>\s*$", re.DOTALL)
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 1e18

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def calculate(expression: str) -> int | float:
    """The value of a plain arithmetic expression; ValueError for anything else."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError("expression too long")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError("not an arithmetic expression") from None

    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            result = node.value
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            result = -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            try:
                result = _OPERATORS[type(node.op)](value(node.left), value(node.right))
            except ZeroDivisionError:
                raise ValueError("division by zero") from None
        else:
            raise ValueError(f"{type(node).__name__} is not allowed")
        if abs(result) > MAX_MAGNITUDE:
            raise ValueError("number too large")
        return result

    return value(tree)


def format_value(number: int | float) -> str:
    if isinstance(number, float) and number.is_integer():
        number = int(number)
    return str(number)


class CalculatorEnv(Environment):
    stop_strings = ("</calc>",)

    def __init__(self) -> None:
        self.task = CalculatorTask()

    def step(self, state: Any, turn: str, *, finished: bool, episode: Episode) -> Step:
        call = None if finished else CALL.search(turn)
        if call is None:
            return Step(done=True, reward=self.task.score(turn, episode.answer, finished=finished))
        try:
            reply = "=" + format_value(calculate(call.group(1)))
        except ValueError:
            reply = "=error"
        return Step(done=False, reply=reply)
