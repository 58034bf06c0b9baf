"""Probe contexts (method.md section 2): ``prompt + reasoning tokens + conclude + answer (+ suffix)``.

Everything works on token ids. The only text operation is *decoding* the response to locate the last
final-answer marker (``\\boxed{`` or ``####``); its character position is mapped back to a token index by
binary search over decoded prefixes, so the model's own tokenization is never redone. The conclude
string and the reference answer are ours, so they are encoded (once per distinct string).

Layout of one probe context, left-padded into a batch of width ``T``::

    [pad ... pad | prompt (P) | reasoning R (L) | conclude (C) | answer (K) | suffix (1)]
                                                          ^ probe positions: the K positions whose
                                                            next-token prediction is an answer token

``probe_start`` (per row) is the index, inside the kept logits window of the last ``keep`` positions,
of the position predicting the first answer token, so probe logits are ``logits[:, probe_start + k]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

#: Default final-answer markers searched in a response, last occurrence wins (method.md section 2).
DEFAULT_MARKERS = ("\\boxed{", "####")
#: tool-call openers that end a turn's reasoning under ``turn_probe: action`` (docs/method.md section 13): the
#: Hermes / Qwen chat templates' ``<tool_call>``, Llama 3.1's ``<|python_tag|>`` and the calculator task's ``<calc>``
DEFAULT_ACTION_MARKERS = ("<tool_call>", "<|python_tag|>", "<calc>")


def _as_list(ids, name: str = "ids") -> list[int]:
    """A 1-D sequence of token ids as a list of ints; ValueError naming ``name`` otherwise."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D integer tensor of token ids, got shape {tuple(ids.shape)} and "
                             f"dtype {ids.dtype}")
        return [int(x) for x in ids.tolist()]
    if isinstance(ids, (str, bytes)):
        raise ValueError(f"{name} must be a sequence of token ids, got {type(ids).__name__} {ids!r}")
    out = []
    for x in ids:
        if isinstance(x, (bool, float)) or not hasattr(x, "__index__"):
            raise ValueError(f"{name} must hold integer token ids, got {type(x).__name__} {x!r}")
        out.append(int(x))
    return out


def reasoning_length(
    response_ids: Sequence[int],
    tokenizer,
    markers: Sequence[str] = DEFAULT_MARKERS,
    stop_ids: Sequence[int] = (),
) -> int:
    """Number of leading response tokens that form the reasoning span R (method.md section 2).

    Args:
        response_ids: the response token ids (no padding; may end with EOS).
        tokenizer: a Hugging Face tokenizer (only ``decode`` is used).
        markers: final-answer markers; the span ends before the token where the LAST occurrence of any
            marker starts.
        stop_ids: ids that end the response (EOS, PAD); they and everything after are never reasoning.

    Returns:
        L, with ``response_ids[:L]`` the reasoning tokens. Without a marker: the whole response up to the
        first stop id. The token that contains the first character of the marker is excluded.
    """
    ids = _as_list(response_ids, "response_ids")
    stops = set(int(s) for s in stop_ids)
    end = len(ids)
    for i, t in enumerate(ids):
        if t in stops:
            end = i
            break
    ids = ids[:end]
    if not ids:
        return 0
    text = tokenizer.decode(ids, skip_special_tokens=False)
    pos = max((text.rfind(m) for m in markers), default=-1)
    if pos < 0:
        return end
    # Smallest k with len(decode(ids[:k])) > pos: token k-1 is the first one reaching into the marker.
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[:mid], skip_special_tokens=False)) > pos:
            hi = mid
        else:
            lo = mid + 1
    return lo - 1


@dataclass
class ProbeBatch:
    """A batch of probe contexts, left-padded. Built by :meth:`ProbeContextBuilder.build`.

    Attributes:
        input_ids: (B, T) int64, left-padded with ``pad_id``.
        attention_mask: (B, T) int64, 0 on padding.
        position_ids: (B, T) int64, ``cumsum(attention_mask) - 1`` (0 on padding), so a row's positions do
            not depend on how much padding the batch needed.
        reasoning_start: (B,) int64 column index of the first reasoning token in ``input_ids``.
        reasoning_len: (B,) int64 L_i (may be 0).
        answer_ids: (B, K_max) int64 answer token ids, padded with 0 past ``answer_len``.
        answer_len: (B,) int64 K_i >= 1.
        keep: number of trailing positions whose logits are kept: K_max + suffix length + 1 as built (the probe
            reads the first K_max of them; :meth:`probe_view` cuts the rest), K_max in the view.
        probe_start: (B,) int64 index inside the kept window of the position predicting answer token 0.
        pad_id: the PAD id used for padding (and by OAR-P for masking).
        context_len: (B,) int64 unpadded context lengths.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    reasoning_start: torch.Tensor
    reasoning_len: torch.Tensor
    answer_ids: torch.Tensor
    answer_len: torch.Tensor
    keep: int
    probe_start: torch.Tensor
    pad_id: int
    context_len: torch.Tensor
    meta: dict = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    def reasoning_columns(self, row: int) -> torch.Tensor:
        """Column indices (L_i,) of row ``row``'s reasoning tokens in ``input_ids``."""
        s = int(self.reasoning_start[row])
        return torch.arange(s, s + int(self.reasoning_len[row]))

    def probe_view(self) -> "ProbeBatch":
        """This batch without its trailing columns that no probe reads: the last answer token and the suffix
        (``keep - max(probe_start + answer_len)`` columns, the same for every row: rows are right-aligned). The
        logits of a causal model at the probe positions do not depend on later columns, so every OAR-P score is
        the same on the view (tested); the engines run it (fewer tokens per masked variant: docs/design.md,
        "The dead tail"). ``input_ids``, ``attention_mask`` and ``position_ids`` are (B, T - d) views, ``keep`` and
        ``context_len`` shrink by d, ``probe_start`` and everything else are unchanged; ``self`` when d = 0 (a
        second call) or when a row's reasoning reaches into those columns (a batch not built by
        :class:`ProbeContextBuilder`)."""
        T = int(self.input_ids.shape[1])
        if self.batch_size == 0 or T == 0:
            return self
        d = int(self.keep) - int((self.probe_start + self.answer_len).max())
        d = min(d, T - int((self.reasoning_start + self.reasoning_len).max()), int(self.context_len.min()) - 1)
        if d <= 0:
            return self
        out = ProbeBatch(**self.__dict__)
        out.input_ids, out.attention_mask, out.position_ids = (t[:, :T - d] for t in (self.input_ids,
                                                                                      self.attention_mask,
                                                                                      self.position_ids))
        out.keep = int(self.keep) - d
        out.context_len = self.context_len - d
        out.meta = dict(self.meta)
        return out

    def to(self, device) -> "ProbeBatch":
        out = ProbeBatch(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()})
        return out


class ProbeContextBuilder:
    """Builds :class:`ProbeBatch` objects from prompt ids, response ids and reference answers.

    Args:
        tokenizer: Hugging Face tokenizer of the policy (used to decode responses and encode the conclude
            string and answers, never to re-tokenize model text).
        conclude: text appended after the reasoning (method.md section 2, default from OARConfig).
        answer_suffix: text appended after the answer (default ``"}"`` closes ``\\boxed{``).
        pad_id: PAD id; defaults to ``tokenizer.pad_token_id`` (then EOS).
        markers: final-answer markers (see :func:`reasoning_length`).

    Raises:
        ValueError: tokenizer without pad and eos ids; an answer that encodes to no tokens.
    """

    def __init__(self, tokenizer, conclude: str, answer_suffix: str = "}", pad_id: int | None = None,
                 markers: Sequence[str] = DEFAULT_MARKERS):
        self.tokenizer = tokenizer
        if pad_id is None:
            pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad_id is None:
            raise ValueError("pad_id: the tokenizer has neither pad_token_id nor eos_token_id; pass pad_id explicitly")
        if isinstance(pad_id, bool) or not hasattr(pad_id, "__index__") or int(pad_id) < 0:
            raise ValueError(f"pad_id must be a token id (an int >= 0), got {pad_id!r}")
        self.pad_id = int(pad_id)
        self.markers = tuple(markers)
        self.conclude_ids = self._encode(conclude)
        self.suffix_ids = self._encode(answer_suffix) if answer_suffix else []
        stop = {self.pad_id}
        if tokenizer.eos_token_id is not None:
            stop.add(int(tokenizer.eos_token_id))
        self.stop_ids = tuple(sorted(stop))
        self._answer_cache: dict[str, list[int]] = {}

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def answer_ids(self, answer: str) -> list[int]:
        """Token ids of a reference answer (cached). Raises ValueError for an empty encoding."""
        ids = self._answer_cache.get(answer)
        if ids is None:
            ids = self._encode(str(answer))
            if not ids:
                raise ValueError(f"answers: reference answer {answer!r} encodes to no tokens")
            self._answer_cache[answer] = ids
        return ids

    def build(self, prompt_ids: Sequence, response_ids: Sequence, answers: Sequence[str],
              reasoning_lens: Sequence[int] | None = None) -> ProbeBatch:
        """Builds the batch.

        Args:
            prompt_ids: B unpadded prompt id sequences (lists or 1-D tensors).
            response_ids: B unpadded response id sequences (may end with EOS/padding; cut at the first stop id).
            answers: B reference answers (strings).
            reasoning_lens: optional precomputed L_i (else :func:`reasoning_length`).

        Raises:
            ValueError: mismatched lengths (naming the argument and both sizes).
        """
        B = len(prompt_ids)
        for name, seq in (("response_ids", response_ids), ("answers", answers)):
            if len(seq) != B:
                raise ValueError(f"{name} must have one entry per prompt (B = {B}), got {len(seq)}")
        if reasoning_lens is not None and len(reasoning_lens) != B:
            raise ValueError(f"reasoning_lens must have B = {B} entries, got {len(reasoning_lens)}")
        ps, rs, ans = [], [], []
        for i in range(B):
            p = _as_list(prompt_ids[i], f"prompt_ids[{i}]")
            r = _as_list(response_ids[i], f"response_ids[{i}]")
            if reasoning_lens is None:
                L = reasoning_length(r, self.tokenizer, self.markers, self.stop_ids)
            else:
                L = _reasoning_len_arg(reasoning_lens[i], i, len(r))
            ps.append(p), rs.append(r[:L]), ans.append(self.answer_ids(answers[i]))
        return self._pack(ps, rs, ans, self.conclude_ids, self.suffix_ids)

    def build_actions(self, prompt_ids: Sequence, response_ids: Sequence, reasoning_lens: Sequence[int]) -> ProbeBatch:
        """Probe contexts whose answer is each response's own action (``turn_probe: action``, docs/method.md section
        13): ``prompt + response[:L]`` followed by ``response[L:e]`` as the probed tokens, with no conclude string
        and no suffix; ``e`` is the first stop id (EOS, PAD) or the end. The action is the model's stored tokens,
        never re-encoded text. A response with no action (``L == e``: no marker, e.g. a turn cut by the length limit)
        gets L = 0 and a one-token PAD answer: nothing of it is scored.

        Args:
            prompt_ids, response_ids: B unpadded id sequences. reasoning_lens: B ints in [0, len(response)].

        Raises:
            ValueError: mismatched lengths; a length out of range.
        """
        B = len(prompt_ids)
        for name, seq in (("response_ids", response_ids), ("reasoning_lens", reasoning_lens)):
            if len(seq) != B:
                raise ValueError(f"{name} must have one entry per prompt (B = {B}), got {len(seq)}")
        ps, rs, ans = [], [], []
        for i in range(B):
            p = _as_list(prompt_ids[i], f"prompt_ids[{i}]")
            r = _as_list(response_ids[i], f"response_ids[{i}]")
            L = _reasoning_len_arg(reasoning_lens[i], i, len(r))
            e = next((j for j, t in enumerate(r) if t in self.stop_ids), len(r))
            if L >= e:
                ps.append(p), rs.append([]), ans.append([self.pad_id])
            else:
                ps.append(p), rs.append(r[:L]), ans.append(r[L:e])
        return self._pack(ps, rs, ans, [], [])

    def _pack(self, ps: list, rs: list, ans: list, conclude: list, suffix: list) -> ProbeBatch:
        """Left-padded rows ``prompt + reasoning + conclude + answer + suffix`` as a :class:`ProbeBatch`."""
        B = len(ps)
        rows = [p + r + conclude + a + suffix for p, r, a in zip(ps, rs, ans)]
        starts = [len(p) for p in ps]
        lens = [len(r) for r in rs]
        T = max(len(x) for x in rows) if rows else 0
        K = max((len(a) for a in ans), default=1)
        S = len(suffix)
        input_ids = torch.full((B, T), self.pad_id, dtype=torch.long)
        attn = torch.zeros((B, T), dtype=torch.long)
        answer_ids = torch.zeros((B, K), dtype=torch.long)
        for i, row in enumerate(rows):
            off = T - len(row)
            input_ids[i, off:] = torch.tensor(row, dtype=torch.long)
            attn[i, off:] = 1
            starts[i] += off
            answer_ids[i, : len(ans[i])] = torch.tensor(ans[i], dtype=torch.long)
        answer_len = torch.tensor([len(a) for a in ans], dtype=torch.long)
        # Trailing window: the K_max answer-predicting positions of the longest answer end at T - 1 - S - 1.
        keep = K + S + 1
        # Row i's first answer token sits at column T - S - K_i; its predictor at T - S - K_i - 1, i.e.
        # index keep - (S + K_i + 1) inside the window of the last `keep` columns.
        probe_start = keep - (S + answer_len + 1)
        position_ids = (attn.cumsum(-1) - 1).clamp_min(0)
        return ProbeBatch(
            input_ids=input_ids, attention_mask=attn, position_ids=position_ids,
            reasoning_start=torch.tensor(starts, dtype=torch.long), reasoning_len=torch.tensor(lens, dtype=torch.long),
            answer_ids=answer_ids, answer_len=answer_len, keep=keep, probe_start=probe_start, pad_id=self.pad_id,
            context_len=torch.tensor([len(r) for r in rows], dtype=torch.long),
        )


def _reasoning_len_arg(L, i: int, n: int) -> int:
    """``reasoning_lens[i]`` as an int in [0, n]; raises ValueError naming it."""
    if isinstance(L, torch.Tensor) and L.dim() == 0 and not L.dtype.is_floating_point:
        L = int(L)
    if isinstance(L, bool) or not hasattr(L, "__index__"):
        raise ValueError(f"reasoning_lens[{i}] must be an int, got {type(L).__name__} {L!r}")
    L = int(L)
    if not 0 <= L <= n:
        raise ValueError(f"reasoning_lens[{i}] must be in [0, {n}], got {L}")
    return L
