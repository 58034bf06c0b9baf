"""TRL integration: GRPO with OAR per-token advantages (docs/trainers.md, TRL section; docs/trainers/trl.md).

Source hook point: ``trl.GRPOTrainer._generate_and_score_completions`` (trl 1.13.0,
trl/trainer/grpo_trainer.py). It returns a dict whose ``advantages`` are (B,) sequence advantages after
TRL's own group normalization (over rewards gathered from every process, then sliced to this process). We
replace them by (B, C) per-token advantages; ``_compute_loss`` consumes a 2-D tensor per token (it unsqueezes
only 1-D ones), and buffering/shuffling split dim 0 only, so the (B, C) tensor survives unchanged.

Usage (one changed import, one extra argument)::

    from oar.integrations.trl import OARGRPOTrainer
    trainer = OARGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=ds,
                             oar_config=oar.OARConfig.from_json('{"method": "oar_g"}'))

Every method of :data:`oar.METHODS` works: ``grpo``, ``dr_grpo`` (sets TRL's ``scale_rewards="none"``),
``random``, ``entropy``, ``entropy_shaping``, ``ktae``, ``oar_p``, ``oar_g``. The dataset rows must carry
the reference answer in ``answer_column`` (default ``"answer"``) for ``oar_p`` / ``oar_g``.

Multi-process (accelerate, DDP / DeepSpeed / FSDP): attribution runs on each process's own rows with the
advantages TRL normalized over the gathered batch; the forwards are kept in step across ranks
(:mod:`oar.distributed`), which ZeRO-3 / FSDP require. KTAE needs whole groups, which may span processes: its
token tables are built on the gathered completions and sliced back.
"""

from __future__ import annotations

import time
import warnings
from collections import defaultdict

import torch

from oar.hook import TokenAdvantageHook

SUPPORTED_TRL = ("1.13.0",)
SUPPORTED_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
# Methods that need the reference answer of each row (the outcome probe).
_NEEDS_ANSWER = ("oar_p", "oar_g")


def _check_oar_args(oar_config, answer_column, train_dataset=None) -> None:
    """Checks the OAR arguments before TRL builds anything: config type, answer column name and, for oar_p /
    oar_g, that a dataset with known columns has the answer column."""
    from oar import OARConfig

    if oar_config is not None and not isinstance(oar_config, OARConfig):
        raise ValueError(f"oar_config must be an oar.OARConfig or None, got {type(oar_config).__name__} "
                         "(build one with oar.OARConfig.from_json(...))")
    if not isinstance(answer_column, str) or not answer_column:
        raise ValueError(f"answer_column must be a non-empty str (a dataset column), got {answer_column!r}")
    method = oar_config.method if oar_config is not None else OARConfig().method
    columns = getattr(train_dataset, "column_names", None)
    if method in _NEEDS_ANSWER and isinstance(columns, (list, tuple)) and answer_column not in columns:
        raise KeyError(f"oar method {method!r} needs the reference answer in dataset column {answer_column!r}; "
                       f"train_dataset has columns {list(columns)} (set answer_column=... to the right column)")


def _check_args(args) -> None:
    """Refuses trainer settings under which per-token advantages are wrong, warns where pointless."""
    if getattr(args, "use_liger_kernel", False):
        raise ValueError("OAR needs per-token advantages, but use_liger_kernel=True: the Liger GRPO loss always "
                         "unsqueezes advantages to (B, 1). Set use_liger_kernel=False.")
    loss_type = getattr(args, "loss_type", "grpo")
    if loss_type == "luspo":
        raise ValueError("OAR is incompatible with loss_type='luspo' (sequence-level loss); use one of "
                         f"{SUPPORTED_LOSS_TYPES}")
    if loss_type not in SUPPORTED_LOSS_TYPES:
        warnings.warn(f"OAR is tested with loss_type in {SUPPORTED_LOSS_TYPES}, got {loss_type!r}", stacklevel=3)
    if getattr(args, "importance_sampling_level", "token") == "sequence":
        warnings.warn("importance_sampling_level='sequence' averages the ratio over the sequence: per-token "
                      "advantages still weight tokens, but OAR's credit assignment is partly pointless there",
                      stacklevel=3)
    if getattr(args, "top_entropy_quantile", 1.0) < 1.0:
        warnings.warn("top_entropy_quantile < 1 drops low-entropy tokens from the loss, which breaks OAR's "
                      "sum preservation of the advantage mass", stacklevel=3)


class OARTrainerMixin:
    """Mixin for GRPOTrainer subclasses: put it first in the bases and call :meth:`_oar_setup` from
    ``__init__`` after ``GRPOTrainer.__init__``::

        class MyTrainer(OARTrainerMixin, GRPOTrainer):
            def __init__(self, *args, oar_config=None, **kwargs):
                super().__init__(*args, **kwargs)
                self._oar_setup(oar_config)

    Adds per-token advantages and logs ``oar/*`` metrics plus ``time/generation``, ``time/attribution``
    (seconds per generation batch).
    """

    def _oar_setup(self, oar_config, answer_column: str = "answer") -> None:
        if oar_config is None:
            from oar import OARConfig

            oar_config = OARConfig()
        _check_args(self.args)
        self.oar_config = oar_config
        self.oar_answer_column = answer_column
        if oar_config.method == "dr_grpo" and getattr(self, "scale_rewards", "none") != "none":
            warnings.warn(f"oar method 'dr_grpo' uses sequence advantages without std scaling: setting TRL's "
                          f"scale_rewards='none' (was {self.scale_rewards!r})", stacklevel=3)
            self.scale_rewards = "none"
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        self.oar_hook = TokenAdvantageHook(oar_config, tokenizer)
        self.oar_timings: dict[str, list[float]] = defaultdict(list)
        self._oar_rewards = None

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # TRL returns the rewards of every process (gathered); keep their weighted sum for KTAE's correctness.
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        w = self.reward_weights.to(rewards_per_func.device)
        self._oar_rewards = (rewards_per_func * w.unsqueeze(0)).nansum(dim=1).detach()
        return rewards_per_func

    def _oar_ktae(self, out, eligible):
        """KTAE on the gathered batch (its groups may span processes), sliced back to this process."""
        from oar.api import additive_baseline

        acc = self.accelerator
        B = out["completion_ids"].shape[0]
        pad = int(self.oar_hook.builder.pad_id)
        ids = acc.gather(acc.pad_across_processes(out["completion_ids"], dim=1, pad_index=pad))
        cmask = acc.gather(acc.pad_across_processes(out["completion_mask"].int(), dim=1, pad_index=0))
        elig = acc.gather(acc.pad_across_processes(eligible.int(), dim=1, pad_index=0))
        adv = acc.gather(out["advantages"].detach().float())
        rewards = self._oar_rewards
        if rewards is not None and rewards.shape[0] == adv.shape[0]:
            rewards = torch.nan_to_num(rewards.float(), nan=float("-inf")).clamp_min(-3e38)  # unscorable = wrong
        else:
            rewards = None
        res = additive_baseline(self.oar_hook, None, [[]] * ids.shape[0], ids.cpu(), cmask.cpu().bool(), adv.cpu(),
                                elig.cpu().bool(), torch.device("cpu"), rewards=None if rewards is None else rewards.cpu(),
                                group_offsets=int(self.num_generations))
        sl = slice(acc.process_index * B, (acc.process_index + 1) * B)
        C = out["completion_ids"].shape[1]
        res.advantages = res.advantages[sl, :C]
        res.weights = res.weights[sl, :C]
        res.scores = res.scores[sl, :C]
        res.reasoning_mask = res.reasoning_mask[sl, :C]
        return res

    def _generate_and_score_completions(self, inputs):
        t0 = time.perf_counter()
        out = super()._generate_and_score_completions(inputs)
        t1 = time.perf_counter()
        mode = "train" if self.model.training else "eval"
        if mode != "train":
            return out
        method = self.oar_config.method
        if method in _NEEDS_ANSWER:
            missing = [i for i, x in enumerate(inputs) if x.get(self.oar_answer_column) is None]
            if missing:
                raise KeyError(f"OAR needs the reference answer in dataset column {self.oar_answer_column!r}; rows "
                               f"{missing[:5]} lack it or hold None (set answer_column=... to the right column)")
        answers = [str(x.get(self.oar_answer_column, "")) for x in inputs]
        prompt_ids = [row[m.bool()] for row, m in zip(out["prompt_ids"], out["prompt_mask"])]
        eligible = out["completion_mask"]
        if "tool_mask" in out:
            eligible = eligible * out["tool_mask"]
        if method == "ktae":
            res = self._oar_ktae(out, eligible)
        else:
            model = self.accelerator.unwrap_model(self.model)
            res = self.oar_hook.compute(model, prompt_ids, out["completion_ids"], out["completion_mask"],
                                        out["advantages"], answers, eligible_mask=eligible,
                                        group_offsets=int(self.num_generations))  # oar/skipped_groups_frac
        out["advantages"] = res.advantages.to(out["advantages"].device)
        t2 = time.perf_counter()
        for k, v in res.metrics.items():
            self._metrics[mode][k].append(v)
        self._metrics[mode]["time/generation"].append(t1 - t0)
        self._metrics[mode]["time/attribution"].append(t2 - t1)
        return out


def _make_trainer_class():
    try:
        import trl
        from trl import GRPOTrainer
    except ImportError as e:  # pragma: no cover - exercised only without trl
        raise ImportError("oar.integrations.trl needs the `trl` package (pip install trl==1.13.0)") from e
    if trl.__version__ not in SUPPORTED_TRL:
        warnings.warn(f"oar.integrations.trl is tested with trl {SUPPORTED_TRL}, found {trl.__version__}; the hook "
                      "point _generate_and_score_completions may have changed", stacklevel=2)
    for name in ("_generate_and_score_completions", "_calculate_rewards"):
        if not hasattr(GRPOTrainer, name):
            raise RuntimeError(f"trl {trl.__version__}: GRPOTrainer has no {name}; this trl version is not supported "
                               f"by oar (tested: {SUPPORTED_TRL})")

    class OARGRPOTrainer(OARTrainerMixin, GRPOTrainer):
        """``trl.GRPOTrainer`` with OAR per-token advantages. Same constructor plus:

        Args:
            oar_config: ``oar.OARConfig`` (default: OAR-G, answer_mean probe, q=0.25, beta=1, floor=0.1); any
                method of ``oar.METHODS``.
            answer_column: dataset column holding the reference answer (needed by oar_p / oar_g).

        Raises:
            ValueError: ``use_liger_kernel=True`` or ``loss_type="luspo"`` (per-token advantages would be lost);
                ``oar_config`` not an ``oar.OARConfig``; ``answer_column`` not a non-empty str.
            KeyError: method oar_p / oar_g and a ``train_dataset`` without ``answer_column`` (checked here; rows
                whose answer is missing or None are refused at the step that samples them).
        """

        def __init__(self, *args, oar_config=None, answer_column: str = "answer", **kwargs):
            # Refuse incompatible settings before TRL builds anything (GRPOTrainer(model, reward_funcs, args, ...)).
            _check_oar_args(oar_config, answer_column, kwargs.get("train_dataset", args[3] if len(args) > 3 else None))
            grpo_args = kwargs.get("args", args[2] if len(args) > 2 else None)
            if grpo_args is not None:
                _check_args(grpo_args)
            super().__init__(*args, **kwargs)
            self._oar_setup(oar_config, answer_column)

    return OARGRPOTrainer


OARGRPOTrainer = _make_trainer_class()
