"""The PrefixGrouper peer (PyPI ``prefix_grouper`` on our TorchTitan model) equals our baseline in fp64."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY, tiny_model
from support.reference import max_rel_diff

import prefixflow as pf
from harness.peers.prefix_grouper import grouped_attention_func, train_group_prefix_grouper

TOL = 1e-12  # measured ~1e-15: nothing in PrefixGrouper drops below fp64


def grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


class Recorder:
    def __init__(self):
        self.calls = []

    def enter(self, phase):
        self.calls.append(("enter", phase))

    def exit(self, phase):
        self.calls.append(("exit", phase))


@pytest.mark.parametrize("loss", ["pg", "grpo"])
@pytest.mark.parametrize("family", sorted(TINY))
def test_loss_and_gradients_equal_baseline(family, loss):
    model = tiny_model(family)
    # Unequal lengths (padding inside PrefixGrouper) and a one-token response (empty suffix input).
    group = pf.synthetic_group(97, 12, [6, 1, 9, 4], seed=7, with_logprobs=True)
    model.zero_grad(set_to_none=True)
    base = pf.train_group(model, group, system="baseline", loss=loss)
    want = grads(model)
    model.zero_grad(set_to_none=True)
    observer = Recorder()
    stats = train_group_prefix_grouper(model, group, loss=loss, observer=observer)
    assert abs(stats.loss - base.loss) <= TOL * max(1.0, abs(base.loss))
    assert max_rel_diff(grads(model), want) <= TOL
    assert observer.calls == [("enter", "full"), ("exit", "full")]
    assert set(stats.phase_times) == {"full"} and stats.system == "prefix_grouper"
    assert stats.trunk_tokens == 12 + sum(group.response_lens) - 4
    assert stats.suffix_tokens == sum(group.response_lens)
    assert model._prefixflow.state.mode is None


def test_matches_baseline_under_activation_checkpointing():
    """The mode stays active through backward, so AC recomputation attends the same way."""
    model = tiny_model("llama3", ac="full")
    group = pf.synthetic_group(97, 10, [5, 3, 7], seed=3)
    model.zero_grad(set_to_none=True)
    base = pf.train_group(model, group, system="baseline")
    want = grads(model)
    model.zero_grad(set_to_none=True)
    stats = train_group_prefix_grouper(model, group)
    assert abs(stats.loss - base.loss) <= TOL * max(1.0, abs(base.loss))
    assert max_rel_diff(grads(model), want) <= TOL


def test_attention_func_is_bottom_right_causal():
    """Suffix queries are the last Lq positions of the keys; a top-left mask would hide the prefix."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 3, 4, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 2, 5, 4, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 2, 5, 4, generator=gen, dtype=torch.float64)
    key_mask = torch.tensor([[True, True, True, True, False]])
    out = grouped_attention_func(q, k, v, key_mask)
    assert out.shape == (1, 3, 2, 4)
    for i in range(3):  # query i sees keys 0 .. 2 + i that are not padding
        keys = [j for j in range(2 + i + 1) if key_mask[0, j]]
        scores = torch.einsum("hd,hnd->hn", q[0, :, i], k[0][:, keys]) / 2.0
        want = torch.einsum("hn,hnd->hd", torch.softmax(scores, -1), v[0][:, keys])
        torch.testing.assert_close(out[0, i], want, rtol=1e-12, atol=1e-12)


def test_needs_prefixflow_wrapper():
    name, overrides = TINY["llama3"]
    model = pf.build_model(name, dtype=torch.float64, overrides=overrides)
    with pytest.raises(ValueError, match="apply_prefixflow"):
        train_group_prefix_grouper(model, pf.synthetic_group(97, 4, [2, 3]))


def test_prefix_call_is_causal_and_runs_under_the_backend_list(monkeypatch):
    """The prefix call is plain causal SDPA (no boolean mask); suffix calls carry the bottom-right mask; both
    under the model's sdpa_kernel list."""
    from torch.nn.attention import SDPBackend

    import harness.peers.prefix_grouper as peer

    model = tiny_model("llama3")
    for wrapper in model._prefixflow.state.wrappers:
        wrapper.inner.sdpa_backends = [SDPBackend.MATH]
    calls = []
    real = peer.F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        calls.append(
            (q.shape[2], k.shape[2], kwargs.get("is_causal", False), kwargs.get("attn_mask") is None)
        )
        calls[-1] += (torch.backends.cuda.flash_sdp_enabled(),)
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(peer.F, "scaled_dot_product_attention", spy)
    group = pf.synthetic_group(97, 12, [6, 3, 9], seed=7)
    train_group_prefix_grouper(model, group)
    prefix = [c for c in calls if c[0] == c[1] == 12]
    suffix = [c for c in calls if c[0] != c[1]]
    assert len(prefix) == len(suffix) == 2  # one of each per layer
    assert all(c[2] and c[3] for c in prefix) and not any(c[2] or c[3] for c in suffix)
    assert not any(c[4] for c in calls)
