"""Shared test helper: the trainers' own advantage formulas, written out independently of oar (the op tests compare
oar's presets with them; the multi-process TRL test checks the advantages TRL's ranks computed against them)."""


def trl_advantages(rewards, G, scale_rewards):
    """TRL GRPOTrainer (sum_then_normalize): group mean; std per group / over the batch / none; + 1e-4."""
    grouped = rewards.view(-1, G)
    mean = grouped.mean(dim=1).repeat_interleave(G)
    if scale_rewards == "group":
        std = grouped.std(dim=1).repeat_interleave(G)
    elif scale_rewards == "batch":
        std = rewards.std().expand_as(rewards)
    adv = rewards - mean
    if scale_rewards != "none":
        adv = adv / (std + 1e-4)
    return adv
