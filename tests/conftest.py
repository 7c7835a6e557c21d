"""Test-wide setup: 8 host (CPU) devices, so that the sharding tests can build meshes.

XLA reads the device count when JAX starts its backends, so the flag goes into ``XLA_FLAGS`` at
import time, before any test module imports jax. A count already given by the caller wins.
"""

import os

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"

_flags = os.environ.get("XLA_FLAGS", "")
if _DEVICE_COUNT_FLAG not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} {_DEVICE_COUNT_FLAG}=8".strip()
