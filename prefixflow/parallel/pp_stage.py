"""The stage runtime of pipeline parallelism: :class:`Pipeline`, a stage model's :class:`~prefixflow.schedule.stage.Stage`.

The phase functions (``prefixflow.schedule.phases``) run on it, node by node and wave by wave, as on one
device. A cached node's Phase-A forward receives the previous stage's output for the node and sends its own
on (the last stage scores the node's tokens); Phase B (and the baseline's phase) runs each wave's
microbatches in the stage program's 1F1B order (``pp_program.stage_program``), the last stage computing the
shared microbatch objective; a node's Phase-C backward is seeded with the gradient the next stage sent back
for its output, and sends its input's gradient on.
Activations and their gradients travel between neighbouring stages by ``torch.distributed`` P2P (gloo and
NCCL), each tensor preceded by a small shape header. Each operation is recorded with the moment it began
waiting for its input, started and ended; after the group every stage's timeline is gathered onto one clock
(see :meth:`Pipeline._gather_timelines`).
"""

from __future__ import annotations

import contextlib
import socket
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..model.dtypes import DTYPES
from ..runtime import runtime_of
from ..schedule.host import has_values, on_host
from ..schedule.stage import Stage, attention_mode, forward_hidden, microbatch_objective
from .pp_program import stage_program

__all__ = ["Pipeline"]

_WIRE_DTYPES = list(DTYPES.values())  # a tensor's dtype crosses as its index here
_FWD, _BWD = 0, 1  # P2P tags: activations flow down, gradients flow up


class _P2P:
    """Tensor send/recv between neighbouring stages; each tensor is preceded by a small shape header."""

    def __init__(self, pipe: Pipeline, device: torch.device) -> None:
        self.pipe, self.device = pipe, device
        self.pending: list[tuple] = []  # (work, tensor) of sends still in flight

    def send(self, t: torch.Tensor, offset: int, tag: int) -> None:
        t = t.detach().contiguous()
        header = torch.zeros(8, dtype=torch.long, device=self.device)
        header[0], header[1] = t.dim(), _WIRE_DTYPES.index(t.dtype)
        header[2 : 2 + t.dim()] = torch.tensor(t.shape)
        dst = self.pipe.peer(offset)
        for x in (header, t):
            self.pending.append((dist.isend(x, dst, group=self.pipe.process_group, tag=tag), x))

    def recv(self, offset: int, tag: int, shape, dtype: torch.dtype) -> torch.Tensor:
        """The tensor the stage ``offset`` away sends, of the ``shape`` and ``dtype`` this stage expects: checked
        against the header, or taken as is where the header has no values (an estimate's fake process group
        moves nothing, and no shape may come from another rank there)."""
        src = self.pipe.peer(offset)
        header = torch.empty(8, dtype=torch.long, device=self.device)
        dist.recv(header, src, group=self.pipe.process_group, tag=tag)
        shape = tuple(int(n) for n in shape)
        if has_values(header):
            with on_host():
                ndim, sent = int(header[0]), _WIRE_DTYPES[int(header[1])]
                got = tuple(header[2 : 2 + ndim].tolist())
            if got != shape or sent != dtype:
                raise RuntimeError(
                    f"pipeline stage {self.pipe.stage}: rank {src} sent a {list(got)} {sent} tensor where this "
                    f"stage expects {list(shape)} {dtype}"
                )
        t = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(t, src, group=self.pipe.process_group, tag=tag)
        return t

    def flush(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def _compute_dtype(model) -> torch.dtype:
    """What the stage's blocks compute in: FSDP2's ``param_dtype`` where set, else the parameters' dtype."""
    state = runtime_of(model, create=True).parallel
    if state is not None and state.compute_dtype is not None:
        return state.compute_dtype
    return next(model.parameters()).dtype


@dataclass
class Pipeline(Stage):
    """What ``apply_pp`` attaches to a stage model (and puts on its runtime): its place in the pipeline, how
    its phases switch, and the last group's timelines."""

    stage: int
    n_stages: int
    process_group: dist.ProcessGroup
    switching: str = "stage_local"
    hidden: int = (
        0  # the model's hidden size: what a stage expects from the previous one is (*tokens, hidden)
    )
    dtype: torch.dtype | None = None  # what the blocks compute in (set when a group runs)
    shards: int = 1  # how many sequence shards a block's input is split into (TP's degree; set then too)
    timeline: list[dict] = field(default_factory=list)  # this stage's events of the last group
    timelines: list[list[dict]] = field(default_factory=list)  # every stage's, on one clock (after the group)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.n_stages - 1

    @property
    def holds_loss(self) -> bool:  # only the last stage may stop Phase A at its last K/V
        return self.last

    def peer(self, offset: int) -> int:
        return dist.get_global_rank(self.process_group, self.stage + offset)

    # --- the Stage interface ------------------------------------------------------------------------------

    def check(self, model, system: str, microbatch) -> None:
        if microbatch == "auto":
            raise ValueError("microbatch='auto' is not supported under pipeline parallelism; pass an int")
        if runtime_of(model).config.offload:
            raise ValueError(
                "PrefixFlowConfig.offload is not supported under pipeline parallelism; set it False"
            )

    @contextlib.contextmanager
    def running(self, run):
        self.device = run.device
        self.dtype = _compute_dtype(run.model)
        self.shards = runtime_of(run.model, create=True).tp or 1  # TP: blocks pass sequence shards
        self.p2p, self.events, self.nodes = _P2P(self, run.device), [], {}
        dist.barrier(group=self.process_group)
        self.t0, self.wall_t0 = time.perf_counter(), time.time()
        try:
            yield
            self.p2p.flush()  # sends complete once their receivers posted; nothing waits on them earlier
        finally:
            self.nodes = {}

    def node_forward(self, run, j: int, mb):
        waited = time.perf_counter()
        inp = self._input(mb.tokens)
        started = time.perf_counter()
        self.nodes[j] = [inp, None, None]
        try:
            out = forward_hidden(run.model, inp, _positions(mb), final_norm=run.rows.scores(j) > 0)
        finally:
            self._event("A", None, waited, started)  # the last stage may stop early (PrefixCaptured)
        self.nodes[j][1] = out
        if not self.last:
            self.p2p.send(out, +1, _FWD)
            return None
        return out

    def microbatches(self, run, build, chunks=None) -> float:
        chunks = list(enumerate(run.chunks)) if chunks is None else chunks
        work = [(index, *build(chunk)) for index, chunk in chunks]
        prefix = run.system == "prefixflow" and bool(run.rows.cached)
        program = stage_program(self.switching, self.n_stages, self.stage, len(work), prefix)
        saved: dict[int, tuple] = {}
        total = 0.0
        for op in program:
            if op[0] == "barrier":
                start = time.perf_counter()
                dist.barrier(group=self.process_group)
                self._event("barrier", None, start, start)
            elif op[0] == "F":
                total += self._forward(run, *work[op[1]], saved)
            elif op[0] == "B":
                self._backward(run, work[op[1]][0], work[op[1]][1], saved)
        return total

    def node_seeds(self, run, j: int):
        waited = time.perf_counter()
        out = self.nodes[j][1]
        roots, grads = ([], []) if self.last else ([out], [self.p2p.recv(+1, _BWD, out.shape, out.dtype)])
        self.nodes[j][2] = (waited, time.perf_counter())
        return roots, grads

    def node_backward_done(self, run, j: int) -> None:
        inp, _, (waited, started) = self.nodes.pop(j)
        self._event("C", None, waited, started)
        if not self.first:
            self.p2p.send(_grad_or_zeros(inp), -1, _BWD)

    def report_loss(self, value: float) -> float:
        """The loss lives on the last stage; every stage reports it."""
        with on_host():  # a host number (an estimate's too)
            t = torch.tensor([value], dtype=torch.float64, device=self.device)
            dist.broadcast(t, src=self.peer(self.n_stages - 1 - self.stage), group=self.process_group)
            return float(t.item())

    def stats(self) -> dict[str, float]:
        self.timeline = self.events
        return self._gather_timelines()

    # --- operations ----------------------------------------------------------------------------------------

    def _event(self, op: str, mb, waited: float, started: float) -> None:
        now = time.perf_counter()
        self.events.append(
            dict(
                stage=self.stage,
                op=op,
                mb=mb,
                wait=waited - self.t0,
                start=started - self.t0,
                end=now - self.t0,
            )
        )

    def _input(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.first:
            return tokens
        b, length = tokens.shape  # under TP each rank holds its share of the padded sequence (parallel.tp)
        shape = (b, -(-length // self.shards), self.hidden)
        return self.p2p.recv(-1, _FWD, shape, self.dtype).requires_grad_(True)

    def _forward(self, run, m: int, mb, mode, saved: dict) -> float:
        waited = time.perf_counter()
        inp = self._input(mb.tokens)
        started = time.perf_counter()
        value = 0.0
        with attention_mode(run, mode), run.hooks.microbatch(mb):
            out = forward_hidden(run.model, inp, _positions(mb))
            if self.last:
                value, out = microbatch_objective(run, mb, out)
            roots, grads = [out], [None]
            extra = None if self.last else run.hooks.extra_loss()  # the last stage's is in its objective
            if extra is not None:  # this stage's own loss terms (e.g. its MoE layers' balance loss)
                roots.append(extra)
                grads.append(torch.ones_like(extra))
        self._event("F", m, waited, started)
        if not self.last:
            self.p2p.send(out, +1, _FWD)
        saved[m] = (inp, roots, grads, mode)
        return value

    def _backward(self, run, m: int, mb, saved: dict) -> None:
        inp, roots, grads, mode = saved.pop(m)
        waited = time.perf_counter()
        if not self.last:
            grads[0] = self.p2p.recv(+1, _BWD, roots[0].shape, roots[0].dtype)
        started = time.perf_counter()
        # The microbatch's attention mode is active again: checkpointed blocks recompute under it.
        with attention_mode(run, mode), run.hooks.microbatch(mb):
            torch.autograd.backward(roots, grads)
        self._event("B", m, waited, started)
        if not self.first:
            self.p2p.send(_grad_or_zeros(inp), -1, _BWD)

    # --- after the group -----------------------------------------------------------------------------------

    def _gather_timelines(self) -> dict[str, float]:
        """Every stage's events on one clock, from 0 (the first stage to begin waiting). Each stage counts from
        its own exit of the start barrier, and ranks leave a barrier milliseconds apart under load, so each
        stage's events are shifted by how much later its clock started: read from the monotonic clock when
        every stage runs on one host (one clock for all its processes: exact, so causal order shows), else
        from the wall clock (NTP-synchronised hosts)."""
        every: list = [None] * self.n_stages
        me = (self.events, socket.gethostname(), self.t0, self.wall_t0)
        with on_host():  # pickled objects cross as real byte tensors (an estimate's fake group repeats ours)
            dist.all_gather_object(every, me, group=self.process_group)
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
        self.timelines = shifted
        span = max(e["end"] for events in shifted for e in events)
        busy = [sum(e["end"] - e["start"] for e in events if e["op"] != "barrier") for events in shifted]
        bubbles = [span - b for b in busy]
        return {
            "pp_stage": self.stage,
            "pp_span_s": span,
            "pp_bubble_s": bubbles[self.stage],
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
