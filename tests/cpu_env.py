"""Environments for the child processes the tests start on the CPU."""

import os

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def fake_devices(devices: int, env: dict | None = None, **extra) -> dict:
    """``env`` (default: this process's) for a child with ``devices`` fake CPU devices: the caller's other
    XLA flags kept, any device count among them replaced."""
    env = dict(os.environ if env is None else env)
    kept = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG + "=")]
    env.update(XLA_FLAGS=" ".join(kept + [f"{DEVICE_COUNT_FLAG}={devices}"]), JAX_PLATFORMS="cpu", **extra)
    return env
