"""The calculator task and its tool sessions (issue 44 item 4, docs/method.md section 13): the expression evaluator
refuses what is not arithmetic, sessions keep the model's tokens and the environment's replies apart (``env_mask``),
the task's splits never share an expression, and ``oar train`` runs the sessions through TRL's rollout hook with
per-turn credit."""

import ast
import operator
import re

import pytest
import torch

from oar.app.tasks import get_task
from oar.app.tasks.tools import Session, evaluate_expression, result_text, run_sessions
from oar.testing import minimal_tokenizer

# ---- the calculator ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,value", [("347*29", 10063), ("347*29 + 118", 10181), ("(604 - 58)*7", 3822),
                                        ("-5 + 2", -3), ("7 // 2", 3), ("7 % 4", 3), ("7/2", 3.5), (" 12 ", 12)])
def test_expressions_evaluate(text, value):
    assert evaluate_expression(text) == value


@pytest.mark.parametrize("text,why", [
    ("2**10", "only integers"), ("__import__('os')", "only integers"), ("x + 1", "only integers"),
    ("1.5 * 2", "only integers"), ("'a' * 3", "only integers"), ("1/0", "division by zero"), ("5 % 0", "division by zero"),
    ("999999*999999*9", "value too large"), ("1 +", "not an arithmetic expression"), ("", "empty expression"),
    ("1+" * 40 + "1", "longer than 64"),
])
def test_anything_else_is_an_error_reply(text, why):
    with pytest.raises(ValueError, match=why):
        evaluate_expression(text)
    assert result_text(text).startswith("<result>error: ") and why.split()[0] in result_text(text)


def test_result_text_formats_values():
    assert result_text("6*7") == "<result>42</result>"
    assert result_text("10/4") == "<result>2.5</result>"
    assert result_text("10/5") == "<result>2</result>"
    assert result_text("1/3") == "<result>0.333333</result>"


# ---- sessions ---------------------------------------------------------------------------------------------------


class ScriptedModel:
    """Stands in for a causal LM in ``run_sessions``: row r says its script's next turn (character tokens of the
    minimal tokenizer), stopping after ``</calc>`` as ``generate(stop_strings=...)`` does and padding after it."""

    def __init__(self, tok, scripts, prompts):
        self.tok, self.scripts, self.prompts = tok, scripts, [list(p) for p in prompts]
        self.calls = 0

    def parameters(self):
        yield torch.zeros(1)

    def generate(self, input_ids, attention_mask, max_new_tokens, pad_token_id, **kw):
        assert kw["stop_strings"] == ["</calc>"]
        self.calls += 1
        outs = []
        for ids, m in zip(input_ids.tolist(), attention_mask.tolist()):
            ctx = [t for t, a in zip(ids, m) if a]
            r = next(k for k, p in enumerate(self.prompts) if ctx[:len(p)] == p)
            done = self.tok.decode(ctx[len(self.prompts[r]):])
            said = done.count("</calc>")  # turns said so far (each but the last ends with a call)
            turn = self.scripts[r][said]
            new = self.tok(turn, add_special_tokens=False)["input_ids"]
            if not turn.endswith("</calc>"):
                new = new + [self.tok.eos_token_id]
            outs.append(new[:max_new_tokens])
        width = max(len(o) for o in outs)
        gen = torch.full((len(outs), width), pad_token_id, dtype=torch.long)
        for k, o in enumerate(outs):
            gen[k, :len(o)] = torch.tensor(o)
        return torch.cat([input_ids, gen], 1)


def _run(scripts, **kw):
    tok = minimal_tokenizer()
    prompts = [tok(f"Q{k}\n", add_special_tokens=False)["input_ids"] for k in range(len(scripts))]
    model = ScriptedModel(tok, scripts, prompts)
    return tok, run_sessions(model, tok, prompts, temperature=0.0, **kw), model


def test_sessions_interleave_the_models_turns_and_the_replies():
    scripts = [["Let me <calc>12*3</calc>", " so \\boxed{36}"],
               ["Try <calc>1/0</calc>", " again <calc>2+2</calc>", " it is \\boxed{4}"],
               ["It is \\boxed{5}"]]
    tok, sessions, model = _run(scripts, max_new_tokens=200)
    want = ["Let me <calc>12*3</calc><result>36</result> so \\boxed{36}",
            "Try <calc>1/0</calc><result>error: division by zero</result> again <calc>2+2</calc><result>4</result> it "
            "is \\boxed{4}",
            "It is \\boxed{5}"]
    for s, w, script in zip(sessions, want, scripts):
        assert s.text == w
        assert s.completion_ids[-1] == tok.eos_token_id and s.env_mask[-1] == 1  # the EOS is the model's
        own = tok.decode([t for t, m in zip(s.completion_ids, s.env_mask) if m], skip_special_tokens=True)
        assert own == "".join(script)  # exactly the model's tokens are marked 1, every reply token 0
        assert len(s.env_mask) == len(s.completion_ids)
    assert [s.calls for s in sessions] == [1, 2, 0] and [s.failures for s in sessions] == [0, 1, 0]
    assert model.calls == 3  # rounds: every live session advances together


def test_calls_beyond_max_calls_and_the_token_budget_end_the_session():
    scripts = [["a <calc>1+1</calc>", " b <calc>2+2</calc>", " c \\boxed{4}"]]
    _, (s,), _ = _run(scripts, max_new_tokens=200, max_calls=1)
    assert s.text == "a <calc>1+1</calc><result>2</result> b <calc>2+2</calc>" and s.calls == 1
    _, (s,), _ = _run(scripts, max_new_tokens=25, max_calls=4)
    assert len(s.completion_ids) == 25 and s.text == "a <calc>1+1</calc><result"  # the reply cut to the budget
    with pytest.raises(ValueError, match="max_calls must be an int >= 0, got -1"):
        _run(scripts, max_calls=-1)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1, got 0"):
        _run(scripts, max_new_tokens=0)


# ---- the task ---------------------------------------------------------------------------------------------------


def _value(expr: str) -> int:
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}

    def ev(n):
        return n.value if isinstance(n, ast.Constant) else ops[type(n.op)](ev(n.left), ev(n.right))

    return ev(ast.parse(expr, mode="eval").body)


@pytest.mark.parametrize("level", [1, 2])
def test_problems_are_deterministic_disjoint_and_answered(level):
    task = get_task("calculator", level=level)
    train, test = task.problems("train", n=300, seed=0), task.problems("test", n=100, seed=0)
    assert [p.question for p in task.problems("train", n=300, seed=0)] == [p.question for p in train]
    assert not {p.question for p in train} & {p.question for p in test}
    for p in train + test:
        assert p.answer == str(_value(p.metadata["expression"]))
    assert len({p.question for p in train}) == 300


def test_reward_reads_the_boxed_answer_not_a_copied_result():
    task = get_task("calculator")
    p = task.problems("test", n=1, seed=0)[0]
    assert task.reward(f"<calc>x</calc><result>{p.answer}</result> so \\boxed{{{p.answer}}}", p) == 1.0
    assert task.reward(f"<calc>x</calc><result>{p.answer}</result>", p) == 0.0  # no boxed answer
    assert task.tool and task.max_calls == 4
    with pytest.raises(ValueError, match="level must be one of"):
        get_task("calculator", level=3)


def test_sessions_are_sampled_in_oar_train_with_per_turn_credit(tmp_path, monkeypatch):
    """``oar train`` on the calculator config (tiny model, one step): TRL calls the task's rollout function, the
    replies reach oar's pipeline as observations (``tool_mask``), and every session of several turns is scored turn
    by turn (one engine row per turn)."""
    import oar.app.tasks.tools as tools
    import oar.pipeline as pipeline
    from oar.app.train import run_training

    def scripted(model, tok, prompt_ids, **kw):
        """Two turns per session: a call on the question's expression, its reply, the answer (right on even
        sessions, so that groups have reward variance and a non-zero advantage)."""
        out = []
        for k, ids in enumerate(prompt_ids):
            expr = re.findall(r"What is (.*?)\?", tok.decode(ids))[-1]
            value = evaluate_expression(expr)
            s = Session()
            for text, env in ((f"I compute <calc>{expr}</calc>", 1), (f"<result>{value}</result>", 0),
                              (f" so \\boxed{{{value if k % 2 == 0 else value + 1}}}", 1)):
                ids = tok(text, add_special_tokens=False)["input_ids"]
                s.completion_ids += ids
                s.env_mask += [env] * len(ids)
            s.completion_ids.append(tok.eos_token_id)
            s.env_mask.append(1)
            s.calls, s.text = 1, tok.decode(s.completion_ids, skip_special_tokens=True)
            out.append(s)
        return out

    monkeypatch.setattr(tools, "run_sessions", scripted)
    turn_rows = []
    real = pipeline.Pipeline._turn_batch

    def spy(self, b, segments, prompts, builder):
        out = real(self, b, segments, prompts, builder)
        turn_rows.append(sum(len(v) for v in segments.values()))
        return out

    monkeypatch.setattr(pipeline.Pipeline, "_turn_batch", spy)
    summary = run_training("calculator", overrides=[
        "model.name=tiny-random-llama", "grpo.max_steps=1", "grpo.gradient_accumulation_steps=8",
        "grpo.max_completion_length=64", "eval.problems=4", "eval.max_new_tokens=64", "run.plot=false",
        "task.train_size=8"], output_dir=str(tmp_path))
    assert turn_rows and all(n % 2 == 0 for n in turn_rows)  # two turns per scored session
    assert summary is not None


def test_diagnose_samples_sessions_and_credits_only_the_models_tokens():
    """``oar diagnose`` on a tool task: its rollouts are sessions whose replies are no action of the policy (log-prob
    0 there, excluded from N_tok) and get no advantage under any setting; OAR-G scores the sessions turn by turn."""
    import oar
    from oar.app import diagnose_core as core
    from oar.testing import tiny_random_llama

    tok = minimal_tokenizer()
    scripts = [["I do <calc>3*4</calc>", " so \\boxed{12}"], ["It is \\boxed{13}"]]
    prompts = [tok(f"Q{k}\n", add_special_tokens=False)["input_ids"] for k in range(2)]
    scripted = ScriptedModel(tok, scripts, prompts)
    r = core.sample_rollouts(scripted, prompts, lambda i, ids, text: float("boxed{12}" in text), group_size=2,
                             temperature=0.9, max_new_tokens=64, seed=0, pad_id=tok.pad_token_id,
                             eos_id=tok.eos_token_id, tokenizer=tok, answers=["12", "12"], max_calls=4)
    assert r.eligible_mask is not None and r.rewards.tolist() == [1.0, 1.0, 0.0, 0.0]
    obs = r.completion_mask & ~r.eligible_mask
    assert int(obs[0].sum()) == len("<result>12</result>") and not bool(obs[2:].any())
    model, _ = tiny_random_llama(hidden_size=32, num_layers=1, num_heads=2, tokenizer="minimal", seed=0)
    lp = core.token_logprobs(model, r, list(range(4)), tok.pad_token_id)
    assert bool((lp[obs] == 0).all()) and bool((lp[r.eligible_mask] != 0).all())
    base = oar.OARConfig(conclude="\nTherefore, the final answer is \\boxed{", turn_credit="probe")
    for spec in ("grpo", "oar_g", "random"):
        adv, seq, _ = core.method_advantages(core.parse_credit(spec), r, model=model, tokenizer=tok, base_config=base,
                                             seed=0)
        assert float(adv[obs].abs().sum()) == 0, spec
        for i in range(4):
            assert float(adv[i].double().sum()) == pytest.approx(float(seq[i]) * int(r.eligible_mask[i].sum()),
                                                                 rel=1e-5, abs=1e-6)
