"""``executor`` and ``executor_options``: which executor computes samples, and how Ray is used.

Parsed without importing ray (an optional extra): :mod:`loader.executors.ray`
imports it only when a Ray executor is built.
"""

from __future__ import annotations

from ..checks import check_keys, int_at_least
from ..settings import RayOptions

#: Where tasks run: ``"process"`` (the worker pool: processes, or threads) or ``"ray"`` (Ray actors).
EXECUTORS = ("process", "ray")
#: Keys of ``executor_options`` (``executor="ray"``); see :func:`parse_executor`.
RAY_OPTION_KEYS = frozenset({"address", "num_workers", "actor_options", "init_options", "start_timeout"})
#: Actor options the Ray executor sets itself: it replaces dead actors (and counts them against
#: ``max_worker_restarts``), runs one task at a time per actor, and no actor may outlive the loader.
RESERVED_ACTOR_OPTIONS = frozenset({"max_restarts", "max_task_retries", "max_concurrency", "lifetime", "name",
                                    "namespace", "get_if_exists"})
#: Seconds a Ray actor may take to be placed and started before the loader says why it is not.
DEFAULT_START_TIMEOUT = 120.0


def parse_executor(executor: object, options: object, nb_worker: int | None, default_nb_worker: int,
                   use_threading: bool, gpu_indices: object) -> tuple[RayOptions | None, int]:
    """Validate ``executor`` and ``executor_options``; return the filled-in options and the worker count.

    ``executor_options`` (only with ``executor="ray"``): ``address`` (``None``:
    this process's Ray connection, else a Ray instance started for the loader;
    ``"auto"``, ``"HOST:PORT"`` or ``"ray://..."``: that cluster),
    ``num_workers`` (actors; default `nb_worker`), ``actor_options`` (passed to
    ``ActorClass.options``; default ``{"num_cpus": 1}``), ``init_options``
    (keyword arguments of ``ray.init``) and ``start_timeout`` (seconds an actor
    may take to be placed).

    Parameters
    ----------
    executor, options
        The constructor's ``executor`` and ``executor_options``.
    nb_worker
        The constructor's `nb_worker` (alias resolved), ``None`` when not given.
    default_nb_worker
        Workers when neither `nb_worker` nor ``num_workers`` is given.
    use_threading, gpu_indices
        The constructor's; neither applies to Ray actors.

    Returns
    -------
    tuple
        The Ray options with every default filled in (``None`` for
        ``"process"``), and the number of workers (processes, threads or actors).

    Raises
    ------
    ValueError
        Naming the argument or key at fault.
    """
    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
    if executor == "process":
        if options:
            raise ValueError("executor_options apply to executor='ray' only; the process executor is set up by "
                             "nb_worker, use_threading and start_method")
        return None, default_nb_worker if nb_worker is None else nb_worker
    options = check_keys("executor_options", {} if options is None else options, set(RAY_OPTION_KEYS))
    if use_threading:
        raise ValueError("use_threading=True means worker threads in this process; it cannot be combined with "
                         "executor='ray'")
    if gpu_indices is not None:
        raise ValueError("gpu_indices applies to worker processes; with executor='ray' ask Ray for GPUs: "
                         "executor_options={'actor_options': {'num_gpus': 1}}")
    address = options.get("address")
    if address is not None and (not isinstance(address, str) or not address):
        raise ValueError(f"executor_options['address'] must be 'auto', 'HOST:PORT' or 'ray://HOST:PORT', "
                         f"got {address!r}")
    num_workers = options.get("num_workers")
    if nb_worker == 0:
        raise ValueError("nb_worker=0 computes samples in this process; executor='ray' needs at least one actor "
                         "(executor_options['num_workers'])")
    if num_workers is None:
        num_workers = default_nb_worker if nb_worker is None else nb_worker
    elif nb_worker is not None and nb_worker != num_workers:
        raise ValueError(f"nb_worker={nb_worker} and executor_options['num_workers']={num_workers} disagree; "
                         "give one of them")
    num_workers = int_at_least("executor_options['num_workers']", num_workers, 1)
    actor_options = _actor_options(options.get("actor_options", {}))
    init_options = options.get("init_options", {})
    if not isinstance(init_options, dict):
        raise ValueError(f"executor_options['init_options'] must be a dict, got {type(init_options).__name__}")
    if "address" in init_options:
        raise ValueError("executor_options['init_options'] cannot hold 'address': give executor_options['address']")
    timeout = options.get("start_timeout", DEFAULT_START_TIMEOUT)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"executor_options['start_timeout'] must be a number of seconds > 0, got {timeout!r}")
    return RayOptions(address, num_workers, {"num_cpus": 1, **actor_options}, dict(init_options),
                      float(timeout)), num_workers


def _actor_options(actor_options: object) -> dict[str, object]:
    """``executor_options["actor_options"]``, checked: a dict that leaves the loader's own options alone
    and asks for positive amounts of named resources."""
    if not isinstance(actor_options, dict):
        raise ValueError(f"executor_options['actor_options'] must be a dict, got {type(actor_options).__name__}")
    reserved = sorted(RESERVED_ACTOR_OPTIONS & set(actor_options))
    if reserved:
        raise ValueError(f"executor_options['actor_options'] cannot set {', '.join(map(repr, reserved))}: the "
                         "loader replaces dead actors itself (max_worker_restarts) and terminates its actors "
                         "when it closes")
    resources = actor_options.get("resources", {})
    if not isinstance(resources, dict) or not all(isinstance(k, str) and isinstance(v, (int, float)) and v > 0
                                                  for k, v in resources.items()):
        raise ValueError("executor_options['actor_options']['resources'] must map resource names to positive "
                         f"amounts, e.g. {{'producer': 1}}; got {resources!r}")
    return actor_options


def fits(actor_options: dict[str, object], available: dict[str, object]) -> bool:
    """Whether `available` (Ray's ``available_resources()``) holds what `actor_options` asks of a node."""
    asked: dict[str, float] = {}
    for option, resource in (("num_cpus", "CPU"), ("num_gpus", "GPU"), ("memory", "memory")):
        value = actor_options.get(option)
        if isinstance(value, (int, float)) and value > 0:
            asked[resource] = float(value)
    extra = actor_options.get("resources")
    if isinstance(extra, dict):
        asked.update({str(k): float(v) for k, v in extra.items() if isinstance(v, (int, float))})
    return all(isinstance(available.get(k), (int, float)) and float(available[k]) >= v  # type: ignore[arg-type]
               for k, v in asked.items())
