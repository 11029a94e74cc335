"""The runtime: one object holds PrefixFlow's state of a model, reached only through ``runtime_of``; it is the
one PrefixFlow attribute on any module, and the wrappers users apply (``torch.compile``, PEFT, FSDP2's
``fully_shard``) do not hide it."""

from __future__ import annotations

import os
import socket

import pytest
import torch
from conftest import tiny_model
from support.reference import max_rel_diff

import prefixflow as pf
import prefixflow.hooks
from prefixflow.runtime import HANDLE, runtime_of

GROUP = pf.synthetic_group(97, 10, [4, 6], seed=2)


def prefixflow_attributes(model) -> list[str]:
    """Every attribute whose name mentions prefixflow, on every module of ``model``, but the root's handle."""
    found = []
    for name, module in model.named_modules():
        for key in vars(module):
            if "prefixflow" in key.lower() and not (module is model and key == HANDLE):
                found.append(f"{name or '<root>'}.{key}")
    return found


def grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def test_every_transform_records_on_the_one_runtime():
    model = pf.build_model("llama3:debugmodel", dtype=torch.float64, seed=0,
                           overrides={"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 97})  # fmt: skip
    pf.apply_ac(model, "full")
    pf.apply_prefixflow(model)
    pf.apply_compile(model, backend="eager")
    runtime = runtime_of(model)
    assert (runtime.name, runtime.ac, runtime.compiled["backend"]) == ("llama3:debugmodel", "full", "eager")
    assert runtime.config is not None and pf.hooks.hooks_of(model) is runtime.hooks
    assert prefixflow_attributes(model) == []


def test_the_check_finds_a_stray_attribute():
    model = tiny_model("llama3")
    model.layers["0"].prefixflow_note = 1  # a transform that left its state on a module
    assert prefixflow_attributes(model) == ["layers.0.prefixflow_note"]


def test_runtime_of_refuses_a_model_without_prefixflow():
    plain = pf.build_model("llama3:debugmodel", overrides={"dim": 32, "n_layers": 1, "n_heads": 4})
    with pytest.raises(ValueError, match="call prefixflow.apply_prefixflow"):
        runtime_of(plain)
    assert runtime_of(plain, create=True).config is None


def test_the_runtime_survives_torch_compile():
    model = tiny_model("llama3")
    wrapped = torch.compile(model, backend="eager")
    assert type(wrapped).__name__ == "OptimizedModule"
    assert runtime_of(wrapped) is runtime_of(model)
    model.zero_grad(set_to_none=True)
    pf.train_group(model, GROUP)
    want = grads(model)
    model.zero_grad(set_to_none=True)
    pf.train_group(wrapped, GROUP)
    assert all(torch.equal(g, w) for g, w in zip(grads(model), want, strict=True))


def test_the_runtime_survives_peft():
    peft = pytest.importorskip("peft")
    from prefixflow.integrations import hf

    base = hf.build_hf_model("llama-tiny", dtype=torch.float64)
    pf.apply_prefixflow(base)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert runtime_of(lora) is runtime_of(base)
    pf.train_group(lora, pf.synthetic_group(hf.hf_config("llama-tiny").vocab_size, 10, [4, 6], seed=2))
    adapters = [p for n, p in lora.named_parameters() if "lora_" in n]
    assert adapters and all(p.grad is not None for p in adapters)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_runtime_survives_fully_shard(monkeypatch):
    """PrefixFlow's FSDP2 (``apply_fsdp``: ``fully_shard`` per unit, over a one-rank mesh here) swaps the
    model's class; its runtime stays, and training through it matches the unsharded model."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from prefixflow.parallel.fsdp import apply_fsdp

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        plain = tiny_model("llama3")
        pf.train_group(plain, GROUP)
        want = grads(plain)
        model = tiny_model("llama3")
        runtime = runtime_of(model)
        apply_fsdp(model, init_device_mesh("cpu", (1,)))
        assert "FSDP" in type(model).__name__ and runtime_of(model) is runtime
        pf.train_group(model, GROUP)
        got = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
        assert max_rel_diff(got, want) <= 1e-12
    finally:
        dist.destroy_process_group()
        os.environ.pop("MASTER_PORT", None)
