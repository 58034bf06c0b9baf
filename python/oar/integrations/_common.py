"""Helpers shared by the trainer adapters (verl, OpenRLHF): grouping rows by prompt id, reading the OAR
config from the environment, and turning sequence advantages into per-token ones for every method.

Nothing here imports a trainer framework.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Sequence

import torch

from oar import ops

#: Environment variable read by the verl plugin and the OpenRLHF launcher when no config was passed in code:
#: a JSON object (the ``oar`` schema of docs/config.md) or a path to a JSON/YAML file holding one.
CONFIG_ENV = "OAR_CONFIG"


def config_from_env(method: str | None = None):
    """``oar.OARConfig`` from ``$OAR_CONFIG`` (JSON text or a .json/.yaml file; default: empty = defaults), with
    ``method`` overriding the file's method when given. A file may hold the schema itself or a whole run config
    with the schema under ``oar`` (configs/*.yaml, runs/*/config.json).

    Raises:
        ValueError: unreadable file, invalid JSON/YAML (naming $OAR_CONFIG and the file), or a value the schema
            refuses (message names the key).
    """
    from oar import OARConfig

    raw = os.environ.get(CONFIG_ENV, "").strip()
    obj: dict = {}
    if raw:
        if raw.lstrip().startswith("{"):
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"${CONFIG_ENV} must be a JSON object or a file path, got invalid JSON: {e}") from None
        else:
            if not os.path.isfile(raw):
                raise ValueError(f"${CONFIG_ENV} must be a JSON object or an existing file, got {raw!r}")
            import yaml

            is_yaml = raw.endswith((".yaml", ".yml"))
            try:
                with open(raw, encoding="utf-8") as f:
                    text = f.read()
                obj = (yaml.safe_load(text) if is_yaml else json.loads(text)) or {}
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, yaml.YAMLError) as e:
                kind = "YAML" if is_yaml else "JSON"
                msg = str(e).replace("\n", " ")
                raise ValueError(f"${CONFIG_ENV} file {raw!r} is not readable {kind}: {msg}") from None
            # a whole run config (configs/*.yaml, runs/*/config.json) holds the schema under "oar"
            obj = obj.get("oar", obj) if isinstance(obj, dict) else obj
        if not isinstance(obj, dict):
            raise ValueError(f"${CONFIG_ENV} must hold a JSON object, got {type(obj).__name__}")
    if method is not None:
        obj = dict(obj, method=method)
    return OARConfig.from_json(json.dumps(obj))


def config_with_method(config, method: str):
    """A copy of ``config`` whose ``method`` is ``method`` (every other key kept)."""
    from oar import OARConfig

    obj = json.loads(config.to_json())
    obj["method"] = method
    if method != "dr_grpo" and obj.get("estimator") == "dr_grpo":
        obj["estimator"] = "grpo"
    if method == "dr_grpo":
        obj["estimator"] = "dr_grpo"
    return OARConfig.from_json(json.dumps(obj))


def group_layout(index: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows grouped by prompt id, whatever their order (verl's balance_batch reorders rows).

    Args:
        index: N hashable group ids (verl's ``uid`` array, OpenRLHF's prompt positions).

    Returns:
        ``(perm, offsets)``: (N,) int64 permutation that makes every group contiguous (groups in order of
        first appearance, rows in their original order inside a group) and the (G + 1,) int64 CSR offsets of the
        permuted rows.
    """
    order: dict = {}
    rows: list[list[int]] = []
    for i, key in enumerate(list(index)):
        try:
            g = order.setdefault(key, len(order))
        except TypeError:
            raise ValueError(f"index must hold hashable group ids, got {key!r} at row {i}") from None
        if g == len(rows):
            rows.append([])
        rows[g].append(i)
    perm = [i for r in rows for i in r]
    off = [0]
    for r in rows:
        off.append(off[-1] + len(r))
    return torch.tensor(perm, dtype=torch.long), torch.tensor(off, dtype=torch.long)


def per_token_advantages(config, seq_adv: torch.Tensor, mask: torch.Tensor, *, rewards: torch.Tensor | None = None,
                         offsets: torch.Tensor | None = None, token_ids: torch.Tensor | None = None,
                         entropy: torch.Tensor | None = None,
                         scorer: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None,
                         ignore_ids: Sequence[int] = ()) -> torch.Tensor:
    """(B, T) float32 per-token advantages of ``config.method`` from sequence advantages (docs/method.md 5-8).

    Args:
        config: ``oar.OARConfig``.
        seq_adv: (B,) sequence advantages (rows grouped as ``offsets`` says).
        mask: (B, T) tokens that carry the loss.
        rewards, offsets, token_ids: (B,), (G + 1,), (B, T): method ``ktae`` (correct = reward > ktae_threshold).
        entropy: (B, T) policy entropies (nats): method ``entropy_shaping``.
        scorer: () -> (scores (B, T) >= 0, reasoning_mask (B, T) bool): methods ``random``, ``entropy``, ``oar_p``,
            ``oar_g`` (called only for them).
        ignore_ids: token ids KTAE scores 0 (EOS / PAD).

    Raises:
        ValueError: a method's missing input, naming it.
    """
    from oar import baselines

    method = config.method
    a = seq_adv.detach().float().cpu()
    m = mask.detach().bool().cpu()
    if method in ("grpo", "dr_grpo"):
        return a[:, None] * m
    if method == "entropy_shaping":
        if entropy is None:
            raise ValueError("method 'entropy_shaping' needs the policy entropies (B, T) of the batch")
        es = config.entropy_shaping
        return baselines.entropy_shaping_advantages(a, entropy.detach().float().cpu(), m, alpha=es.alpha, kappa=es.kappa)
    if method == "ktae":
        if rewards is None or offsets is None or token_ids is None:
            raise ValueError("method 'ktae' needs rewards (B,), the group offsets and the response token ids (B, T)")
        kt = config.ktae
        bonus = baselines.ktae_token_scores(token_ids.detach().cpu(), m, rewards.detach().cpu().float(), offsets.cpu(),
                                            alpha=kt.alpha, beta=kt.beta, tf=kt.tf, scale=kt.scale,
                                            threshold=kt.threshold, ignore_ids=list(ignore_ids))
        return ((a.double()[:, None] + bonus.double()) * m).float()
    if scorer is None:
        raise ValueError(f"method {method!r} needs per-token importance scores: configure a scorer")
    scores, reasoning = scorer()
    r = config.reshape
    tok, _ = ops.reshape_advantages(a, scores.detach().float().cpu(), reasoning.detach().bool().cpu() & m, m, q=r.q,
                                    beta=r.beta, floor=r.floor, tiers=r.tiers)
    return tok
