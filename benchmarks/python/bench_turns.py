"""Token-columns of exact OAR-P on one multi-turn session, turn by turn against one probe for the whole session
(docs/method.md section 13): ``turn_probe: answer`` re-runs the rest of the masked token's turn and the probe tail,
sum_k (n_k^2 / 2 + n_k S); ``session`` re-runs the rest of the whole row, about L^2 / 2.

A fixed four-turn calculator session (three tool results between the turns), the minimal character tokenizer and a
random two-layer Llama (counts only: they do not depend on the weights). Prints the engine's counters for both.

Usage: PYTHONPATH=python python benchmarks/python/bench_turns.py
"""

import torch

import oar
from oar.batch import RolloutBatch
from oar.pipeline import Pipeline
from oar.testing import tiny_random_llama

TURNS = ["First I need 347 times 29, which I will ask the calculator for: <calc>347*29</calc>",
         "Now I add 118 to that product and check the sum again: <calc>10063+118</calc>",
         "Next the second product, 56 times 7, also with the tool: <calc>56*7</calc>",
         "Finally I subtract 392 from 10181 to get the answer, so it is 9789. \\boxed{9789}"]
OBSERVATIONS = ["<result>10063</result>", "<result>10181</result>", "<result>392</result>"]


def main() -> None:
    model, tok = tiny_random_llama(hidden_size=32, num_layers=2, num_heads=4, tokenizer="minimal", seed=1)

    def enc(s):
        return tok(s, add_special_tokens=False)["input_ids"]

    ids, eligible = [], []
    for k, t in enumerate(TURNS):
        ids += enc(t)
        eligible += [True] * len(enc(t))
        if k < len(OBSERVATIONS):
            ids += enc(OBSERVATIONS[k])
            eligible += [False] * len(enc(OBSERVATIONS[k]))
    batch = RolloutBatch(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.bool),
                         prompt_ids=[enc("Q: compute (347*29+118)-(56*7)?\n")], eligible_mask=torch.tensor([eligible]),
                         sequence_advantages=torch.tensor([1.0]), answers=["9789"])
    print(f"session: {len(ids)} completion tokens, turns of {[len(enc(t)) for t in TURNS]} tokens")
    tokens = {}
    for probe in ("session", "answer"):
        s = Pipeline(oar.OARConfig(method="oar_p", turn_probe=probe), tok).scores(batch, model).stats
        tokens[probe] = s["tokens"]
        print(f"turn_probe {probe!r}: {s['variants']} variants, {s['tokens']} token-columns, "
              f"{s['forward_passes']} forwards ({s['engine']} engine)")
    print(f"turn by turn / whole session: {tokens['answer'] / tokens['session']:.2f}x the token-columns")


if __name__ == "__main__":
    main()
