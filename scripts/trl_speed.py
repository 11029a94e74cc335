"""Time one micro-batch update: TRL 1.16's ``compute_loss -> backward`` against PrefixFlowGRPOTrainer's, with
LoRA off and on (a long shared prompt, several completions; HF Llama with the ``hf:llama-debug`` shape, fp32).

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python scripts/trl_speed.py [--prompt 1280 --completion 256 --n 8]

Prints the median of ``--repeats`` seconds per update and the speedup, per LoRA setting.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import support.trl_fixtures as F  # noqa: E402

from prefixflow.integrations import hf  # noqa: E402


def micro_batch(vocab: int, prompt: int, completion: int, n: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    p = torch.randint(3, vocab, (1, prompt), generator=gen).expand(n, prompt).clone()
    c = torch.randint(3, vocab, (n, completion), generator=gen)
    lens = torch.linspace(completion // 2, completion, n).long()
    cm = (torch.arange(completion)[None] < lens[:, None]).long()
    adv = torch.randn(n, generator=gen)
    return {
        "prompt_ids": p, "prompt_mask": torch.ones_like(p), "completion_ids": c, "completion_mask": cm,
        "advantages": adv - adv.mean(), "num_items_in_batch": cm.sum(),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=1280)
    ap.add_argument("--completion", type=int, default=256)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import peft

    for use_lora in (False, True):
        model = hf.build_hf_model("llama-debug", overrides={"vocab_size": len(F.SPECIALS) + len(F.WORDS)})
        model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
        extra = {}
        if use_lora:
            extra["peft_config"] = peft.LoraConfig(
                r=16, lora_alpha=32, lora_dropout=0.0,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            )  # fmt: skip
        tr = F.trainer(
            Path(tempfile.mkdtemp()), model=model, loss_type="dapo", gradient_checkpointing=False, **extra
        )
        tr.model.train()
        tr.current_gradient_accumulation_steps = 1
        inputs = micro_batch(model.config.vocab_size, args.prompt, args.completion, args.n)
        times = {"trl": [], "prefixflow": []}
        for _ in range(args.repeats):
            for name in times:
                tr.model.zero_grad(set_to_none=True)
                start = time.perf_counter()
                if name == "trl":
                    tr.compute_loss(tr.model, inputs).backward()
                else:
                    tr._prefixflow_update(tr.model, inputs)
                times[name].append(time.perf_counter() - start)
        trl, pf = (statistics.median(v) for v in times.values())
        print(
            f"LoRA {'on ' if use_lora else 'off'}: TRL {trl:.2f} s, PrefixFlow {pf:.2f} s, speedup {trl / pf:.2f}x "
            f"(prompt {args.prompt}, {args.n} x <= {args.completion} completion tokens, median of {args.repeats})",
            flush=True,
        )


if __name__ == "__main__":
    main()
