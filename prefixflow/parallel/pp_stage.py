"""The stage runtime of pipeline parallelism: one rollout group on one stage, following ``stage_program``.

Activations and their gradients travel between neighbouring stages by ``torch.distributed`` P2P (gloo and
NCCL), each tensor preceded by a small shape header. Each operation is recorded with the moment it began
waiting for its input, started and ended; after the group every stage's timeline is gathered onto one clock
(see :meth:`StageSchedule._gather_timelines`).
"""

from __future__ import annotations

import contextlib
import socket
import time

import torch
import torch.distributed as dist
from torch import nn

from ..apply import runtime_of
from ..attention import AttendWithPrefix, CapturePrefix, MaskedAttention, PrefixCaptured
from ..hooks import hooks_of
from ..kv_cache import PrefixKVCache
from ..layouts import build_microbatch, full_sequence_segments, prefix_microbatch, suffix_segments
from ..loss import microbatch_loss, resolve_loss, token_logprobs
from .pp import Pipeline, stage_hidden, stage_program

__all__ = ["StageSchedule"]

_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
_FWD, _BWD = 0, 1  # P2P tags: activations flow down, gradients flow up


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


class StageSchedule:
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
                self.wall_t0 = time.time()
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
        """Every stage's events on one clock, from 0 (the first stage to begin waiting). Each stage counts from
        its own exit of the start barrier, and ranks leave a barrier milliseconds apart under load, so each
        stage's events are shifted by how much later its clock started: read from the monotonic clock when
        every stage runs on one host (one clock for all its processes: exact, so causal order shows), else
        from the wall clock (NTP-synchronised hosts)."""
        every: list = [None] * self.pipe.n_stages
        me = (self.events, socket.gethostname(), self.t0, self.wall_t0)
        dist.all_gather_object(every, me, group=self.pipe.group)
        one_host = len({host for _, host, _, _ in every}) == 1
        origin = 2 if one_host else 3
        shifts = [stage[origin] - every[0][origin] for stage in every]
        zero = min(
            e["wait"] + shift for (events, *_), shift in zip(every, shifts, strict=True) for e in events
        )
        shifted = [
            [{**e, **{k: e[k] + shift - zero for k in ("wait", "start", "end")}} for e in events]
            for (events, *_), shift in zip(every, shifts, strict=True)
        ]  # the first stage to begin waiting begins at 0
        self.pipe.timelines = shifted
        span = max(e["end"] for events in shifted for e in events)
        busy = [sum(e["end"] - e["start"] for e in events if e["op"] != "barrier") for events in shifted]
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
