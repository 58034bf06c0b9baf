"""Masking units (docs/method.md section 11, our extension): the reasoning tokens of a rollout cut into spans (words,
lines, sentences, or the caller's own boundaries) that OAR-P masks whole and the token-level scorers sum over.

A row's spans are half-open ranges ``(j0, j1)`` of reasoning indices (reasoning token j = completion column j),
sorted, disjoint, each non-empty; tokens outside every span (e.g. tool outputs) are neither masked nor scored. The
boundaries come from the decoded text of each token (token ids are never re-tokenized: each id is decoded on its
own), so they are the tokenizer's token boundaries, grouped:

- ``word``: a new span after whitespace and where the character class changes between letters/digits and other
  symbols (``12+34`` is three words, ``1234`` split into digit tokens is one);
- ``line``: a new span at the first token with content after a newline (the newline ends its line);
- ``sentence``: a line, or a new span after ``.``, ``!`` or ``?`` followed by whitespace (``3.14`` is one).

Whitespace stays with the span before it, except a token's own leading whitespace (byte-level BPE's ``" word"``).

:func:`span_starts` finds the boundaries from token texts, :func:`token_texts` decodes ids, :func:`spans_of` turns
start flags and the eligible tokens into spans, :func:`span_sums` applies the unit rule to token-level scores.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from oar import _args
from oar.schema import MASK_UNITS

__all__ = ["span_starts", "token_texts", "spans_of", "span_sums", "check_spans"]


def _kind(ch: str) -> int:
    """Character class of word boundaries: 1 letters/digits/underscore, 2 anything else (not whitespace)."""
    return 1 if ch.isalnum() or ch == "_" else 2


def span_starts(texts: Sequence[str], unit: str) -> list[bool]:
    """Which tokens begin a masking unit.

    Whitespace belongs to the unit before it, except a token's own leading whitespace (byte-level BPE's " word"),
    which begins the unit with it; a token of whitespace only never begins a unit (but the first token).

    - ``word``: a token with content begins a word after whitespace, or where the class of the characters changes
      between letters/digits and other symbols;
    - ``line``: a token with content begins a line when a newline came since the last content;
    - ``sentence``: a line, or a token with content after ``.``, ``!`` or ``?`` and whitespace.

    Args:
        texts: the decoded text of each reasoning token, in order (:func:`token_texts`).
        unit: one of :data:`oar.schema.MASK_UNITS` (``token``: every token begins one).

    Returns:
        One bool per token; the first token always begins a unit.

    Raises:
        ValueError: an unknown unit, or texts that are not strings.
    """
    if not isinstance(unit, str) or unit not in MASK_UNITS:
        raise ValueError(f"unit must be one of {MASK_UNITS}, got {unit!r}")
    out: list[bool] = []
    last = ""  # the last non-whitespace character so far
    gap = nl = False  # whitespace / a newline since that character
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise ValueError(f"texts[{i}] must be a str, got {type(t).__name__}")
        body = t.lstrip()
        lead = t[:len(t) - len(body)]
        if not body:  # whitespace only (or an empty decode): never begins a unit
            out.append(i == 0 or unit == "token")
            gap |= bool(lead)
            nl |= "\n" in lead
            continue
        g, n = gap or bool(lead), nl or "\n" in lead
        if i == 0 or unit == "token":
            start = True
        elif unit == "word":
            start = g or _kind(last) != _kind(body[0])
        else:
            start = n or (unit == "sentence" and g and last in (".", "!", "?"))
        out.append(start)
        rest = body.rstrip()
        trail = body[len(rest):]
        last, gap, nl = rest[-1], bool(trail), "\n" in trail
    return out


def token_texts(tokenizer, ids: Sequence[int] | torch.Tensor) -> list[str]:
    """The decoded text of each token id on its own (a Hugging Face tokenizer's ``decode``; byte fragments of a
    multi-byte character decode to a replacement character, which is not whitespace). Returns one str per id."""
    ids = ids.tolist() if isinstance(ids, torch.Tensor) else [int(i) for i in ids]
    if hasattr(tokenizer, "batch_decode"):
        return list(tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False,
                                           clean_up_tokenization_spaces=False))
    return [tokenizer.decode([i]) for i in ids]


def spans_of(starts: Sequence[bool] | torch.Tensor, eligible: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """Spans ``(j0, j1)`` of one row from its start flags (one per reasoning token), cut also at tokens that are not
    ``eligible`` (sorted reasoning indices; None = all): a span holds eligible tokens only, and an ineligible token
    ends the span before it."""
    flags = [bool(x) for x in (starts.tolist() if isinstance(starts, torch.Tensor) else starts)]
    ok = [True] * len(flags) if eligible is None else [False] * len(flags)
    if eligible is not None:
        for j in eligible:
            ok[int(j)] = True
    out: list[tuple[int, int]] = []
    begin = None
    for j, (s, e) in enumerate(zip(flags, ok)):
        if begin is not None and (s or not e):
            out.append((begin, j))
            begin = None
        if e and begin is None:
            begin = j
    if begin is not None:
        out.append((begin, len(flags)))
    return out


def check_spans(spans, reasoning_len: Mapping[int, int], name: str = "spans") -> dict[int, list[tuple[int, int]]]:
    """``spans`` checked: a mapping {row: [(j0, j1), ...]} whose rows are keys of ``reasoning_len`` and whose
    ranges are int pairs with 0 <= j0 < j1 <= L_row, sorted and disjoint. Returns it as {int: [(int, int)]}.

    Raises:
        ValueError: naming ``name``, the row and the offending range.
    """
    if not isinstance(spans, Mapping):
        raise ValueError(f"{name} must be a mapping {{row: [(j0, j1), ...]}} or None, got {type(spans).__name__}")

    out: dict[int, list[tuple[int, int]]] = {}
    for key, ranges in spans.items():
        r = _args.int_arg(f"{name} key", key, tensors=True)
        if r not in reasoning_len:
            raise ValueError(f"{name} has row {r}, which is not among the rows scored")
        L = int(reasoning_len[r])
        if isinstance(ranges, (str, bytes, Mapping)) or not hasattr(ranges, "__iter__"):
            raise ValueError(f"{name}[{r}] must be a sequence of (j0, j1) pairs, got {type(ranges).__name__}")
        got, end = [], 0
        for k, pair in enumerate(ranges):
            try:
                j0, j1 = pair
            except (TypeError, ValueError):
                raise ValueError(f"{name}[{r}][{k}] must be a (j0, j1) pair, got {pair!r}") from None
            j0 = _args.int_arg(f"{name}[{r}][{k}][0]", j0, tensors=True)
            j1 = _args.int_arg(f"{name}[{r}][{k}][1]", j1, tensors=True)
            if not (end <= j0 < j1 <= L):
                raise ValueError(f"{name}[{r}] must be sorted, disjoint, non-empty ranges within [0, {L}), got "
                                 f"({j0}, {j1}) at index {k}" + (f" after one ending at {end}" if k else ""))
            got.append((j0, j1))
            end = j1
        out[r] = got
    return out


def span_sums(scores: torch.Tensor, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The unit rule for token-level scores of one row (method.md section 11): every token of a span gets the sum of
    the span's token scores; tokens outside every span keep their score. ``scores`` (L,) float; returns a new
    (L,) tensor of the same dtype."""
    out = scores.clone()
    for j0, j1 in spans:
        out[j0:j1] = scores[j0:j1].sum()
    return out
