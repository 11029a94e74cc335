"""Training systems behind one interface, and their registry.

A system prepares its own model copy (``prepare``) and trains one rollout group on it (``step``), calling
``observer.enter(phase)``/``observer.exit(phase)`` around each phase. Add a system with
:func:`register_system`; the runner looks systems up by the names a spec lists.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from torch import nn


class System(Protocol):
    name: str

    def prepare(self, model: nn.Module, cell: Any) -> nn.Module:
        """Transform a freshly built model in place for this system; return the model to train."""

    def step(self, model: nn.Module, group: Any, cell: Any, observer: Any) -> Any:
        """Accumulate one group's gradients into ``param.grad``; return prefixflow.GroupStats."""


_REGISTRY: dict[str, Callable[[], System]] = {}


def register_system(name: str, factory: Callable[[], System]) -> None:
    """Register ``factory`` (a zero-argument callable returning a System) under ``name``."""
    if name in _REGISTRY:
        raise ValueError(f"system {name!r} is already registered")
    _REGISTRY[name] = factory


def available_systems() -> list[str]:
    return sorted(_REGISTRY)


def get_system(name: str) -> System:
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ValueError(f"unknown system {name!r}; registered: {', '.join(available_systems())}") from None


def prefixflow_config(cell: Any, attention: str = "auto"):
    """The prefixflow.PrefixFlowConfig for a cell: its offload flag and the system's attention variant."""
    from prefixflow import PrefixFlowConfig

    return PrefixFlowConfig(attention=attention, offload=bool(getattr(cell, "offload", False)))


class TrainGroupSystem:
    """A system that is one ``system=`` value of ``prefixflow.train_group`` on a PrefixFlow-wrapped model.

    ``attention``: the PrefixFlowConfig attention variant; ``"auto"`` (the library default) resolves per
    device, and :meth:`attention_variant` says what it resolved to (recorded with every row)."""

    def __init__(self, name: str, library_system: str, uses_offload: bool, attention: str = "auto") -> None:
        self.name = name
        self.library_system = library_system
        self.uses_offload = uses_offload
        self.attention = attention
        self.cost_model = library_system  # harness.costmodel.flops's name for this schedule

    def attention_variant(self, device) -> str | None:
        """The suffix-attention variant this system runs on ``device`` (None for the baseline)."""
        if self.library_system != "prefixflow":
            return None
        from prefixflow import PrefixFlowConfig

        return PrefixFlowConfig(attention=self.attention).attention_for(device)

    def prepare(self, model: nn.Module, cell: Any) -> nn.Module:
        from prefixflow import PrefixFlowConfig, apply_prefixflow

        # The baseline runs through the same wrapped attention (plain path), so kernels match.
        config = prefixflow_config(cell, self.attention) if self.uses_offload else PrefixFlowConfig()
        return apply_prefixflow(model, config)

    def step(self, model: nn.Module, group: Any, cell: Any, observer: Any) -> Any:
        from prefixflow import train_group

        return train_group(
            model,
            group,
            system=self.library_system,
            layout=cell.layout,
            microbatch=cell.microbatch,
            loss=cell.loss,
            observer=observer,
        )


register_system("baseline", lambda: TrainGroupSystem("baseline", "baseline", uses_offload=False))
# `prefixflow` is the library's default (attention="auto": split on CPU, concat elsewhere); the explicit
# variants pin one suffix-attention implementation.
register_system("prefixflow", lambda: TrainGroupSystem("prefixflow", "prefixflow", uses_offload=True))
register_system(
    "prefixflow_concat",
    lambda: TrainGroupSystem("prefixflow_concat", "prefixflow", uses_offload=True, attention="concat"),
)
register_system(
    "prefixflow_split",
    lambda: TrainGroupSystem("prefixflow_split", "prefixflow", uses_offload=True, attention="split"),
)


class PrefixGrouperSystem:
    """The PyPI ``prefix_grouper`` peer: one packed graph per group on the same wrapped model and loss."""

    name = "prefix_grouper"
    cost_model = "prefix_grouper"

    def attention_variant(self, device) -> None:
        return None

    def prepare(self, model: nn.Module, cell: Any) -> nn.Module:
        from prefixflow import apply_prefixflow

        return apply_prefixflow(model)

    def step(self, model: nn.Module, group: Any, cell: Any, observer: Any) -> Any:
        from harness.peers import train_group_prefix_grouper

        return train_group_prefix_grouper(model, group, loss=cell.loss, observer=observer)


register_system("prefix_grouper", PrefixGrouperSystem)


class ParallelScheduleVariant(TrainGroupSystem):
    """PrefixFlow with one knob of its parallel schedule turned, so both schedules run interleaved in one
    multi-rank cell: ``prefixflow_cp_demand`` (CP prefix K/V gathered on demand, no prefetch) and
    ``prefixflow_pp_barrier`` (PP global A | B | C barriers instead of stage-local switching). The multi-rank
    runner passes ``parallel_options`` to ``prefixflow.parallel.parallelize``."""

    def __init__(self, name: str, **parallel_options: Any) -> None:
        super().__init__(name, "prefixflow", uses_offload=True)
        self.parallel_options = parallel_options


register_system(
    "prefixflow_cp_demand", lambda: ParallelScheduleVariant("prefixflow_cp_demand", cp_prefetch=False)
)
register_system(
    "prefixflow_pp_barrier", lambda: ParallelScheduleVariant("prefixflow_pp_barrier", pp_switching="barrier")
)
