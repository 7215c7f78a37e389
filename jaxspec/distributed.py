"""Multi-host runs: one process per host, one mesh over every host's devices.

    from jaxspec import distributed
    distributed.initialize("10.0.0.1:1234", num_processes=2, process_id=0)   # before anything touches devices
    engine = Engine.load("kimi")          # the mesh spans jax.devices(): every process's devices
    if distributed.is_primary(): ...      # print from process 0 only

Every process runs the same program: it loads the same checkpoint (each process reads
only its own devices' shards of each leaf), calls the same compiled functions with the
same arguments, and gets the same replicated results back. This goes through
`jax.distributed` (a coordinator at HOST:PORT that every process can reach), not a
launcher of its own; on CPU the processes talk through gloo.
"""

from __future__ import annotations

import jax
import numpy as np

# The flag spellings of `python -m jaxspec.generate`, for error messages from the CLI.
CLI_NAMES = {"coordinator": "--coordinator", "num_processes": "--num-processes", "process_id": "--process-id"}
API_NAMES = {k: k for k in CLI_NAMES}


def check_args(
    coordinator: str | None, num_processes: int | None, process_id: int | None, names: dict[str, str] = API_NAMES
) -> bool:
    """Validate a multi-host setting; True when it asks for more than one process.

    Raises ValueError naming the argument (`names` maps to the spelling the caller uses)
    with what was expected and what was found.
    """
    c, n, i = names["coordinator"], names["num_processes"], names["process_id"]
    given = {
        k: v
        for k, v in (("coordinator", coordinator), ("num_processes", num_processes), ("process_id", process_id))
        if v is not None
    }
    if not given:
        return False
    if num_processes is None:
        raise ValueError(
            f"{', '.join(names[k] for k in given)} given without {n}: pass {n} N (the number "
            f"of processes, one per host) together with {c} HOST:PORT and {i} I"
        )
    if num_processes < 1:
        raise ValueError(f"{n} must be >= 1, found {num_processes}")
    if num_processes == 1 and coordinator is None:
        if process_id not in (None, 0):
            raise ValueError(f"{i} {process_id} is out of range for {n} 1: expected 0")
        return False
    if coordinator is None:
        raise ValueError(
            f"{n} {num_processes} needs {c} HOST:PORT (the address of process 0, which every process can reach)"
        )
    host, sep, port = coordinator.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{c} {coordinator!r}: expected HOST:PORT with a port in 1..65535")
    if process_id is None:
        raise ValueError(f"{n} {num_processes} needs {i} I (this process's index, 0..{num_processes - 1})")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"{i} {process_id} is out of range for {n} {num_processes}: expected 0..{num_processes - 1}")
    return True


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids=None,
    timeout_s: int = 300,
    names: dict[str, str] = API_NAMES,
) -> bool:
    """Join a multi-process run (`jax.distributed.initialize`); a no-op for a single process.

    Must run before anything touches devices (`jax.devices()`, an array, a compile).
    Returns True when this process is part of a multi-process run. Calling it again with
    the same setting is harmless.
    """
    if not check_args(coordinator, num_processes, process_id, names):
        return False
    if _initialized():
        if (jax.process_count(), jax.process_index()) != (num_processes, process_id):
            raise RuntimeError(
                f"jax.distributed is already initialized as process {jax.process_index()} of "
                f"{jax.process_count()}, not {process_id} of {num_processes}"
            )
        return True
    try:  # CPU processes need a cross-process collective implementation (gloo ships with jaxlib)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, ValueError, KeyError):
        pass
    try:
        jax.distributed.initialize(
            coordinator, num_processes, process_id, local_device_ids=local_device_ids, initialization_timeout=timeout_s
        )
    except RuntimeError as e:
        if "must be called before" in str(e):  # jax's own check: a backend already exists
            raise RuntimeError(
                f"{names['coordinator']}: the multi-host setup must happen before anything touches "
                f"the devices (jax.devices(), an array, a compile); it ran after: {e}"
            ) from e
        raise
    return True


def _initialized() -> bool:
    check = getattr(jax.distributed, "is_initialized", None)
    return bool(check()) if check is not None else False  # then jax itself refuses a second initialize


def is_primary() -> bool:
    """True in process 0 (the one that prints), and in every single-process run."""
    return jax.process_index() == 0


def to_host(x) -> np.ndarray:
    """A global array as one host numpy array in every process.

    Fully replicated or process-local arrays are read directly; an array sharded across
    processes is gathered first (a collective: every process must call this together).
    """
    if isinstance(x, np.ndarray) or x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
