"""Hostile values, as a red team would try them, each expecting a result or a one-line error naming the field
(issue 36, "make the attacks permanent"): pf-bench spec values, hf: model overrides, TRL trainer options, and
the library's train_group inputs, whose refusal leaves every ``.grad`` untouched."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from conftest import tiny_model
from hypothesis import given
from hypothesis import strategies as st
from support.properties import ci, fuzz

import prefixflow as pf
from harness.spec.load import SpecError, expand, parse_spec

HOSTILE = st.one_of(
    st.integers(-3, 10),
    st.sampled_from([0, -1, 2**31, 2**63, 10**6, 10**12]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["2", "", "auto", "nan", "1e9", "../x", "padded"]),
    st.none(),
    st.booleans(),
    st.lists(st.integers(-2, 3), max_size=3),
)
SPEC_FIELDS = {
    ("axes", "n"): lambda v: [v],
    ("axes", "microbatch"): lambda v: [v],
    ("axes", "layout"): lambda v: [v],
    ("axes", "lengths"): lambda v: [{"prefix": v, "suffix": 4}],
    ("axes", "trees"): lambda v: [
        {"kind": "search", "depth": v, "branch": 4, "segment_len": 2, "prompt_len": 4}
    ],
    ("axes", "suffix_spread"): lambda v: [v],
    ("executor", "nodes"): lambda v: v,
    ("executor", "timeout_min"): lambda v: v,
    ("limits", "max_paths"): lambda v: v,
    ("", "repeats"): lambda v: v,
}


def _spec(block: str, key: str, value) -> dict:
    spec = {"name": "hostile", "axes": {"models": [{"name": "llama3:debugmodel"}], "n": [2],
                                          "lengths": [{"prefix": 4, "suffix": 2}]}}  # fmt: skip
    if key == "trees":
        del spec["axes"]["n"], spec["axes"]["lengths"]
    if block:
        spec.setdefault(block, {})[key] = value
    else:
        spec[key] = value
    return spec


def _check_spec(field, value) -> None:
    block, key = field
    try:
        spec = parse_spec(_spec(block, key, SPEC_FIELDS[field](value)))
    except SpecError as e:
        text = str(e)
        assert "Traceback" not in text and "validation error for" not in text, text
        assert key in text or "limits." in text, text  # names the field (or the limit it breaks)
        return
    cells = expand(spec)  # what loads also expands into valid cells
    assert cells and all(c.n <= spec.limits.max_paths for c in cells)


@ci(60)
@given(st.sampled_from(sorted(SPEC_FIELDS)), HOSTILE)
def test_hostile_spec_values_load_or_name_the_field(field, value):
    _check_spec(field, value)


@fuzz(3000)
@given(st.sampled_from(sorted(SPEC_FIELDS)), HOSTILE)
def test_hostile_spec_values_load_or_name_the_field_fuzz(field, value):
    _check_spec(field, value)


HF_FIELDS = {
    "qwen3_5-tiny": ("num_hidden_layers", "linear_conv_kernel_dim", "linear_num_value_heads",
                     "linear_num_key_heads", "linear_key_head_dim", "num_key_value_heads", "head_dim"),
    "nemotron_h-tiny": ("num_hidden_layers", "mamba_num_heads", "n_groups", "conv_kernel", "ssm_state_size",
                        "chunk_size", "mamba_head_dim"),
    "qwen3-tiny": ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size"),
}  # fmt: skip
SMALL_INTS = st.one_of(st.integers(-3, 9), st.sampled_from([100_000]))


def _check_override(name, field, value) -> None:
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from prefixflow.integrations.hf_configs import hf_config

    try:
        config = hf_config(name, {field: value})
    except ValueError as e:
        assert "\n" not in str(e) and field in str(e), str(e)
        return
    assert getattr(config, field) == value  # the override took effect: the config that is built holds it
    if getattr(config.get_text_config(), "num_hidden_layers", 0) > 64:
        return  # a meta build of 100,000 layers proves nothing more
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert len(model.model.layers) == config.get_text_config().num_hidden_layers


@ci(40)
@given(st.sampled_from([(n, f) for n, fs in HF_FIELDS.items() for f in fs]), SMALL_INTS)
def test_hf_overrides_take_effect_or_name_the_field(name_field, value):
    _check_override(*name_field, value)


@fuzz(2000)
@given(st.sampled_from([(n, f) for n, fs in HF_FIELDS.items() for f in fs]), SMALL_INTS)
def test_hf_overrides_take_effect_or_name_the_field_fuzz(name_field, value):
    _check_override(*name_field, value)


OPTIONS = ("layout", "microbatch", "tree", "min_shared_tokens", "verify_tolerance")


def _check_options(option, value) -> None:
    pytest.importorskip("trl")
    from prefixflow.integrations.trl.options import check_options

    values = dict(
        layout="padded", microbatch=None, tree="auto", min_shared_tokens=None, verify_tolerance=None
    )
    values[option] = value
    try:
        check_options(*(values[k] for k in OPTIONS))
    except ValueError as e:
        name = "verify_tolerance" if option == "verify_tolerance" else f"prefixflow_{option}"
        assert str(e).startswith(name) and "\n" not in str(e), str(e)
        return
    if option == "verify_tolerance" and value is not None:
        assert math.isfinite(value) and value > 0 and not isinstance(value, bool)
    if option == "microbatch" and value not in (None, "auto"):
        assert isinstance(value, int) and not isinstance(value, bool) and value >= 1


@ci(60)
@given(st.sampled_from(OPTIONS), HOSTILE)
def test_trainer_options_pass_or_name_the_option(option, value):
    _check_options(option, value)


@fuzz(3000)
@given(st.sampled_from(OPTIONS), HOSTILE)
def test_trainer_options_pass_or_name_the_option_fuzz(option, value):
    _check_options(option, value)


@functools.cache
def _model():
    return tiny_model("llama3", dim=32, vocab_size=97)


CALL_FIELDS = ("layout", "microbatch", "system", "advantages", "prompt", "response", "parents")


def _check_call(field, value) -> None:
    model = _model()
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        before = [p.detach().clone() for p in model.parameters()]
    kwargs = dict(layout="padded", microbatch=None, system="prefixflow")
    try:
        if field == "parents":
            group = pf.RolloutTree(
                [torch.tensor([1, 2]), torch.tensor([3, 4])], [-1, value], [1], [1.0],
                [torch.tensor([False, False, True, True])],
            )  # fmt: skip
        else:
            prompt = torch.tensor([1, 2, 3])
            responses = [torch.tensor([4, 5]), torch.tensor([6])]
            adv = torch.tensor([1.0, -1.0])
            if field == "advantages":
                adv = torch.tensor([1.0, value]) if isinstance(value, float) else value
            elif field == "prompt":
                prompt = torch.tensor(value) if isinstance(value, list) else value
            elif field == "response":
                responses = [torch.tensor(value) if isinstance(value, list) else value, torch.tensor([6])]
            else:
                kwargs[field] = value
            group = pf.RolloutGroup(prompt=prompt, responses=responses, advantages=adv)
        stats = pf.train_group(model, group, **kwargs)
    except (ValueError, TypeError) as e:
        assert "\n" not in str(e), str(e)
        assert all(p.grad is None for p in model.parameters())  # refused before any gradient changed
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        return
    assert math.isfinite(stats.loss)
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


@ci(60)
@given(st.sampled_from(CALL_FIELDS), HOSTILE)
def test_hostile_library_inputs_train_or_are_refused_untouched(field, value):
    _check_call(field, value)


@fuzz(3000)
@given(st.sampled_from(CALL_FIELDS), HOSTILE)
def test_hostile_library_inputs_train_or_are_refused_untouched_fuzz(field, value):
    _check_call(field, value)
