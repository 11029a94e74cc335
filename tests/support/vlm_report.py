"""The multimodal exactness numbers of docs/multimodal.md, measured (fp64, HF's fp32 casts neutralised):

    PYTHONPATH=.:tests OMP_NUM_THREADS=1 python -m support.vlm_report

For each model: the worst loss and per-tensor gradient ratio (max|d| / max|ref|) over PrefixFlow padded and
packed at microbatch 1, 2 and all and the baseline, against the model's own forward on full sequences; and
what the vision tower encoded per group (patches, runs, forward FLOPs) under each system."""

from __future__ import annotations

import pytest
import torch

import prefixflow as pf

from . import vlm


def _group(prompt, inputs):
    gen = torch.Generator().manual_seed(1)
    responses = [torch.randint(3, 200, (n,), generator=gen) for n in (4, 9, 2)]
    return pf.RolloutGroup(prompt, responses, torch.tensor([1.0, -0.5, 0.3]), prompt_inputs=inputs)


def cases():
    for kind in ("qwen2_5_vl", "qwen3_vl"):
        model = vlm.build_qwen(kind)
        prompt, inputs = vlm.qwen_prompt(videos=((2, 4, 4),), per_frame=kind == "qwen3_vl")
        yield f"{kind} (image + 4-frame video)", model, prompt, inputs
    model = vlm.build_gemma3(sliding_window=16)
    prompt, inputs = vlm.gemma_prompt(n_images=2, text=(14, 3))
    yield "gemma3 (2 images, window 16 < 42 tokens)", model, prompt, inputs
    model = vlm.build_llava_onevision()
    yield "llava_onevision (anyres image)", model, *vlm.llava_prompt(model, ((28, 50),))


def main() -> None:
    runs = [("prefixflow", layout, mb) for layout in ("padded", "packed") for mb in (None, 1, 2)]
    runs.append(("baseline", "padded", None))
    print(
        "| model | loss ratio | worst gradient ratio | tower (PrefixFlow / baseline): patches, runs, GFLOP |"
    )
    print("|---|---|---|---|")
    for name, model, prompt, inputs in cases():
        with pytest.MonkeyPatch.context() as mp:
            vlm.neutralise_fp32(model, mp)
            group = _group(prompt, inputs)
            want_loss, want = vlm.reference_pg(model, group, inputs)
            pf.apply_prefixflow(model)
            loss_ratio, grad_ratio, seen = 0.0, 0.0, {}
            for system, layout, mb in runs:
                model.zero_grad(set_to_none=True)
                stats = pf.train_group(model, group, system=system, layout=layout, microbatch=mb)
                loss_ratio = max(loss_ratio, abs(stats.loss - want_loss) / abs(want_loss))
                grad_ratio = max(grad_ratio, vlm.compare_grads(model, want))
                seen[system] = (stats.vision_tokens, stats.vision_runs, stats.vision_flops / 1e9)
        pfs, base = seen["prefixflow"], seen["baseline"]
        print(
            f"| {name} | {loss_ratio:.1e} | {grad_ratio:.1e} | {pfs[0]}, {pfs[1]}, {pfs[2]:.4f} / "
            f"{base[0]}, {base[1]}, {base[2]:.4f} |"
        )


if __name__ == "__main__":
    main()
