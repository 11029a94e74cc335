"""The TRL VLM equivalence table of docs/multimodal.md: PrefixFlowGRPOTrainer's update against TRL 1.16's
``compute_loss -> backward`` on TRL's own VLM micro-batch (the tests' set-up, ``support.trl_vlm``).

    PYTHONPATH=.:tests OMP_NUM_THREADS=1 python -m support.trl_vlm_report

Columns: loss |Δ|/|ref|; the worst gradient max|Δ|/max|ref| over every tensor (tower included; attention key
biases, zero in exact arithmetic, skipped); fp32 also TRL's own move, loss and gradient, when its prompts get one
more pad column (the same math in another layout: fp32's floor); the patches the tower encoded, TRL /
PrefixFlow.
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from support import trl_vlm as V

CASES = [  # family, options, dtype, column
    ("qwen2_5_vl", dict(loss_type="grpo", prefixflow_tree=False), torch.float64, "image"),
    ("qwen2_5_vl", dict(loss_type="dapo", prefixflow_tree=True, prefixflow_layout="packed",
                        prefixflow_microbatch=1), torch.float64, "images"),
    ("qwen2_5_vl", dict(loss_type="grpo"), torch.float64, "same text"),
    ("qwen3_vl", dict(loss_type="bnpo", prefixflow_tree=False), torch.float64, "image"),
    ("gemma3", dict(loss_type="grpo", prefixflow_tree=False, prefixflow_layout="packed"), torch.float64, "images"),
    ("gemma3", dict(loss_type="sapo", prefixflow_tree=True), torch.float64, "image"),
    ("qwen2_5_vl", dict(loss_type="grpo", prefixflow_tree=False), torch.float32, "image"),
    ("qwen2_5_vl", dict(loss_type="grpo", prefixflow_tree=True), torch.float32, "image"),
    ("qwen3_vl", dict(loss_type="grpo", prefixflow_tree=False), torch.float32, "image"),
    ("gemma3", dict(loss_type="grpo", prefixflow_tree=False), torch.float32, "image"),
]  # fmt: skip
TOWER = {"qwen2_5_vl": "visual", "qwen3_vl": "visual", "gemma3": "vision_tower"}


def _patches(model, family, run):
    seen = []

    def hook(module, args, kwargs, out):
        x = args[0] if args else next(iter(kwargs.values()))
        seen.append(x.shape[0] * (16 if family == "gemma3" else 1))

    handle = getattr(model.model, TOWER[family]).register_forward_hook(hook, with_kwargs=True)
    try:
        return run(), sum(seen)
    finally:
        handle.remove()


def _one_more_pad(inputs):
    out = dict(inputs)
    for key in ("prompt_ids", "prompt_mask", "mm_token_type_ids", "token_type_ids"):
        if key in out:
            out[key] = torch.cat([out[key].new_zeros(out[key].shape[0], 1), out[key]], 1)
    return out


def row(family, options, dtype, column):
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        model = V.conditioned(V.model(family, dtype=dtype))
        if dtype == torch.float64:
            V.fp64(model, mp)
        data = V.dataset(same_text=True) if column == "same text" else V.dataset(column=column)
        tr = V.trainer(tmp, family, model=model, dataset=data, **options)
        inputs = V.micro_batch(tr)
        tr.beta = 0.04
        (want_loss, want), trl_patches = _patches(model, family, lambda: V.trl_grads(tr, inputs))
        (got_loss, got), pf_patches = _patches(model, family, lambda: V.prefixflow_grads(tr, inputs))
        floor = None
        if dtype == torch.float32:
            pad_loss, pad_grads = V.trl_grads(tr, _one_more_pad(inputs))
            floor = (abs(pad_loss - want_loss) / abs(want_loss), V.worst_ratio(pad_grads, want))
        units = tr._plan(inputs)
        shape = "tree" if options.get("prefixflow_tree", "auto") is not False and len(units) == 1 else "flat"
    layout = options.get("prefixflow_layout", "padded") + (
        f", microbatch {options['prefixflow_microbatch']}" if "prefixflow_microbatch" in options else ""
    )
    name = f"{family}, {options['loss_type']}, {shape} ({layout}), '{column}'"
    return (name, "fp64" if dtype == torch.float64 else "fp32", abs(got_loss - want_loss) / abs(want_loss),
            V.worst_ratio(got, want), floor, trl_patches, pf_patches)  # fmt: skip


def lora_row() -> float:
    """LoRA on the language model (Qwen2.5-VL, fp64, support.vlm's weights): the adapter gradients' worst ratio."""
    import peft

    targets = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, init_lora_weights=False
    )
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        model = V.model("qwen2_5_vl", dtype=torch.float64)
        V.fp64(model, mp)
        tr = V.trainer(tmp, "qwen2_5_vl", model=model, loss_type="grpo", peft_config=lora)
        inputs = V.micro_batch(tr)
        return V.worst_ratio(V.prefixflow_grads(tr, inputs)[1], V.trl_grads(tr, inputs)[1])


def step_row() -> float:
    """One SGD step, GRPOTrainer against PrefixFlowGRPOTrainer (Gemma-3, dapo, fp64): the update's worst ratio."""
    from trl import GRPOTrainer

    steps = []
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        for cls in (GRPOTrainer, None):
            model = V.conditioned(V.model("gemma3", dtype=torch.float64))
            V.fp64(model, mp)
            tr = V.trainer(
                f"{tmp}/{cls}", "gemma3", cls=cls, model=model, loss_type="dapo", prefixflow_tree=False
            )
            before = [p.detach().clone() for p in tr.model.parameters()]
            tr.train()
            steps.append([p.detach() - b for p, b in zip(tr.model.parameters(), before, strict=True)])
    top = max(float(s.abs().max()) for s in steps[0])
    return max(float((g - w).abs().max() / w.abs().max()) for g, w in zip(steps[1], steps[0], strict=True)
               if float(w.abs().max()) > 1e-8 * top)  # fmt: skip


def main() -> None:
    print(
        "| case | dtype | loss | worst gradient | TRL's own, one more pad column (loss / gradient) | tower patches, TRL / PrefixFlow |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for case in CASES:
        name, dt, loss, grad, floor, trl, pf = row(*case)
        floor = "-" if floor is None else f"{floor[0]:.1e} / {floor[1]:.1e}"
        print(f"| {name} | {dt} | {loss:.1e} | {grad:.1e} | {floor} | {trl} / {pf} |", flush=True)
    print(f"\nLoRA on the language model, Qwen2.5-VL fp64, adapter gradients: {lora_row():.1e}")
    print(
        f"One SGD step, GRPOTrainer vs PrefixFlowGRPOTrainer, Gemma-3 dapo fp64, the update: {step_row():.1e}"
    )


if __name__ == "__main__":
    main()
