"""Runs on each of 2 ranks (``harness.local_ranks`` or torchrun): for every case, one SGD step of TRL's own
``GRPOTrainer`` under DDP (accelerate's MULTI_CPU state, gloo) and of ``PrefixFlowGRPOTrainer`` with the model
sharded by PrefixFlow's FSDP2 (``prefixflow_parallel={"dp_shard": 2}``, or sharded by the caller with
``parallelize`` first), same launch and seed. Rank 0 writes, per case, the max relative difference (per tensor,
max|d| / max|ref|) of the full (gathered) weights after the step and of the gradients the first optimizer step
applies, with what shows the sharding is real: no DDP wrapper, sharded parameters, one reduce-scatter per unit
per micro-batch.

``python -m harness.local_ranks --nproc-per-node=2 tests/support/trl_fsdp_worker.py OUT.json``
"""

from __future__ import annotations

import json
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback

CASES = {
    "dapo": dict(loss_type="dapo", rerun_trl=True, save=True),
    "tools-tree": dict(loss_type="grpo", tools=True),
    "presharded-clip": dict(loss_type="dr_grpo", max_grad_norm=0.05, presharded=True),
    "dapo-fp64": dict(loss_type="dapo", fp64=True),
    "grpo-beta": dict(loss_type="grpo", beta=0.04, reference=True),  # an unsharded reference model
    # TRL's bf16 (CPU autocast over fp32 weights); the first-step check still runs in fp32
    "bf16-verify": dict(loss_type="dapo", bf16=True, verify_first_step=True),
    # gradient accumulation: the ranks train different numbers of groups per micro-batch
    "verify-ga2": dict(
        loss_type="grpo",
        gradient_accumulation_steps=2,
        steps_per_generation=2,
        prompts=8,
        verify_first_step=True,
    ),
}


_SHARED: list[Path] = []


def _shared() -> Path:
    """A folder rank 0 creates and every rank reads (the ranks share a file system here)."""
    if not _SHARED:
        name = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(name, src=0)
        _SHARED.append(Path(name[0]))
    return _SHARED[0]


def _rel(got: dict, want: dict) -> float:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return max(float((got[n] - w).abs().max()) / (float(w.abs().max()) or 1.0) for n, w in want.items())


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _step(cls, folder: Path, options: dict, sharded: bool):
    import prefixflow as pf
    import support.trl_fixtures as F
    from prefixflow.parallel import fsdp as pf_fsdp
    from prefixflow.parallel import parallelize

    options = dict(options)
    options.pop("rerun_trl", None)
    save = options.pop("save", False)
    options["dataset"] = F.dataset(options.pop("prompts", 4))
    if options.pop("tools", False):
        options["rollout_func"] = F.multi_turn_rollout
    fp64 = options.pop("fp64", False)
    model = F.model(dtype=torch.float64 if fp64 else torch.float32)
    if fp64:
        F.fp64_norms(model)
    if options.pop("reference", False):  # beta > 0: TRL loads its reference model from the policy's path
        path = _shared() / folder.name  # transformers saves on rank 0 only: a folder both ranks read
        if dist.get_rank() == 0:
            model.save_pretrained(str(path))
        dist.barrier()
        model = str(path)
    presharded = options.pop("presharded", False)
    if sharded and presharded:  # the caller shards; the trainer takes the model as it is
        parallelize(pf.apply_prefixflow(model), {"dp_shard": 2})
    elif sharded:
        options["prefixflow_parallel"] = {"dp_shard": 2}
    tr = F.trainer(folder, cls=cls, model=model, **options)
    named = [(n, p) for n, p in tr.model.named_parameters() if p.requires_grad]
    grads: dict = {}

    class FirstGradients(TrainerCallback):  # the reduced gradients the first optimizer step applies
        def on_pre_optimizer_step(self, *args, **kwargs):
            if not grads:
                grads.update((n, _full(p.grad)) for n, p in named)

    tr.add_callback(FirstGradients())
    if sharded:
        pf_fsdp.reset_collective_counts(tr.model)
    tr.train()
    out = {
        "after": {n: _full(p) for n, p in named},
        "grads": grads,
        "world": tr.accelerator.num_processes,
        "logged": tr.state.log_history[0],
        "wrapper": type(tr.model_wrapped).__name__,
    }
    if (
        sharded and save
    ):  # save_model gathers the full weights; rank 0 writes them, from_pretrained reads them
        from transformers import AutoModelForCausalLM

        path = _shared() / f"{folder.name}-saved"
        tr.save_model(str(path))
        dist.barrier()
        loaded = dict(AutoModelForCausalLM.from_pretrained(str(path), dtype=model.dtype).named_parameters())
        out["saved"] = _rel({n: loaded[n].detach() for n in out["after"]}, out["after"])
    if sharded:
        out["sharded"] = sum(isinstance(p, DTensor) and p.to_local().numel() < p.numel() for _, p in named)
        out["n_params"] = len(named)
        out["counts"] = pf_fsdp.collective_counts(tr.model)["reduce_scatter"]
        out["units"] = pf_fsdp.n_units(tr.model)
        out["residue"] = pf_fsdp.fsdp_residue(tr.model)
    return out


def _train_groups(tied: bool, ac: bool) -> dict:
    """No trainer: the HF model sharded by ``parallelize`` (units from the HF adapter, each block resharded after
    its forward), each rank training its own groups with ``train_group``, against one process training all of
    them (fp64). Every rank runs the same sequence of forwards (2 groups each), so nothing is held gathered:
    Phase A's interrupted last block and the gather before each prefix backward are exercised."""
    import copy

    import prefixflow as pf
    from prefixflow.integrations import hf
    from prefixflow.parallel import fsdp as pf_fsdp
    from prefixflow.parallel import parallelize

    model = hf.build_hf_model(
        "qwen3-tiny", dtype=torch.float64, seed=1, overrides={"tie_word_embeddings": tied}
    )
    pf.apply_prefixflow(model)
    if ac:
        pf.apply_ac(model, "full")  # HF's own non-reentrant gradient checkpointing, per decoder layer
    ref = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(2)
    groups = [
        pf.RolloutGroup(
            prompt=torch.randint(0, 256, (12 + 5 * i,), generator=gen),
            responses=[torch.randint(0, 256, (n,), generator=gen) for n in (5, 9, 3)],
            advantages=torch.randn(3, generator=gen, dtype=torch.float64),
        )
        for i in range(4)
    ]
    for group in groups:
        pf.train_group(ref, group, layout="packed", microbatch=1)
    parallelize(model, {"dp_shard": 2})
    for group in groups[dist.get_rank() :: 2]:
        pf.train_group(model, group, layout="padded", microbatch=2)
    got = {n: _full(p.grad) for n, p in model.named_parameters()}
    return {
        "grads": _rel(got, {n: p.grad for n, p in ref.named_parameters()}),
        "units": [n for n, _ in pf_fsdp._units(model)],
        "residue": pf_fsdp.fsdp_residue(model),
        "reduce_scatters": pf_fsdp.collective_counts(model)["reduce_scatter"],
    }


def _nonfinite(folder: Path) -> dict:
    """A non-finite loss on rank 0 only (old log-probs 1e4 below the current ones: ratio inf): both ranks refuse
    the micro-batch (NonFiniteError) and every gradient, the LM head's included, is as before (None)."""
    import support.trl_fixtures as F
    from prefixflow import NonFiniteError
    from prefixflow.parallel import fsdp as pf_fsdp

    tr = F.trainer(folder, prefixflow_parallel={"dp_shard": 2})
    inputs = F.micro_batch(tr)  # TRL's generation and log-prob forwards leave the LM head's unit gathered
    if dist.get_rank() == 0:
        inputs["old_per_token_logps"] = inputs["old_per_token_logps"] - 1e4
    try:
        tr._prefixflow_update(tr.model, inputs)
        raised = 0
    except NonFiniteError:
        raised = 1
    flag = torch.tensor([raised])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    left = [n for n, p in tr.model.named_parameters() if p.grad is not None]
    return {
        "raised_everywhere": bool(flag.item()),
        "grads_left": left,
        "residue": pf_fsdp.fsdp_residue(tr.model),
    }


def _foreign(folder: Path) -> str:
    """A model sharded with torch's own ``fully_shard`` (not PrefixFlow's units and hooks) is refused."""
    from torch.distributed.fsdp import fully_shard

    import prefixflow as pf
    import support.trl_fixtures as F

    model = pf.apply_prefixflow(F.model())
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    try:
        F.trainer(folder, model=model)
    except ValueError as exc:
        return str(exc)
    return "accepted"


def main(out: str) -> None:
    import trl.trainer.utils
    from trl import GRPOTrainer

    import support.trl_fixtures as F
    from prefixflow.integrations.trl import PrefixFlowGRPOTrainer
    from prefixflow.parallel import init_distributed

    init_distributed("cpu")  # accelerate then joins this process group
    results = {}
    tmp = Path(tempfile.mkdtemp())
    chunked = trl.trainer.utils._ChunkedLogProbFunction
    for name, options in CASES.items():
        # fp64: TRL's LM head in fp64 too (its chunked kernel accumulates in fp32)
        trl.trainer.utils._ChunkedLogProbFunction = F.PlainLogProbs if options.get("fp64") else chunked
        try:
            base = _step(GRPOTrainer, tmp / f"{name}-trl", options, sharded=False)
            again = (
                _step(GRPOTrainer, tmp / f"{name}-trl2", options, False) if options.get("rerun_trl") else None
            )
            pf = _step(PrefixFlowGRPOTrainer, tmp / f"{name}-pf", options, sharded=True)
            results[name] = {
                "world": pf["world"],
                "trl_deterministic": None if again is None else _rel(again["after"], base["after"]),
                "params": _rel(pf["after"], base["after"]),
                "grads": _rel(pf["grads"], base["grads"]),
                "grad_size": max(float(g.abs().max()) for g in base["grads"].values()),
                "trl_wrapper": base["wrapper"],
                "pf_wrapper": pf["wrapper"],
                "sharded": pf["sharded"],
                "n_params": pf["n_params"],
                "units": pf["units"],
                "reduce_scatters": pf["counts"],
                "residue": pf["residue"],
                "micro_batches": options.get("gradient_accumulation_steps", 1),
                "loss_diff": abs(pf["logged"]["loss"] - base["logged"]["loss"]),
                "grad_norm": pf["logged"]["grad_norm"],  # before clipping, over the gathered gradient
                "trl_grad_norm": base["logged"]["grad_norm"],
                "logged": sorted(k for k in pf["logged"] if k in base["logged"]),
                "trees": pf["logged"].get("prefixflow/trees"),
                "verified": pf["logged"].get("prefixflow/verify_max_rel_diff"),
                "saved": pf.get("saved"),
            }
        except Exception:  # noqa: BLE001 - reported to the test
            results[name] = {"error": traceback.format_exc()[-3000:]}
    trl.trainer.utils._ChunkedLogProbFunction = chunked
    for name, tied, ac in (("units-untied-ac", False, True), ("units-tied", True, False)):
        try:
            results[name] = _train_groups(tied, ac)
        except Exception:  # noqa: BLE001 - reported to the test
            results[name] = {"error": traceback.format_exc()[-3000:]}
    try:
        results["nonfinite"] = _nonfinite(tmp / "nonfinite")
    except Exception:  # noqa: BLE001 - reported to the test
        results["nonfinite"] = {"error": traceback.format_exc()[-3000:]}
    try:
        results["foreign"] = {"message": _foreign(tmp / "foreign")}
    except Exception:  # noqa: BLE001 - reported to the test
        results["foreign"] = {"error": traceback.format_exc()[-3000:]}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()  # no rank leaves while another is still in a collective
    dist.destroy_process_group()


def one_process() -> None:
    """The bf16 case on one process, TRL's trainer against PrefixFlowGRPOTrainer: bf16's own difference
    (``python tests/support/trl_fsdp_worker.py --one-process``, with ``tests`` on PYTHONPATH)."""
    from trl import GRPOTrainer

    from prefixflow.integrations.trl import PrefixFlowGRPOTrainer

    tmp = Path(tempfile.mkdtemp())
    for options in (CASES["bf16-verify"], CASES["dapo"]):
        options = {k: v for k, v in options.items() if k not in ("verify_first_step", "save", "rerun_trl")}
        base = _step(GRPOTrainer, tmp / "trl", options, sharded=False)
        pf = _step(PrefixFlowGRPOTrainer, tmp / "pf", options, sharded=False)
        print(
            options,
            "weights",
            _rel(pf["after"], base["after"]),
            "gradients",
            _rel(pf["grads"], base["grads"]),
        )


if __name__ == "__main__":
    one_process() if sys.argv[1] == "--one-process" else main(sys.argv[1])
