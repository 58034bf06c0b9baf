"""Trainer integrations: ``oar.integrations.trl`` (TRL GRPOTrainer). Each submodule imports its trainer
framework lazily, so ``import oar`` never requires TRL, verl or OpenRLHF."""
