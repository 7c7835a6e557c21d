"""Implementation registries: each public op chooses among named implementations.

The pattern of openxla/tokamax (``implementation=`` with a fallback chain): an op owns a
:class:`Registry` of :class:`Implementation` objects. Each implementation says whether it can
take a call (:attr:`Implementation.supported` returns the reason it cannot, or ``None``), and the
op's ``implementation=`` argument picks one:

* a name: that implementation, or an error with its reason (also for another platform than
  JAX's default backend, e.g. to lower for a GPU on a host);
* a sequence of names: the first that supports the call and runs on the default backend;
* ``None``: the op's preference order for the platform (``jax.default_backend()``).

Adding an implementation to an op is one module (its :class:`Implementation`) and one entry in
the op's registry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from jax_dsa import _native


class Unavailable(str):
    """A reason meaning "this install cannot run it" (its native module is not built or did not
    load), as opposed to "it does not support this call". When every candidate is unavailable the
    op raises ``NotImplementedError`` instead of ``ValueError``."""


@dataclasses.dataclass(frozen=True, eq=False)
class Implementation:
    """One implementation of an op.

    Attributes:
      name: the name users pass as ``implementation=``.
      supported: ``supported(call) -> str | None``: why this implementation cannot take ``call``
        (the op's description of one call's static properties), or ``None``. Returns an
        :class:`Unavailable` reason when it is not built.
      forward: the op's forward kernel; its signature is the op's own.
      backward: the op's backward kernel, or ``None`` where the op differentiates ``forward``.
      platforms: the JAX backends it runs on (``"cpu"``, ``"gpu"``); empty: every one. A
        sequence of names (or ``None``) skips an implementation whose platforms do not include
        the default backend; a single name does not, so that a program can be lowered for another
        platform.
      forward_with_grads: optional, for ops whose VJP says where it is used (e.g. the dense
        indexer KL loss): the forward and the gradients for a unit cotangent in one call, for
        when a separate backward would repeat the forward's passes.
    """

    name: str
    supported: Callable[[Any], str | None]
    forward: Callable
    backward: Callable | None = None
    platforms: tuple[str, ...] = ()
    forward_with_grads: Callable | None = None

    def __repr__(self):
        return f"Implementation({self.name!r})"


def always(call) -> None:
    """A ``supported`` check for implementations that take every call (pure JAX)."""
    del call
    return None


# Every implementation name some registry holds: a layer's ``implementation=`` may name another
# op's implementation (skipped by :meth:`Registry.restrict`), but not one that no op has.
_ALL_NAMES: set[str] = set()


def _as_names(implementation) -> tuple[str, ...] | None:
    """A name or a non-empty sequence of non-empty names as a tuple; ``None`` for anything else."""
    names = (implementation,) if isinstance(implementation, str) else implementation
    if (not isinstance(names, Sequence) or not names
            or not all(isinstance(n, str) and n for n in names)):
        return None
    return tuple(names)


class Registry:
    """The implementations of one op and its default preference per platform.

    Args:
      op: the op's public name (error messages).
      implementations: its :class:`Implementation` objects.
      preference: platform (``"cpu"``, ``"gpu"``, ...; ``"default"`` for the others) -> names in
        the order ``implementation=None`` tries them.
    """

    def __init__(self, op: str, implementations: Sequence[Implementation],
                 preference: Mapping[str, Sequence[str]]):
        self.op = op
        self._impls = {impl.name: impl for impl in implementations}
        if len(self._impls) != len(implementations):
            raise ValueError(f"{op}: two implementations share a name")
        self._preference = {k: tuple(v) for k, v in preference.items()}
        for names in self._preference.values():
            for name in names:
                if name not in self._impls:
                    raise ValueError(f"{op}: preference names unknown implementation {name!r}")
        if "default" not in self._preference:
            raise ValueError(f"{op}: the preference needs a 'default' entry")
        _ALL_NAMES.update(self._impls)

    @property
    def names(self) -> tuple[str, ...]:
        """Every registered implementation name, in registration order."""
        return tuple(self._impls)

    def __getitem__(self, name: str) -> Implementation:
        return self._impls[name]

    def __contains__(self, name) -> bool:
        return name in self._impls

    def preference(self, platform: str | None = None) -> tuple[str, ...]:
        """The names ``implementation=None`` tries on ``platform`` (default: JAX's backend)."""
        platform = jax.default_backend() if platform is None else platform
        return self._preference.get(platform, self._preference["default"])

    def candidates(self, implementation) -> tuple[str, ...]:
        """The names ``implementation=`` asks for, checked; raises ValueError for unknown ones."""
        if implementation is None:
            return self.preference()
        names = _as_names(implementation)
        if names is None or any(n not in self._impls for n in names):
            raise ValueError(
                f"{self.op}: implementation must be one of {self.names}, a non-empty sequence of "
                f"them, or None; got {implementation!r}"
            )
        return names

    def restrict(self, implementation):
        """What this op runs for a layer's ``implementation``: the names it registers, in order,
        then its own preference order for the platform (so a call the named implementation does
        not support, e.g. the V4 KL loss's dense form on ``"cuda"``, falls back); ``None`` (its
        default order) when it has none of them.

        Raises:
          ValueError: ``implementation`` is not None, a name or a non-empty sequence of names,
            or names an implementation that no op registers (a typo would otherwise run the
            defaults silently).
        """
        if implementation is None:
            return None
        names = _as_names(implementation)
        if names is None:
            raise ValueError(f"{self.op}: implementation must be None, a name or a non-empty "
                             f"sequence of names, got {implementation!r}")
        unknown = [n for n in names if n not in _ALL_NAMES]
        if unknown:
            raise ValueError(f"{self.op}: implementation {unknown} is not an implementation of any "
                             f"op; the known ones are {sorted(_ALL_NAMES)}")
        known = tuple(n for n in names if n in self._impls)
        if not known:
            return None
        return tuple(dict.fromkeys(known + self.preference()))

    def choose(self, implementation, call) -> Implementation:
        """The implementation that runs ``call``.

        Raises:
          ValueError: an unknown name, or no candidate supports the call (each reason listed).
          NotImplementedError: every candidate is unavailable in this install (not built).
        """
        names = self.candidates(implementation)
        platform = jax.default_backend()
        chained = not isinstance(implementation, str)
        reasons = []
        for name in names:
            impl = self._impls[name]
            why = impl.supported(call)
            if why is None and chained and impl.platforms and platform not in impl.platforms:
                why = (f"implementation={name!r} runs on {impl.platforms}, the default backend is "
                       f"{platform!r}")
            if why is None:
                return impl
            reasons.append((name, why))
        if len(reasons) == 1:
            message = f"{self.op}: {reasons[0][1]}"
        else:
            listed = "; ".join(f"{name!r}: {why}" for name, why in reasons)
            message = f"{self.op}: no implementation of {names} supports this call ({listed})"
        if all(isinstance(why, Unavailable) for _, why in reasons):
            raise NotImplementedError(message)
        raise ValueError(message)


def native_unavailable(name: str, module: str) -> Unavailable | None:
    """Why implementation ``name`` cannot run in this install because its native ``module``
    (``"_cpu"``, ``"_cuda"``) is not loaded, or ``None`` when it is."""
    if _native.loaded(module):
        return None
    why = _native.LOAD_ERRORS.get(module, "not built")
    return Unavailable(
        f"implementation={name!r} is not available in this jax_dsa (jax_dsa.{module}: {why})")


def sm90_device_error() -> str | None:
    """Why the default GPU cannot run these kernels (None if it can, or if there is no GPU:
    e.g. lowering for CUDA on a host)."""
    if jax.default_backend() != "gpu":
        return None
    cc = getattr(jax.devices()[0], "compute_capability", None)
    if cc is None or not str(cc).startswith("9."):
        return (f"implementation='cuda' runs on SM90 GPUs (H100/H200); this GPU has compute "
                f"capability {cc} (SM100/SM103 kernels are not built; SM120 is unsupported)")
    return None
