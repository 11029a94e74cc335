"""The 4-rank worker of ``test_verl_ulysses.py``: verl's engine at SP=1 (DP4) against PrefixFlow's at Ulysses SP=2
(DP2 x SP2) on the same global batch, in one gloo launch (``torch.multiprocessing.spawn``).

verl's own Ulysses lives in its flash-attention forward: with SDPA on a CPU it does no all-to-all, so verl at SP=2
is no reference here. verl dispatches a mini-batch by DP rank: at DP4 rank ``r`` holds chunk ``r`` of the
(interleaved) batch, at DP2 x SP2 DP rank ``d = r // 2`` holds chunks ``2d, 2d+1`` and both of its SP ranks hold
the same rows. verl's trainer collects outputs from SP rank 0 only (``is_collect``).
"""

from __future__ import annotations

import numpy as np
import torch
import verl_cpu as vc

ORDER = np.array([0, 4, 1, 5, 2, 6, 3, 7])  # rows interleaved: every chunk holds both uids


def _gathered(value, collect: bool) -> list:
    """Every collecting rank's ``value``, in rank order, on every rank."""
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, (collect, value))
    return [v for c, v in every if c]


def _infer(rank: int, world: int, model_dir: str, proto, sp: int) -> dict:
    """``infer_batch`` with entropy (verl's old-log-prob call): verl at DP4 against PrefixFlow at DP2 x SP2 with
    one micro-batch of the DP rank's 4 rows, whose packed sequences straddle verl's SP slice boundary."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    from prefixflow.integrations.verl import VENDOR

    out = {}
    per = len(ORDER) // world
    for name, vendor, size, rows in (
        ("want", None, 1, ORDER[rank * per : (rank + 1) * per]),
        ("got", VENDOR, sp, ORDER[(rank // sp) * per * sp : (rank // sp + 1) * per * sp]),
    ):
        engine = vc.build_engine(
            model_dir, vendor=vendor, use_remove_padding=True, ulysses_sequence_parallel_size=size
        )
        td = vc.engine_batch(proto[rows], micro_batch_size=len(rows), use_remove_padding=True)
        tu.assign_non_tensor(td, calculate_entropy=True)
        with engine.eval_mode():
            output = engine.infer_batch(td)["model_output"]
        mask = td["response_mask"].bool()
        out[name] = {
            key: no_padding_2_padding(output[key], td)[mask].detach().clone()
            for key in ("log_probs", "entropy")
        }
        out[name]["rows"] = rows.tolist()
    return {"infer": _gathered(out, True)}


def ulysses_worker(
    rank: int, world: int, port: int, model_dir: str, cases: list[dict], out_path: str
) -> None:
    from prefixflow.integrations.verl import VENDOR

    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        proto = vc.grpo_batch(uids=("a", "b"), seed=4)
        per_dp4, sp = len(ORDER) // world, 2
        per_dp2 = len(ORDER) // (world // sp)
        results = []
        for case in cases:
            actor = vc.actor_config(**case["actor"])
            kw = dict(
                micro_batch_size=2,
                global_batch_size=len(ORDER),
                use_remove_padding=True,
                **case.get("kw", {}),
            )
            dp4 = proto[ORDER[rank * per_dp4 : (rank + 1) * per_dp4]]
            want, out_want = vc.train_once(model_dir, None, actor, dp4, **kw)
            d = rank // sp
            dp2 = proto[ORDER[d * per_dp2 : (d + 1) * per_dp2]]
            got, out_got = vc.train_once(
                model_dir, VENDOR, actor, dp2, ulysses_sequence_parallel_size=sp, **kw
            )
            results.append(
                {
                    "want": want,
                    "got": got,
                    "loss": (_gathered(out_want["loss"], True), _gathered(out_got["loss"], rank % sp == 0)),
                    "metrics": (
                        _gathered(vc.metric_values(out_want), True),
                        _gathered(vc.metric_values(out_got), rank % sp == 0),
                    ),
                    "sp_ranks_agree": _gathered(out_got["loss"], True),
                }
            )
        results.append(_infer(rank, world, model_dir, proto, sp))
        if rank == 0:
            torch.save(results, out_path)
    finally:
        torch.distributed.destroy_process_group()
