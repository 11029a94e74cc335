"""A GRPO rollout group (one prompt, N responses), its recorded MoE routing, and their validation."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree.rollout_tree import RolloutTree, check_inputs, check_loss_mask

__all__ = ["RolloutGroup", "RoutingMasks", "check_routing_masks", "synthetic_group"]


def _check_has_values(field: str, t: torch.Tensor) -> None:
    if t.device.type == "meta":
        raise ValueError(
            f"{field} is on the meta device (a shape without values); pass a materialised tensor"
        )


def _first_failing(tensors: list[torch.Tensor], holds) -> int | None:
    """The index of the first tensor for which ``holds(t)`` (a 0-d bool tensor) is false, or None. Tensors on
    one device are tested together first (one kernel and one host sync for a whole group; a group's
    responses are many small tensors); only a failure is then located tensor by tensor."""
    if not tensors:
        return None
    if len(tensors) > 1 and len({t.device for t in tensors}) == 1:
        if bool(holds(torch.cat([t.reshape(-1) for t in tensors]))):
            return None
    return next((i for i, t in enumerate(tensors) if not bool(holds(t))), None)


def _non_negative(t: torch.Tensor) -> torch.Tensor:
    return (t >= 0).all()


def _all_finite(t: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(t).all()


def _check_token_ids(fields: list[str], tensors: list[torch.Tensor]) -> None:
    bad = _first_failing(tensors, _non_negative)
    if bad is not None:
        raise ValueError(
            f"{fields[bad]} has negative token ids (min {int(tensors[bad].min())}); token ids must be >= 0"
        )


def _check_tokens(field: str, t) -> torch.Tensor:
    """Type, dtype, shape and emptiness of one token tensor (values: :func:`_check_token_ids`)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{field} must be a torch.LongTensor of token ids, got {type(t).__name__}")
    _check_has_values(field, t)
    if t.dtype in (torch.bool,) or t.dtype.is_floating_point or t.dtype.is_complex:
        raise TypeError(f"{field} must hold integer token ids, got dtype {t.dtype}; use tokens.long()")
    if t.dim() != 1:
        raise ValueError(f"{field} must be 1-D (a token sequence), got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError(f"{field} is empty; every prompt and response needs at least one token")
    return t.long()


@dataclass
class RoutingMasks:
    """A group's recorded MoE routing (Rollout Routing Replay, R3): top-k expert ids per MoE layer (in
    ``model.layers`` order). The rollout engine routes every token it feeds the model: the ``P`` prompt tokens
    once (stored beside the prefix KV cache, shared by the whole group) and, per response, every sampled
    token but the last (the last one is never fed back). Training replays exactly these expert ids.

    ``prefix``: LongTensor[n_moe_layers, P, k], the prompt's tokens, shared by all responses.
    ``suffixes``: one LongTensor[n_moe_layers, S_i - 1, k] per response: its tokens fed to the model
    (every response token but the last).
    """

    prefix: torch.Tensor
    suffixes: list[torch.Tensor]

    @property
    def n_layers(self) -> int:
        return int(self.prefix.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.prefix.shape[2])

    def to(self, device) -> RoutingMasks:
        return RoutingMasks(self.prefix.to(device), [s.to(device) for s in self.suffixes])

    def check_model(self, n_layers: int, num_experts: int, top_k: int) -> None:
        """Raise ValueError naming the field when the masks do not fit the model's MoE layers."""
        if self.n_layers != n_layers:
            raise ValueError(
                f"routing.prefix has masks for {self.n_layers} MoE layers; the model has {n_layers}"
            )
        if self.top_k != top_k:
            raise ValueError(f"routing masks choose top-{self.top_k} experts; the model routes top-{top_k}")
        for name, t in [("routing.prefix", self.prefix)] + [
            (f"routing.suffixes[{i}]", s) for i, s in enumerate(self.suffixes)
        ]:
            if t.numel() and int(t.max()) >= num_experts:
                raise ValueError(
                    f"{name} has expert id {int(t.max())} outside the model's experts [0, {num_experts})"
                )


def _check_mask(name: str, t, rows: int, layers: int | None, k: int | None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a LongTensor of expert ids, got {type(t).__name__}")
    if t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex:
        raise TypeError(f"{name} must hold integer expert ids, got dtype {t.dtype}")
    if t.device.type == "meta":
        raise ValueError(f"{name} is on the meta device (a shape without values); pass a materialised tensor")
    if t.dim() != 3:
        raise ValueError(f"{name} must be 3-D [n_moe_layers, tokens, top_k], got shape {tuple(t.shape)}")
    want = (layers if layers is not None else t.shape[0], rows, k if k is not None else t.shape[2])
    if tuple(t.shape) != want:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {want} (n_moe_layers, tokens, top_k)")
    if t.shape[0] < 1 or t.shape[2] < 1:
        raise ValueError(f"{name} needs at least one MoE layer and top_k >= 1, got shape {tuple(t.shape)}")
    if t.numel() and int(t.min()) < 0:
        raise ValueError(f"{name} has a negative expert id ({int(t.min())}); expert ids must be >= 0")
    if t.shape[2] > 1 and t.numel():
        ordered = t.sort(dim=-1).values
        if (ordered[..., 1:] == ordered[..., :-1]).any():
            raise ValueError(f"{name} routes a token to the same expert twice; top-k ids must be distinct")
    return t.long()


def check_routing_masks(routing, prompt_len: int, response_lens: list[int]) -> RoutingMasks:
    """Validate ``routing`` against the group's lengths; returns it with LongTensor masks."""
    if not isinstance(routing, RoutingMasks):
        raise TypeError(f"routing must be a prefixflow.RoutingMasks, got {type(routing).__name__}")
    prefix = _check_mask("routing.prefix", routing.prefix, prompt_len, None, None)
    suffixes = routing.suffixes
    if not isinstance(suffixes, (list, tuple)) or len(suffixes) != len(response_lens):
        raise ValueError(f"routing.suffixes must be a list of {len(response_lens)} masks, one per response")
    layers, k = prefix.shape[0], prefix.shape[2]
    checked = [
        _check_mask(f"routing.suffixes[{i}]", s, n - 1, layers, k)
        for i, (s, n) in enumerate(zip(suffixes, response_lens, strict=True))
    ]
    return RoutingMasks(prefix, checked)


@dataclass
class RolloutGroup:
    """One prompt and its N sampled responses, with per-response advantages.

    ``prompt``: LongTensor[P]; ``responses``: list of N LongTensor[S_i] (lengths may differ);
    ``advantages``: Tensor[N]; ``old_logprobs`` / ``ref_logprobs``: optional lists of N Tensor[S_i]
    (per-token log-probs of the responses under the sampling / reference policy). ``routing``: optional
    recorded MoE routing (:class:`prefixflow.RoutingMasks`: one prefix mask, per-response suffix masks) that
    both systems replay. ``loss_masks``: optional list of N bool Tensor[S_i], True where a response token
    carries loss (False e.g. on tool output); a group with masks trains as its tree (:meth:`as_tree`).
    ``prompt_inputs``: optional dict of the extra forward keywords a multimodal model's processor returns for
    the prompt alone (batch of one), named as the model names them (Qwen-VL: ``pixel_values``,
    ``image_grid_thw``, ``mm_token_type_ids``, ...; docs/multimodal.md); the model's adapter checks them.
    Validated on construction.
    """

    prompt: torch.Tensor
    responses: list[torch.Tensor]
    advantages: torch.Tensor
    old_logprobs: list[torch.Tensor] | None = None
    ref_logprobs: list[torch.Tensor] | None = None
    routing: RoutingMasks | None = None
    loss_masks: list[torch.Tensor] | None = None
    prompt_inputs: dict[str, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        self.prompt = _check_tokens("prompt", self.prompt)
        self.prompt_inputs = check_inputs("prompt_inputs", self.prompt_inputs)
        if isinstance(self.responses, torch.Tensor) or not isinstance(self.responses, (list, tuple)):
            raise TypeError("responses must be a list of 1-D LongTensors (one per response)")
        if len(self.responses) == 0:
            raise ValueError("responses is empty; a rollout group needs at least one response")
        names = [f"responses[{i}]" for i in range(len(self.responses))]
        self.responses = [_check_tokens(f, r) for f, r in zip(names, self.responses, strict=True)]
        _check_token_ids(["prompt", *names], [self.prompt, *self.responses])
        n = len(self.responses)
        adv = self.advantages
        if not isinstance(adv, torch.Tensor):
            try:
                adv = torch.as_tensor(adv)
            except (TypeError, ValueError, RuntimeError) as e:
                raise TypeError(f"advantages must be a real tensor of {n} numbers: {e}") from None
        _check_has_values("advantages", adv)
        if adv.dtype.is_complex or adv.dtype == torch.bool:
            raise TypeError(f"advantages must be real numbers, got dtype {adv.dtype}")
        if not adv.dtype.is_floating_point:
            adv = adv.double()
        if adv.shape != (n,):
            raise ValueError(f"advantages must have shape ({n},) (one per response), got {tuple(adv.shape)}")
        if not torch.isfinite(adv).all():
            raise ValueError("advantages must be finite (found NaN or inf)")
        self.advantages = adv
        for field in ("old_logprobs", "ref_logprobs"):
            value = getattr(self, field)
            if value is None:
                continue
            if not isinstance(value, (list, tuple)) or len(value) != n:
                raise ValueError(f"{field} must be a list of {n} tensors, one per response")
            checked = []
            for i, (lp, resp) in enumerate(zip(value, self.responses, strict=True)):
                if not isinstance(lp, torch.Tensor) or not lp.dtype.is_floating_point:
                    raise TypeError(f"{field}[{i}] must be a real floating tensor of per-token log-probs")
                _check_has_values(f"{field}[{i}]", lp)
                if lp.shape != resp.shape:
                    raise ValueError(
                        f"{field}[{i}] has shape {tuple(lp.shape)} but responses[{i}] has {tuple(resp.shape)}"
                    )
                checked.append(lp)
            bad = _first_failing(checked, _all_finite)
            if bad is not None:
                raise ValueError(f"{field}[{bad}] must be finite (found NaN or inf)")
            setattr(self, field, checked)
        if self.routing is not None:
            self.routing = check_routing_masks(self.routing, self.prompt_len, self.response_lens)
        if self.loss_masks is not None:
            if not isinstance(self.loss_masks, (list, tuple)) or len(self.loss_masks) != n:
                raise ValueError(f"loss_masks must be a list of {n} bool tensors, one per response")
            self.loss_masks = [
                check_loss_mask(f"loss_masks[{i}]", m, len_i, first_trainable=True)
                for i, (m, len_i) in enumerate(zip(self.loss_masks, self.response_lens, strict=True))
            ]

    @property
    def n(self) -> int:
        return len(self.responses)

    @property
    def prompt_len(self) -> int:
        return int(self.prompt.numel())

    @property
    def response_lens(self) -> list[int]:
        return [int(r.numel()) for r in self.responses]

    @property
    def path_lens(self) -> list[int]:
        """Each full sequence's length ``|P| + |S_i|`` (as ``RolloutTree.path_lens``)."""
        p = self.prompt_len
        return [p + n for n in self.response_lens]

    def check_representable(self, dtype: torch.dtype) -> None:
        """Raise ValueError naming the field if a value becomes NaN/inf once cast to ``dtype`` (the loss's
        compute dtype): advantages of 1e308 are finite in fp64 but overflow fp32."""
        fields = [("advantages", self.advantages)]
        for name in ("old_logprobs", "ref_logprobs"):
            fields += [(f"{name}[{i}]", t) for i, t in enumerate(getattr(self, name) or [])]
        bad = _first_failing([t for _, t in fields], lambda t: torch.isfinite(t.to(dtype)).all())
        if bad is not None:
            field, t = fields[bad]
            i = int((~torch.isfinite(t.to(dtype))).flatten().nonzero()[0])
            raise ValueError(
                f"{field} holds {float(t.flatten()[i])!r} (index {i}), which overflows {dtype}, the loss's "
                "compute dtype; rescale it"
            )

    def check_fits(self, vocab_size: int, max_seq_len: int, field: str = "max_seq_len") -> None:
        """Raise ValueError if a token id is outside the vocabulary or a sequence exceeds ``max_seq_len`` (the
        model's config ``field``: TorchTitan's ``max_seq_len``, HF's ``max_position_embeddings``)."""
        tokens = [self.prompt, *self.responses]
        bad = _first_failing(tokens, lambda t: t.max() < vocab_size)
        if bad is not None:
            field = "prompt" if bad == 0 else f"responses[{bad - 1}]"
            raise ValueError(
                f"{field} has token id {int(tokens[bad].max())} outside the model's vocabulary [0, {vocab_size})"
            )
        longest = self.prompt_len + max(self.response_lens)
        if longest > max_seq_len:
            raise ValueError(
                f"prompt ({self.prompt_len}) + longest response ({max(self.response_lens)}) = {longest} tokens "
                f"exceeds the model's {field}={max_seq_len}; shorten them or build the model with "
                f"overrides={{'{field}': {longest}}}"
            )

    def to(self, device) -> RolloutGroup:
        def move(xs):
            return None if xs is None else [x.to(device) for x in xs]

        return RolloutGroup(
            self.prompt.to(device),
            move(self.responses),
            self.advantages.to(device),
            move(self.old_logprobs),
            move(self.ref_logprobs),
            None if self.routing is None else self.routing.to(device),
            move(self.loss_masks),
            None if self.prompt_inputs is None else {k: v.to(device) for k, v in self.prompt_inputs.items()},
        )

    def as_tree(self) -> RolloutTree:
        """This group as a depth-1 :class:`~prefixflow.RolloutTree`: the prompt is the root, each response a
        child and a path; the loss masks (all response tokens when None) cover the responses only."""
        if self.routing is not None:
            raise ValueError(
                "RolloutGroup.as_tree does not carry MoE routing masks; trees do not replay them yet"
            )
        p = self.prompt_len
        masks = self.loss_masks or [torch.ones(n, dtype=torch.bool) for n in self.response_lens]
        masks = [torch.cat([torch.zeros(p, dtype=torch.bool, device=m.device), m]) for m in masks]

        def padded(values):
            if values is None:
                return None
            return [torch.cat([v.new_zeros(p), v]) for v in values]

        return RolloutTree(
            [self.prompt, *self.responses], [-1] + [0] * self.n, list(range(1, self.n + 1)), self.advantages,
            masks, padded(self.old_logprobs), padded(self.ref_logprobs),
            path_inputs=None if self.prompt_inputs is None else [self.prompt_inputs] * self.n,
        )  # fmt: skip


def synthetic_group(
    vocab_size: int,
    prompt_len: int,
    response_lens: list[int],
    *,
    seed: int = 0,
    with_logprobs: bool = False,
) -> RolloutGroup:
    """A deterministic random group (token ids, standardised advantages) for tests and benchmarks.

    ``with_logprobs`` adds old/ref per-token log-probs near a uniform policy, for ``loss="grpo"``.
    """
    if prompt_len < 1 or not response_lens or min(response_lens) < 1:
        raise ValueError("synthetic_group needs prompt_len >= 1 and at least one response of length >= 1")
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab_size, (prompt_len,), generator=gen)
    responses = [torch.randint(0, vocab_size, (n,), generator=gen) for n in response_lens]
    adv = torch.randn(len(response_lens), generator=gen, dtype=torch.float64)
    if len(response_lens) > 1:
        adv = (adv - adv.mean()) / (adv.std() + 1e-6)
    old = ref = None
    if with_logprobs:
        base = -float(torch.log(torch.tensor(float(vocab_size))))
        old = [base + 0.1 * torch.randn(n, generator=gen, dtype=torch.float64) for n in response_lens]
        ref = [base + 0.1 * torch.randn(n, generator=gen, dtype=torch.float64) for n in response_lens]
    return RolloutGroup(prompt, responses, adv, old, ref)
