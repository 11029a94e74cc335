"""Issue 36.2 / 36.4: an ``hf:`` override either shapes the model that is built, or is refused in one line
naming the field (before any weight exists)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from prefixflow.integrations import hf  # noqa: E402
from prefixflow.integrations.hf_configs import hf_config  # noqa: E402


def test_an_override_another_field_governs_is_refused_naming_it():
    """NemotronH takes its depth from layers_block_type: num_hidden_layers=100000 built 3 layers."""
    with pytest.raises(
        ValueError, match=r"num_hidden_layers=100000 does not take effect.* from layers_block_type"
    ):
        hf_config("nemotron_h-tiny", {"num_hidden_layers": 100000})
    assert hf_config("nemotron_h-tiny", {"num_hidden_layers": 3}).num_hidden_layers == 3  # = the default


def test_an_override_reaches_the_fields_derived_from_it():
    """qwen3 derives layer_types from num_hidden_layers: the override builds that many layers (it used to leave
    layer_types at 2 entries, an IndexError inside the model and in the memory floor)."""
    model = hf.build_hf_model("qwen3-tiny", overrides={"num_hidden_layers": 3}, dtype=torch.float64)
    assert len(model.model.layers) == 3 and len(model.config.layer_types) == 3
    with pytest.raises(ValueError, match=r"override num_hidden_layers=5: .*number of `layer_types` \(3\)"):
        hf_config("qwen3_5-tiny", {"num_hidden_layers": 5})


@pytest.mark.parametrize(
    "name, overrides, text",
    [
        ("qwen3_5-tiny", {"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim=0 must be an integer >= 1"),
        ("qwen3_5-tiny", {"linear_conv_kernel_dim": -3}, "linear_conv_kernel_dim=-3 must be an integer >= 1"),
        (
            "qwen3_5-tiny",
            {"linear_num_value_heads": 3},
            "linear_num_value_heads=3 must be a multiple of linear_num_key_heads=2",
        ),
        ("nemotron_h-tiny", {"mamba_num_heads": 3}, "mamba_num_heads=3 must be a multiple of n_groups=2"),
    ],
)
def test_recurrent_sizes_are_checked_before_the_model_is_built(name, overrides, text):
    with pytest.raises(ValueError, match=text) as err:
        hf_config(name, overrides)
    assert "\n" not in str(err.value)
