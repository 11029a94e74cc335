"""verl 0.9.1's own FSDP engine vs PrefixFlow's, one ``train_batch`` each on the same data (CPU, fp32, one rank).

Runs in ``.venv-verl`` (``make test-verl``); skipped where verl is not installed (``make test``).
"""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("verl", minversion="0.9")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import verl_cpu as vc  # noqa: E402

model_dir = vc.model_dir  # the shared fixture

from prefixflow.integrations.verl import VENDOR, PrefixFlowFSDPEngine  # noqa: E402

GRAD_TOL = 1e-6  # |g - g_verl| / |g_verl| over all parameters
TENSOR_TOL = 2e-6  # the same per parameter tensor, worst (measured <= 8.2e-7)
MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")
KL_TYPES = ("low_var_kl", "kl", "abs", "mse")


@pytest.fixture(scope="module")
def proto():
    return vc.grpo_batch()


def assert_equal(result: dict) -> None:
    assert result["norm"] <= GRAD_TOL, result
    assert result["tensor"] <= TENSOR_TOL, result
    want, got = result["loss"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    want_m, got_m = result["metrics"]
    assert want_m.keys() == got_m.keys()
    for key in want_m:
        if key != "grad_norm":
            np.testing.assert_allclose(got_m[key], want_m[key], rtol=1e-5, atol=1e-6, err_msg=key)
    np.testing.assert_allclose(got_m["grad_norm"], want_m["grad_norm"], rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_loss_modes_equal_verl_with_dual_clip_binding(model_dir, proto, mode):
    result = vc.compare(model_dir, vc.actor_config(loss_agg_mode=mode), proto)
    assert_equal(result)
    metrics = result["metrics"][0]
    assert metrics["actor/pg_clipfrac_lower"] > 0  # verl's own count: the dual clip binds on some tokens
    assert metrics["actor/pg_clipfrac"] > 0


@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_kl_losses_equal_verl(model_dir, kl_type):
    actor = vc.actor_config(
        loss_agg_mode="seq-mean-token-mean", use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type=kl_type
    )
    result = vc.compare(model_dir, actor, vc.grpo_batch(seed=1, temperature=0.7))
    assert_equal(result)
    assert "kl_loss" in result["metrics"][1]


def test_uid_groups_split_across_micro_batches(model_dir):
    """Rows interleaved (a, b, a, b, ...) and micro-batches of 3: every micro-batch holds parts of both uids."""
    proto = vc.grpo_batch(uids=("a", "b", "c"), seed=2)
    order = np.array([0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11])
    proto = proto[order]
    actor = vc.actor_config(loss_agg_mode="seq-mean-token-mean", use_kl_loss=True, kl_loss_coef=0.1)
    assert_equal(vc.compare(model_dir, actor, proto, micro_batch_size=3, global_batch_size=12))


def test_local_normalisation_without_global_batch_size(model_dir, proto):
    """One rank and no global_batch_size: verl normalises the seq-mean modes per micro-batch."""
    actor = vc.actor_config(loss_agg_mode="seq-mean-token-sum")
    assert_equal(vc.compare(model_dir, actor, proto, micro_batch_size=2, global_batch_size=None))


def test_differing_prompts_fall_back_to_full_sequences(model_dir):
    proto = vc.grpo_batch(shared_prompts=False, seed=3)
    with pytest.warns(UserWarning, match="prompts differ"):
        result = vc.compare(model_dir, vc.actor_config(loss_agg_mode="token-mean"), proto)
    assert_equal(result)


def test_gradient_checkpointing(model_dir, proto):
    actor = vc.actor_config(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=4)
    assert_equal(vc.compare(model_dir, actor, proto, checkpointing=True))


def test_forward_only_is_verl_own(model_dir, proto):
    """Log-prob inference goes through verl's path unchanged: the same log-probs from both engines."""
    outs = []
    for vendor in (None, VENDOR):
        engine = vc.build_engine(model_dir, vendor=vendor)
        data = vc.engine_batch(proto, micro_batch_size=4)
        with engine.eval_mode():
            outs.append(engine.infer_batch(data)["model_output"]["log_probs"])
    torch.testing.assert_close(outs[1].values(), outs[0].values(), rtol=0, atol=0)


def test_selected_only_by_vendor(model_dir):
    assert type(vc.build_engine(model_dir)).__name__ == "FSDPEngineWithLMHead"
    assert type(vc.build_engine(model_dir, vendor=VENDOR)) is PrefixFlowFSDPEngine


# -- refusals -------------------------------------------------------------------------------------------------


def _train(model_dir, actor, proto, loss_function=None):
    from functools import partial

    from verl.workers.utils.losses import ppo_loss

    engine = vc.build_engine(model_dir, vendor=VENDOR)
    before = [p.detach().full_tensor().clone() for p in engine.module.parameters()]
    data = vc.engine_batch(proto, micro_batch_size=4, global_batch_size=8)
    try:
        with engine.train_mode():
            engine.train_batch(data, loss_function=loss_function or partial(ppo_loss, config=actor))
    finally:
        after = [p.detach().full_tensor() for p in engine.module.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), "weights changed"


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"entropy_coeff": 0.01}, "entropy_coeff"),
        ({"calculate_entropy": True}, "calculate_entropy"),
        ({"policy_loss": {"loss_mode": "gspo"}}, "loss_mode"),
        ({"use_kl_loss": True, "kl_loss_type": "k3+"}, "kl_loss_type"),
        ({"loss_scale_factor": 2.5}, "loss_scale_factor"),
    ],
)
def test_unsupported_loss_options_refused(model_dir, proto, overrides, match):
    from verl.workers.config import PolicyLossConfig

    if "policy_loss" in overrides:
        overrides = {**overrides, "policy_loss": PolicyLossConfig(**overrides["policy_loss"])}
    with pytest.raises(ValueError, match=match):
        _train(model_dir, vc.actor_config(**overrides), proto)


def test_other_loss_callable_refused_by_name(model_dir, proto):
    def my_loss(config, model_output, data, dp_group=None):
        raise AssertionError("never called")

    with pytest.raises(ValueError, match="my_loss"):
        _train(model_dir, vc.actor_config(), proto, loss_function=my_loss)


def test_token_masks_inside_responses_refused(model_dir):
    proto = vc.grpo_batch()
    proto.batch["response_mask"][0, 1] = 0
    with pytest.raises(ValueError, match="response_mask"):
        _train(model_dir, vc.actor_config(), proto)


@pytest.mark.parametrize(
    ("engine_kw", "match"),
    [
        ({"strategy": "fsdp"}, "strategy='fsdp'"),
        ({"use_fused_kernels": True}, "use_fused_kernels"),
    ],
)
def test_unsupported_engine_options_refused(model_dir, engine_kw, match):
    with pytest.raises(ValueError, match=match), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vc.build_engine(model_dir, vendor=VENDOR, **engine_kw)


DP_CASES = [
    {"actor": dict(loss_agg_mode="seq-mean-token-mean", use_kl_loss=True, kl_loss_coef=0.1)},
    {"actor": dict(loss_agg_mode="token-mean", use_kl_loss=True, kl_loss_coef=0.1)},
    # verl's defaults: remove-padding, dynamic batch size (a 20-token budget splits each rank's uid pieces)
    {
        "actor": dict(
            loss_agg_mode="token-mean", use_kl_loss=True, kl_loss_coef=0.001, kl_loss_type="low_var_kl"
        ),
        "kw": dict(use_remove_padding=True, max_token_len=20),
    },
]


def test_two_data_parallel_ranks(model_dir, tmp_path):
    """Two gloo ranks (one launch), FSDP2 sharded over both, each uid group spread over both ranks: verl's
    dp_size and global token/sequence counts, one reduce-scatter per unit with verl's own reduction; also under
    remove-padding and use_dynamic_bsz. Gradients within 1e-5 (max), metrics within 1e-5 relative."""
    import torch.multiprocessing as mp

    out = tmp_path / "grads.pt"
    mp.spawn(vc.dp_worker, args=(2, vc.free_port(), str(model_dir), DP_CASES, str(out)), nprocs=2)
    for case, saved in zip(DP_CASES, torch.load(out), strict=True):
        want, got = saved["want"], saved["got"]
        diff = torch.cat([(got[k] - want[k]).flatten() for k in want])
        assert float(diff.norm() / torch.cat([w.flatten() for w in want.values()]).norm()) <= GRAD_TOL, case
        worst = max(float((got[k] - want[k]).abs().max()) for k in want)
        assert worst / max(float(w.abs().max()) for w in want.values()) <= 1e-5, case
        np.testing.assert_allclose(saved["loss"][1], saved["loss"][0], rtol=1e-5, atol=1e-6)
        m_want, m_got = saved["metrics"]
        assert m_want.keys() == m_got.keys()
        for key in m_want:
            np.testing.assert_allclose(m_got[key], m_want[key], rtol=1e-5, atol=1e-7, err_msg=key)


def test_a_training_step_sequence_as_verl_runs_it(model_dir, proto):
    """What a verl step does to the actor: log-probs (forward only), then two updates (AdamW steps between):
    the second update's gradients still equal verl's, so nothing of PrefixFlow's or FSDP's state leaks."""
    from functools import partial

    from verl.workers.utils.losses import ppo_loss

    actor = vc.actor_config(loss_agg_mode="seq-mean-token-mean", use_kl_loss=True, kl_loss_coef=0.1)
    grads = {}
    for vendor in (None, VENDOR):
        engine = vc.build_engine(model_dir, vendor=vendor)
        seen = []
        step = engine.optimizer_step

        def snapshot_then_step(engine=engine, seen=seen, step=step):
            seen.append({n: p.grad.full_tensor().clone() for n, p in engine.module.named_parameters()})
            return step()

        engine.optimizer_step = snapshot_then_step
        with engine.eval_mode():
            engine.infer_batch(vc.engine_batch(proto, micro_batch_size=4))
        for _ in range(2):
            with engine.train_mode():
                engine.train_batch(
                    vc.engine_batch(proto, micro_batch_size=2, global_batch_size=8),
                    loss_function=partial(ppo_loss, config=actor),
                )
        grads[vendor] = seen[-1]
    want, got = grads[None], grads[VENDOR]
    diff = torch.cat([(got[k] - want[k]).flatten() for k in want])
    assert float(diff.norm() / torch.cat([w.flatten() for w in want.values()]).norm()) <= GRAD_TOL
