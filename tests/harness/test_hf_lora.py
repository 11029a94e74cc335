"""LoRA cells (issue 24): ``lora: {r, alpha, target_modules}`` on an ``hf:`` model entry; both systems train
PEFT's base model with the LoRA layers inside, and PrefixFlow's adapter gradients equal the baseline's."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from pydantic import ValidationError

pytest.importorskip("transformers")
pytest.importorskip("peft")

from typer.testing import CliRunner  # noqa: E402

from harness.cli import app  # noqa: E402
from harness.records import collect  # noqa: E402
from harness.run.setup import build_for, make_group  # noqa: E402
from harness.spec.cell import Cell, ModelSpec, Parallel  # noqa: E402
from harness.spec.checks import check_model_spec  # noqa: E402
from harness.spec.load import load_spec  # noqa: E402

TINY = {"num_hidden_layers": 2}
PROJECTIONS = 7  # q/k/v/o, gate/up/down per layer of hf:llama-tiny


def test_lora_spec_valid_and_refused(tmp_path):
    ok = ModelSpec(name="hf:llama-tiny", lora={"r": 16, "alpha": 32})
    assert ok.lora.r == 16 and ok.lora.alpha == 32.0 and ok.lora.target_modules is None
    check_model_spec(ModelSpec(name="hf:llama-tiny", lora={"r": 2, "alpha": 1, "target_modules": ["q_proj"]}))
    for bad, field in [
        ({"r": 0, "alpha": 32}, "lora.r"),
        ({"r": 1.5, "alpha": 32}, "lora.r"),
        ({"r": "16", "alpha": 32}, "lora.r"),
        ({"r": 16, "alpha": 0}, "lora.alpha"),
        ({"r": 16}, "lora.alpha"),
        ({"r": 16, "alpha": 32, "dropout": 0.1}, "lora.dropout"),
        ({"r": 16, "alpha": 32, "target_modules": ["q_proj; rm"]}, "lora.target_modules"),
        ({"r": 16, "alpha": 32, "target_modules": []}, "lora.target_modules"),
    ]:
        with pytest.raises(ValidationError, match=field.replace(".", r"\.")):
            ModelSpec(name="hf:llama-tiny", lora=bad)
    with pytest.raises(ValidationError, match="lora: LoRA goes through PEFT on Hugging Face models only"):
        ModelSpec(name="llama3:debugmodel", lora={"r": 16, "alpha": 32})
    with pytest.raises(ValueError, match=r"lora.target_modules \['qkv'\] are not linear layers"):
        check_model_spec(
            ModelSpec(name="hf:llama-tiny", lora={"r": 2, "alpha": 1, "target_modules": ["qkv"]})
        )
    model = ModelSpec(name="hf:llama-tiny", lora={"r": 2, "alpha": 1})
    with pytest.raises(ValidationError, match="model.lora: LoRA cells run on one process"):
        Cell(spec="t", model=model, prefix_len=4, suffix_len=2, n=2, parallel=Parallel(dp_replicate=2))
    spec = tmp_path / "bad.yaml"
    spec.write_text(
        "name: bad\naxes:\n  models:\n    - {name: 'llama3:debugmodel', lora: {r: 4, alpha: 8}}\n  n: [2]\n"
        "  lengths: [{prefix: 4, suffix: 2}]\n"
    )
    with pytest.raises(ValueError, match="lora") as err:
        load_spec(spec)
    assert "hf: model" in str(err.value)
    cells = {m.display: m for m in load_spec("experiments/hf.yaml").axes.models}
    assert cells["hf-llama-debug-2l-lora16"].lora.r == 16 and cells["hf-llama-debug-2l"].lora is None


def test_lora_cell_id_unchanged_without_lora():
    """Cells without LoRA keep the ids they were recorded under (results/hf/_manifest.json); LoRA cells differ."""
    from harness.spec.load import expand

    ids = {c.model.display: c.cell_id for c in expand(load_spec("experiments/hf.yaml"))}
    assert ids["hf-llama-debug-2l"] == "9d0584a51d45" and ids["llama3-debug-2l"] == "aea9e8456cf9"
    assert ids["hf-llama-debug-2l-lora16"] not in ("9d0584a51d45", "aea9e8456cf9")


def test_lora_adapters_follow_the_cell_seed_not_the_global_rng():
    from harness.run.setup import build_cell_model

    cell = Cell(spec="t", model=ModelSpec(name="hf:llama-tiny", overrides={"num_hidden_layers": 1},
                lora={"r": 2, "alpha": 4}), prefix_len=4, suffix_len=2, n=2)  # fmt: skip

    def adapters(c: Cell, global_seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(global_seed)
        model = build_cell_model(c, torch.device("cpu"))
        return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_A" in n}

    first, second = adapters(cell, 1), adapters(cell, 2)
    assert first and all(torch.equal(first[n], second[n]) for n in first)
    other = adapters(cell.model_copy(update={"seed": 1}), 1)
    assert not any(torch.equal(first[n], other[n]) for n in first)


def _randomize_lora_b(model: torch.nn.Module) -> None:
    """PEFT starts lora_B at zero (so lora_A's gradient is zero); make every adapter's both factors count."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def test_lora_prefixflow_adapter_gradients_equal_baseline_fp64():
    from tests.prefixflow.integrations.test_hf import fp64_norms

    cell = Cell(
        spec="t", model=ModelSpec(name="hf:llama-tiny", overrides=TINY, lora={"r": 4, "alpha": 8}),
        prefix_len=24, suffix_len=6, n=3, dtype="fp64", microbatch=1, systems=("baseline", "prefixflow"),
    )  # fmt: skip
    grads = {}
    for system in cell.systems:
        contender, model = build_for(system, cell, torch.device("cpu"))
        fp64_norms(model)
        _randomize_lora_b(model)
        adapters = [n for n, p in model.named_parameters() if p.requires_grad]
        assert len(adapters) == 2 * PROJECTIONS * 2 and all("lora_" in n for n in adapters), adapters
        group = make_group(cell, model.config.vocab_size)
        contender.step(model, [group], cell, None)
        frozen = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
        assert frozen == [], f"{system}: base weights got gradients: {frozen[:3]}"
        grads[system] = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        assert all(g.dtype == torch.float64 for g in grads[system].values())
    base, pf = grads["baseline"], grads["prefixflow"]
    assert base.keys() == pf.keys()
    for name in base:
        scale = base[name].abs().max().item()
        assert scale > 0, f"{name}: zero gradient (the check would be vacuous)"
        err = (pf[name] - base[name]).abs().max().item() / scale
        assert err <= 1e-9, f"{name}: relative error {err:.2e}"


def test_pf_bench_sweep_lora_cell_records_lora_on_and_off(tmp_path):
    spec = tmp_path / "lora.yaml"
    spec.write_text(
        "name: lora\nsystems: [baseline, prefixflow]\ndevice: cpu\nwarmup: 0\nrepeats: 1\naxes:\n  models:\n"
        "    - {name: 'hf:llama-tiny', label: tiny, overrides: {num_hidden_layers: 2}}\n"
        "    - {name: 'hf:llama-tiny', label: tiny-lora4, overrides: {num_hidden_layers: 2},"
        " lora: {r: 4, alpha: 8}}\n"
        "  n: [3]\n  lengths: [{prefix: 12, suffix: 4}]\n"
    )
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["sweep", str(spec), "--out", str(out), "--executor", "debug"])
    assert res.exit_code == 0, res.output
    df = collect(out).set_index(["model", "system"])
    assert set(df["status"]) == {"ok"}, df["error"].tolist()
    assert (
        pd.isna(df.loc[("tiny", "prefixflow"), "lora_r"])
        and df.loc[("tiny-lora4", "prefixflow"), "lora_r"] == 4
    )
    assert df.loc[("tiny-lora4", "baseline"), "lora_alpha"] == 8.0
    assert df.loc[("tiny", "prefixflow"), "ideal_speedup"] > 1
    assert pd.isna(df.loc[("tiny-lora4", "prefixflow"), "model_flops"])
    # LoRA trains the adapters only: fewer FLOPs than full fine-tuning (no base-weight gradient GEMMs)
    assert df.loc[("tiny-lora4", "baseline"), "counted_flops"] < df.loc[("tiny", "baseline"), "counted_flops"]
    for system in ("baseline", "prefixflow"):
        assert df.loc[("tiny-lora4", system), "loss"] == pytest.approx(
            df.loc[("tiny", system), "loss"], rel=1e-5
        )
