"""Trainer integrations (docs/trainers/): ``oar.integrations.trl`` (TRL GRPOTrainer subclass and mixin),
``oar.integrations.verl`` (advantage estimators loaded through the ``verl.plugins`` entry point,
``oar.integrations.verl.plugin``) and ``oar.integrations.openrlhf`` (patch and launcher for
``RemoteExperienceMaker``). Each submodule imports its trainer framework lazily, so ``import oar`` never requires
TRL, verl or OpenRLHF."""
