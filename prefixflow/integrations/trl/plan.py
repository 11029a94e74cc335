"""A TRL micro-batch as PrefixFlow work: flat groups (one per prompt) or one prefix tree, with TRL's loss.

For each micro-batch ``_prepare_inputs`` hands to ``training_step`` (``B`` completions, ``M`` the trained-token
mask ``completion_mask x tool_mask``, ``T = sum M``, ``GA`` = ``current_gradient_accumulation_steps``), the
gradient PrefixFlow adds to ``param.grad`` is that of ``GRPOTrainer._compute_loss``'s loss for the same
micro-batch, with TRL's per-token policy term (:data:`POLICY`) plus ``beta KL`` and TRL's normalisers:

- ``grpo``, ``sapo``: ``(1/(B GA)) sum_b mean_{t in M_b} l``   -> ``seq-mean-token-mean``, N = B, x 1/GA;
- ``bnpo``: ``sum l / (T GA)``                                 -> ``token-mean`` over T, x 1/GA;
- ``dr_grpo``: ``sum l / (B L_max GA)``                        -> ``seq-mean-token-sum-norm`` (``L_max`` =
  ``max_completion_length``), N = B, x 1/GA;
- ``luspo``: ``(1/(B GA)) sum_b sum_{t in M_b} l``             -> ``seq-mean-token-sum``, N = B, x 1/GA;
- ``dapo``, ``cispo``, ``vespo``: ``sum l / (items/processes x GA/steps_per_generation)`` -> ``token-sum`` x 1/that.

The normalisers are the whole micro-batch's, so any split into groups or a tree gives the same objective.
Completions with no trained token (``mask_truncated_completions``, all tool output) count in ``B`` and add
nothing, as in TRL. Tokens with ``tool_mask`` 0 are context, never trained (``RolloutGroup.loss_masks``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import RolloutGroup, build_tree
from ...loss import LossConfig
from ...tree.rollout_tree import RolloutTree
from .vision import inputs_key

__all__ = [
    "SUPPORTED_LOSS_TYPES",
    "POLICY",
    "TrainingUnit",
    "plan_groups",
    "TREE_MIN_SHARED",
    "check_min_shared_tokens",
    "check_positions",
    "reused_tokens",
]

# TRL loss_type -> PrefixFlow LossConfig.policy; GRPOConfig's full list in TRL 1.16
POLICY = {
    "grpo": "clip",
    "bnpo": "clip",
    "dr_grpo": "clip",
    "dapo": "clip",
    "luspo": "clip",
    "cispo": "cispo",
    "sapo": "sapo",
    "vespo": "vespo",
}
SUPPORTED_LOSS_TYPES = tuple(POLICY)
# prefixflow_tree="auto" builds a tree when two different prompts share at least this many leading tokens
TREE_MIN_SHARED = 4


@dataclass
class TrainingUnit:
    """One unit a TRL micro-batch trains: its rows (a prompt's group, or the whole tree), as a group or tree, and its loss config."""

    rows: list[int]
    group: RolloutGroup | RolloutTree
    loss_config: LossConfig


def _normaliser(loss_type, inputs, *, rows, tokens, ga, max_completion_length, num_processes, spg):
    """(aggregation, norm_len, batch_size, batch_tokens, group_weight) reproducing TRL's normaliser."""
    if loss_type in ("grpo", "sapo"):
        return "seq-mean-token-mean", None, float(rows), None, 1.0 / ga
    if loss_type == "bnpo":
        return "token-mean", None, None, float(max(tokens, 1)), 1.0 / ga
    if loss_type == "dr_grpo":
        return "seq-mean-token-sum-norm", max_completion_length, float(rows), None, 1.0 / ga
    if loss_type == "luspo":
        return "seq-mean-token-sum", None, float(rows), None, 1.0 / ga
    if loss_type in ("dapo", "cispo", "vespo"):
        items = float(inputs["num_items_in_batch"].clamp(min=1.0))
        return "token-sum", None, None, None, 1.0 / (items / num_processes * ga / spg)
    raise ValueError(f"loss_type {loss_type!r} unsupported; PrefixFlow supports {SUPPORTED_LOSS_TYPES}")


def plan_groups(
    inputs: dict,
    *,
    loss_type: str,
    beta: float,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None,
    importance_sampling_level: str,
    use_bias_correction_kl: bool,
    temperature: float,
    max_completion_length: int,
    gradient_accumulation_steps: int,
    num_processes: int = 1,
    steps_per_generation: int = 1,
    policy_options: dict | None = None,
    tree: bool | str = "auto",
    min_shared_tokens: int | str = 1,
    row_inputs: list[dict] | None = None,
) -> list[TrainingUnit]:
    """Group a TRL micro-batch by prompt (or into one prefix tree) with the loss config reproducing TRL's.

    ``inputs``: what ``GRPOTrainer._prepare_inputs`` returns (``prompt_ids/mask`` left-padded,
    ``completion_ids/mask`` right-padded, optional ``tool_mask``, ``advantages`` ``[B]``, optional
    ``old_per_token_logps`` and ``ref_per_token_logps``). ``policy_options``: extra :class:`LossConfig` fields
    (sapo/vespo parameters, ``off_policy_threshold``). ``tree``: True = one tree (``build_tree``) over every
    prompt + completion; False = one flat group per prompt; ``"auto"`` = a tree when there are tool masks or
    different prompts share :data:`TREE_MIN_SHARED` leading tokens; ``min_shared_tokens``: the tree's
    (:func:`prefixflow.build_tree`; 2 on models with recurrent layers). Raises ``ValueError`` for what PrefixFlow
    cannot reproduce. ``row_inputs``: a VLM micro-batch's per-row prompt inputs (:func:`.vision.row_inputs`),
    each group's ``prompt_inputs`` (a tree's ``path_inputs``); rows share a group only if their token ids and
    their images agree.
    """
    for key in ("importance_sampling_ratio", "pixel_values"):
        if inputs.get(key) is not None and (key != "pixel_values" or row_inputs is None):
            raise ValueError(f"TRL input {key!r} is not supported by PrefixFlowGRPOTrainer")
    if tree not in (True, False, "auto"):
        raise ValueError(f"prefixflow_tree must be True, False or 'auto', got {tree!r}")
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"].bool()
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"].bool()
    tool_mask = inputs.get("tool_mask")
    advantages = inputs["advantages"]
    if advantages.dim() != 1:
        raise ValueError(f"advantages must be one value per completion, got shape {tuple(advantages.shape)}")
    old, ref = inputs.get("old_per_token_logps"), inputs.get("ref_per_token_logps") if beta != 0.0 else None
    lengths = completion_mask.sum(-1).tolist()
    trained = completion_mask if tool_mask is None else completion_mask & tool_mask.bool()
    b = len(lengths)
    prompts, masks, by_prompt = [], [], {}
    for row, n in enumerate(lengths):
        if not bool(completion_mask[row, :n].all()):
            raise ValueError(
                f"completion_mask row {row} has gaps; only right-padded completions are supported "
                "(mask tool output with tool_mask)"
            )
        prompts.append(tuple(prompt_ids[row][prompt_mask[row]].tolist()))
        masks.append(trained[row, :n])
        if bool(masks[row].any()):
            key = prompts[row] if row_inputs is None else (prompts[row], inputs_key(row_inputs[row]))
            by_prompt.setdefault(key, []).append(row)
    tokens = sum(int(m.sum()) for m in masks)
    aggregation, norm_len, batch_size, batch_tokens, weight = _normaliser(
        loss_type, inputs, rows=b, tokens=tokens, ga=gradient_accumulation_steps,
        max_completion_length=max_completion_length, num_processes=num_processes, spg=steps_per_generation,
    )  # fmt: skip
    options = dict(policy_options or {})
    if loss_type == "cispo":
        options["cispo_cap"] = epsilon_high
    config = LossConfig(
        clip_eps_low=epsilon_low,
        clip_eps_high=epsilon_high,
        kl_coef=beta,
        aggregation=aggregation,
        importance_sampling=importance_sampling_level,
        ratio_cap=delta if POLICY.get(loss_type) == "clip" else None,
        kl_ratio_correction=bool(use_bias_correction_kl) and beta != 0.0,
        temperature=temperature,
        norm_len=norm_len,
        group_weight=weight,
        batch_size=batch_size,
        batch_tokens=batch_tokens,
        policy=POLICY[loss_type],
        **options,
    )
    if not by_prompt:
        return []
    if tree == "auto":
        heads = [prompts[rows[0]] for rows in by_prompt.values()]
        tree = tool_mask is not None or _prompts_share(heads, TREE_MIN_SHARED)
    if tree:
        rows = [r for rs in by_prompt.values() for r in rs]
        tree = _tree(inputs, rows, prompts, masks, lengths, old, ref, min_shared_tokens, row_inputs)
        return [TrainingUnit(rows, tree, config)]
    plans = []
    for rows in by_prompt.values():
        group = RolloutGroup(
            prompt=torch.tensor(prompts[rows[0]], dtype=torch.long, device=prompt_ids.device),
            responses=[completion_ids[r, : lengths[r]] for r in rows],
            advantages=advantages[rows],
            old_logprobs=_per_row(old, rows, lengths),
            ref_logprobs=_per_row(ref, rows, lengths),
            loss_masks=None if tool_mask is None else [masks[r] for r in rows],
            prompt_inputs=None if row_inputs is None else row_inputs[rows[0]] or None,
        )
        plans.append(TrainingUnit(rows, group, config))
    return plans


def _prompts_share(prompts: list[tuple[int, ...]], k: int) -> bool:
    heads = [p[:k] for p in prompts if len(p) >= k]
    return len(set(heads)) < len(heads)


def _tree(inputs, rows, prompts, masks, lengths, old, ref, min_shared_tokens, row_inputs) -> RolloutTree:
    """Every trained row's prompt + completion as one trie; prompt tokens and tool output are never trained."""
    completion_ids = inputs["completion_ids"]
    device = completion_ids.device
    seqs, loss_masks = [], []
    for r in rows:
        prompt = torch.tensor(prompts[r], dtype=torch.long, device=device)
        seqs.append(torch.cat([prompt, completion_ids[r, : lengths[r]]]))
        loss_masks.append(
            torch.cat([torch.zeros(len(prompts[r]), dtype=torch.bool, device=device), masks[r]])
        )

    def whole(t):
        if t is None:
            return None
        return [torch.cat([t.new_zeros(len(prompts[r])), t[r, : lengths[r]]]) for r in rows]

    return build_tree(
        seqs, inputs["advantages"][rows], loss_masks, old_logprobs=whole(old), ref_logprobs=whole(ref),
        min_shared_tokens=min_shared_tokens,
        path_inputs=None if row_inputs is None else [row_inputs[r] or None for r in rows],
    )  # fmt: skip


def check_min_shared_tokens(value) -> None:
    """``prefixflow_min_shared_tokens``: an int >= 1 or ``"auto"`` (see :func:`prefixflow.build_tree`)."""
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"prefixflow_min_shared_tokens must be an int >= 1 or 'auto', got {value!r}")


def _per_row(t: torch.Tensor | None, rows: list[int], lengths: list[int]) -> list[torch.Tensor] | None:
    return None if t is None else [t[r, : lengths[r]] for r in rows]


def reused_tokens(plans: list[TrainingUnit]) -> int:
    """Tokens not recomputed: a flat group's prompt once per completion beyond the first; a tree's path tokens
    beyond its unique ones."""
    return sum(
        (p.group.n - 1) * (p.group.prompt_len - 1)
        if hasattr(p.group, "prompt")
        else sum(p.group.path_lens) - p.group.unique_tokens
        for p in plans
    )


def check_positions(model, inputs) -> None:
    """A prompt + completion longer than the model's ``max_position_embeddings``, named in HF's terms; from the
    micro-batch's masks, before any group or tree is built."""
    limit = int(model.config.get_text_config().max_position_embeddings)
    lengths = inputs["prompt_mask"].bool().sum(-1) + inputs["completion_mask"].bool().sum(-1)
    longest = int(lengths.max()) if lengths.numel() else 0
    if longest > limit:
        raise ValueError(
            f"a prompt + completion of {longest} tokens exceeds the model's config.max_position_embeddings="
            f"{limit}; lower GRPOConfig.max_completion_length or the prompt length, or raise "
            "config.max_position_embeddings"
        )
