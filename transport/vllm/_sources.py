"""Weight sources of the trainer engine: :class:`ShardSource`, and how the engine reads any
vLLM ``WeightSource``. This is the one place where the vLLM releases we support differ:

=================  ==============================  ==============================================
                   vLLM 0.32                        vLLM 0.33
=================  ==============================  ==============================================
``metadata``       a method: ``source.metadata()``  a property; a subclass must make it a
                                                    ``functools.cached_property`` (checked when
                                                    the class is created)
full tensors       ``iter(source)``                 ``source.iter_full()``, if
                                                    ``implements_iter_full()``
this rank's part   (none)                           ``source.iter_local()``, shaped by
                                                    ``ParamMeta.placements``
ownership          ``held_names()``: this rank's    ``ParamMeta.owners`` (the same on every rank),
                                                    ``owned_names(rank)``
=================  ==============================  ==============================================

:class:`ShardSource` is one class for both (0.32 takes a cached_property for its abstract
``metadata`` method); the functions below read any source, e.g. vLLM's ``ModuleSource``, under
either release.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

# vLLM 0.33: ParamMeta carries ownership and layout (owners, mesh_shape, placements).
_OWNERSHIP = "owners" in {f.name for f in dataclasses.fields(ParamMeta)}


def param_metas(source: WeightSource) -> list[ParamMeta]:
    """Every parameter ``source`` declares (0.33: its cached ``metadata``; 0.32: ``metadata()``,
    or the cached list of a source that declares it the 0.33 way, as :class:`ShardSource` does)."""
    metadata: Any = source.metadata
    return list(metadata() if callable(metadata) else metadata)


def full_tensors(source: WeightSource) -> Iterator[tuple[str, torch.Tensor]]:
    """One fresh pass over the full tensors this rank owns (every trainer rank runs it: an FSDP
    source gathers each tensor with a collective there)."""
    iter_full = getattr(source, "iter_full", None)
    whole: Any = source if iter_full is None else iter_full()
    return iter(whole)


def check_whole_source(source: WeightSource, metas: list[ParamMeta], rank: int) -> None:
    """Checks that ``source`` can feed the whole-tensor path: it yields full tensors and trainer
    rank 0 (which publishes them) owns every parameter. Under 0.33 ownership is in the metadata,
    the same on every rank, so every rank raises alike; under 0.32 only rank 0 knows what it
    holds (``held_names()``) and checks.

    Raises:
        TypeError: the source yields no full tensors (0.33: no ``iter_full``).
        ValueError: rank 0 does not own every parameter.
    """
    implements = getattr(source, "implements_iter_full", None)
    if implements is not None and not implements():
        raise TypeError(f"{type(source).__name__} does not implement iter_full(): the transport trainer engine "
                        "publishes full tensors from rank 0 (or pass a ShardSource: every rank publishes its shards)")
    src: Any = source
    owned: set[str] | None = None
    if _OWNERSHIP:
        owned = set(src.owned_names(0))
    elif rank == 0:
        held = src.held_names()
        owned = None if held is None else set(held)
    missing = [] if owned is None else [m.name for m in metas if m.name not in owned]
    if missing:
        raise ValueError(f"trainer rank 0 publishes every tensor whole but does not own {len(missing)} of them "
                         f"{missing[:5]}: use a ShardSource (every rank publishes what it holds)")


def check_agrees(metas: list[ParamMeta], state: Mapping[str, torch.Tensor]) -> None:
    """Checks that a sharded source's tensors are the ones its metadata declares (names in order,
    dtypes, full shapes).

    Raises:
        ValueError: they differ (the metadata was read before the module took its final form).
    """
    declared = [(m.name, m.dtype, tuple(m.shape)) for m in metas]
    live = [(n, t.dtype, tuple(t.shape)) for n, t in state.items()]
    if declared != live:
        diff = [(d, s) for d, s in zip(declared, live, strict=False) if d != s][:3]
        raise ValueError(f"the source's metadata ({len(declared)} tensors) does not describe its module "
                         f"({len(live)} tensors; first differences (declared, live): {diff}): its metadata is "
                         "read once, when first asked for; shard the module before that")


def _plain(t: DTensor) -> bool:
    """Whether a DTensor's layout is plain ``Shard``/``Replicate`` per mesh axis (not ``Partial``,
    nor the strided shards of FSDP over TP)."""
    return all(type(p) in (TorchShard, TorchReplicate) for p in t.placements)


def _param_meta(name: str, t: torch.Tensor) -> ParamMeta:
    """``t``'s metadata: full shape and dtype; under 0.33 also the trainer ranks that own a
    DTensor (its mesh) and its placements (None: not plain, declared replicated)."""
    if not _OWNERSHIP or not isinstance(t, DTensor):
        return ParamMeta(name, t.dtype, tuple(t.shape))
    from vllm.distributed.weight_transfer import base

    grid = t.device_mesh.mesh
    layout: dict[str, Any] = {"owners": tuple(grid.flatten().tolist()), "mesh_shape": tuple(grid.shape)}
    if _plain(t):
        vllm: Any = base
        layout["placements"] = tuple(vllm.Shard(p.dim) if isinstance(p, TorchShard) else vllm.Replicate()
                                     for p in t.placements)
    return ParamMeta(name, t.dtype, tuple(t.shape), **layout)


class ShardSource(WeightSource):
    """A ``WeightSource`` over a sharded (FSDP2 / DTensor) module whose ranks each publish their
    own shards (:class:`TransportTrainerEngine` reads :meth:`state` and never gathers).

    ``metadata`` is the parameters' names, dtypes and full shapes (under vLLM 0.33 also each
    DTensor's owners and placements), read off the module when first asked for and fixed from
    then on: ``TransportTrainerEngine.trainer_init`` reads it, so shard the module before that.
    ``iter_local()`` yields this rank's piece of each parameter it owns, in metadata order (vLLM
    0.33's mode for sharded sources; a DTensor whose layout is not plain ``Shard``/``Replicate``
    is gathered there). Iterating the source yields the live tensors of :meth:`state`.

    Args:
        module: the model (or a name -> tensor mapping); parameter names are the Hugging Face
            names vLLM's ``load_weights`` takes.
    """

    def __init__(self, module: torch.nn.Module | Mapping[str, torch.Tensor]) -> None:
        self._module = module

    def state(self) -> dict[str, torch.Tensor]:
        """name -> the live (DTensor) parameter."""
        if isinstance(self._module, torch.nn.Module):
            return dict(self._module.state_dict())
        return dict(self._module)

    @functools.cached_property
    def metadata(self) -> list[ParamMeta]:  # type: ignore[override]  # vLLM 0.32 declares a method
        return [_param_meta(n, t) for n, t in self.state().items()]

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        state = self.state()
        for m in self.metadata:
            t = state[m.name]
            if not isinstance(t, DTensor):
                yield m.name, t
            elif t.device_mesh.get_coordinate() is not None:  # this rank is one of its owners
                yield m.name, t.to_local() if _plain(t) else t.full_tensor()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.state().items()
