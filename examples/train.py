"""Trains a tiny DSA language model (GLM-5 style) on the Python standard library's sources.

    .venv/bin/python examples/train.py --model glm5-tiny --steps 120 \
        --metrics-out runs/train-metrics.json

What it does:

* Data (``examples/text_data.py``): the ``*.py`` files of the running Python's standard library,
  byte-level tokens (vocabulary 256), packed into rows of ``--seq-len`` with ``segment_ids`` and
  per-document ``positions``; held-out files chosen by a hash of their path; the loss is masked
  across document boundaries and padding.
* Model: ``jax_dsa.nn.DSALanguageModel`` (flax nnx), split once into a graph definition and a
  pure dict of parameters; the train step is a pure function under ``jax.jit``.
* Indexer training as in the DeepSeek-V3.2 paper (arXiv:2512.02556, section 2.1): the first
  ``--dense-warmup-steps`` steps run dense attention with the dense KL loss of the lightning
  indexer, later steps run sparse attention (top-k from the indexer) with the KL restricted to the
  selected keys. Loss = ``lm_loss + --indexer-loss-coeff * indexer_loss``; the model stops the
  gradient into the indexer's inputs, so the indexer loss trains only the indexer. By default the
  rest of the model trains during the warm-up too (here both stages train from scratch);
  ``--warmup-freeze`` follows the paper: in the warm-up only the indexer's parameters train, on
  the indexer loss alone (the LM loss is reported, never differentiated, and the other
  parameters stay bitwise unchanged). Each attention mode compiles one train program.
  ``--indexer-qk-dtype float8_e4m3fn`` selects the top-k by DeepSeek-V3.2's FP8 scores (as its
  inference does; the KL loss keeps the unquantized q and k).
* Optimizer: optax AdamW, linear warm-up then cosine decay, global-norm gradient clipping.
* Device mesh: ``--mesh dp=2,cp=2,tp=2`` (any subset of ``dp``, ``ep``, ``cp``, ``tp``): data
  parallel over ``dp`` (batch), expert parallel over ``ep`` (each device holds ``E / ep``
  routed experts, tokens move by all-to-all; data parallel for everything else), context
  parallel over ``cp`` (tokens; the DSA ops gather keys along the sequence), tensor parallel
  over ``tp`` (attention heads, MLP, vocabulary). Shardings come from
  :data:`LOGICAL_AXIS_RULES` (``jax_dsa.sharding.DEFAULT_RULES``: logical axis -> mesh axis)
  applied to the logical axis names the model gives its parameters and activations.
  ``--cp-layout zigzag`` puts the tokens in Megatron-LM's load-balanced order for causal
  context parallelism. Runs on several hosts too: call ``jax.distributed.initialize`` first
  (``tests/multihost_worker.py``); every process builds the same global batch.
* Checkpoints (orbax): parameters, optimizer state, step and data position every
  ``--save-every`` steps and at the end; ``--resume`` continues the run exactly, from the newest
  step that restores (a damaged newer step is skipped with a warning naming it, its path and the
  reason, and moved aside to ``<step>.damaged``, never deleted). Without ``--resume`` a
  ``--checkpoint-dir`` that holds steps is refused unless ``--overwrite`` deletes them. Errors
  name the step and its path (``docs/failure_behaviour.md``).

``main(argv) -> dict`` runs it in-process and returns the metrics also written to
``--metrics-out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import pathlib
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import text_data  # noqa: E402  (the example's sibling module)

import jax_dsa.sharding as jax_dsa_sharding  # noqa: E402
from jax_dsa.nn.experts import set_expert_dispatch, update_router_biases  # noqa: E402
from jax_dsa.sharding import expert_dispatch  # noqa: E402

MESH_AXES = jax_dsa_sharding.MESH_AXES  # ("dp", "ep", "cp", "tp"): mesh axes this example knows
# Logical axis -> mesh axis. The model names every parameter dimension with a logical axis
# (jax_dsa.nn.LOGICAL_AXES, kept as the parameters' ``out_sharding`` metadata) and constrains its
# activations with the same names; a logical axis without a rule is replicated.
LOGICAL_AXIS_RULES = jax_dsa_sharding.DEFAULT_RULES
CP_LAYOUTS = ("contiguous", "zigzag")
ATTENTION_MODES = ("dense", "sparse")


# ----------------------------------------------------------------------------------------------
# Command line


def _mesh_spec(text: str) -> dict[str, int]:
    axes = {}
    for part in text.split(","):
        name, sep, size = part.partition("=")
        name = name.strip()
        if not sep or not size.strip().isdigit() or int(size) < 1:
            raise argparse.ArgumentTypeError(
                f"--mesh must look like 'dp=2,cp=2,tp=2' (axis=size, size >= 1), got {text!r}")
        if name not in MESH_AXES:
            raise argparse.ArgumentTypeError(
                f"--mesh axis {name!r} is not supported; known axes: {', '.join(MESH_AXES)}")
        if name in axes:
            raise argparse.ArgumentTypeError(f"--mesh names axis {name!r} twice")
        axes[name] = int(size)
    return axes


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _nonnegative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--model", default="glm5-tiny",
                   help="preset name for jax_dsa.configs.get_config")
    g.add_argument("--implementation", default=None,
                   help="implementation for every DSA op: xla, cpu, cuda (ops lacking it, or a call "
                        "it cannot take, use their default order); None: each op's default")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="compute dtype of the model (parameters stay float32); the GPU kernels "
                        "(--implementation cuda) take bfloat16")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=_positive_int, default=120,
                   help="total optimizer steps (also the length of the learning-rate schedule)")
    g.add_argument("--stop-at-step", type=_positive_int, default=None,
                   help="stop (and checkpoint) after this step, as if pre-empted (see --resume)")
    g.add_argument("--batch", type=_positive_int, default=8, help="rows per step (global batch)")
    g.add_argument("--seq-len", type=_positive_int, default=256, help="tokens (bytes) per row")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    g.add_argument("--warmup-steps", type=_nonnegative_int, default=10,
                   help="linear learning-rate warm-up steps (then cosine decay to --end-lr-ratio)")
    g.add_argument("--end-lr-ratio", type=float, default=0.1, help="final lr as a fraction of --lr")
    g.add_argument("--weight-decay", type=float, default=0.1,
                   help="AdamW decoupled weight decay (matrices only; not norms or biases)")
    g.add_argument("--b1", type=float, default=0.9)
    g.add_argument("--b2", type=float, default=0.95)
    g.add_argument("--grad-clip", type=float, default=1.0,
                   help="global gradient-norm clip (0: off)")
    g.add_argument("--seed", type=int, default=0, help="seed of parameter init and data order")
    g.add_argument("--dense-warmup-steps", type=_nonnegative_int, default=20,
                   help="steps of dense attention and dense indexer KL before sparse training")
    g.add_argument("--warmup-freeze", action="store_true",
                   help="dense warm-up as in the DeepSeek-V3.2 paper: train only the indexer's "
                        "parameters, on the indexer loss alone")
    g.add_argument("--indexer-qk-dtype", choices=("float8_e4m3fn",), default=None,
                   help="the top-k's scores from FP8 q and k (DeepSeek-V3.2's inference recipe: "
                        "e4m3 with power-of-two per-token scales); default: the compute dtype. "
                        "GLM-5 / DeepSeek V3.2 presets")
    g.add_argument("--bias-update-rate", type=float, default=0.001,
                   help="DeepSeek-V3's auxiliary-loss-free balancing: after each step, each MoE "
                        "router's correction bias moves by this times sign(mean load - load) "
                        "(the paper's gamma 0.001; 0 disables; not in --warmup-freeze's steps)")
    g.add_argument("--indexer-loss-coeff", type=float, default=1.0,
                   help="weight of the indexer KL loss in the total loss")
    g.add_argument("--fixed-batch", action="store_true",
                   help="train on the first batch at every step (debugging: the loss must fall)")
    g.add_argument("--mesh", type=_mesh_spec, default="dp=1",
                   help="device mesh, e.g. 'dp=2,cp=2,tp=2' or 'ep=8': data (batch), expert "
                        "(routed experts split; data parallel for the rest), context (tokens) "
                        "and tensor (heads, MLP, vocabulary) parallel")
    g.add_argument("--expert-dispatch", choices=expert_dispatch.MODES, default=None,
                   help="expert parallelism's token exchange: ragged_all_to_all (exact rows; "
                        "GPU) or all_to_all of fixed blocks (any platform); default: ragged on "
                        "accelerators, capacity on the host")
    g.add_argument("--expert-capacity-factor", type=_positive_float, default=None,
                   help="cap the exchange buffers at this times the balanced share (pairs past "
                        "it are dropped, counted and logged as expert_overflow); default: the "
                        "dropless worst case")
    g.add_argument("--cp-layout", choices=CP_LAYOUTS, default="contiguous",
                   help="token order under context parallelism: contiguous shards, or zigzag "
                        "(shard r holds chunks r and 2cp-1-r: balanced causal work)")
    g = p.add_argument_group("data")
    g.add_argument("--data-root", default=None,
                   help="directory of *.py files (default: the standard library of this Python)")
    g.add_argument("--corpus-mb", type=float, default=4.0,
                   help="read only the first N MB of files in sorted path order")
    g.add_argument("--heldout-fraction", type=float, default=0.05,
                   help="fraction of files (chosen by a hash of the path) kept for evaluation")
    g = p.add_argument_group("evaluation and output")
    g.add_argument("--eval-every", type=_nonnegative_int, default=40,
                   help="held-out loss every N steps and at the end (0: only at the end)")
    g.add_argument("--eval-batches", type=_positive_int, default=4,
                   help="held-out batches (of --batch rows) per evaluation")
    g.add_argument("--metrics-out", default=None, help="write the metrics as JSON to this file")
    g.add_argument("--checkpoint-dir", default=None, help="orbax checkpoint directory")
    g.add_argument("--save-every", type=_nonnegative_int, default=50,
                   help="checkpoint every N steps (0: only at the end); needs --checkpoint-dir")
    g.add_argument("--resume", action="store_true",
                   help="continue from the newest step in --checkpoint-dir that restores (if there "
                        "is one); damaged newer steps are moved aside to <step>.damaged")
    g.add_argument("--overwrite", action="store_true",
                   help="delete the steps an earlier run left in --checkpoint-dir and start anew "
                        "(without it, or --resume, such a folder is refused)")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="show a tqdm progress bar")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir")
    if args.overwrite and (args.resume or not args.checkpoint_dir):
        parser.error("--overwrite needs --checkpoint-dir and excludes --resume")
    if args.stop_at_step is not None and args.stop_at_step > args.steps:
        parser.error(f"--stop-at-step ({args.stop_at_step}) must be <= --steps ({args.steps})")
    if args.lr <= 0 or not 0 <= args.end_lr_ratio <= 1:
        parser.error("--lr must be > 0 and --end-lr-ratio in [0, 1]")
    if args.corpus_mb <= 0:
        parser.error(f"--corpus-mb must be > 0, got {args.corpus_mb}")
    if args.seq_len < 2:
        parser.error(f"--seq-len must be >= 2, got {args.seq_len}")
    return args


# ----------------------------------------------------------------------------------------------
# Mesh and sharding


def make_mesh(axes: dict[str, int]) -> jax.sharding.Mesh:
    """A mesh over the first ``prod(sizes)`` devices, axes in :data:`MESH_AXES` order.

    Raises:
      ValueError: fewer devices than the mesh needs (on CPU, set
        ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before JAX starts; the command
        line entry point does that itself).
    """
    names = tuple(a for a in MESH_AXES if a in axes) or ("dp",)
    sizes = tuple(axes.get(a, 1) for a in names)
    need = math.prod(sizes)
    devices = jax.devices()
    if need > len(devices):
        raise ValueError(
            f"--mesh {axes} needs {need} devices but only {len(devices)} "
            f"{devices[0].platform} device(s) are visible")
    return jax.make_mesh(sizes, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names),
                         devices=devices[:need])


def logical_to_mesh(logical_axes, rules=LOGICAL_AXIS_RULES, mesh=None, shape=None) -> P:
    """PartitionSpec for a tuple of logical axis names under ``rules`` (unmatched: replicated).

    Rules naming a mesh axis that ``mesh`` lacks, or (given ``shape``) not dividing the dim, are
    ignored, so a one-axis mesh works with a table written for a larger one
    (:func:`jax_dsa.sharding.logical_to_spec`).
    """
    return jax_dsa_sharding.logical_to_spec(logical_axes, rules, mesh, shape)


def param_shardings(mesh, param_state, rules=LOGICAL_AXIS_RULES):
    """NamedShardings (as a pure dict) of an ``nnx.State`` of parameters from their logical axes."""
    specs = nnx.to_pure_dict(nnx.get_partition_spec(param_state))
    values = nnx.to_pure_dict(param_state)
    return jax.tree.map(
        lambda spec, x: NamedSharding(mesh, logical_to_mesh(tuple(spec), rules, mesh, x.shape)),
        specs, values, is_leaf=lambda x: isinstance(x, P))


def global_array(x, sharding):
    """A global ``jax.Array`` from a host array that every process holds in full (one process
    or several: each places the shards of its own devices)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def place_batch(batch, sharding, cp_layout="contiguous"):
    """A host batch (dict of ``[B, S]`` arrays) as global arrays; in zigzag order if asked (the
    model sees the permuted ``positions``, so causality and RoPE are unchanged)."""
    cp = sharding.mesh.shape.get("cp", 1)
    out = {}
    for k, v in batch.items():
        if cp_layout == "zigzag" and cp > 1:
            v = jax_dsa_sharding.to_zigzag(np.asarray(v), cp, axis=1)
        out[k] = global_array(v, sharding)
    return out


# ----------------------------------------------------------------------------------------------
# Optimizer, losses, steps


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
    """The hyperparameters that define the optimizer (hashable: they key the compiled steps)."""

    steps: int
    lr: float
    warmup_steps: int
    end_lr_ratio: float
    weight_decay: float
    b1: float
    b2: float
    grad_clip: float

    @classmethod
    def from_args(cls, args) -> OptimizerSettings:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def make_optimizer(s: OptimizerSettings) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW; learning rate rising linearly from ``lr / warmup_steps`` to ``lr`` over
    ``warmup_steps``, then cosine decay to ``lr * end_lr_ratio`` at ``steps``; gradients clipped
    to global norm ``grad_clip`` (0: no clipping)."""
    warmup = min(s.warmup_steps, s.steps)
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=s.lr / max(warmup, 1), peak_value=s.lr, warmup_steps=warmup,
        decay_steps=max(s.steps, warmup + 1), end_value=s.lr * s.end_lr_ratio)
    # Decay matrices only (embeddings and projections), not norm scales or biases.
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)  # noqa: E731
    adamw = optax.adamw(schedule, b1=s.b1, b2=s.b2, weight_decay=s.weight_decay, mask=decay_mask)
    if s.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(s.grad_clip), adamw), schedule
    return adamw, schedule


def masked_cross_entropy(logits, targets, mask):
    """Mean next-token cross entropy (nats/token) over positions with ``mask == 1``."""
    nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def set_indexer_qk_dtype(model, qk_dtype) -> int:
    """Sets ``qk_dtype`` on every DSA lightning indexer of ``model`` (``--indexer-qk-dtype``);
    returns how many. Raises ValueError for a model without one (DeepSeek V4's indexer is not
    covered)."""
    from jax_dsa.models.glm.indexer import Indexer
    from jax_dsa.ops.indexer.topk.op import check_qk_dtype

    count = 0
    for _, module in nnx.iter_modules(model):
        if isinstance(module, Indexer):
            check_qk_dtype("--indexer-qk-dtype", qk_dtype)
            module.qk_dtype = qk_dtype
            count += 1
    if not count:
        raise ValueError("--indexer-qk-dtype: this model has no GLM-5 / DeepSeek V3.2 lightning "
                         "indexer (DeepSeek V4's is not covered)")
    return count


# The lightning indexer's parameters (DSA and DeepSeek V4 layers alike): what --warmup-freeze
# trains.
INDEXER_PARAMS = nnx.PathContains("indexer")


def indexer_mask(params) -> list[bool]:
    """For each leaf of the pure parameter dict (``jax.tree.leaves`` order): is it one of the
    indexer's parameters (:data:`INDEXER_PARAMS`)."""
    return [INDEXER_PARAMS(tuple(getattr(k, "key", k) for k in path), x)
            for path, x in jax.tree_util.tree_flatten_with_path(params)[0]]


def _forward(graphdef, params, rest, batch, *, attention_mode, implementation):
    model = nnx.merge(graphdef, params, rest)
    logits, aux = model(batch["tokens"], positions=batch["positions"],
                        segment_ids=batch["segment_ids"], attention_mode=attention_mode,
                        implementation=implementation)
    lm_loss = masked_cross_entropy(logits, batch["targets"], batch["loss_mask"])
    # pairs that capped expert-parallel buffers dropped, over every MoE layer
    overflow = sum((jnp.sum(o) for o in aux.get("expert_overflow", ())), jnp.zeros((), jnp.int32))
    return (lm_loss, aux["indexer_loss"].astype(jnp.float32), aux.get("expert_load", ()),
            overflow)


def balance_router_biases(graphdef, params, rest, expert_load, rate):
    """DeepSeek-V3's auxiliary-loss-free load balancing (arXiv:2412.19437 §2.1.2) after a step:
    each MoE router's ``e_score_correction_bias += rate * sign(mean_load - load)``, from the
    step's tokens per expert (``aux["expert_load"]``). The bias is a non-trainable ``Buffer`` in
    ``rest``: no gradient, no optimizer. Returns the new ``rest``."""
    model = nnx.merge(graphdef, params, rest)
    update_router_biases(model, expert_load, rate)
    return nnx.split(model, nnx.Param, ...)[2]


class Steps:
    """The jitted train and eval steps of one model structure, optimizer and mesh: one compiled
    program per attention mode and kind (train, eval).

    ``traces[kind][mode]`` counts the traces (= compilations) of each program. With
    ``warmup_freeze`` the dense train step updates only the indexer's parameters, from the
    gradient of the indexer loss alone.
    """

    def __init__(self, graphdef, abstract_params, optimizer: OptimizerSettings, *,
                 implementation, indexer_loss_coeff, param_sharding, batch_sharding,
                 warmup_freeze=False):
        self.tx, self.schedule = make_optimizer(optimizer)
        tx = self.tx
        replicated = NamedSharding(batch_sharding.mesh, P())
        # Optimizer moments follow their parameters' shardings; counters are replicated.
        self.opt_sharding = optax.tree_map_params(
            tx, lambda _, sharding: sharding, jax.eval_shape(tx.init, abstract_params),
            param_sharding, transform_non_params=lambda _: replicated)
        self.init_opt_state = jax.jit(tx.init, out_shardings=self.opt_sharding)
        self.traces = {"train": dict.fromkeys(ATTENTION_MODES, 0),
                       "eval": dict.fromkeys(ATTENTION_MODES, 0)}
        self._train, self._eval = {}, {}
        trainable = indexer_mask(abstract_params)

        def frozen_train_step(params, rest, opt_state, batch, forward):
            # DeepSeek-V3.2 §2.1: only the indexer trains, on the indexer loss. The gradient is
            # taken w.r.t. the indexer's leaves alone, so nothing else (main attention, LM loss)
            # is differentiated; the other leaves get zero gradients (their AdamW moments, zero
            # at the start of the run, stay zero) and keep their values bitwise (no weight decay).
            leaves, treedef = jax.tree.flatten(params)

            def merged(train_leaves):
                it = iter(train_leaves)
                return treedef.unflatten([next(it) if m else x for x, m in zip(leaves, trainable)])

            def loss_fn(train_leaves):
                lm_loss, indexer_loss, _, _ = forward(merged(train_leaves), rest, batch)
                return indexer_loss, lm_loss

            (indexer_loss, lm_loss), g = jax.value_and_grad(loss_fn, has_aux=True)(
                [x for x, m in zip(leaves, trainable) if m])
            g = iter(g)
            grads = treedef.unflatten([next(g) if m else jnp.zeros_like(x)
                                       for x, m in zip(leaves, trainable)])
            updates, opt_state = tx.update(grads, opt_state, params)
            new = jax.tree.leaves(optax.apply_updates(params, updates))
            params = treedef.unflatten([n if m else x for n, x, m in zip(new, leaves, trainable)])
            stats = {"loss": lm_loss, "indexer_loss": indexer_loss, "total_loss": indexer_loss,
                     "grad_norm": optax.tree.norm(grads)}
            return params, opt_state, stats

        for mode in ATTENTION_MODES:
            forward = functools.partial(_forward, graphdef, attention_mode=mode,
                                        implementation=implementation)

            def train_step(params, rest, opt_state, batch, _mode=mode, _forward=forward):
                self.traces["train"][_mode] += 1
                if warmup_freeze and _mode == "dense":
                    return frozen_train_step(params, rest, opt_state, batch, _forward)

                def loss_fn(params):
                    lm_loss, indexer_loss, load, overflow = _forward(params, rest, batch)
                    return (lm_loss + indexer_loss_coeff * indexer_loss,
                            (lm_loss, indexer_loss, load, overflow))

                (total, (lm_loss, indexer_loss, load, overflow)), grads = jax.value_and_grad(
                    loss_fn, has_aux=True)(params)
                updates, opt_state = tx.update(grads, opt_state, params)
                params = optax.apply_updates(params, updates)
                # expert_load: tokens per expert of each MoE layer (for the router bias update)
                stats = {"loss": lm_loss, "indexer_loss": indexer_loss, "total_loss": total,
                         "grad_norm": optax.tree.norm(grads), "expert_load": load,
                         "expert_overflow": overflow}
                return params, opt_state, stats

            def eval_step(params, rest, batch, _mode=mode, _forward=forward):
                self.traces["eval"][_mode] += 1
                lm_loss, indexer_loss, _, _ = _forward(params, rest, batch)
                return {"loss": lm_loss, "indexer_loss": indexer_loss}

            self._train[mode] = jax.jit(
                train_step,
                in_shardings=(param_sharding, replicated, self.opt_sharding, batch_sharding),
                out_shardings=(param_sharding, self.opt_sharding, replicated),
                donate_argnums=(0, 2))
            self._eval[mode] = jax.jit(
                eval_step, in_shardings=(param_sharding, replicated, batch_sharding),
                out_shardings=replicated)

    def train(self, mode, params, rest, opt_state, batch):
        """One optimizer step: ``(params, opt_state, stats)``; donates ``params, opt_state``."""
        return self._train[mode](params, rest, opt_state, batch)

    def eval(self, mode, params, rest, batch):
        """``{"loss", "indexer_loss"}`` of one batch."""
        return self._eval[mode](params, rest, batch)


# Compiled steps, reused by later main() calls in the same process with the same model structure,
# optimizer and mesh (tests, notebooks). A few entries at most.
_STEPS_CACHE: dict = {}
_STEPS_CACHE_SIZE = 4


def get_steps(graphdef, params, optimizer: OptimizerSettings, mesh, *, implementation,
              indexer_loss_coeff, param_sharding, batch_sharding, warmup_freeze=False) -> Steps:
    """The :class:`Steps` for this setting, from a small in-process cache."""
    abstract_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    key = (graphdef, optimizer, mesh, implementation, indexer_loss_coeff, warmup_freeze,
           jax.tree.structure(abstract_params), tuple(jax.tree.leaves(abstract_params)),
           tuple(jax.tree.leaves(param_sharding)))
    if key not in _STEPS_CACHE:
        while len(_STEPS_CACHE) >= _STEPS_CACHE_SIZE:
            _STEPS_CACHE.pop(next(iter(_STEPS_CACHE)))
        _STEPS_CACHE[key] = Steps(graphdef, abstract_params, optimizer,
                                  implementation=implementation,
                                  indexer_loss_coeff=indexer_loss_coeff,
                                  param_sharding=param_sharding, batch_sharding=batch_sharding,
                                  warmup_freeze=warmup_freeze)
    return _STEPS_CACHE[key]


def attention_mode_at(step: int, dense_warmup_steps: int) -> str:
    """Attention mode of the 0-based ``step``: dense during the warm-up, sparse after."""
    return "dense" if step < dense_warmup_steps else "sparse"


# ----------------------------------------------------------------------------------------------
# Checkpoints


class CheckpointError(ValueError):
    """A checkpoint folder or step this run cannot use; the message names the step(s) and
    path(s)."""


class CheckpointWarning(UserWarning):
    """A damaged checkpoint step that ``--resume`` skipped (named, with its path and the
    reason)."""


def _checkpoint_manager(directory) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        pathlib.Path(directory).absolute(),
        options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True),
        item_names=("state", "rest", "meta"))


def _step_path(manager, step) -> pathlib.Path:
    return pathlib.Path(manager.directory) / str(step)


def _open_checkpoints(args) -> ocp.CheckpointManager | None:
    """The checkpoint manager of ``--checkpoint-dir``; refuses a folder holding an earlier run's
    steps unless ``--resume`` (continue it) or ``--overwrite`` (delete them) is given."""
    if not args.checkpoint_dir:
        return None
    try:
        manager = _checkpoint_manager(args.checkpoint_dir)
    except Exception as e:
        raise CheckpointError(f"--checkpoint-dir {pathlib.Path(args.checkpoint_dir).absolute()}: "
                              f"cannot open it ({type(e).__name__}: {e})") from e
    steps = sorted(manager.all_steps())
    if steps and not args.resume:
        where = pathlib.Path(manager.directory)
        if not args.overwrite:
            manager.close()
            raise CheckpointError(
                f"--checkpoint-dir {where} holds steps {steps} of an earlier run (e.g. "
                f"{_step_path(manager, steps[-1])}); pass --resume to continue that run, or "
                "--overwrite to delete them and start anew (or choose another folder)")
        for step in steps:
            manager.delete(step)
        tqdm.write(f"--overwrite: deleted steps {steps} of an earlier run from {where}")
    return manager


def _first_line(e: BaseException, limit: int = 300) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = text if len(text) <= limit else text[:limit] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _check_meta(meta, step):
    """Raises ValueError unless ``meta`` is what :func:`_save` wrote for ``step``."""
    if not isinstance(meta, dict):
        raise ValueError(f"meta is a {type(meta).__name__}, not an object")
    missing = [k for k in ("step", "data_position", "settings", "history", "evals")
               if k not in meta]
    if missing:
        raise ValueError(f"meta lacks {missing}")
    if meta["step"] != step:
        raise ValueError(f"meta says step {meta['step']!r}, the folder is step {step}")
    if not isinstance(meta["data_position"], int) or meta["data_position"] < 0:
        raise ValueError(f"meta has data_position {meta['data_position']!r}")
    if not isinstance(meta["settings"], dict) or not isinstance(meta["evals"], list):
        raise ValueError("meta's settings or evals have the wrong type")
    history = meta["history"]
    if (not isinstance(history, dict) or not all(isinstance(v, list) for v in history.values())
            or len(history.get("train_loss", ())) != step):
        raise ValueError(f"meta's history is not lists with {step} train_loss entries")


class _quiet_closed_loops:
    """For a ``with`` block, drops the ``RuntimeError: Event loop is closed`` that tensorstore's
    threads report through ``sys.unraisablehook`` when orbax abandons a failed restore (a read
    still in flight finds orbax's event loop closed): a screen of tracebacks otherwise. Other
    unraisable exceptions go to the hook that was there."""

    def __enter__(self):
        self.previous = previous = sys.unraisablehook

        def hook(unraisable):
            exc = unraisable.exc_value
            if not (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"):
                previous(unraisable)

        self.hook = sys.unraisablehook = hook
        return self

    def __exit__(self, *exc):
        if sys.unraisablehook is self.hook:
            sys.unraisablehook = self.previous


# Settings that must match for a resumed run to continue the same run.
_RESUME_KEYS = ("model", "seq_len", "batch", "seed", "corpus_mb", "heldout_fraction", "data_root",
                "fixed_batch", "steps", "lr", "warmup_steps", "end_lr_ratio", "weight_decay",
                "b1", "b2", "grad_clip", "dense_warmup_steps", "indexer_loss_coeff",
                "warmup_freeze")


def _save(manager, step, params, opt_state, rest, meta):
    # ``rest``: the model's non-trainable state (the routers' correction biases, which the
    # balance step updates), a separate item so that steps saved before it existed still restore.
    items = {"state": ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
             "meta": ocp.args.JsonSave(meta)}
    if jax.tree.leaves(rest):
        items["rest"] = ocp.args.StandardSave(nnx.to_pure_dict(rest))
    manager.save(step, args=ocp.args.Composite(**items), force=True)
    # The next train step donates these buffers: let the save finish reading them first.
    manager.wait_until_finished()


def _restore(manager, params, opt_state, rest, settings):
    """``(params, opt_state, rest, meta)`` of the newest step that restores (``rest`` as given
    where the step predates its saving). Damaged newer steps are
    skipped with a :class:`CheckpointWarning` naming the step, its path and the reason, and moved
    aside to ``<step>.damaged`` (so that this run can save that step again); nothing is deleted.

    Raises:
      CheckpointError: a step saved with other ``settings`` (step and path named), or no step
        that restores (each one named with its path and reason).
    """
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                            {"params": params, "opt_state": opt_state})
    failed = []
    for step in sorted(manager.all_steps(), reverse=True):
        path = _step_path(manager, step)
        try:
            meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            meta = meta["meta"]
            _check_meta(meta, step)
        except Exception as e:
            failed.append((step, path, "meta: " + _first_line(e)))
            continue
        mismatched = {k: (meta["settings"].get(k), v) for k, v in _jsonable(settings).items()
                      if meta["settings"].get(k) != v}
        if mismatched:
            raise CheckpointError(
                f"--resume: step {step} at {path} was saved with other settings (saved, now): "
                f"{mismatched}; resume with the same settings, or start anew in another "
                "--checkpoint-dir")
        try:
            state = manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract)))["state"]
        except Exception as e:
            failed.append((step, path, "state: " + _first_line(e)))
            continue
        if (path / "rest").exists() and jax.tree.leaves(rest):
            try:
                saved = manager.restore(step, args=ocp.args.Composite(rest=ocp.args.StandardRestore(
                    jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.to_pure_dict(rest)))))["rest"]
            except Exception as e:
                failed.append((step, path, "rest: " + _first_line(e)))
                continue
            nnx.replace_by_pure_dict(rest, saved)
        for bad_step, bad_path, reason in failed:
            aside = bad_path.with_name(f"{bad_step}.damaged")
            n = 1
            while aside.exists():
                aside, n = bad_path.with_name(f"{bad_step}.damaged-{n}"), n + 1
            bad_path.rename(aside)
            warnings.warn(CheckpointWarning(
                f"--resume: skipped step {bad_step} at {bad_path}: it does not restore "
                f"({reason}); moved it to {aside} (not deleted); resuming from step {step}"),
                stacklevel=3)
        if failed:
            manager.reload()
        return state["params"], state["opt_state"], rest, meta
    raise CheckpointError(
        f"--resume: no step in {manager.directory} restores: "
        + "; ".join(f"step {s} at {p}: {r}" for s, p, r in failed)
        + " (nothing was moved or deleted; start anew with --overwrite, or in another "
        "--checkpoint-dir)")


# ----------------------------------------------------------------------------------------------
# Main


def _jsonable(obj):
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (np.generic,)):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def _config_dict(config) -> dict:
    if dataclasses.is_dataclass(config):
        return _jsonable(config)
    if hasattr(config, "to_dict"):
        return _jsonable(config.to_dict())
    return _jsonable(dict(vars(config)))


def main(argv=None) -> dict:
    """Runs the training example; ``argv`` as on the command line. Returns the metrics dict.

    Metrics keys: ``initial_loss`` / ``final_loss`` (LM cross entropy of the first / last step,
    nats per byte), ``steps``, ``tokens_per_s`` (tokens, padding included, per second of the
    steps that did not compile; of all steps when every step compiled), per-step lists
    ``train_loss``, ``indexer_loss``, ``total_loss``, ``grad_norm``, ``lr``, ``attention_mode``
    (every step of the run, including those before a resume),
    ``eval`` (list of ``{step, attention_mode, loss, indexer_loss}``), ``final_eval_loss``,
    ``config``, ``args``, ``wall_time_s``, ``jax_version``, ``device``, ``num_params``, ...
    """
    t_start = time.perf_counter()
    args = parse_args(argv)
    manager = _open_checkpoints(args)  # refuses an earlier run's steps before any work
    with _quiet_closed_loops():
        try:
            return _run(args, manager, t_start)
        finally:
            if manager is not None:
                manager.close()


def _run(args, manager, t_start) -> dict:
    from jax_dsa.configs import get_config  # the model package, imported when needed
    from jax_dsa.models.deepseek_v4.config import DeepseekV4Config
    from jax_dsa.models.deepseek_v4.model import DeepseekV4LanguageModel
    from jax_dsa.nn import DSALanguageModel

    config = get_config(args.model)
    vocab_size = getattr(config, "vocab_size", None)
    if vocab_size != text_data.VOCAB_SIZE:
        raise ValueError(f"--model {args.model!r} has vocab_size={vocab_size}; the byte-level "
                         f"data needs {text_data.VOCAB_SIZE}")

    mesh = make_mesh(args.mesh)
    ep = mesh.shape.get("ep", 1)
    n_experts = getattr(config, "n_routed_experts", None) or 0
    if ep > 1 and n_experts % ep:
        raise ValueError(f"--mesh ep={ep} must divide the model's n_routed_experts "
                         f"({n_experts}: --model {args.model})")
    expert_flags = args.expert_dispatch is not None or args.expert_capacity_factor is not None
    if expert_flags and ep == 1:
        warnings.warn("--expert-dispatch / --expert-capacity-factor have no effect without an "
                      "ep mesh axis (--mesh ep=N)", stacklevel=2)
    if args.expert_dispatch == "ragged" and expert_dispatch.default_mode(mesh) != "ragged":
        raise ValueError("--expert-dispatch ragged needs GPUs or TPUs (XLA:CPU has no "
                         "ragged-all-to-all); use capacity on the host")
    dp = mesh.shape.get("dp", 1) * ep  # ep devices hold other rows too
    if args.batch % dp:
        raise ValueError(f"--batch ({args.batch}) must be divisible by the dp x ep mesh size "
                         f"({dp})")
    cp = mesh.shape.get("cp", 1)
    if args.seq_len % (2 * cp if args.cp_layout == "zigzag" else cp):
        raise ValueError(f"--seq-len ({args.seq_len}) must be divisible by the cp mesh size "
                         f"({cp}; twice that for --cp-layout zigzag)")

    # Data.
    corpus = text_data.load_corpus(args.data_root, max_bytes=int(args.corpus_mb * 2**20),
                                   heldout_fraction=args.heldout_fraction)
    train_rows = text_data.pack_documents(corpus.train_docs, args.seq_len)
    heldout_rows = text_data.pack_documents(corpus.heldout_docs, args.seq_len)
    sampler = text_data.RowSampler(len(train_rows), seed=args.seed, shuffle=not args.fixed_batch)
    eval_sampler = text_data.RowSampler(len(heldout_rows), seed=0, shuffle=False)
    eval_batches = [text_data.make_batch(heldout_rows, eval_sampler.indices(i * args.batch,
                                                                            args.batch))
                    for i in range(args.eval_batches)]

    # Model and optimizer state.
    # DeepSeek V4 presets get the V4 model (window / CSA / HCA attention), the others DSA.
    model_cls = DeepseekV4LanguageModel if isinstance(config, DeepseekV4Config) else DSALanguageModel
    model = model_cls(config, rngs=nnx.Rngs(args.seed), dtype=jnp.dtype(args.dtype))
    if args.indexer_qk_dtype is not None:
        set_indexer_qk_dtype(model, args.indexer_qk_dtype)
    if expert_flags:
        set_expert_dispatch(model, args.expert_dispatch, args.expert_capacity_factor)
    graphdef, param_state, rest = nnx.split(model, nnx.Param, ...)
    params = nnx.to_pure_dict(param_state)
    param_sharding = param_shardings(mesh, param_state)
    del model, param_state
    num_params = int(sum(x.size for x in jax.tree.leaves(params)))
    batch_sharding = NamedSharding(mesh, logical_to_mesh(("batch", "sequence"), mesh=mesh))
    params = jax.tree.map(global_array, params, param_sharding)
    rest = jax.device_put(rest, NamedSharding(mesh, P()))
    steps = get_steps(graphdef, params, OptimizerSettings.from_args(args), mesh,
                      implementation=args.implementation,
                      indexer_loss_coeff=args.indexer_loss_coeff, param_sharding=param_sharding,
                      batch_sharding=batch_sharding, warmup_freeze=args.warmup_freeze)
    traces_at_start = {kind: dict(v) for kind, v in steps.traces.items()}
    balance = jax.jit(functools.partial(balance_router_biases, graphdef),
                      out_shardings=NamedSharding(mesh, P()))
    schedule = steps.schedule
    opt_state = steps.init_opt_state(params)

    history = {k: [] for k in ("train_loss", "indexer_loss", "total_loss", "grad_norm", "lr",
                               "attention_mode")}
    evals: list[dict] = []
    start_step, data_position, resumed_from = 0, 0, None
    settings = {k: getattr(args, k) for k in _RESUME_KEYS}
    if args.resume and manager.all_steps():
        params, opt_state, rest, meta = _restore(manager, params, opt_state, rest, settings)
        start_step, data_position = meta["step"], meta["data_position"]
        history, evals, resumed_from = meta["history"], meta["evals"], start_step
    elif args.resume:
        tqdm.write(f"--resume: no checkpoint in {args.checkpoint_dir}; starting from step 0")
    startup_s = time.perf_counter() - t_start

    def save(step):
        meta = {"step": step, "data_position": data_position, "settings": _jsonable(settings),
                "history": history, "evals": evals}
        _save(manager, step, params, opt_state, rest, meta)

    def evaluate(step, mode):
        stats = [jax.device_get(steps.eval(mode, params, rest,
                                           place_batch(b, batch_sharding, args.cp_layout)))
                 for b in eval_batches]
        entry = {"step": step, "attention_mode": mode,
                 "loss": float(np.mean([s["loss"] for s in stats])),
                 "indexer_loss": float(np.mean([s["indexer_loss"] for s in stats]))}
        evals.append(entry)
        return entry

    stop = args.stop_at_step or args.steps
    tokens_per_step = args.batch * args.seq_len
    timed_tokens, timed_s, loop_s = 0, 0.0, 0.0
    bar = tqdm(total=stop, initial=start_step, disable=not args.progress, unit="step",
               dynamic_ncols=True)
    mode = attention_mode_at(start_step, args.dense_warmup_steps)
    with jax.set_mesh(mesh):
        for step in range(start_step, stop):
            mode = attention_mode_at(step, args.dense_warmup_steps)
            index = sampler.indices(0 if args.fixed_batch else data_position, args.batch)
            batch = place_batch(text_data.make_batch(train_rows, index), batch_sharding,
                                args.cp_layout)
            traces_before = steps.traces["train"][mode]
            t0 = time.perf_counter()
            params, opt_state, stats = steps.train(mode, params, rest, opt_state, batch)
            stats = jax.device_get(stats)
            if args.bias_update_rate and stats.get("expert_load"):  # frozen steps have none
                rest = balance(params, rest, stats["expert_load"], args.bias_update_rate)
            dt = time.perf_counter() - t0
            loop_s += dt
            if steps.traces["train"][mode] == traces_before:  # did not compile
                timed_tokens += tokens_per_step
                timed_s += dt
            data_position += args.batch
            for key, value in (("train_loss", stats["loss"]),
                               ("indexer_loss", stats["indexer_loss"]),
                               ("total_loss", stats["total_loss"]),
                               ("grad_norm", stats["grad_norm"]), ("lr", schedule(step))):
                history[key].append(float(value))
            history["attention_mode"].append(mode)
            if stats.get("expert_load"):  # MoE layers (none in --warmup-freeze's steps)
                history.setdefault("expert_overflow", []).append(int(stats["expert_overflow"]))
            if not math.isfinite(history["total_loss"][-1]):
                raise FloatingPointError(f"non-finite loss at step {step + 1}: {stats}")
            done = step + 1
            bar.update(1)
            dropped = int(stats.get("expert_overflow", 0))
            bar.set_postfix(mode=mode, loss=f"{stats['loss']:.3f}",
                            idx=f"{stats['indexer_loss']:.3f}",
                            tok_s=f"{timed_tokens / timed_s:.0f}" if timed_s else "-",
                            **({"dropped": dropped} if dropped else {}))
            if args.eval_every and done % args.eval_every == 0 and done != stop:
                e = evaluate(done, mode)
                tqdm.write(f"step {done}: eval loss {e['loss']:.4f} "
                           f"indexer {e['indexer_loss']:.4f} ({mode})")
            if manager and args.save_every and done % args.save_every == 0 and done != stop:
                save(done)
        bar.close()
        done = stop
        if start_step < stop or not evals or evals[-1]["step"] != done:
            e = evaluate(done, mode)
            tqdm.write(f"step {done}: eval loss {e['loss']:.4f} "
                       f"indexer {e['indexer_loss']:.4f} ({mode})")
        if manager:
            if manager.latest_step() != done:
                save(done)
            manager.wait_until_finished()

    device = jax.devices()[0]
    losses = history["train_loss"]
    tokens_per_s_with_compile = (done - start_step) * tokens_per_step / loop_s if loop_s else None
    metrics = {
        "model": args.model,
        "steps": done,
        "initial_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "final_indexer_loss": history["indexer_loss"][-1] if losses else None,
        "final_eval_loss": evals[-1]["loss"] if evals else None,
        "tokens_per_s": timed_tokens / timed_s if timed_s else tokens_per_s_with_compile,
        "tokens_per_s_including_compile": tokens_per_s_with_compile,
        "tokens_per_step": tokens_per_step,
        "wall_time_s": time.perf_counter() - t_start,
        "startup_s": startup_s,
        **history,
        "eval": evals,
        # Programs compiled by this call (a later call in the same process reuses them).
        "compilations": {kind: {m: steps.traces[kind][m] - traces_at_start[kind][m]
                                for m in ATTENTION_MODES} for kind in steps.traces},
        "resumed_from_step": resumed_from,
        "data_position": data_position,
        "num_params": num_params,
        "config": _config_dict(config),
        "args": _jsonable(vars(args)),
        "corpus": {"root": corpus.root, "bytes": corpus.num_bytes,
                   "train_files": len(corpus.train_docs),
                   "heldout_files": len(corpus.heldout_docs),
                   "train_rows": len(train_rows), "heldout_rows": len(heldout_rows)},
        "mesh": dict(mesh.shape),
        "jax_version": jax.__version__,
        "device": {"platform": device.platform, "kind": device.device_kind,
                   "count": mesh.devices.size, "name": str(device)},
        # Peak device memory of each local device, where the backend reports it (GPUs do).
        "peak_bytes_per_device": [(d.memory_stats() or {}).get("peak_bytes_in_use")
                                  for d in jax.local_devices()],
        "checkpoint_dir": str(pathlib.Path(args.checkpoint_dir).absolute())
        if args.checkpoint_dir else None,
    }
    if args.metrics_out:
        out = pathlib.Path(args.metrics_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(metrics, indent=1) + "\n")
    return metrics


def _cli():
    # A dp mesh on the CPU needs that many host devices, which XLA fixes when JAX starts.
    args = parse_args(sys.argv[1:])
    n = math.prod(args.mesh.values())
    flags = os.environ.get("XLA_FLAGS", "")
    if n > 1 and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    _quiet_closed_loops().__enter__()  # for the life of the process, main's return included
    try:
        m = main(sys.argv[1:])
    except CheckpointError as e:  # the message names the step(s) and path(s): no traceback
        print(f"train.py: error: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # Straight out (the checkpoint manager is closed): a failed restore's reads may still be
        # in flight, and interpreter shutdown would print their tracebacks to the raw stderr.
        os._exit(2)
    summary = {k: m[k] for k in ("steps", "initial_loss", "final_loss", "final_eval_loss",
                                 "tokens_per_s", "wall_time_s")}
    print(json.dumps(summary))


if __name__ == "__main__":
    _cli()
