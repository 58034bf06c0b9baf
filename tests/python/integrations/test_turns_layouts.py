"""One multi-turn session in each trainer's own layout gives the same per-token advantages (issue 44 item 5,
docs/method.md section 13): TRL's ``completion_mask`` and ``tool_mask``, verl's left-padded prompts with
``response_mask``, OpenRLHF's one right-padded sequence with ``action_mask`` shifted by one (column c is token c + 1).
Each adapter's own conversion (``OARTrainerMixin._oar_batch``, ``rollout_rows``, ``_experience_rows``) builds the
batch; the pipeline then runs exact OAR-P turn by turn with probe turn credit.
"""

from types import SimpleNamespace

import pytest
import torch

import oar
from oar.batch import RolloutBatch
from oar.pipeline import Pipeline
from oar.testing import tiny_random_llama

from _sessions import THREE_TURNS, session_tokens

CONCLUDE = "\nTherefore, the final answer is \\boxed{"
ADV = [1.0, -1.0]  # two rows: the session, and a one-turn row of the same group


@pytest.fixture(scope="module")
def setup():
    model, tok = tiny_random_llama(hidden_size=32, num_layers=2, num_heads=4, tokenizer="minimal", seed=1,
                                   initializer_range=0.12)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    ids, mask, _ = session_tokens(tok, *THREE_TURNS)
    ids.append(tok.eos_token_id)
    mask.append(1)
    single = enc("It is 12*3+5 = 41. \\boxed{41}") + [tok.eos_token_id]
    rows = [dict(prompt=enc("Q: 12*3+5?\n"), ids=ids, mask=mask), dict(prompt=enc("Q: 12*3+5?\n"), ids=single,
                                                                      mask=[1] * len(single))]
    cfg = oar.OARConfig(method="oar_p", conclude=CONCLUDE, turn_credit="probe")
    return model.eval(), tok, rows, cfg


def _advantages(batch, model, tok, cfg, completions):
    """Each row's token advantages over its completion tokens (the layout's padding dropped)."""
    out = Pipeline(cfg, tok).compute(batch, model).advantages
    return [out[i][m] for i, m in enumerate(completions)]


def _trl_layout(rows, tok, cfg, C):
    """(stand-in trainer, TRL's output dict) of ``rows``: prompts left-padded with prompt_mask, completions
    right-padded to C, tool_mask 0 on the tool's replies (what ``OARTrainerMixin._oar_batch`` reads)."""
    B = len(rows)
    P = max(len(r["prompt"]) for r in rows)
    pids, pmask = torch.zeros((B, P), dtype=torch.long), torch.zeros((B, P), dtype=torch.long)
    cids, cmask = torch.zeros((B, C), dtype=torch.long), torch.zeros((B, C), dtype=torch.long)
    tmask = torch.ones((B, C), dtype=torch.long)
    for i, r in enumerate(rows):
        pids[i, P - len(r["prompt"]):], pmask[i, P - len(r["prompt"]):] = torch.tensor(r["prompt"]), 1
        cids[i, :len(r["ids"])], cmask[i, :len(r["ids"])] = torch.tensor(r["ids"]), 1
        tmask[i, :len(r["ids"])] = torch.tensor(r["mask"])
    trainer = SimpleNamespace(num_generations=B, accelerator=SimpleNamespace(process_index=0),
                              oar_pipeline=Pipeline(cfg, tok), oar_answer_column="answer", oar_answer_extractor=None,
                              oar_tokenizer=tok)
    out = dict(prompt_ids=pids, prompt_mask=pmask, completion_ids=cids, completion_mask=cmask, tool_mask=tmask,
               advantages=torch.tensor(ADV))
    return trainer, out


def test_trl_verl_and_openrlhf_layouts_give_the_same_advantages(setup):
    pytest.importorskip("verl")
    import numpy as np
    from verl import DataProto

    from oar.integrations.openrlhf import _experience_rows
    from oar.integrations.trl import OARTrainerMixin
    from oar.integrations.verl import rollout_rows

    model, tok, rows, cfg = setup
    B = len(rows)
    P = max(len(r["prompt"]) for r in rows)
    C = max(len(r["ids"]) for r in rows) + 3  # extra right padding in every layout

    # TRL: prompts left-padded with prompt_mask; completions right-padded; tool_mask 0 on the tool's replies
    trainer, out = _trl_layout(rows, tok, cfg, C)
    pids, pmask, cids, cmask, tmask = (out[k] for k in ("prompt_ids", "prompt_mask", "completion_ids",
                                                          "completion_mask", "tool_mask"))
    trl_batch = OARTrainerMixin._oar_batch(trainer, [{"answer": "41"}] * B, out)
    trl = _advantages(trl_batch, model, tok, cfg, [cmask[i].bool() for i in range(B)])

    # verl: DataProto with prompts left-padded, responses right-padded, response_mask 0 on the replies
    attn = torch.cat([pmask, cmask], 1)
    data = DataProto.from_dict(tensors=dict(prompts=pids, responses=cids, attention_mask=attn,
                                            response_mask=cmask * tmask),
                               non_tensors=dict(reward_model=np.array([{"ground_truth": "41"}] * B, dtype=object)))
    vr = rollout_rows(data, cfg)
    verl_batch = RolloutBatch(vr["responses"], vr["completion_mask"], prompt_ids=vr["prompt_ids"],
                              eligible_mask=vr["eligible_mask"], answers=vr["answers"],
                              sequence_advantages=torch.tensor(ADV))
    verl = _advantages(verl_batch, model, tok, cfg, [vr["completion_mask"][i].bool() for i in range(B)])

    # OpenRLHF: one right-padded sequence per rollout, action_mask (B, T - 1): column c is token c + 1
    T = max(len(r["prompt"]) + len(r["ids"]) for r in rows) + 2
    seqs, am_full = torch.zeros((B, T), dtype=torch.long), torch.zeros((B, T), dtype=torch.bool)
    att = torch.zeros((B, T), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["prompt"]) + len(r["ids"])
        seqs[i, :n] = torch.tensor(r["prompt"] + r["ids"])
        att[i, :n] = 1
        am_full[i, len(r["prompt"]):n] = torch.tensor(r["mask"]).bool()
    exp = SimpleNamespace(sequences=seqs, attention_mask=att, action_mask=am_full[:, 1:],
                          advantages=torch.tensor(ADV)[:, None] * am_full[:, 1:], labels=["41"] * B,
                          rewards=torch.tensor([1.0, 0.0]))
    er = _experience_rows(exp)
    Co = max(len(x["ids"]) for x in er)
    ocids, ocmask, oelig = (torch.zeros((B, Co), dtype=torch.long), torch.zeros((B, Co), dtype=torch.bool),
                            torch.zeros((B, Co), dtype=torch.bool))
    for i, x in enumerate(er):
        n = len(x["ids"])
        ocids[i, :n], ocmask[i, :n], oelig[i, :n] = x["ids"], x["completion"], x["eligible"]
    orl_batch = RolloutBatch(ocids, ocmask, prompt_ids=[x["prompt"] for x in er], eligible_mask=oelig,
                             answers=[x["label"] for x in er], sequence_advantages=torch.tensor([x["adv"] for x in er]))
    orl = _advantages(orl_batch, model, tok, cfg, [ocmask[i] for i in range(B)])

    for i in range(B):
        assert len(trl[i]) == len(verl[i]) == len(orl[i]) == len(rows[i]["ids"])
        assert torch.equal(trl[i], verl[i]), i
        assert torch.equal(trl[i], orl[i]), i
    session = trl[0]
    obs = torch.tensor(rows[0]["mask"]) == 0
    assert float(session[obs].abs().sum()) == 0 and float(session.double().sum()) == pytest.approx(
        ADV[0] * int((~obs).sum()), rel=1e-5)
    assert len({round(float(x), 6) for x in session[~obs]}) > 3  # credit varies within and between turns


def test_trl_reads_a_rollout_funcs_turn_rewards(setup):
    """turn_credit 'rewards' under TRL: a rollout_func that returns a ``turn_rewards`` list (TRL merges its extra
    fields into each row's inputs) reaches the batch; without it the pipeline refuses, naming the field."""
    from oar.integrations.trl import OARTrainerMixin

    model, tok, rows, _ = setup
    cfg = oar.OARConfig(method="random", conclude=CONCLUDE, turn_credit="rewards")
    B = len(rows)
    trainer, out = _trl_layout(rows, tok, cfg, max(len(r["ids"]) for r in rows))
    inputs = [{"answer": "41", "turn_rewards": [-0.05, 1.0]}, {"answer": "41", "turn_rewards": []}]
    batch = OARTrainerMixin._oar_batch(trainer, inputs, out)
    assert batch.turn_rewards == [[-0.05, 1.0], []]
    adv = Pipeline(cfg, tok).compute(batch, model).advantages
    ref = Pipeline(cfg, tok).compute(RolloutBatch(**{**batch.__dict__, "turn_rewards": [[-0.05, 1.0], None]}), model)
    assert torch.equal(adv, ref.advantages)
    batch = OARTrainerMixin._oar_batch(trainer, [{"answer": "41"}] * B, out)
    assert batch.turn_rewards is None
    with pytest.raises(ValueError, match="TRL: a rollout_func field 'turn_rewards'"):
        Pipeline(cfg, tok).compute(batch, model)
