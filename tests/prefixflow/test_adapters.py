"""The model-adapter registry: how the schedule finds what it needs from a model family."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY

import prefixflow as pf
from prefixflow.model import adapters


def test_torchtitan_models_get_the_core_adapter():
    name, overrides = TINY["qwen3"]
    model = pf.build_model(name, dtype=torch.float64, overrides=overrides)
    adapter = pf.adapter_for(model)
    assert isinstance(adapter, pf.TorchTitanAdapter)
    assert adapter.lm_head(model) is model.output
    assert adapter.blocks(model) == list(model.layers.values())
    assert adapter.vocab_size(model) == pf.model_args(model).vocab_size
    pf.apply_prefixflow(model)
    assert model._prefixflow.adapter is adapter
    assert model._prefixflow.n_wrapped == len(adapter.blocks(model))


def test_unknown_model_is_a_type_error_naming_the_fix(monkeypatch):
    monkeypatch.setattr(adapters, "_entry_points_loaded", True)
    with pytest.raises(TypeError, match=r"Linear is not a model PrefixFlow knows.*prefixflow\[hf\]"):
        pf.apply_prefixflow(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="ModelAdapter"):
        pf.register_adapter(object())


def test_entry_points_register_adapters_on_first_miss(monkeypatch):
    """An installed integration announces itself through the entry-point group; loading it registers it."""

    class Toy(torch.nn.Module):
        pass

    class ToyAdapter(pf.ModelAdapter):
        name = "toy"

        def matches(self, model):
            return isinstance(model, Toy)

    class Entry:
        def load(self):
            pf.register_adapter(ToyAdapter())

    class Broken:
        def load(self):
            raise ImportError("optional dependency missing")

    groups = []
    monkeypatch.setattr(adapters, "_entry_points_loaded", False)
    monkeypatch.setattr(adapters, "_ADAPTERS", list(adapters._ADAPTERS))
    monkeypatch.setattr(
        adapters.metadata, "entry_points", lambda group: groups.append(group) or [Broken(), Entry()]
    )
    assert isinstance(pf.adapter_for(Toy()), ToyAdapter)
    assert groups == [adapters.ENTRY_POINT_GROUP]
    pf.adapter_for(Toy())
    assert len(groups) == 1  # loaded once
