"""verl integration: the refusals and checks of a verl run, made when the trainer is built, before any worker,
data loader or generation (docs/trainers/verl.md, "Refused at trainer start"): the OAR config and its estimator, the
actor's engine (FSDP / FSDP2 only), Ulysses sequence parallelism, verl's fused-kernel forward, an OAR estimator on
one of verl's own v1 trainer modes, and the dataset's reference answers. Importing it imports neither verl nor
torch; the worker side (:mod:`oar.integrations.verl.workers`) runs the same refusals again where the engine is.
"""

from __future__ import annotations

from oar.integrations.verl.estimators import ADV_ESTIMATORS, driver_scorer, estimator_config

#: The actor roles whose worker computes the scores (verl's ``Role`` values as strings).
ACTOR_ROLES = ("actor", "actor_rollout", "actor_rollout_ref")
#: verl engines ``oar_scores`` runs on (``actor_rollout_ref.actor.strategy``).
SUPPORTED_STRATEGIES = ("fsdp", "fsdp2")


def strategy_refusal(strategy: str) -> str:
    """The message refusing a verl engine ``oar_scores`` does not run on (driver at start, worker as backstop)."""
    return (f"oar_scores supports verl's FSDP / FSDP2 engines: actor_rollout_ref.actor.strategy must be one of "
            f"{SUPPORTED_STRATEGIES}, got actor.strategy={strategy!r} (Megatron is not supported yet)")


def sequence_parallel_refusal(sp: int) -> str:
    """The message refusing Ulysses sequence parallelism (driver at start, worker as backstop)."""
    return (f"oar_scores does not support Ulysses sequence parallelism yet (actor ulysses_sequence_parallel_size={sp}; "
            "each rank of a sequence-parallel group holds a slice of every sequence, OAR's probes need whole "
            "sequences); set actor_rollout_ref.actor.ulysses_sequence_parallel_size (and actor_rollout_ref.actor."
            "fsdp_config.ulysses_sequence_parallel_size) to 1")


def fused_kernels_refusal() -> str:
    """The message refusing verl's fused-kernel forward (driver at start, worker as backstop)."""
    return ("OAR's probes need the policy's logits, which verl's fused-kernel forward does not return (it returns "
            "log-probs and entropies only, docs/trainers/verl.md): actor_rollout_ref.model.use_fused_kernels must "
            "be False, got True; set actor_rollout_ref.model.use_fused_kernels=False")


def _estimator_name(config) -> str:
    adv = config.algorithm.adv_estimator
    return str(getattr(adv, "value", adv))


def scores_on_workers(config) -> bool:
    """Whether the trainer's advantage estimator (``algorithm.adv_estimator``) sends rows to the actor workers'
    ``oar_scores``: an OAR estimator (:data:`oar.integrations.verl.ADV_ESTIMATORS`) of a method that reshapes by
    per-token scores (``oar_p``, ``oar_g``, ``random``, ``entropy``), with no driver-side scorer set by
    :func:`oar.integrations.verl.configure`."""
    from oar.methods import method_spec

    name = _estimator_name(config)
    if name not in ADV_ESTIMATORS:
        return False
    return method_spec(estimator_config(name).method).credit.name == "reshape" and driver_scorer() is None


def check_trainer_config(config) -> None:
    """Refuses, when the trainer starts (before any worker or generation), a verl config the actor workers'
    ``oar_scores`` cannot serve; the worker checks the same again (:func:`worker_scores`). Nothing is checked
    when the estimator does not score on the workers (:func:`scores_on_workers`).

    Args:
        config: verl's trainer config (``DictConfig``): reads ``algorithm.adv_estimator``,
            ``actor_rollout_ref.actor.strategy``, ``actor_rollout_ref.actor.ulysses_sequence_parallel_size``,
            ``actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size`` and
            ``actor_rollout_ref.model.use_fused_kernels`` (verl's defaults when absent).

    Raises:
        NotImplementedError: ``actor.strategy`` not FSDP / FSDP2 (Megatron, ...); Ulysses sequence parallel size
            > 1; ``model.use_fused_kernels`` True with a method that runs the policy (``oar_p``, ``oar_g``,
            ``entropy``); each message names the key, the expected and the actual value.
    """
    from omegaconf import OmegaConf

    from oar.methods import method_spec

    if not scores_on_workers(config):
        return

    def get(key, default):
        v = OmegaConf.select(config, key, default=default)
        return default if v is None else v

    strategy = str(get("actor_rollout_ref.actor.strategy", "fsdp"))
    if strategy not in SUPPORTED_STRATEGIES:
        raise NotImplementedError(strategy_refusal(strategy))
    sp = max(int(get("actor_rollout_ref.actor.ulysses_sequence_parallel_size", 1)),
             int(get("actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size", 1)))
    if sp > 1:
        raise NotImplementedError(sequence_parallel_refusal(sp))
    needs_model = method_spec(estimator_config(_estimator_name(config)).method).needs_model
    if needs_model and bool(get("actor_rollout_ref.model.use_fused_kernels", False)):
        raise NotImplementedError(fused_kernels_refusal())


def start_checks(config, oar_trainer: bool) -> None:
    """Everything an OAR run of verl can be refused for, checked when the trainer is built (before any worker,
    data loader or generation): the OAR config (the ``oar`` section of verl's config or ``$OAR_CONFIG``, read by
    :func:`oar.integrations.verl.estimators.use_trainer_config`), then, for an OAR estimator,
    :func:`check_trainer_config`; and, for verl's v1 trainer, that an OAR estimator runs on an OAR trainer mode.

    Args:
        config: verl's trainer config (``DictConfig``).
        oar_trainer: whether the trainer being built is an OAR v1 trainer (``trainer.v1.trainer_mode=oar_<mode>``) or
            the legacy trainer's ``init_workers`` (True), or one of verl's own v1 trainers (False).

    Raises:
        ValueError: ``+oar.*`` keys with an estimator that is not oar's (they would be ignored: plain GRPO); an
            invalid OAR config (naming the key); an OAR estimator (``algorithm.adv_estimator=oar_*``)
            with one of verl's own v1 trainer modes (the message names the line to add,
            ``trainer.v1.trainer_mode=oar_<mode>``).
        NotImplementedError / TypeError: see :func:`check_trainer_config`, :func:`require_oar_workers`.
    """
    from oar.integrations.verl.estimators import use_trainer_config
    from oar.integrations.verl.launch import trainer_oar_section

    name = _estimator_name(config)
    section = trainer_oar_section(config) or {}
    if name not in ADV_ESTIMATORS and section:
        raise ValueError(f"the config has OAR keys (+oar.*: {sorted(section)}) but "
                         f"algorithm.adv_estimator={name!r} is not an OAR estimator, so they would be ignored and the "
                         f"run would be plain {name}: Hydra keeps the last value of a key, so check that the rest of "
                         "the command does not set algorithm.adv_estimator again (e.g. =grpo after =oar_g), or drop "
                         f"the +oar.* keys (OAR estimators: {sorted(ADV_ESTIMATORS)})")
    if name not in ADV_ESTIMATORS:
        if oar_trainer and name.lower().replace("-", "_").startswith("oar"):
            raise ValueError(f"algorithm.adv_estimator must be one of oar's estimators {sorted(ADV_ESTIMATORS)} (or "
                             f"one of verl's), got {name!r}")
        return
    if not oar_trainer:
        mode = str(config.trainer.v1.get("trainer_mode", "sync"))
        if _REWRITTEN.get(id(config)) == f"oar_{mode}":
            raise ValueError(f"this config was already used to build the OAR trainer of trainer.v1.trainer_mode="
                             f"oar_{mode}, which set trainer.v1.trainer_mode to {mode!r} as verl reads it; build each "
                             f"trainer from its own config (or set trainer.v1.trainer_mode=oar_{mode} again)")
        raise ValueError(
            f"algorithm.adv_estimator={name!r} needs oar's v1 trainer, which hands the estimator the rollouts and the "
            f"actor workers: trainer.v1.trainer_mode={mode!r} runs verl's own {mode!r} trainer without them. Add "
            f"trainer.v1.trainer_mode=oar_{mode} to the command (verl's {mode!r} trainer plus OAR; or "
            "trainer.use_v1=False for the legacy trainer)")
    cfg = use_trainer_config(config)
    wanted = ADV_ESTIMATORS[name]
    if "method" in section and wanted is not None and cfg.method != wanted:
        raise ValueError(f"+oar.method={section['method']} disagrees with algorithm.adv_estimator={name!r}, which "
                         f"runs method {wanted!r}: drop +oar.method, or use algorithm.adv_estimator=oar_"
                         f"{section['method'].removeprefix('oar_')} (or algorithm.adv_estimator=oar, which takes the "
                         "method from the config)")
    check_trainer_config(config)


def check_dataset_answers(config, dataset, answer_key=("reward_model", "ground_truth"), tokenizer=None,
                          rows: int = 8) -> int:
    """Checks the reference answers of the first ``rows`` rows of verl's train dataset when the estimator's method
    probes them (``oar_p`` / ``oar_g``), when the OAR trainer loads the data (before any worker or generation): each
    row must hold ``row[answer_key[0]][answer_key[1]]`` and it must be a final answer, not a worked solution
    (:func:`oar.answers.check_reference_answer`). Every batch's answers are checked again when they are read
    (:func:`oar.integrations.verl.rollout_rows`).

    Args:
        config: verl's trainer config. dataset: verl's ``RLHFDataset`` (its ``dataframe`` is read, or its rows by
            index), or None (nothing checked). answer_key: where the answer is (verl: ``reward_model.ground_truth``).
        tokenizer: the policy's tokenizer (the length check in tokens). rows: how many leading rows to check.

    Returns:
        The number of rows checked.

    Raises:
        KeyError: a checked row without the answer (naming the row and the key).
        ValueError: an answer that is not a final answer (naming the row, the start of the value and the fix).
    """
    from oar.answers import answer_text, check_reference_answer
    from oar.integrations.verl.rollouts import ANSWER_FIX
    from oar.methods import method_spec

    name = _estimator_name(config)
    if dataset is None or name not in ADV_ESTIMATORS or not method_spec(estimator_config(name).method).needs_answers:
        return 0
    table = getattr(dataset, "dataframe", None)
    try:
        n = min(rows, len(table if table is not None else dataset))
    except TypeError:  # a dataset without a length: checked per batch only
        return 0
    k0, k1 = answer_key
    for i in range(n):
        row = (table.iloc[i].to_dict() if hasattr(table, "iloc") else table[i]) if table is not None else dataset[i]
        holder = row.get(k0) if isinstance(row, dict) else None
        value = holder.get(k1) if isinstance(holder, dict) else None
        if value is None:
            raise KeyError(f"algorithm.adv_estimator={name!r} probes the reference answers, read from each dataset "
                           f"row's {k0}.{k1} (verl's RL datasets); train row {i} has none ({k0} = {holder!r})")
        column = f"{k0}.{k1}"
        check_reference_answer(answer_text(value, column=column, row=i, fix=ANSWER_FIX), column=column, row=i,
                               tokenizer=tokenizer, fix=ANSWER_FIX)
    return n


#: id of each trainer config whose ``trainer.v1.trainer_mode`` an OAR trainer set back to verl's name -> the OAR mode
#: the command gave (a second trainer built from the same config object is told so instead of "add the line").
_REWRITTEN: dict[int, str] = {}
