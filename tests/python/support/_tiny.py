"""Tiny models shared by a test module and the worker it runs in a subprocess (which cannot import each other)."""

#: The one-layer tiny policy of the OpenRLHF tests (test_openrlhf.py, openrlhf_worker.py):
#: ``oar.testing.tiny_random_llama(**OPENRLHF_TINY)``, sharpened (``initializer_range=0.12``) so that its divergences
#: (~1e-2) stand far above float32 rounding and rule 1's error budgets (_tolerance.py) are not vacuous.
OPENRLHF_TINY = dict(hidden_size=32, num_layers=1, num_heads=2, tokenizer="minimal", seed=0, initializer_range=0.12)
