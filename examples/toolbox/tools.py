"""The toolbox agent's workspace tools: read_file, write_file, calculator.

Tools take the model's arguments, which may be anything, and always answer with a short text observation: bad
input becomes an "error: ..." observation the model can learn from, never an exception that ends the run. Paths
are confined to the workspace and sizes are bounded, so a confused policy cannot write outside its directory or
flood its own small context. (delegate is the fourth tool; it needs a model, so the agent loop implements it.)
"""

from __future__ import annotations

import ast
import math
import operator
from pathlib import Path
from typing import Any, Callable

MAX_READ_CHARS = 1000
"""A read returns at most this many characters (the model's context is small)."""
MAX_WRITE_CHARS = 10_000
"""A write may hold at most this many characters."""
MAX_EXPRESSION_CHARS = 200
"""Longest expression the calculator accepts."""
MAX_MAGNITUDE = 1e15
"""Calculator results (and intermediate values) beyond this are refused, which also bounds the work of **."""


class ToolError(ValueError):
    """A tool call that cannot be carried out; its message becomes the observation."""


def _resolve(workspace: Path, path: Any) -> Path:
    if not isinstance(path, str) or not path.strip():
        raise ToolError("path must be a non-empty string")
    candidate = Path(path)
    if candidate.is_absolute():
        raise ToolError(f"path must be relative: {path}")
    root = workspace.resolve()
    resolved = (root / candidate).resolve()
    if resolved != root and root not in resolved.parents:
        raise ToolError(f"path leaves the workspace: {path}")
    return resolved


def read_file(workspace: Path, path: Any) -> str:
    """The file's text, cut to MAX_READ_CHARS."""
    target = _resolve(workspace, path)
    if not target.is_file():
        raise ToolError(f"no such file: {path}")
    with target.open("rb") as handle:
        data = handle.read(MAX_READ_CHARS * 4)
    text = data.decode("utf-8", errors="replace")
    if len(text) > MAX_READ_CHARS:
        return text[:MAX_READ_CHARS] + "\n[truncated]"
    return text


def write_file(workspace: Path, path: Any, content: Any) -> str:
    """Write content to path (parents created); answers "ok"."""
    target = _resolve(workspace, path)
    if not isinstance(content, str):
        raise ToolError("content must be a string")
    if len(content) > MAX_WRITE_CHARS:
        raise ToolError(f"content longer than {MAX_WRITE_CHARS} characters")
    if target.is_dir():
        raise ToolError(f"is a directory: {path}")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(content, encoding="utf-8")
    return "ok"


_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = node.value
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _UNARY[type(node.op)](_evaluate(node.operand))
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
            raise ToolError("power too large")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("result out of range") from None
    else:
        raise ToolError("only numbers, + - * / // % ** and parentheses are allowed")
    if isinstance(value, complex) or not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise ToolError("result out of range")
    return value


def format_number(value: int | float) -> str:
    """Integers print without a decimal point (so 12/3 gives "4"); other values with at most 6 decimals."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.6f}".rstrip("0").rstrip(".")
    return str(value)


def calculator(expression: Any) -> str:
    """Evaluate plain arithmetic safely (an AST walk, no eval)."""
    if not isinstance(expression, str) or not expression.strip():
        raise ToolError("expression must be a non-empty string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse: {expression}") from None
    return format_number(_evaluate(tree))


WORKSPACE_TOOLS = frozenset({"read_file", "write_file", "calculator"})
"""Tools this module runs; delegate is run by the agent loop."""


def run_tool(workspace: Path, name: str, arguments: Any) -> str:
    """Run one workspace tool call and return its observation; model mistakes become "error: ..." text."""
    try:
        if not isinstance(arguments, dict):
            raise ToolError("arguments must be a JSON object")
        if name == "read_file":
            return read_file(workspace, arguments.get("path"))
        if name == "write_file":
            return write_file(workspace, arguments.get("path"), arguments.get("content"))
        if name == "calculator":
            return calculator(arguments.get("expression"))
        raise ToolError(f"unknown tool: {name}")
    except ToolError as error:
        return f"error: {error}"
    except OSError as error:
        return f"error: {error.strerror or error}"
