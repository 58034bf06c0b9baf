"""Multi-turn sessions written as text, for the tests of docs/method.md section 13 (pipeline and trainer layouts)."""

#: A three-turn calculator session: a failed call, a call whose result holds the answer, the answer.
THREE_TURNS = (["I try <calc>12/0</calc>", "Then <calc>12*3+5</calc>", "so \\boxed{41}"],
               ["<result>error</result>", "<result>41</result>"])


def session_tokens(tok, turns, observations):
    """``(ids, mask, spans)`` of one session: the model's ``turns`` with ``observations[k]`` after turn k, as token
    ids (``tok`` without special tokens), mask 1 on the turns' tokens and 0 on the observations', and each turn's
    ``(start, end)`` token range."""
    ids, mask, spans = [], [], []
    for k, text in enumerate(turns):
        start = len(ids)
        ids += tok(text, add_special_tokens=False)["input_ids"]
        mask += [1] * (len(ids) - start)
        spans.append((start, len(ids)))
        if k < len(observations):
            obs = tok(observations[k], add_special_tokens=False)["input_ids"]
            ids += obs
            mask += [0] * len(obs)
    return ids, mask, spans
