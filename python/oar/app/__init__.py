"""The application built on the oar library: the command line (``oar train | attribute | eval-attribution |
compare``), the GRPO training job on TRL, the paired comparison, the attribution evaluation, the YAML run configs,
the tasks (GSM8K, MATH500, arithmetic; answer checking), model loading and the statistics. Needs
``pip install "oar[train]"``.

The library (everything else under ``oar``) never imports this package; ``import oar`` does not load it
(docs/architecture.md).
"""
