"""Every ``loss_type`` TRL 1.16 accepts, against TRL's own ``_compute_loss -> backward`` on one micro-batch.

The micro-batch is TRL's (``_prepare_inputs``: left-padded prompts, completions of different lengths), with
off-policy old log-probs and reference log-probs injected so the clip, the soft gate, the gamma weights, the
KL and the off-policy mask are all active. fp32 (TRL's LM head as shipped) to 1e-5; fp64 with HF's norms in
fp64 and TRL's LM-head kernel (an fp32 online softmax) replaced by a plain fp64 one, to 1e-9.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

import support.trl_fixtures as F  # noqa: E402
from support.reference import max_rel_diff  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from prefixflow.integrations.trl import SUPPORTED_LOSS_TYPES  # noqa: E402

CASES = {
    "grpo": dict(loss_type="grpo", beta=0.04, epsilon_high=0.28),
    "bnpo": dict(loss_type="bnpo", epsilon=0.1),
    "dr_grpo": dict(loss_type="dr_grpo", beta=0.1, delta=1.2),
    "dapo": dict(loss_type="dapo", epsilon_high=0.28),
    "cispo": dict(loss_type="cispo", epsilon_high=1.1, beta=0.04),
    "sapo": dict(loss_type="sapo", sapo_temperature_pos=0.8, sapo_temperature_neg=1.3),
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence", beta=0.04),
    "luspo-token": dict(loss_type="luspo"),
    "vespo": dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_neg=2.5),
    "grpo-offpolicy-mask": dict(loss_type="grpo", off_policy_mask_threshold=0.0),
    "dapo-offpolicy-mask-sequence": dict(
        loss_type="dapo", off_policy_mask_threshold=0.02, importance_sampling_level="sequence"
    ),
    "sapo-packed-mb1": dict(loss_type="sapo", prefixflow_layout="packed", prefixflow_microbatch=1),
}


def test_every_trl_loss_type_is_covered():
    """GRPOConfig's list of loss types (its help text) is exactly what PrefixFlow supports and tests here."""
    help_text = GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    listed = help_text.split("Supported values are ")[1].split(". ")[0].rstrip(".")
    trl_types = {t.strip(" '") for t in listed.replace(" and ", ", ").split(",")} - {""}
    assert trl_types == set(SUPPORTED_LOSS_TYPES)
    assert trl_types <= {c["loss_type"] for c in CASES.values()}


def _run(tmp_path, case, dtype):
    options = dict(CASES[case])
    beta = options.pop("beta", 0.0)
    model = F.model("qwen3" if "packed" not in case else "llama", dtype=dtype)
    if dtype == torch.float64:
        F.fp64_norms(model)
    tr = F.trainer(tmp_path, model=model, **options)
    inputs = F.micro_batch(tr)
    tr.beta = beta  # its reference log-probs are injected, so no reference model is needed
    assert len(set(inputs["completion_mask"].sum(-1).tolist())) > 1, "completions should differ in length"
    return tr, inputs, F.trl_and_prefixflow_grads(tr, inputs)


@pytest.mark.parametrize("case", sorted(CASES))
def test_loss_type_gradients_equal_trl_fp32(tmp_path, case):
    tr, inputs, (want_loss, want, got_loss, got) = _run(tmp_path, case, torch.float32)
    assert got_loss == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    assert max(float(w.abs().max()) for w in want) > 1e-4  # the gradient is not trivially zero
    assert max_rel_diff(got, want) <= 1e-5
    if "offpolicy" in case:  # the mask really drops a completion, and PrefixFlow drops the same one
        with torch.no_grad():
            logps, _, _ = tr._get_per_token_logps_and_entropies(
                tr.model,
                torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
                torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1),
                inputs["completion_ids"].shape[1],
            )
        keep = tr.get_off_policy_mask(
            inputs["advantages"].unsqueeze(1), logps, inputs["old_per_token_logps"],
            inputs["completion_mask"], tr.off_policy_mask_threshold,
        )  # fmt: skip
        assert 0 < int(keep.sum()) < keep.numel()


@pytest.mark.parametrize("case", ["grpo", "cispo", "sapo", "luspo", "vespo", "grpo-offpolicy-mask"])
def test_loss_type_gradients_equal_trl_fp64(tmp_path, monkeypatch, case):
    """fp64 weights, HF norms in fp64, TRL's LM head in fp64 (its kernel's fp32 softmax replaced)."""
    F.fp64_trl(monkeypatch)
    _, _, (want_loss, want, got_loss, got) = _run(tmp_path, case, torch.float64)
    assert got_loss == pytest.approx(want_loss, rel=1e-9, abs=1e-12)
    assert max_rel_diff(got, want) <= 1e-9


def test_a_wrong_policy_term_is_caught(tmp_path, monkeypatch):
    """Negative control: SAPO's gate with TRL's temperatures swapped moves the gradient far past 1e-5."""
    import prefixflow.loss as L

    real = L._policy_term

    def swapped(cfg, *args):
        cfg = L.LossConfig(
            **{**cfg.__dict__, "sapo_tau_pos": cfg.sapo_tau_neg, "sapo_tau_neg": cfg.sapo_tau_pos}
        )
        return real(cfg, *args)

    monkeypatch.setattr(L, "_policy_term", swapped)
    _, _, (_, want, _, got) = _run(tmp_path, "sapo", torch.float32)
    assert max_rel_diff(got, want) > 1e-3


@pytest.mark.parametrize("family", ["gemma3", "phi3", "olmo2"])
def test_more_families_equal_trl(tmp_path, family):
    """Model families beyond Llama/Qwen under TRL (Gemma-3, Phi-3, OLMo-2), tool rollouts through a tree, fp32."""
    tr = F.trainer(tmp_path, model=F.model(family), loss_type="dapo", rollout_func=F.multi_turn_rollout)
    inputs = F.micro_batch(tr)
    want_loss, want, got_loss, got = F.trl_and_prefixflow_grads(tr, inputs)
    assert got_loss == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    assert max_rel_diff(got, want) <= 1e-5
