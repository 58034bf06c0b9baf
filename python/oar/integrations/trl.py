"""TRL integration: GRPO with OAR per-token advantages (docs/trainers.md, TRL section; docs/trainers/trl.md).

Source hook point: ``trl.GRPOTrainer._generate_and_score_completions`` (tested with trl 1.13.0,
trl/trainer/grpo_trainer.py; other versions are accepted when they have the hook points, checked by feature
detection: :data:`HOOK_POINTS`). It returns a dict whose ``advantages`` are (B,) sequence advantages after
TRL's own group normalization (over rewards gathered from every process, then sliced to this process). We
replace them by (B, C) per-token advantages; ``_compute_loss`` consumes a 2-D tensor per token (it unsqueezes
only 1-D ones), and buffering/shuffling split dim 0 only, so the (B, C) tensor survives unchanged.

Usage (one changed import, one extra argument)::

    from oar.integrations.trl import OARGRPOTrainer
    trainer = OARGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=ds,
                             oar_config=oar.OARConfig(method="oar_g"))

Every method of :data:`oar.METHODS` works: ``grpo``, ``dr_grpo`` (sets TRL's ``scale_rewards="none"``),
``random``, ``entropy``, ``entropy_shaping``, ``ktae``, ``oar_p``, ``oar_g``. The dataset rows must carry
the reference answer in ``answer_column`` (default ``"answer"``) for ``oar_p`` / ``oar_g``: the final answer, which
the probe reads after the conclude string; ``answer_extractor`` (a callable str -> str, e.g.
:func:`oar.answers.gsm8k_final_answer` for GSM8K's worked solutions ending in ``#### 42``) derives it from the
column's value. A value that is a solution rather than an answer (a final-answer marker, several lines) is refused,
a long one warned about (:func:`oar.answers.check_reference_answer`), at construction on the first
:data:`CHECKED_ROWS` rows of an indexable ``train_dataset`` and at each step on the rows it scores.

Multi-process (accelerate, DDP / DeepSpeed / FSDP1 / FSDP2): attribution runs on each process's own rows with the
advantages TRL normalized over the gathered batch, on the policy being trained (the FSDP1 wrapper itself, else the
unwrapped model: :meth:`OARTrainerMixin._oar_policy`). Every model call is a root forward on ids (OAR-G takes the
embeddings through a hook inside the forward) and the forwards are kept in step across ranks
(:mod:`oar.distributed`, over the replica's shard group: :func:`oar.distributed.replica_group`), which ZeRO-3 / FSDP
require. KTAE needs whole groups, which may span processes: its token tables are built on the gathered completions
and sliced back. An error on some ranks only (a row without its answer, a malformed batch, an engine error, a
reward function that raises or returns the wrong number of rewards) is raised on every rank as one
:class:`oar.distributed.RankError` instead of leaving the others in a collective (docs/trainers/trl.md, "Errors").
Reward functions are wrapped for that (:func:`guard_reward_func`); reward models (``nn.Module``) are not.
"""

from __future__ import annotations

import functools
import inspect
import time
import warnings
from collections.abc import Mapping

import torch

from oar.answers import prepare_reference_answers
from oar.batch import RolloutBatch
from oar.distributed import agree_on_errors, agreed_call, distributed_world, replica_group
from oar.pipeline import Pipeline
from oar.groups import group_ids_from
from oar.schema import OARConfig, config_arg

#: trl versions the tests run against (other versions are accepted when they have :data:`HOOK_POINTS`).
#: trl versions the tests ran (the tested series, which ``oar[trl]`` installs, is
#: :data:`oar.integrations._versions.TESTED`; another installed version gets a warning at import).
TESTED_TRL = ("1.13.0",)
#: TRL's loss types whose loss and gradients are TRL's own under uniform credit (tests/python/integrations/test_trl.py,
#: test_uniform_credit_is_trl_grpo): every loss_type of trl 1.13 but "luspo".
SUPPORTED_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "vespo")
#: Loss types whose per-token term is the importance ratio times the advantage only: under
#: importance_sampling_level="sequence" the ratio is one number per row, so a row's loss depends on its advantage
#: mass alone, which OAR's reshaping keeps (cispo and vespo also multiply by each token's log-probability).
RATIO_TIMES_ADVANTAGE = ("grpo", "dr_grpo", "dapo", "bnpo", "sapo")
#: GRPOTrainer methods we override, with the parameters we rely on.
HOOK_POINTS = {
    "_generate_and_score_completions": ("self", "inputs"),
    "_calculate_rewards": ("self", "inputs", "prompts", "completions", "completion_ids_list"),
}
#: Keys of the dict ``_generate_and_score_completions`` returns that we read.
OUTPUT_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")
#: Rows of an indexable ``train_dataset`` whose reference answers are checked at construction (the rest at the steps
#: that sample them).
CHECKED_ROWS = 8
#: What a user changes when a reference answer is refused (the end of :mod:`oar.answers`' messages).
ANSWER_FIX = ("pass answer_extractor=oar.answers.gsm8k_final_answer (GSM8K's '#### x' format) or another callable "
              "str -> str to OARGRPOTrainer, or answer_column=... naming a column that holds only the final answer")


def check_trl_features(trainer_cls) -> None:
    """Checks that ``trainer_cls`` (``trl.GRPOTrainer`` or a subclass) has the hook points oar overrides, with
    the parameters it relies on (:data:`HOOK_POINTS`).

    Raises:
        RuntimeError: one message naming the missing or changed hook point and the trl version found.
    """
    try:
        import trl

        version = trl.__version__
    except ImportError:  # pragma: no cover - only without trl
        version = "?"
    for name, params in HOOK_POINTS.items():
        fn = getattr(trainer_cls, name, None)
        if fn is None:
            raise RuntimeError(f"trl {version}: {trainer_cls.__name__} has no {name}, the hook point oar overrides; "
                               f"oar.integrations.trl needs a trl whose GRPOTrainer has {name}{params} (tested: "
                               f"{TESTED_TRL})")
        got = tuple(inspect.signature(fn).parameters)
        if got[: len(params)] != params:
            raise RuntimeError(f"trl {version}: {trainer_cls.__name__}.{name}{got} is not {name}{params}, the hook "
                               f"point oar overrides (tested: {TESTED_TRL})")


def _check_oar_args(oar_config, answer_column, train_dataset=None, answer_extractor=None, tokenizer=None) -> None:
    """Checks the OAR arguments before TRL builds anything: config type, answer column name, answer extractor and,
    for the methods that read reference answers, that a dataset with known columns has the answer column and that
    the answers of its first rows are final answers (:func:`_check_first_answers`)."""
    from oar.methods import method_spec

    config_arg(oar_config, "oar_config")
    if not isinstance(answer_column, str) or not answer_column:
        raise ValueError(f"answer_column must be a non-empty str (a dataset column), got {answer_column!r}")
    if answer_extractor is not None and not callable(answer_extractor):
        raise ValueError(f"answer_extractor must be a callable str -> str (e.g. oar.answers.gsm8k_final_answer) or "
                         f"None, got {type(answer_extractor).__name__} {answer_extractor!r}")
    spec = method_spec(oar_config.method if oar_config is not None else OARConfig().method)
    columns = getattr(train_dataset, "column_names", None)
    if spec.needs_answers and isinstance(columns, (list, tuple)) and answer_column not in columns:
        raise KeyError(f"oar method {spec.name!r} needs the reference answer in dataset column {answer_column!r}; "
                       f"train_dataset has columns {list(columns)} (set answer_column=... to the right column)")
    if spec.needs_answers:
        _check_first_answers(train_dataset, answer_column, answer_extractor, tokenizer)


def _text_tokenizer(processing_class):
    """The tokenizer of a processing class (a processor's ``.tokenizer``), None when it has no ``encode``."""
    tok = getattr(processing_class, "tokenizer", processing_class)
    return tok if callable(getattr(tok, "encode", None)) else None


def _check_first_answers(train_dataset, answer_column: str, answer_extractor, tokenizer) -> None:
    """:func:`oar.answers.prepare_reference_answers` on the first :data:`CHECKED_ROWS` rows of an indexable
    ``train_dataset`` (``len`` and ``[i]`` giving a mapping; a ``datasets.Dataset``), named by their dataset index;
    rows without the column or with None are left to the step (which refuses them). Nothing for an iterable
    dataset."""
    if train_dataset is None or not hasattr(train_dataset, "__getitem__") or not hasattr(train_dataset, "__len__"):
        return
    try:
        n = min(len(train_dataset), CHECKED_ROWS)
        rows = [(i, train_dataset[i]) for i in range(n)]
    except Exception:  # noqa: BLE001 - not indexable by position after all: the steps check every row
        return
    got = [(i, r[answer_column]) for i, r in rows if isinstance(r, Mapping) and r.get(answer_column) is not None]
    if got:
        prepare_reference_answers([v for _, v in got], column=answer_column, rows=[i for i, _ in got],
                                  extractor=answer_extractor, tokenizer=tokenizer, fix=ANSWER_FIX)


def _check_args(args, method: str | None = None) -> None:
    """Refuses trainer settings under which per-token advantages are wrong, warns where OAR's credit is pointless
    (``method``: the oar method, default the OARConfig default; uniform-credit methods are TRL's GRPO and get no
    warning). docs/trainers/trl.md lists what is refused and served."""
    from oar.methods import method_spec

    credit = method_spec(method if method is not None else OARConfig().method).credit.name
    if getattr(args, "use_liger_kernel", False):
        raise ValueError("OAR needs per-token advantages, but use_liger_kernel=True: the Liger GRPO loss always "
                         "unsqueezes advantages to (B, 1). Set use_liger_kernel=False.")
    loss_type = getattr(args, "loss_type", "grpo")
    if loss_type == "luspo":
        raise ValueError("OAR is incompatible with loss_type='luspo' (sequence-level loss); use one of "
                         f"{SUPPORTED_LOSS_TYPES}")
    if loss_type not in SUPPORTED_LOSS_TYPES:
        warnings.warn(f"OAR is tested with loss_type in {SUPPORTED_LOSS_TYPES}, got {loss_type!r}", stacklevel=3)
    if credit != "reshape":
        return
    if getattr(args, "importance_sampling_level", "token") == "sequence" and loss_type in RATIO_TIMES_ADVANTAGE:
        warnings.warn(f"importance_sampling_level='sequence' with loss_type={loss_type!r}: the importance ratio is one "
                      "number per sequence, so each sequence's loss depends only on the sum of its token advantages, "
                      "which OAR's reshaping keeps: OAR's credit assignment has no effect on the gradient here (except "
                      "on tokens top_entropy_quantile drops); use importance_sampling_level='token'", stacklevel=3)
    if getattr(args, "top_entropy_quantile", 1.0) < 1.0:
        warnings.warn("top_entropy_quantile < 1 drops low-entropy tokens from the loss, which breaks OAR's "
                      "sum preservation of the advantage mass", stacklevel=3)


def _callable_name(func) -> str:
    """The name TRL gives a reward function (trl/trainer/utils.py, ``get_callable_name``): a ``functools.partial``'s
    function's, else ``__name__``, else the class name of a callable instance."""
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", type(func).__name__)


def _checked_rewards(out, n: int, name: str):
    """A reward function's output as TRL reads it (grpo_trainer.py, ``_calculate_rewards``: None -> NaN, one reward
    per row, converted to a float32 tensor), checked: raises where TRL would after the call. Returns ``out`` itself
    when it is a list or tuple (TRL then reads exactly what the function returned), else its values as a list (an
    iterator is read once)."""
    if isinstance(out, (str, bytes)) or not hasattr(out, "__iter__"):
        raise TypeError(f"the reward function {name!r} must return a list of {n} rewards (float or None), got "
                        f"{type(out).__name__}")
    values = out if isinstance(out, (list, tuple)) else list(out)
    if len(values) != n:
        raise ValueError(f"the reward function {name!r} returned {len(values)} rewards, but {n} were expected (one "
                         "per prompt-completion pair of this process's batch)")
    torch.tensor([float("nan") if r is None else r for r in values], dtype=torch.float32)  # TRL's conversion
    return values


def guard_reward_func(func, errors: list):
    """``func`` (a TRL reward function: ``func(prompts=..., completions=..., completion_ids=..., **columns)``, sync
    or async) wrapped so that, with several processes, a failure on one rank reaches TRL's gather of the rewards
    instead of leaving the other ranks waiting in it: an exception, or an output TRL would refuse after the call (not
    one reward per row, a value that is not a number or None), is appended to ``errors`` and the wrapper returns
    ``[None] * len(prompts)`` (NaN rewards for TRL); the trainer then raises the first recorded error on every rank
    (:meth:`OARTrainerMixin._calculate_rewards`). A correct output is returned as it is, so the rewards are
    bit-identical. With one process (or a call without ``prompts``) the wrapper is ``func`` itself: its errors and
    TRL's are raised as without oar.

    The wrapper is a coroutine function exactly when ``func`` is one (TRL awaits those on its event loop), and keeps
    ``func``'s ``__name__`` (TRL's ``get_callable_name(func)``: TRL logs rewards under it), ``__qualname__``,
    ``__doc__``, ``__module__``; ``__wrapped__`` is ``func``. Wrapping a wrapper wraps its original function.

    Args:
        func: a callable reward function (not an ``nn.Module`` reward model, which TRL calls as a model).
        errors: the list the errors of the current step are appended to.

    Returns:
        the wrapper.

    Raises:
        ValueError: ``func`` is an ``nn.Module`` or not callable.
    """
    func = getattr(func, "__oar_reward_func__", func)
    if isinstance(func, torch.nn.Module) or not callable(func):
        raise ValueError(f"guard_reward_func wraps a callable reward function, got {type(func).__name__} (reward "
                         "models are called by TRL as models and are not wrapped)")
    name = _callable_name(func)

    def rows(kwargs) -> int | None:
        prompts = kwargs.get("prompts")
        return len(prompts) if prompts is not None and distributed_world() else None

    if inspect.iscoroutinefunction(func):
        async def guarded(*args, **kwargs):
            n = rows(kwargs)
            if n is None:
                return await func(*args, **kwargs)
            try:
                return _checked_rewards(await func(*args, **kwargs), n, name)
            except Exception as e:  # noqa: BLE001 - raised on every rank after TRL's gather
                errors.append(e)
                return [None] * n
    else:
        def guarded(*args, **kwargs):
            n = rows(kwargs)
            if n is None:
                return func(*args, **kwargs)
            try:
                return _checked_rewards(func(*args, **kwargs), n, name)
            except Exception as e:  # noqa: BLE001 - raised on every rank after TRL's gather
                errors.append(e)
                return [None] * n

    guarded.__name__ = name
    guarded.__qualname__ = getattr(func, "__qualname__", name)
    guarded.__doc__ = getattr(func, "__doc__", None)
    guarded.__module__ = getattr(func, "__module__", guarded.__module__)
    guarded.__wrapped__ = func
    guarded.__oar_reward_func__ = func
    return guarded


def combined_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(B,) weighted sum of TRL's per-function rewards (B, F), NaN (a function that returned None) left out as
    TRL does, except that a row whose rewards are ALL NaN stays NaN: an unscorable rollout, a failure for KTAE,
    never reward 0 (which TRL's ``nansum`` would make it, and which is "correct" under a negative threshold)."""
    r = rewards_per_func.detach().float()
    out = (r * weights.to(r.device).float().unsqueeze(0)).nansum(dim=1)
    return torch.where(torch.isnan(r).all(dim=1), torch.full_like(out, float("nan")), out)


class OARTrainerMixin:
    """Mixin for GRPOTrainer subclasses: put it first in the bases and call :meth:`_oar_setup` from
    ``__init__`` after ``GRPOTrainer.__init__``::

        class MyTrainer(OARTrainerMixin, GRPOTrainer):
            def __init__(self, *args, oar_config=None, **kwargs):
                super().__init__(*args, **kwargs)
                self._oar_setup(oar_config)

    Adds per-token advantages and logs ``oar/*`` metrics plus ``time/generation``, ``time/attribution``
    (seconds per generation batch). ``_oar_setup(oar_config, answer_column="answer", answer_extractor=None)`` takes
    :class:`OARGRPOTrainer`'s extra arguments, checks the reference answers of the first rows of ``train_dataset``,
    and wraps the callable reward functions so that a failure on one rank is raised on every rank
    (:func:`guard_reward_func`).
    """

    def _oar_setup(self, oar_config, answer_column: str = "answer", answer_extractor=None) -> None:
        """Builds oar's pipeline for ``oar_config`` (None: ``OARConfig()``), checks the trainer's settings, the answer
        arguments and the first rows of ``train_dataset`` (:func:`_check_oar_args`), and wraps the callable reward
        functions (:func:`guard_reward_func`). ``answer_column`` / ``answer_extractor``: as for
        :class:`OARGRPOTrainer`.

        Raises:
            RuntimeError: the trl version lacks a hook point (:func:`check_trl_features`).
            ValueError, KeyError: as :class:`OARGRPOTrainer`'s constructor.
        """
        check_trl_features(type(self))
        tokenizer = _text_tokenizer(self.processing_class)
        _check_oar_args(oar_config, answer_column, getattr(self, "train_dataset", None), answer_extractor, tokenizer)
        if oar_config is None:
            oar_config = OARConfig()
        _check_args(self.args, oar_config.method)
        self.oar_config = oar_config
        self.oar_answer_column = answer_column
        self.oar_answer_extractor = answer_extractor
        # Reward functions report their errors here, for every rank to raise after TRL's gather; reward models
        # (nn.Module) are called by TRL as models and are not wrapped. A new list: the user's list stays as it was.
        self._oar_reward_errors = []
        funcs = getattr(self, "reward_funcs", None)
        if funcs is not None:
            self.reward_funcs = [f if isinstance(f, torch.nn.Module) else guard_reward_func(f, self._oar_reward_errors)
                                 for f in funcs]
        if oar_config.advantages.estimator == "dr_grpo" and getattr(self, "scale_rewards", "none") != "none":
            warnings.warn(f"oar estimator 'dr_grpo' uses sequence advantages without std scaling: setting TRL's "
                          f"scale_rewards='none' (was {self.scale_rewards!r})", stacklevel=3)
            self.scale_rewards = "none"
        self.oar_tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        self.oar_pipeline = Pipeline(oar_config, self.oar_tokenizer)
        self._oar_rewards = None

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards of every process (gathered), after one error round: a reward function that failed on some
        rank (recorded by :func:`guard_reward_func`, which let that rank reach TRL's gather) is raised on every rank
        as the same :class:`oar.distributed.RankError` (one scalar all-reduce per call; with one process nothing is
        recorded and this is TRL's method). Keeps the rewards' combination for KTAE's correctness."""
        errors = getattr(self, "_oar_reward_errors", None)
        if errors is not None:
            errors.clear()
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        error = errors[0] if errors else None
        if errors is not None:
            errors.clear()
        agree_on_errors(error, during="the reward functions")
        self._oar_rewards = combined_rewards(rewards_per_func, self.reward_weights)
        return rewards_per_func

    def _oar_batch(self, inputs, out) -> RolloutBatch:
        """This process's rows as a RolloutBatch, after checking what the adapter assumes of TRL's layout."""
        missing = [k for k in OUTPUT_KEYS if k not in out]
        if missing:
            raise RuntimeError(f"GRPOTrainer._generate_and_score_completions returned no {missing} (keys: "
                               f"{sorted(out)}): this trl version is not supported by oar (tested: {TESTED_TRL})")
        cids, cmask = out["completion_ids"], out["completion_mask"]
        B, C = cids.shape
        eligible = cmask
        if out.get("tool_mask") is not None:
            tm = out["tool_mask"]
            if not isinstance(tm, torch.Tensor) or tuple(tm.shape) != (B, C):
                got = tuple(tm.shape) if isinstance(tm, torch.Tensor) else type(tm).__name__
                raise ValueError(f"tool_mask must be (B, C) = {(B, C)} like completion_mask, got {got}")
            eligible = cmask.bool() & tm.bool()
        prompt_ids = [row[m.bool()] for row, m in zip(out["prompt_ids"], out["prompt_mask"])]
        G = int(self.num_generations)
        first = self.accelerator.process_index * B  # global row of local row 0 (TRL slices the gathered batch)
        groups = [(first + i) // G for i in range(B)]
        for i in range(1, B):
            if groups[i] == groups[i - 1] and not torch.equal(prompt_ids[i].cpu(), prompt_ids[i - 1].cpu()):
                rows = [k for k in range(B) if groups[k] == groups[i]]
                raise ValueError(f"TRL batch layout: rows {rows} (group {groups[i]}, num_generations = {G}) must share "
                                 f"one prompt, but row {i}'s prompt differs from row {i - 1}'s: oar reads each block "
                                 "of num_generations rows as one prompt's group")
        answers = None
        if self.oar_pipeline.method.needs_answers:
            col = self.oar_answer_column
            bad = [i for i, x in enumerate(inputs) if x.get(col) is None]
            if bad:
                raise KeyError(f"OAR needs the reference answer in dataset column {col!r}; rows "
                               f"{bad[:5]} lack it or hold None (set answer_column=... to the right column)")
            rank = self.accelerator.process_index
            answers = prepare_reference_answers(
                [x[col] for x in inputs], column=col, rows=[f"{i} of process {rank}'s batch" for i in range(B)],
                extractor=getattr(self, "oar_answer_extractor", None), tokenizer=_text_tokenizer(self.oar_tokenizer),
                fix=ANSWER_FIX)
        turn_rewards = None
        if self.oar_pipeline.config.turn_credit == "rewards":  # a rollout_func's per-row field (TRL merges it in)
            turn_rewards = [x.get("turn_rewards") for x in inputs]
            if all(r is None for r in turn_rewards):
                turn_rewards = None  # refused by the pipeline, which names what is missing
        return RolloutBatch(cids, cmask, prompt_ids=prompt_ids, eligible_mask=eligible, group_ids=groups,
                            answers=answers, sequence_advantages=out["advantages"], turn_rewards=turn_rewards)

    def _oar_gathered(self, batch: RolloutBatch) -> RolloutBatch:
        """The whole batch of every process (KTAE's groups may span processes), padded to one width."""
        acc = self.accelerator
        pad = self.oar_pipeline.pad_id
        ids = acc.gather(acc.pad_across_processes(batch.completion_ids, dim=1, pad_index=pad))
        cmask = acc.gather(acc.pad_across_processes(batch.completion_mask.int(), dim=1, pad_index=0))
        elig = acc.gather(acc.pad_across_processes(batch.eligible_mask.int(), dim=1, pad_index=0))
        adv = acc.gather(batch.sequence_advantages.detach().float())
        G = int(self.num_generations)
        rewards = self._oar_rewards
        if rewards is not None and rewards.shape[0] != adv.shape[0]:
            rewards = None
        return RolloutBatch(ids.cpu(), cmask.cpu().bool(), eligible_mask=elig.cpu().bool(),
                            rewards=None if rewards is None else rewards.cpu(),
                            group_ids=group_ids_from(int(ids.shape[0]), group_size=G),
                            sequence_advantages=adv.cpu())

    def _oar_policy(self):
        """The module attribution runs forwards of: one whose forward is a root forward of the trained policy.

        FSDP1 keeps the root module's own parameters (embedding, LM head) as flat shards that only the wrapper's
        forward gathers, so the wrapper is used (its forward passes the keyword arguments through). DDP (whose
        forward would prepare a gradient reduction), DeepSpeed (every submodule gathers its own ZeRO-3
        parameters) and FSDP2 (the module itself gathers) give the unwrapped model."""
        wrapped = getattr(self, "model_wrapped", self.model)
        try:
            from torch.distributed.fsdp import FullyShardedDataParallel
        except ImportError:  # pragma: no cover - torch without distributed
            FullyShardedDataParallel = ()
        for m in (wrapped, self.model):
            if isinstance(m, FullyShardedDataParallel):
                return m
        return self.accelerator.unwrap_model(self.model)

    def _generate_and_score_completions(self, inputs):
        t0 = time.perf_counter()
        out = super()._generate_and_score_completions(inputs)
        t1 = time.perf_counter()
        mode = "train" if self.model.training else "eval"
        if mode != "train":
            return out
        needs_groups = self.oar_pipeline.method.needs_groups
        policy = None if needs_groups else self._oar_policy()
        # A check that fails on some ranks only (a row without its answer, a malformed batch) must stop every rank:
        # one error round over the world before any collective of the scoring, then agreed_call around it (one
        # round over the forward gate's group, then one over the world): docs/trainers/trl.md, "Errors".
        error = None
        try:
            batch = self._oar_batch(inputs, out)
        except Exception as e:  # noqa: BLE001 - re-raised on every rank by agree_on_errors
            error = e
        agree_on_errors(error)

        def score():
            if needs_groups:  # KTAE: whole groups, gathered, then this process's slice
                res = self.oar_pipeline.compute(self._oar_gathered(batch))
                B, C = batch.completion_ids.shape
                rows = slice(self.accelerator.process_index * B, (self.accelerator.process_index + 1) * B)
                return res, res.advantages[rows, :C]
            res = self.oar_pipeline.compute(batch, policy)
            return res, res.advantages

        res, tok = agreed_call(score, group=None if policy is None else replica_group(policy))
        out["advantages"] = tok.to(out["advantages"].device)
        t2 = time.perf_counter()
        for k, v in res.metrics.items():
            self._metrics[mode][k].append(v)
        self._metrics[mode]["time/generation"].append(t1 - t0)
        self._metrics[mode]["time/attribution"].append(t2 - t1)
        return out


def _make_trainer_class(base=None):
    """``OARGRPOTrainer`` over ``base`` (default ``trl.GRPOTrainer``), after :func:`check_trl_features`; an installed
    trl outside the tested series gets a warning (:func:`oar.integrations._versions.check_tested`)."""
    from oar.integrations._versions import check_tested, requirement

    if base is None:
        try:
            from trl import GRPOTrainer as base
        except ImportError as e:  # pragma: no cover - exercised only without trl
            raise ImportError(f"oar.integrations.trl needs the `trl` package: pip install \"{requirement('trl')}\" "
                              "(what oar[trl] installs)") from e
        check_tested("trl")
    check_trl_features(base)

    class OARGRPOTrainer(OARTrainerMixin, base):
        """``trl.GRPOTrainer`` with OAR per-token advantages. Same constructor plus:

        Args:
            oar_config: ``oar.OARConfig`` (default: OAR-G, answer_mean probe, q=0.25, beta=1, floor=0.1); any
                method of ``oar.METHODS``.
            answer_column: dataset column holding the reference answer (needed by oar_p / oar_g).
            answer_extractor: None (the column holds the final answer), or a callable str -> str applied to each
                row's ``answer_column`` value (``str()`` of it) before probing, returning the final answer as a
                non-empty str: ``oar.answers.gsm8k_final_answer`` for GSM8K's worked solutions ending in
                ``#### 42``.

        The answers (after the extractor) of the first ``CHECKED_ROWS`` rows of an indexable ``train_dataset`` are
        checked here, those of each step's rows at the step (:func:`oar.answers.check_reference_answer`): a
        final-answer marker (``####``, ``\\boxed``) or several lines are refused, an answer over
        ``oar.answers.MAX_ANSWER_TOKENS`` tokens is warned about once.

        Raises:
            ValueError: ``use_liger_kernel=True`` or ``loss_type="luspo"`` (per-token advantages would be lost);
                ``oar_config`` not an ``oar.OARConfig``; ``answer_column`` not a non-empty str;
                ``answer_extractor`` neither None nor callable; method oar_p / oar_g and a reference answer (here
                among the first rows, or at a step) that holds a final-answer marker or several lines, or is empty,
                or an extractor that raised or returned no non-empty str on a row (the message names the column,
                the row and the start of its value); at a step, a block of ``num_generations`` rows that are not
                one prompt's group, a ``tool_mask`` of another shape than the completions.
            KeyError: method oar_p / oar_g and a ``train_dataset`` without ``answer_column`` (checked here; rows
                whose answer is missing or None are refused at the step that samples them).
            oar.distributed.RankError: at a step with several processes, in place of any of the step's errors
                above (or of the scoring, or of a reward function: an exception, or not one reward per row) raised
                on some rank: on every rank, naming each failed rank and its message. With one process a reward
                function's error is raised as without oar.
        """

        def __init__(self, *args, oar_config=None, answer_column: str = "answer", answer_extractor=None, **kwargs):
            # Refuse incompatible settings before TRL builds anything (GRPOTrainer(model, reward_funcs, args,
            # train_dataset, eval_dataset, processing_class, ...)).
            _check_oar_args(oar_config, answer_column, kwargs.get("train_dataset", args[3] if len(args) > 3 else None),
                            answer_extractor, _text_tokenizer(kwargs.get("processing_class",
                                                                         args[5] if len(args) > 5 else None)))
            grpo_args = kwargs.get("args", args[2] if len(args) > 2 else None)
            if grpo_args is not None:
                _check_args(grpo_args, oar_config.method if oar_config is not None else None)
            super().__init__(*args, **kwargs)
            self._oar_setup(oar_config, answer_column, answer_extractor)

    return OARGRPOTrainer


OARGRPOTrainer = _make_trainer_class()
