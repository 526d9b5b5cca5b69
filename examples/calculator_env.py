"""A tool-use environment to copy: the policy may call a calculator before it answers.

Each prompt row asks for a computation and holds the ``answer`` column. On each turn the policy
writes either ``calc: <expression>`` (the environment evaluates it and replies with the result as
a ``tool`` message) or ``answer: <number>`` (the episode ends: reward 1 when it equals the row's
answer, else 0). Anything else gets a reminder of the format.

The calculator is a real tool with its own limits: it evaluates arithmetic only (numbers, + - * /
// % **, parentheses) by walking the expression's syntax tree (never ``eval``), refuses exponents
that would build huge numbers, and stops any evaluation after ``TOOL_TIMEOUT_S`` seconds. Every
way an expression can fail (not arithmetic, division by zero, overflow, a result too long to print)
is the policy's mistake and comes back as an ``error: ...`` observation: an exception escaping
``step`` is the environment's failure, which stops the run (or costs the episode
``rollout.environment_timeout_reward``). rayppo
runs this class in child processes with its own deadline per step as well
(``rollout.environment_timeout_s``): a tool that hangs anyway is killed and named.

    rollout.environment: calculator_env:Calculator     (run from this folder; rayppo submit ships it)
"""

from __future__ import annotations

import ast
import operator
import signal

TOOL_TIMEOUT_S = 2.0
MAX_EXPONENT = 64

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


class ToolError(ValueError):
    """The expression is not one the calculator evaluates."""


def shown(number: float | int) -> str:
    """The result as the tool's reply; ``ToolError`` for an integer too long to print (Python
    refuses ``str()`` of one over 4,300 digits)."""
    try:
        return str(number)
    except ValueError:
        raise ToolError("the result has too many digits to show") from None


def evaluate(expression: str) -> float | int:
    """The value of an arithmetic ``expression``; ``ToolError`` for anything else."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot read {expression!r}") from None

    def value(node: ast.AST) -> float | int:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ToolError(f"exponent {right} is over {MAX_EXPONENT}")
            return OPERATORS[type(node.op)](left, right)
        raise ToolError(f"{ast.unparse(node)!r} is not arithmetic")

    def out_of_time(signum, frame):  # noqa: ANN001 - a signal handler's arguments
        raise ToolError(f"took more than {TOOL_TIMEOUT_S:g} s")

    previous = signal.signal(signal.SIGALRM, out_of_time)  # the environment runs in its process's main thread
    signal.setitimer(signal.ITIMER_REAL, TOOL_TIMEOUT_S)
    try:
        return value(tree)
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except ArithmeticError as exc:  # OverflowError: 1e200 ** 2 and the like
        raise ToolError(f"result out of range ({exc})") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Calculator:
    """One episode: a question whose ``answer`` column is the number to reach."""

    def __init__(self, prompt: str, answer: float):
        self.answer = float(answer)

    def step(self, action: str) -> tuple[str | None, float, bool]:
        text = action.strip()
        if text.startswith("calc:"):
            try:
                return shown(evaluate(text[len("calc:"):].strip())), 0.0, False
            except ToolError as exc:  # the policy's mistake: an observation, never the run's failure
                return f"error: {exc}", 0.0, False
        if text.startswith("answer:"):
            try:
                given = float(text[len("answer:"):].strip())
            except ValueError:
                return None, 0.0, True
            return None, 1.0 if abs(given - self.answer) < 1e-6 * max(1.0, abs(self.answer)) else 0.0, True
        return "write 'calc: <expression>' to use the calculator or 'answer: <number>' to answer", 0.0, False
