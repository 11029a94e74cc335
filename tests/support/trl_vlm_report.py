"""The TRL VLM equivalence table of docs/multimodal.md: PrefixFlowGRPOTrainer's update against TRL 1.16's
``compute_loss -> backward`` on TRL's own VLM micro-batch (the tests' set-up, ``support.trl_vlm``).

    PYTHONPATH=.:tests OMP_NUM_THREADS=1 python -m support.trl_vlm_report

Columns: loss |Δ|/|ref|; the worst gradient max|Δ|/max|ref| over every tensor (tower included; attention key
biases, zero in exact arithmetic, skipped); fp32 also TRL's own move, loss and gradient, when its prompts get one
more pad column (the same math in another layout: fp32's floor); the patches the tower encoded, TRL /
PrefixFlow. A second table puts each fp32 case against its fp64 truth (the same weights and micro-batch cast to
fp64, HF's fp32 casts neutralised, TRL's loss): PrefixFlow's error, TRL's own, TRL's with one more pad column,
and PrefixFlow's over TRL's. ``... trl_vlm_report seeds N`` repeats that ratio over N seeds (weights, images,
generations and injected log-probs all drawn again).
"""

from __future__ import annotations

import statistics
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


def row(family, options, dtype, column, seed=0):
    """One case: (name, dtype, loss, worst gradient, pad floor, TRL's patches, PrefixFlow's, fp32: ``truth``,
    {side: (loss, worst gradient)} against the fp64 truth for PrefixFlow, TRL and TRL with one more pad)."""
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        model = V.conditioned(V.model(family, dtype=dtype), seed=seed)
        if dtype == torch.float64:
            V.fp64(model, mp)
        data = V.dataset(same_text=True) if column == "same text" else V.dataset(column=column, seed=seed)
        tr = V.trainer(tmp, family, model=model, dataset=data, **options)
        inputs = V.micro_batch(tr, seed=seed)
        tr.beta = 0.04
        (want_loss, want), trl_patches = _patches(model, family, lambda: V.trl_grads(tr, inputs))
        (got_loss, got), pf_patches = _patches(model, family, lambda: V.prefixflow_grads(tr, inputs))
        units = tr._plan(inputs)
        shape = "tree" if options.get("prefixflow_tree", "auto") is not False and len(units) == 1 else "flat"
        floor = truth = None
        if dtype == torch.float32:
            pad_loss, pad_grads = V.trl_grads(tr, _one_more_pad(inputs))
            floor = (abs(pad_loss - want_loss) / abs(want_loss), V.worst_ratio(pad_grads, want))
            true_loss, true = V.fp64_truth(tr, inputs, mp)  # last: the model is fp64 from here
            sides = {"pf": (got_loss, got), "trl": (want_loss, want), "pad": (pad_loss, pad_grads)}
            truth = {
                k: (abs(loss - true_loss) / abs(true_loss), V.worst_ratio(g, true))
                for k, (loss, g) in sides.items()
            }
    layout = options.get("prefixflow_layout", "padded") + (
        f", microbatch {options['prefixflow_microbatch']}" if "prefixflow_microbatch" in options else ""
    )
    name = f"{family}, {options['loss_type']}, {shape} ({layout}), '{column}'"
    return (name, "fp64" if dtype == torch.float64 else "fp32", abs(got_loss - want_loss) / abs(want_loss),
            V.worst_ratio(got, want), floor, trl_patches, pf_patches, truth)  # fmt: skip


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


def seeds(n: int) -> None:
    """PrefixFlow's fp32 error over TRL's (worst gradient against the fp64 truth), each fp32 case, seeds 0..n-1."""
    print("| case | PrefixFlow / TRL, per seed | min / median / max |\n| --- | --- | --- |")
    for case in [c for c in CASES if c[2] == torch.float32]:
        rows = [row(*case, seed=s) for s in range(n)]
        q = [r[-1]["pf"][1] / r[-1]["trl"][1] for r in rows]
        mid = statistics.median(q)
        print(f"| {rows[0][0]} | {' '.join(f'{r:.2f}' for r in q)} | {min(q):.2f} / {mid:.2f} / {max(q):.2f} |",
              flush=True)  # fmt: skip


def main() -> None:
    print(
        "| case | dtype | loss | worst gradient | TRL's own, one more pad column (loss / gradient) | tower patches, TRL / PrefixFlow |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    truths = []
    for case in CASES:
        name, dt, loss, grad, floor, trl, pf, truth = row(*case)
        floor = "-" if floor is None else f"{floor[0]:.1e} / {floor[1]:.1e}"
        print(f"| {name} | {dt} | {loss:.1e} | {grad:.1e} | {floor} | {trl} / {pf} |", flush=True)
        if truth is not None:
            truths.append((name, grad, truth))
    print(
        "\nfp32 against the fp64 truth (loss / worst gradient):\n\n| case | PrefixFlow vs TRL (gradient) | "
        "PrefixFlow vs truth | TRL vs truth | TRL, one more pad column, vs truth | PrefixFlow / TRL (gradient) |"
        "\n| --- | --- | --- | --- | --- | --- |"
    )
    for name, grad, t in truths:
        cells = " | ".join(f"{t[k][0]:.1e} / {t[k][1]:.1e}" for k in ("pf", "trl", "pad"))
        print(f"| {name} | {grad:.1e} | {cells} | {t['pf'][1] / t['trl'][1]:.2f} |")
    print(f"\nLoRA on the language model, Qwen2.5-VL fp64, adapter gradients: {lora_row():.1e}")
    print(
        f"One SGD step, GRPOTrainer vs PrefixFlowGRPOTrainer, Gemma-3 dapo fp64, the update: {step_row():.1e}"
    )


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["seeds"]:
        seeds(int(sys.argv[2]) if len(sys.argv) > 2 else 6)
    else:
        main()
