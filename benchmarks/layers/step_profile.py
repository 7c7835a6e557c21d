"""Where a layer's training step spends its GPU time: the kernels of one jitted forward+backward,
from a JAX profiler trace.

    python benchmarks/layers/step_profile.py --glm5 16384 --v4 8192 [--steps 5] [--top 25] \
        [--out [FILE]]

``--glm5 S``: GLM-5's ``DSAAttention`` in sparse mode with the indexer KL loss (the step of
``benchmarks/layers/dsa_layer.py``); ``--v4 S``: DeepSeek V4-Flash's CSA and HCA layers (the step
of ``benchmarks/layers/v4_layers.py time``). Each step is compiled and run twice, then ``--steps`` runs
are traced (``jax.profiler.trace``); the trace's GPU plane gives every kernel's duration, summed
per kernel name and divided by the steps: ms a step, launches a step, share of the kernels' sum.
``busy_ms`` is the sum over all kernels (streams may overlap, so it can differ from the wall
time, which is reported too). ``--implementation`` goes to every op (``None``: each op's default
order for the platform). Meant for GPUs.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks import common  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.layers import dsa_layer, v4_layers  # noqa: E402
from jax_dsa.configs import get_config  # noqa: E402
from jax_dsa.models.deepseek_v4.config import CSA, HCA  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--glm5", type=int, default=None, help="GLM-5 layer at this sequence length")
    p.add_argument("--v4", type=int, default=None, help="V4-Flash CSA and HCA at this length")
    p.add_argument("--implementation", default=None)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=25)
    common.add_result_args(p)
    a = p.parse_args(argv)
    out = {"benchmark": "benchmarks/layers/step_profile.py", "date": common.today(),
           "gpu": jax.devices()[0].device_kind, "jax": jax.__version__,
           "commit": common.commit(a.commit),
           "implementation": a.implementation, "steps": a.steps,
           "shapes": "one batch row, bfloat16, random weights; glm5: hidden 6144, H 64, D_qk 576, "
                     "index 32 x 128, top-k 2048, sparse mode with the KL loss; v4-flash: its config "
                     "(H 64, head_dim 512, index 64 x 128, top-k 512, window 128)",
           "profiles": {}}
    if a.glm5:
        step, args = dsa_layer.make_layer_step(get_config("glm5"), a.glm5, a.implementation)
        out["profiles"][f"glm5 DSAAttention sparse {a.glm5}"] = common.kernel_times(
            step, args, a.steps, a.top)
    if a.v4:
        c = get_config("deepseek-v4-flash")
        for t in (CSA, HCA):
            step, args = v4_layers.make_layer_step(c, c.layer_types.index(t), a.v4,
                                                   a.implementation, jnp.bfloat16)
            out["profiles"][f"v4-flash {t} {a.v4}"] = common.kernel_times(step, args, a.steps,
                                                                          a.top)
    print(json.dumps(out, indent=1))
    common.write_json(common.out_path(a.out, __file__), out)


if __name__ == "__main__":
    main()
