"""Pipeline parallelism (paper §4.6): PrefixFlow's phases run per stage, switched stage-locally.

The model is cut into stages with TorchTitan's ``pipeline_module_split`` (``apply_pp``). Each stage runs a
program of operations; activations and their gradients travel between neighbouring stages by P2P send/recv:

- ``A``: the prefix forward on this stage (capture mode). It starts as soon as the previous stage's prefix
  output arrives, and sends this stage's prefix output on.
- ``F m`` / ``B m``: the forward / backward of microbatch ``m`` in 1F1B order (``pp - stage - 1`` warm-up
  forwards, then one forward one backward, then the cool-down backwards). Suffix microbatches for PrefixFlow,
  ``[P || S_i]`` microbatches for the baseline; both use the same stage code.
- ``C``: the delayed prefix backward of this stage, seeded with its accumulated gK/gV and the gradient of its
  prefix output that the next stage's ``C`` sent back; it sends the gradient of its prefix input on. So the
  prefix backward runs in reverse stage order, each stage right after its own last suffix backward.

``switching="stage_local"`` is exactly that program. ``switching="barrier"`` adds global barriers after ``A``
and before ``C`` (A | B | C): the pipeline drains after the prefix forward and refills around the prefix
backward. Both run the same operations on the same data; only the waiting differs. :func:`stage_program` is
the one definition of both orders (the simulator in ``harness/simulate.py`` replays it).

Why not ``torch.distributed.pipelining``'s schedules: they run one stage function over equal-shaped chunks of
one batch and seed every backward with the stage output's gradient alone. PrefixFlow's prefix is another
computation (capture mode, ``[1, P-1]`` tokens), its backward is seeded by gK/gV accumulated inside the stage
and must wait for that stage's last suffix backward, and padded widths, packed lengths and CP shards differ
per microbatch. So the stage program is written here over ``torch.distributed`` P2P (gloo and NCCL), with a
small shape header before each tensor; the split itself is TorchTitan's.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..apply import runtime_of
from ..attention import AttendWithPrefix, CapturePrefix, MaskedAttention, PrefixCaptured
from ..hooks import hooks_of
from ..kv_cache import PrefixKVCache
from ..layouts import build_microbatch, full_sequence_segments, prefix_microbatch, suffix_segments
from ..loss import microbatch_loss, resolve_loss, token_logprobs
from ..models import rope_buffer

__all__ = ["SWITCHING", "Pipeline", "apply_pp", "stage_program", "stage_hidden", "switching"]

SWITCHING = ("stage_local", "barrier")
_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
_FWD, _BWD = 0, 1  # P2P tags: activations flow down, gradients flow up


def stage_program(
    switching: str, n_stages: int, stage: int, n_microbatches: int, prefix: bool
) -> list[tuple]:
    """The ordered operations of one stage: ``("A",)``, ``("F", m)``, ``("B", m)``, ``("C",)``, ``("barrier",)``."""
    if switching not in SWITCHING:
        raise ValueError(f"switching {switching!r} unknown; valid: {SWITCHING}")
    ops: list[tuple] = []
    if prefix:
        ops.append(("A",))
        if switching == "barrier":
            ops.append(("barrier",))
    warmup = min(n_stages - stage - 1, n_microbatches)
    ops += [("F", m) for m in range(warmup)]
    for m in range(warmup, n_microbatches):
        ops += [("F", m), ("B", m - warmup)]
    ops += [("B", m) for m in range(n_microbatches - warmup, n_microbatches)]
    if prefix:
        if switching == "barrier":
            ops.append(("barrier",))
        ops.append(("C",))
    return ops


def stage_hidden(model: nn.Module, inputs: torch.Tensor, positions, *, final_norm: bool = True):
    """A TorchTitan stage's forward without the LM head: embeddings on the first stage (else ``inputs`` are the
    previous stage's hidden states), this stage's blocks, the final norm on the last stage."""
    h = model.tok_embeddings(inputs) if model.tok_embeddings is not None else inputs
    rope = rope_buffer(model)
    for block in model.layers.values():
        h = block(h, rope, None, positions)
    return model.norm(h) if final_norm and model.norm is not None else h


@dataclass
class Pipeline:
    """What ``apply_pp`` attaches to a stage model: its place in the pipeline and the last group's timeline."""

    stage: int
    n_stages: int
    group: dist.ProcessGroup
    switching: str = "stage_local"
    timeline: list[dict] = field(default_factory=list)  # this stage's events of the last group
    timelines: list[list[dict]] = field(default_factory=list)  # every stage's, gathered after the group

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.n_stages - 1

    def peer(self, offset: int) -> int:
        return dist.get_global_rank(self.group, self.stage + offset)

    def train_group(self, model, group, **kwargs):
        return _StageSchedule(model, self).run(group, **kwargs)


class _P2P:
    """Tensor send/recv between neighbouring stages; each tensor is preceded by a small shape header."""

    def __init__(self, pipe: Pipeline, device: torch.device) -> None:
        self.pipe, self.device = pipe, device
        self.pending: list[tuple] = []  # (work, tensor) of sends still in flight

    def send(self, t: torch.Tensor, offset: int, tag: int) -> None:
        t = t.detach().contiguous()
        header = torch.zeros(8, dtype=torch.long, device=self.device)
        header[0], header[1] = t.dim(), _DTYPES.index(t.dtype)
        header[2 : 2 + t.dim()] = torch.tensor(t.shape)
        dst = self.pipe.peer(offset)
        for x in (header, t):
            self.pending.append((dist.isend(x, dst, group=self.pipe.group, tag=tag), x))

    def recv(self, offset: int, tag: int) -> torch.Tensor:
        src = self.pipe.peer(offset)
        header = torch.empty(8, dtype=torch.long, device=self.device)
        dist.recv(header, src, group=self.pipe.group, tag=tag)
        ndim, dtype = int(header[0]), _DTYPES[int(header[1])]
        t = torch.empty(header[2 : 2 + ndim].tolist(), dtype=dtype, device=self.device)
        dist.recv(t, src, group=self.pipe.group, tag=tag)
        return t

    def flush(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


class _StageSchedule:
    """One group on one stage: runs :func:`stage_program` and records each operation's timeline."""

    def __init__(self, model: nn.Module, pipe: Pipeline) -> None:
        self.model, self.pipe = model, pipe
        self.runtime = runtime_of(model)
        self.device = next(model.parameters()).device
        self.hooks = hooks_of(model)

    def run(self, group, *, system, layout, microbatch, loss, loss_config=None, observer=None):
        from ..schedule import GroupStats, _chunks, _trunk_tokens, _validate

        _validate(self.model, group, system, layout, microbatch)
        if microbatch == "auto":
            raise ValueError("microbatch='auto' is not supported under pipeline parallelism; pass an int")
        if self.runtime.config.offload:
            raise ValueError(
                "PrefixFlowConfig.offload is not supported under pipeline parallelism; set it False"
            )
        self.cfg, self.loss = resolve_loss(loss, loss_config, group), loss
        group = group.to(self.device)
        chunks = _chunks(group.n, microbatch)
        prefix = system == "prefixflow" and group.prompt_len > 1
        self.p2p, self.events, self.saved, self.total = _P2P(self.pipe, self.device), [], {}, 0.0
        self.group = group
        self.cache = PrefixKVCache(self.runtime.grad_kv_dtype(self.model)) if system == "prefixflow" else None
        program = stage_program(self.pipe.switching, self.pipe.n_stages, self.pipe.stage, len(chunks), prefix)
        phase_times: dict[str, float] = {}
        try:
            with self.hooks.group(self.model, group, system):
                if self.cache is not None:
                    self.cache.view = self.hooks.prefix_view(self.model, group) or self.cache.view
                if system == "prefixflow":
                    segs = suffix_segments(group)
                    cached = group.prompt_len - 1
                else:
                    segs, cached = full_sequence_segments(group), None
                self.mbs = [
                    self._shard(
                        build_microbatch(
                            group, [segs[i] for i in c], layout, cached_prefix_len=cached, device=self.device
                        )
                    )
                    for c in chunks
                ]
                dist.barrier(group=self.pipe.group)
                self.t0 = time.perf_counter()
                for phase, ops in _phases(program, system):
                    start = time.perf_counter()
                    if observer is not None:
                        observer.enter(phase)
                    with self.hooks.phase(phase):
                        for op in ops:
                            self._do(op)
                    if observer is not None:
                        observer.exit(phase)
                    phase_times[phase] = time.perf_counter() - start
                self.p2p.flush()  # sends complete once their receivers posted; nothing waits on them earlier
                value = self.hooks.reduce_loss(self.total)
        finally:
            if self.cache is not None:
                self.cache.release()
            self.saved.clear()
        value = self._from_last_stage(value)
        self.pipe.timeline = self.events
        stats = self._gather_timelines()
        trunk = _trunk_tokens(group, chunks, layout, 1 if prefix else group.prompt_len) + (
            group.prompt_len - 1 if prefix else 0
        )
        return GroupStats(
            system,
            layout,
            value,
            len(chunks),
            group.prompt_len - 1 if system == "prefixflow" else 0,
            sum(group.response_lens),
            trunk,
            phase_times,
            hooks={**self.hooks.stats(), **stats},
        )

    # --- operations ----------------------------------------------------------------------------------------

    def _shard(self, mb):
        return self.hooks.shard(mb)

    def _do(self, op: tuple) -> None:
        kind = op[0]
        if kind == "barrier":
            start = time.perf_counter()
            dist.barrier(group=self.pipe.group)
            self._event("barrier", None, start, start)
            return
        {"A": self._prefix_forward, "F": self._forward, "B": self._backward, "C": self._prefix_backward}[
            kind
        ](*op[1:])

    def _event(self, op: str, mb, waited: float, started: float) -> None:
        now = time.perf_counter()
        self.events.append(
            dict(
                stage=self.pipe.stage,
                op=op,
                mb=mb,
                wait=waited - self.t0,
                start=started - self.t0,
                end=now - self.t0,
            )
        )

    def _input(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.pipe.first:
            return tokens
        return self.p2p.recv(-1, _FWD).requires_grad_(True)

    def _prefix_forward(self) -> None:
        from ..schedule import _last_needed_layer

        waited = time.perf_counter()
        mb = self._shard(prefix_microbatch(self.group, self.device))
        inp = self._input(mb.tokens)
        started = time.perf_counter()
        stop = _last_needed_layer(self.model, self.runtime) if self.pipe.last else None
        mode = CapturePrefix(self.cache, stop, mask=mb.mask, sequence=mb.sequence)
        out = None
        with self.runtime.state.use(mode):
            try:
                out = stage_hidden(self.model, inp, _positions(mb), final_norm=False)
            except PrefixCaptured:
                pass
        self._event("A", None, waited, started)
        if not self.pipe.last:
            self.p2p.send(out, +1, _FWD)
        self.prefix = (inp, out, mb)

    def _forward(self, m: int) -> None:
        mb = self.mbs[m]
        waited = time.perf_counter()
        inp = self._input(mb.tokens)
        started = time.perf_counter()
        if self.cache is not None:
            variant = self.runtime.config.attention_for(self.device)
            mode = AttendWithPrefix(self.cache, mb.mask, variant, sequence=mb.sequence)
        else:
            mode = MaskedAttention(mb.mask, mb.sequence) if mb.mask is not None else None
        with self.hooks.microbatch(mb), self._attention(mode):
            out = stage_hidden(self.model, inp, _positions(mb))
            if self.pipe.last:
                logits = self.model.output(out[mb.loss_rows, mb.loss_cols])
                logp = token_logprobs(logits, mb.targets, self.cfg.temperature)
                out = microbatch_loss(logp, mb, self.group, self.loss, self.cfg)
                self.total += out.item()
        self._event("F", m, waited, started)
        if not self.pipe.last:
            self.p2p.send(out, +1, _FWD)
        self.saved[m] = (inp, out, mode)

    def _attention(self, mode):
        """The microbatch's attention mode, active in its forward and again in its backward (checkpointed
        blocks recompute under it)."""
        return self.runtime.state.use(mode) if mode is not None else contextlib.nullcontext()

    def _backward(self, m: int) -> None:
        inp, out, mode = self.saved.pop(m)
        waited = time.perf_counter()
        grad = None if self.pipe.last else self.p2p.recv(+1, _BWD)
        started = time.perf_counter()
        with self.hooks.microbatch(self.mbs[m]), self._attention(mode):
            torch.autograd.backward(out, grad)
        self._event("B", m, waited, started)
        if not self.pipe.first:
            self.p2p.send(_grad_or_zeros(inp), -1, _BWD)

    def _prefix_backward(self) -> None:
        inp, out, mb = self.prefix
        waited = time.perf_counter()
        roots, grads = [], []
        if not self.pipe.last:
            roots, grads = [out], [self.p2p.recv(+1, _BWD)]
        started = time.perf_counter()
        # Checkpointed prefix blocks recompute under the prefix's attention (see phase_c_prefix_backward).
        recompute = MaskedAttention(mb.mask, mb.sequence) if mb.sequence is not None else None
        with self._attention(recompute):
            self.cache.backward_prefix(roots, grads)
        self._event("C", None, waited, started)
        if not self.pipe.first:
            self.p2p.send(_grad_or_zeros(inp), -1, _BWD)
        self.prefix = None

    # --- after the group -----------------------------------------------------------------------------------

    def _from_last_stage(self, value: float) -> float:
        """The loss lives on the last stage; every stage reports it."""
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.broadcast(t, src=self.pipe.peer(self.pipe.n_stages - 1 - self.pipe.stage), group=self.pipe.group)
        return float(t.item())

    def _gather_timelines(self) -> dict[str, float]:
        every: list = [None] * self.pipe.n_stages
        dist.all_gather_object(every, self.events, group=self.pipe.group)
        self.pipe.timelines = every
        span = max(e["end"] for events in every for e in events)
        busy = [sum(e["end"] - e["start"] for e in events if e["op"] != "barrier") for events in every]
        bubbles = [span - b for b in busy]
        return {
            "pp_stage": self.pipe.stage,
            "pp_span_s": span,
            "pp_bubble_s": bubbles[self.pipe.stage],
            "pp_bubble_mean_s": sum(bubbles) / len(bubbles),
            "pp_bubble_max_s": max(bubbles),
        }


def _positions(mb) -> torch.Tensor:
    """Explicit RoPE positions (``0 ..`` when the layout left them implicit): a stage cannot infer the sequence
    length from tokens it never sees, e.g. under tensor parallelism's sequence-sharded activations."""
    if mb.positions is not None:
        return mb.positions
    return torch.arange(mb.tokens.shape[1], device=mb.tokens.device).unsqueeze(0)


def _grad_or_zeros(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)


def _phases(program: list[tuple], system: str) -> list[tuple[str, list[tuple]]]:
    """Split a stage program into the schedule's phases: A | B (F/B and barriers) | C, or ``full``."""
    if system == "baseline":
        return [("full", program)]
    a = [op for op in program[:1] if op[0] == "A"]
    c = [op for op in program[-1:] if op[0] == "C"]
    return [
        (name, ops)
        for name, ops in (("A", a), ("B", program[len(a) : len(program) - len(c)]), ("C", c))
        if ops
    ]


def apply_pp(
    model: nn.Module,
    pp_mesh,
    *,
    switching: str = "stage_local",
    input_weight: int = 1,
    output_weight: int = 1,
) -> nn.Module:
    """Cut ``model`` into ``pp_mesh.size()`` stages with TorchTitan's ``pipeline_module_split`` and return this
    rank's stage (``pp_mesh``: a DeviceMesh with a ``pp`` dimension, e.g. ``world_mesh["pp"]``).

    TorchTitan's order: PP first, then TP/AC/compile/FSDP. It may come before or after ``apply_prefixflow``
    (a wrapped model's stage renumbers its attention layers from 0). ``train_group`` on the returned stage runs
    the pipelined schedule. ``switching``: ``"stage_local"`` or
    ``"barrier"`` (changeable later through ``model._prefixflow_pipeline.switching``)."""
    from torchtitan.distributed.pipeline_parallel import (
        generate_llm_fqn_per_model_part,
        pipeline_module_split,
    )

    if switching not in SWITCHING:
        raise ValueError(f"switching {switching!r} unknown; valid: {SWITCHING}")
    tok, out = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    if tok is not None and out is not None and out.weight is tok.weight:
        raise ValueError(
            "pipeline parallelism cannot split tied input/output embeddings across stages; "
            "build the model with overrides={'enable_weight_tying': False}"
        )
    n_layers = len(model.layers)
    names = generate_llm_fqn_per_model_part(pp_mesh.size(), n_layers, input_weight, output_weight)
    device = next(model.parameters()).device
    stages, models = pipeline_module_split(model, pp_mesh, "1F1B", device, names)
    stage = models[0]
    if getattr(stage, "_prefixflow", None) is not None:
        _renumber_attention(stage)
    stage._prefixflow_pipeline = Pipeline(
        stage=stages[0].stage_index,
        n_stages=stages[0].num_stages,
        group=pp_mesh.get_group(),
        switching=switching,
    )
    for attr in ("prefixflow_name",):
        if hasattr(model, attr):
            setattr(stage, attr, getattr(model, attr))
    return stage


def _renumber_attention(stage: nn.Module) -> None:
    """A stage cut from a PrefixFlow-wrapped model: its wrappers get a state of their own, numbered 0.. in
    layer order (the cache's layer keys are per stage)."""
    from ..attention import AttentionState, PrefixAwareAttention

    runtime = stage._prefixflow
    state = AttentionState()
    for i, wrapper in enumerate(m for m in stage.modules() if isinstance(m, PrefixAwareAttention)):
        wrapper.layer, wrapper.state = i, state
        state.wrappers.append(wrapper)
    runtime.state, runtime.n_wrapped = state, len(state.wrappers)


@contextlib.contextmanager
def switching(model: nn.Module, value: str):
    """Run with another phase switching for a while (e.g. to compare ``barrier`` with ``stage_local``)."""
    pipe = getattr(model, "_prefixflow_pipeline", None)
    if pipe is None:
        raise ValueError("this model is not a pipeline stage (apply_pp / parallelize with pp > 1 first)")
    if value not in SWITCHING:
        raise ValueError(f"switching {value!r} unknown; valid: {SWITCHING}")
    old, pipe.switching = pipe.switching, value
    try:
        yield
    finally:
        pipe.switching = old
