"""One process of the multi-host test: ``jax.distributed`` on localhost, then the training example.

    python tests/multihost_worker.py PROCESS_ID NUM_PROCESSES PORT LOCAL_DEVICES METRICS_OUT \
        -- [examples/train.py arguments]

Each process gets ``LOCAL_DEVICES`` host (CPU) devices; cross-process collectives go through
JAX's CPU collectives (gloo). Started by tests/test_sharding_multihost.py.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys


def main(argv: list[str]) -> None:
    if len(argv) < 6 or argv[5] != "--":
        raise SystemExit(__doc__)
    process_id, num_processes, port, local_devices = (int(a) for a in argv[:4])
    metrics_out = argv[4]
    train_args = argv[6:]
    # Before JAX starts: this process's device count (replacing any inherited count).
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join(
        flags + [f"--xla_force_host_platform_device_count={local_devices}"])
    os.environ["JAX_PLATFORMS"] = "cpu"

    import jax

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=num_processes, process_id=process_id,
                               initialization_timeout=120)
    assert jax.process_count() == num_processes and jax.local_device_count() == local_devices

    examples = pathlib.Path(__file__).resolve().parents[1] / "examples"
    spec = importlib.util.spec_from_file_location("jax_dsa_example_train", examples / "train.py")
    train = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = train
    spec.loader.exec_module(train)
    train.main(train_args + ["--metrics-out", metrics_out])
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
