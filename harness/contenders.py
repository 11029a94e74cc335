"""Contenders: what a benchmark cell compares, behind one interface, and their registry.

A contender is one entry of a cell's ``systems`` list (and of a record's ``system`` column); most are one
``system=`` value of the library's ``prefixflow.train_group`` (``baseline``, ``prefixflow``), others a
variant of it or a peer implementation. A contender prepares its own model copy (``prepare``) and trains
one step's rollout groups on it (``step``), calling ``observer.enter(phase)``/``observer.exit(phase)``
around each phase. The one measurement loop (``harness.run.loop``) calls ``step`` for every cell kind (one group,
a tree, the data-parallel step on one rank or many), so a contender registered with :func:`register_contender`
runs in all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from torch import nn


class Contender(Protocol):
    name: str

    def prepare(self, model: nn.Module, cell: Any) -> nn.Module:
        """Transform a freshly built model in place for this contender; return the model to train."""

    def step(self, model: nn.Module, groups: list, cell: Any, observer: Any) -> Any:
        """Accumulate the step's gradients into ``param.grad``: one group in one process
        (``prefixflow.GroupStats``), or the cell's groups over its ranks (``prefixflow.parallel`` StepStats)."""


_REGISTRY: dict[str, Callable[[], Contender]] = {}


def register_contender(name: str, factory: Callable[[], Contender]) -> None:
    """Register ``factory`` (a zero-argument callable returning a Contender) under ``name``."""
    if name in _REGISTRY:
        raise ValueError(f"system {name!r} is already registered")
    _REGISTRY[name] = factory


def available_contenders() -> list[str]:
    return sorted(_REGISTRY)


def get_contender(name: str) -> Contender:
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ValueError(
            f"unknown system {name!r}; registered: {', '.join(available_contenders())}"
        ) from None


def prefixflow_config(cell: Any, attention: str = "auto"):
    """The prefixflow.PrefixFlowConfig for a cell: its offload flag and the system's attention variant."""
    from prefixflow import PrefixFlowConfig

    return PrefixFlowConfig(attention=attention, offload=bool(getattr(cell, "offload", False)))


def one_process_group(groups: list, cell: Any) -> bool:
    """Whether a step is a single group in one process (``train_group``), not a data-parallel step."""
    return (
        len(groups) == 1 and getattr(cell, "world_size", 1) == 1 and getattr(cell, "groups_per_step", 1) == 1
    )


class TrainGroupContender:
    """A contender that is one ``system=`` value of the library (``prefixflow.train_group``, and
    ``prefixflow.parallel.train_step`` for a step of several groups or ranks) on a PrefixFlow-wrapped model.

    ``uses_prefixflow_config``: the model is wrapped with the cell's PrefixFlowConfig (its offload flag and
    this contender's attention variant); otherwise with the default config (the baseline: same kernels).
    ``attention``: the PrefixFlowConfig attention variant; ``"auto"`` (the library default) resolves per
    device, and :meth:`attention_variant` says what it resolved to (recorded with every row)."""

    def __init__(
        self, name: str, library_system: str, uses_prefixflow_config: bool, attention: str = "auto"
    ) -> None:
        self.name = name
        self.library_system = library_system
        self.uses_prefixflow_config = uses_prefixflow_config
        self.attention = attention
        self.cost_model = library_system  # harness.costmodel.flops's name for this schedule

    def attention_variant(self, device) -> str | None:
        """The suffix-attention variant this system runs on ``device`` (None for the baseline)."""
        if self.library_system != "prefixflow":
            return None
        from prefixflow import PrefixFlowConfig

        return PrefixFlowConfig(attention=self.attention).attention_for(device)

    def layout_for(self, group: Any, cell: Any) -> str:
        """The cell's layout; on a tree the baseline always runs its paths padded: they share nothing, and
        its packed layout is one dense masked SDPA over the whole pack (docs/trees-practice.md)."""
        from prefixflow import RolloutTree

        if self.library_system == "baseline" and isinstance(group, RolloutTree):
            return "padded"
        return cell.layout

    def prepare(self, model: nn.Module, cell: Any) -> nn.Module:
        from prefixflow import PrefixFlowConfig, apply_prefixflow

        # The baseline runs through the same wrapped attention (plain path), so kernels match.
        config = (
            prefixflow_config(cell, self.attention) if self.uses_prefixflow_config else PrefixFlowConfig()
        )
        return apply_prefixflow(model, config)

    def step(self, model: nn.Module, groups: list, cell: Any, observer: Any) -> Any:
        if not one_process_group(groups, cell):
            from prefixflow.parallel.dp import train_step

            return train_step(
                model,
                groups,
                system=self.library_system,
                layout=cell.layout,
                microbatch=cell.microbatch,
                loss=cell.loss,
                split_threshold=cell.split_threshold,
                observer=observer,
            )
        from prefixflow import train_group

        return train_group(
            model,
            groups[0],
            system=self.library_system,
            layout=self.layout_for(groups[0], cell),
            microbatch=cell.microbatch,
            loss=cell.loss,
            observer=observer,
        )


register_contender(
    "baseline", lambda: TrainGroupContender("baseline", "baseline", uses_prefixflow_config=False)
)
# `prefixflow` is the library's default (attention="auto": split on CPU, concat elsewhere); the explicit
# variants pin one suffix-attention implementation.
register_contender(
    "prefixflow", lambda: TrainGroupContender("prefixflow", "prefixflow", uses_prefixflow_config=True)
)
register_contender(
    "prefixflow_concat",
    lambda: TrainGroupContender(
        "prefixflow_concat", "prefixflow", uses_prefixflow_config=True, attention="concat"
    ),
)
register_contender(
    "prefixflow_split",
    lambda: TrainGroupContender(
        "prefixflow_split", "prefixflow", uses_prefixflow_config=True, attention="split"
    ),
)


class PrefixGrouperContender:
    """The PyPI ``prefix_grouper`` peer: one packed graph per group on the same wrapped model and loss; one
    group in one process only (it has no multi-rank schedule)."""

    name = "prefix_grouper"
    cost_model = "prefix_grouper"

    def attention_variant(self, device) -> None:
        return None

    def prepare(self, model: nn.Module, cell: Any) -> nn.Module:
        from prefixflow import apply_prefixflow

        if getattr(cell, "world_size", 1) != 1 or getattr(cell, "groups_per_step", 1) != 1:
            raise ValueError(
                f"system {self.name!r} has no multi-rank schedule; parallel cells run baseline/prefixflow systems"
            )
        return apply_prefixflow(model)

    def step(self, model: nn.Module, groups: list, cell: Any, observer: Any) -> Any:
        from harness.peers.prefix_grouper import train_group_prefix_grouper

        (group,) = groups
        return train_group_prefix_grouper(model, group, loss=cell.loss, observer=observer)


register_contender("prefix_grouper", PrefixGrouperContender)


class ParallelScheduleVariant(TrainGroupContender):
    """PrefixFlow with one knob of its parallel schedule turned, so both schedules run interleaved in one
    multi-rank cell: ``prefixflow_cp_demand`` (CP prefix K/V gathered on demand, no prefetch) and
    ``prefixflow_pp_barrier`` (PP global A | B | C barriers instead of stage-local switching). The multi-rank
    loop passes ``parallel_options`` to ``prefixflow.parallel.parallelize``."""

    def __init__(self, name: str, **parallel_options: Any) -> None:
        super().__init__(name, "prefixflow", uses_prefixflow_config=True)
        self.parallel_options = parallel_options


register_contender(
    "prefixflow_cp_demand", lambda: ParallelScheduleVariant("prefixflow_cp_demand", cp_prefetch=False)
)
register_contender(
    "prefixflow_pp_barrier", lambda: ParallelScheduleVariant("prefixflow_pp_barrier", pp_switching="barrier")
)


class TreePeerContender:
    """A peer on prefix trees (``harness.peers``): one tree in one process, on the PrefixFlow-wrapped model
    (the baseline's kernels) and ``prefixflow.loss``. ``tree_mask`` packs each microbatch of paths once under a
    tree mask; ``dfs_relay`` walks the tree one path at a time; ``prefixflow_flat`` is PrefixFlow sharing only
    the paths' longest common prefix; ``prefixflow_auto`` is PrefixFlow on the same paths rebuilt with
    ``build_tree(min_shared_tokens="auto")``. ``baseline`` and ``prefixflow`` take trees through ``train_group``."""

    cost_model = None

    def __init__(self, name: str) -> None:
        self.name = name

    def attention_variant(self, device) -> None:
        return None

    def prepare(self, model: nn.Module, cell: Any) -> nn.Module:
        from prefixflow import apply_prefixflow

        if getattr(cell, "world_size", 1) != 1 or getattr(cell, "groups_per_step", 1) != 1:
            raise ValueError(f"system {self.name!r} runs one tree in one process")
        return apply_prefixflow(model, prefixflow_config(cell))

    def step(self, model: nn.Module, groups: list, cell: Any, observer: Any) -> Any:
        from prefixflow import RolloutTree

        (tree,) = groups
        if not isinstance(tree, RolloutTree):  # a flat group: its depth-1 tree
            tree = tree.as_tree()
        if self.name == "tree_mask":
            from harness.peers.tree_mask import train_tree_mask

            if cell.microbatch == "auto":
                raise ValueError(
                    "tree_mask takes a fixed microbatch of paths (or null); 'auto' is PrefixFlow's"
                )

            return train_tree_mask(model, tree, microbatch=cell.microbatch, loss=cell.loss, observer=observer)
        if self.name == "dfs_relay":
            from harness.peers.dfs_relay import train_dfs_relay

            return train_dfs_relay(model, tree, loss=cell.loss, observer=observer)
        from harness.peers.tree_flat import flatten_tree, rebuild_tree
        from prefixflow import train_group

        shaped = rebuild_tree(tree, "auto") if self.name == "prefixflow_auto" else flatten_tree(tree)
        return train_group(
            model, shaped, system="prefixflow", layout=cell.layout, microbatch=cell.microbatch,
            loss=cell.loss, observer=observer,
        )  # fmt: skip


for _name in ("tree_mask", "dfs_relay", "prefixflow_flat", "prefixflow_auto"):
    register_contender(_name, lambda _n=_name: TreePeerContender(_n))


def _verl_contender(name: str) -> Contender:
    from harness.peers.verl_engine import VerlEngineContender

    return VerlEngineContender(name)


# verl 0.9.x's actor update (engine.train_batch with ppo_loss): verl's own FSDP engine and PrefixFlow's engine for
# verl, side by side (needs verl: run pf-bench from .venv-verl).
for _name in ("verl", "verl_prefixflow"):
    register_contender(_name, lambda _n=_name: _verl_contender(_n))
