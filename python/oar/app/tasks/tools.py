"""Tool-using sessions for the offline multi-turn task (docs/method.md section 13): a calculator the model calls with
``<calc>expression</calc>``, answered in the same assistant message with ``<result>value</result>``.

:func:`run_sessions` samples sessions from a Hugging Face causal LM: the model generates until it closes a call (a
stop string) or ends; the call is evaluated (:func:`evaluate_expression`: integers, + - * / // % and parentheses,
nothing else) and the result's tokens are appended with ``env_mask`` 0 (the model did not write them: TRL's
``env_mask``, oar's observations); generation goes on, at most ``max_calls`` calls and ``max_new_tokens`` tokens in
all. What comes back are the stored ids and masks a trainer keeps, never re-rendered messages. Imports torch.
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

__all__ = ["CALL_OPEN", "CALL_CLOSE", "RESULT_OPEN", "RESULT_CLOSE", "evaluate_expression", "result_text", "Session",
           "run_sessions"]

CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
_CALL_RE = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.S)

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_MAX_ABS = 10**12  # operands and results beyond this are refused (no huge products from a loop of calls)
_MAX_CHARS = 64


def evaluate_expression(text: str) -> int | float:
    """The value of an arithmetic expression: integer literals, ``+ - * / // %``, unary minus and parentheses.

    Raises:
        ValueError: anything else (names, calls, powers, floats, strings), more than 64 characters, a value beyond
            1e12 in magnitude, or a division by zero; the message says which, as the tool's reply.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError("empty expression")
    if len(text) > _MAX_CHARS:
        raise ValueError(f"expression longer than {_MAX_CHARS} characters")
    try:
        tree = ast.parse(text.strip().replace("×", "*").replace("÷", "/"), mode="eval")
    except SyntaxError:
        raise ValueError("not an arithmetic expression") from None

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            v = node.value
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            v = -v if isinstance(node.op, ast.USub) else v
        elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and b == 0:
                raise ValueError("division by zero")
            v = _OPS[type(node.op)](a, b)
        else:
            raise ValueError("only integers, + - * / // % and parentheses are allowed")
        if abs(v) > _MAX_ABS:
            raise ValueError("value too large")
        return v

    return ev(tree)


def result_text(expression: str) -> str:
    """The tool's reply to a call: ``<result>value</result>`` (integers exact, other values to 6 significant
    digits) or ``<result>error: reason</result>``."""
    try:
        v = evaluate_expression(expression)
    except ValueError as e:
        return f"{RESULT_OPEN}error: {e}{RESULT_CLOSE}"
    if isinstance(v, float):
        v = int(v) if v.is_integer() else float(f"{v:.6g}")
    return f"{RESULT_OPEN}{v}{RESULT_CLOSE}"


@dataclass
class Session:
    """One sampled session: ``completion_ids`` (the model's tokens and the results, in order), ``env_mask`` (1 on the
    model's tokens, 0 on the results'), ``calls`` and ``failures`` (results that are errors), ``text`` (decoded,
    special tokens skipped)."""

    completion_ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    calls: int = 0
    failures: int = 0
    text: str = ""


def _closed_call(text: str, before: str) -> str | None:
    """The expression of the call that the last token closed: ``text`` (the new tokens decoded) holds one more
    complete ``<calc>...</calc>`` than ``before`` (the same without the last token), else None. The model's last
    token may run past the close (a token such as ``"><"``); it is kept as sampled."""
    calls = _CALL_RE.findall(text)
    return calls[-1] if len(calls) > len(_CALL_RE.findall(before)) else None


def run_sessions(model: Any, tokenizer: Any, prompt_ids: Sequence[Sequence[int]], *, max_calls: int = 4,
                 max_new_tokens: int = 128, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 batch_size: int = 64) -> list[Session]:
    """Samples one tool-using session per prompt.

    Args:
        model, tokenizer: a Hugging Face causal LM and its tokenizer (EOS / PAD ids end a sequence).
        prompt_ids: B prompts as token id lists (already chat-templated, generation prompt included).
        max_calls: calls answered per session (>= 0); a call beyond them ends the session unanswered.
        max_new_tokens: the session's budget, the model's tokens and the results' together (>= 1).
        temperature: 0 for greedy decoding; top_p, top_k (0: off) as in ``transformers`` sampling.
        batch_size: sequences per ``generate`` call.

    Returns:
        B :class:`Session` s, in the prompts' order. The global RNG advances as ``model.generate`` draws.

    Raises:
        ValueError: ``max_calls`` < 0, ``max_new_tokens`` or ``batch_size`` < 1, ``temperature`` < 0.
    """
    if isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 0:
        raise ValueError(f"max_calls must be an int >= 0, got {max_calls!r}")
    for arg, v in (("max_new_tokens", max_new_tokens), ("batch_size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{arg} must be an int >= 1, got {v!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    stop = {int(t) for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None}
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    sessions = [Session() for _ in prompt_ids]
    live = list(range(len(prompt_ids)))
    device = next(model.parameters()).device
    gen_kwargs: dict[str, Any] = dict(pad_token_id=pad, stop_strings=[CALL_CLOSE], tokenizer=tokenizer)
    gen_kwargs.update(dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k) if temperature > 0
                      else dict(do_sample=False))
    with torch.no_grad():
        while live:
            nxt = []
            for start in range(0, len(live), batch_size):
                rows = live[start:start + batch_size]
                ctx = [list(prompt_ids[i]) + sessions[i].completion_ids for i in rows]
                budget = [max_new_tokens - len(sessions[i].completion_ids) for i in rows]
                T = max(len(c) for c in ctx)
                ids = torch.full((len(rows), T), pad, dtype=torch.long)
                attn = torch.zeros((len(rows), T), dtype=torch.long)
                for k, c in enumerate(ctx):
                    ids[k, T - len(c):] = torch.tensor(c, dtype=torch.long)
                    attn[k, T - len(c):] = 1
                out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device),
                                     max_new_tokens=max(budget), **gen_kwargs)[:, T:].tolist()
                for k, i in enumerate(rows):
                    s, new = sessions[i], out[k][:budget[k]]
                    cut = next((j for j, t in enumerate(new) if t in stop), None)
                    ended = cut is not None
                    new = new if cut is None else new[:cut + 1]  # keep the first EOS, as trainers do
                    s.completion_ids += new
                    s.env_mask += [1] * len(new)
                    own = new[:-1] if ended else new  # the model's tokens before the EOS / PAD
                    call = _closed_call(tokenizer.decode(own, skip_special_tokens=True),
                                        tokenizer.decode(own[:-1], skip_special_tokens=True)) if own else None
                    if call is not None and ended:
                        # the stop string ended it (padding after it): drop the PAD, answer the call
                        s.completion_ids.pop(), s.env_mask.pop()
                    elif call is None:
                        continue  # EOS or the budget: the session is over
                    room = max_new_tokens - len(s.completion_ids)
                    if s.calls >= max_calls or room <= 0:
                        continue
                    reply = result_text(call)
                    r_ids = tokenizer(reply, add_special_tokens=False)["input_ids"][:room]
                    s.completion_ids += r_ids
                    s.env_mask += [0] * len(r_ids)
                    s.calls += 1
                    s.failures += int("error:" in reply)
                    if len(s.completion_ids) < max_new_tokens:
                        nxt.append(i)
            live = nxt
    for s in sessions:
        s.text = tokenizer.decode(s.completion_ids, skip_special_tokens=True)
    return sessions
