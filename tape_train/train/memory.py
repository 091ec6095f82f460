"""Memory per rank of a training run, estimated before anything is built (``tape-train --dry-run``).

    est = estimate_memory(cfg, world_size=8)
    est.total_bytes            # what one rank needs at its peak, in bytes
    est.lines()                # the table printed by the dry run

Model states (bytes per parameter, Ψ_local = parameters a rank holds after tensor parallelism;
D = dp·sp, DeepSpeed's data-parallel group, over which ZeRO partitions)::

                       ZeRO-0                  ZeRO-1           ZeRO-2          ZeRO-3
    weights            e                       e                e               e / D
    gradients          e (+4 fp32 acc. bf16)   e                e / D           e / D
    fp32 master copy   4 / D (bf16 only)       4 / D            4 / D           4 / D
    AdamW m, v         8 / D (bf16), 8 (fp32)  8 / D            8 / D           8 / D

with e = 2 (bf16) or 4 (fp32). This follows DeepSpeed 0.19: bf16 without ZeRO runs its
``BF16_Optimizer`` (fp32 master and moments partitioned like ZeRO-1, a full fp32 gradient
accumulator); fp32 without ZeRO is the plain optimizer; ZeRO-1/2/3 always keep an fp32 copy
of their partition (also in fp32, where it duplicates the weights). ZeRO-3 also holds the
parameters it has gathered for the layer being computed and the next one (prefetch) and
keeps tensors below ``parallel.zero3_param_persistence_threshold`` whole.
DeepSpeed's ``estimate_zero3_model_states_mem_needs_all_live`` gives 18·Ψ/D + 4·largest layer
for bf16 ZeRO-3 (it counts fp32 gradients of the partition); the table above gives 16·Ψ/D + the
gathered layers.

ZeRO-Offload (``parallel.offload_optimizer`` / ``offload_params``, DeepSpeed's CPU offload):
the fp32 master copy and the AdamW moments of the rank's partition move to host memory, plus
an fp32 gradient partition there (4 / D: CPU Adam reads fp32 gradients); with offloaded
parameters (ZeRO-3) the e / D weight partition too, and the device then holds only the layers
gathered for compute (two, with prefetch) and the persistent small tensors. The device's
gradients stay as in the table (an upper bound: ZeRO streams them to the host in buckets).
On a CPU run host and device are the same memory: the offloaded parts stay in its total.

Activations are not guessed from a formula: the model runs one forward on PyTorch's ``meta``
device (no memory, no FLOPs: shapes only) at the run's micro-batch, local sequence length
(seq_len / sp) and dtype, and every tensor autograd saves for the backward is counted once
(parameters excluded). Tensors inside the attention and MLP blocks are divided by tp (AutoTP
splits heads and the MLP width); the residual stream, norms, TAPE's positional state and the
loss head's gradients are not. With activation checkpointing a layer keeps only its inputs
(hidden state and TAPE's state E⁰, E¹), plus one layer's activations while it is recomputed.
The backward adds a transient of about two of the largest saved tensors (a gradient and its
temporary); the loss, computed in token chunks, one chunk's logits (``loss_chunk_bytes``). Measured
against real runs in docs/training.md ("Preflight"): ``benchmarks/memory_estimate.py``.

With ``eval.interval`` > 0 the estimate also holds the scheduled evaluation's peak
(``MemoryEstimate.evaluation``): the model states and the rest a step does not free, plus one
forward without autograd of ``eval.batch_size`` windows of the longest eval length
(``eval_forward_bytes``); the preflight checks it against the device like a step.

Before any of that, ``memory_floor`` bounds the peak from below from the config alone (model
states, the layer inputs of one micro-batch, one hidden state of the evaluation batch; Python
ints): the preflight refuses a run above the device with it, so no size is ever traced that
would take hours or overflow torch's element counts.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

GIB = 2**30
# Resident memory of a training process once Python, torch, DeepSpeed and the process group
# are up, before the run builds anything (measured: 0.25 GiB, docs/training.md). CPU only: on
# CUDA the CUDA context takes device memory instead.
CPU_RUNTIME_BYTES = int(0.25 * GIB)
CUDA_CONTEXT_BYTES = int(0.5 * GIB)
# What a CPU process grows by during set-up and the first steps beyond the run's tensors:
# thread pools, gloo buffers, DeepSpeed's engine (measured on `tiny`, where the model is small;
# refitted 2026-11-24, benchmarks/memory_estimate.py).
CPU_STARTUP_GROWTH_BYTES = int(0.235 * GIB)
# DeepSpeed's working copies on CPU beyond the table (the flattened copy of the weights while
# it partitions them, the flattened gradient partition of the step, AdamW's temporaries over a
# flat partition), retained by glibc with train.keep_freed_memory: in fp32 copies of the
# rank's parameters, fitted to the measured peaks of `125m` on one rank (docs/training.md;
# refitted 2026-11-24: ZeRO-1/3 peaked 1.4-1.6 GiB lower than when first fitted, with the same
# model-state code). ZeRO-2 is taken as ZeRO-1 (not measured). Unpartitioned: measured so at
# dp=2 (125m, ZeRO-3), an upper bound for larger dp·sp.
CPU_DEEPSPEED_COPIES = {0: 0.55, 1: 1.65, 2: 1.65, 3: 4.5}


@dataclass
class ActivationTrace:
    """Bytes autograd saves for the backward in one micro-batch, per rank (already divided by
    tp where the tensor is split)."""

    saved: int                 # everything, without activation checkpointing
    layer_inputs: int          # Σ over layers of the layer's inputs (the checkpointed form)
    largest_layer: int         # the largest one layer's saved activations
    outside_layers: int        # embedding, final norm and the loss head
    positional: int            # part of ``saved`` that is TAPE's state and its updates
    largest_tensor: int        # the largest single saved tensor


@dataclass
class EvalMemory:
    """The scheduled evaluation (``eval.interval`` > 0) during training, per rank: one forward
    without autograd of ``batch`` windows of the longest eval length (``local_length`` tokens
    on this rank: length / sp), beside the model states."""

    batch: int
    length: int
    local_length: int
    forward_bytes: int   # the forward's working set (``eval_forward_bytes``)
    total_bytes: int     # with the model states, runtime and the rest the step does not free


@dataclass
class MemoryEstimate:
    """Bytes per rank at the peak of a training step. ``parts`` in order of the table."""

    parts: dict[str, int]
    activations_no_ckpt: int
    activations_ckpt: int
    checkpointing: bool
    notes: list[str] = field(default_factory=list)
    host: dict[str, int] = field(default_factory=dict)  # ZeRO-Offload's states, on a GPU run
    evaluation: EvalMemory | None = None  # the scheduled evaluation's peak, where it runs

    @property
    def total_bytes(self) -> int:
        return sum(self.parts.values())

    @property
    def host_bytes(self) -> int:
        """Host memory per rank for the offloaded states (0: none, or a CPU run, where they
        are in ``parts``)."""
        return sum(self.host.values())

    def lines(self) -> list[str]:
        out = [f"  {name:<42} {value / GIB:9.3f} GiB" for name, value in self.parts.items()]
        out.append(f"  {'total per rank':<42} {self.total_bytes / GIB:9.3f} GiB")
        out += [f"  {name + ' (host)':<42} {value / GIB:9.3f} GiB"
                for name, value in self.host.items()]
        if self.host:
            out.append(f"  {'host memory per rank (offloaded)':<42} "
                       f"{self.host_bytes / GIB:9.3f} GiB")
        other = self.activations_no_ckpt if self.checkpointing else self.activations_ckpt
        mine = self.activations_ckpt if self.checkpointing else self.activations_no_ckpt
        out.append(f"  (activations {'with' if self.checkpointing else 'without'} activation "
                   f"checkpointing as configured: {mine / GIB:.3f} GiB; "
                   f"{'without' if self.checkpointing else 'with'}: {other / GIB:.3f} GiB)")
        if self.evaluation is not None:
            ev = self.evaluation
            shape = f"{ev.batch} x {ev.length}" + (f" (/sp: {ev.local_length})"
                                                   if ev.local_length != ev.length else "")
            out.append(f"  {'scheduled evaluation, total per rank':<42} "
                       f"{ev.total_bytes / GIB:9.3f} GiB   (a forward of {shape} tokens: "
                       f"{ev.forward_bytes / GIB:.3f} GiB, beside the model states)")
        return out + [f"  note: {n}" for n in self.notes]


def dtype_of(cfg):
    """The torch dtype training runs in (``cfg.train.dtype`` already resolved: see
    ``preflight.resolve_planning_dtype``). The one place the plan reads the config's dtype."""
    import torch

    return torch.bfloat16 if cfg.train.dtype == "bf16" else torch.float32


def _memory_efficient_core():
    """An attention core that saves what flash, Triton and the blocked CPU kernel save for the
    backward (q, k, v, the output and the fp32 log-sum-exp), on the meta device in O(1): the
    real kernels' loops over blocks would make tracing long sequences slow."""
    import torch

    class _Core(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, *values):
            outs = tuple(q.new_empty(*q.shape[:-1], v.shape[-1]) for v in values)
            lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
            ctx.save_for_backward(q, k, *values, *outs, lse)
            return outs

        @staticmethod
        def backward(ctx, *grads):  # never run: the trace does no backward
            raise NotImplementedError

    class Core(torch.nn.Module):
        # A value in parts (TAPE's v, E⁰, E¹) is kept in parts, with one output per part,
        # as the fused kernel does.
        def forward(self, q, k, v, *, backend=None, bias=None, alibi_slopes=None):
            if isinstance(v, (tuple, list)):
                return _Core.apply(q, k, *v)
            return _Core.apply(q, k, v)[0]

    return Core()


def trace_activations(model_cfg, micro_batch: int, seq_len: int, dtype, tp: int = 1,
                      *, chunked_loss: bool = False) -> ActivationTrace:
    """Run the model on the meta device and count what autograd saves (see module doc).

    ``seq_len`` is the rank's local length (train.seq_len / sp). The loss runs as one token
    chunk unless ``chunked_loss``: it saves the same tensors either way (∂h and ∂W, formed in
    its forward), and one chunk takes the same time at any batch, where the chunks' loop took
    minutes at a micro-batch of a million sequences.
    """
    import torch

    from tape_train.model import TransformerLM

    # The core below stands in for every backend; `auto` keeps an explicit one (triton,
    # flash) from refusing the meta device.
    model_cfg = dataclasses.replace(model_cfg, attn_backend="auto")
    with torch.device("meta"):
        model = TransformerLM(model_cfg).to(dtype)
    if not chunked_loss:
        model.lm_head.loss_chunk = micro_batch * seq_len
    if not model_cfg.encoding.dense_bias:  # dense-bias encodings keep SDPA with an N×N bias
        for layer in model.layers:
            layer.attn.core = _memory_efficient_core()
    params = {id(p) for p in model.parameters()}
    stack: list[str] = []
    seen: dict[int, object] = {}
    per_layer: dict[int, int] = {}
    totals = {"saved": 0, "outside": 0, "positional": 0, "largest": 0}
    layer_inputs = [0]

    def push(name):
        return lambda module, args: stack.append(name)

    def pop(module, args, output):
        stack.pop()

    def layer_input(module, args):
        layer_inputs[0] += sum(_nbytes(t) for t in _tensors(args))

    hooks = []
    for name, module in model.named_modules():
        if name:
            hooks.append(module.register_forward_pre_hook(push(name)))
            hooks.append(module.register_forward_hook(pop))
    for layer in model.layers:
        hooks.append(layer.register_forward_pre_hook(layer_input))

    def pack(t):
        base = t._base if t._base is not None else t
        if id(base) in params or id(base) in seen:
            return t
        seen[id(base)] = base  # keep it alive: ids stay unique
        n = _nbytes(base)
        where = stack[-1] if stack else ""
        if _split_by_tp(where):
            n //= tp
        totals["saved"] += n
        totals["largest"] = max(totals["largest"], n)
        if "pos_update" in where or where.startswith("pe"):
            totals["positional"] += n
        parts = where.split(".")
        if len(parts) > 1 and parts[0] == "layers":
            per_layer[int(parts[1])] = per_layer.get(int(parts[1]), 0) + n
        else:
            totals["outside"] += n
        return t

    ids = torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta")
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids, labels=ids)
    finally:
        for h in hooks:
            h.remove()
    return ActivationTrace(saved=totals["saved"], layer_inputs=layer_inputs[0],
                           largest_layer=max(per_layer.values(), default=0),
                           outside_layers=totals["outside"], positional=totals["positional"],
                           largest_tensor=totals["largest"])


def saved_for_backward(fn, exclude=()) -> tuple:
    """``(fn(), bytes)``: the result of ``fn()`` and the bytes of the distinct storages
    autograd keeps for its backward, the storages of ``exclude`` (parameters, inputs that are
    alive anyway) not counted. Real tensors only (meta tensors have no storage addresses: see
    ``trace_activations``)."""
    import torch

    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


def _split_by_tp(module_path: str) -> bool:
    """Saved inside attention or MLP, except the replicated inputs of the column-parallel
    projections (q, k, v, gate, up save their C-wide input)."""
    if ".attn" not in module_path and ".mlp" not in module_path:
        return False
    return not module_path.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))


def _tensors(obj):
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def parameter_split(model_cfg, tp: int, persistence_threshold: int) -> dict[str, int]:
    """Parameter counts one rank holds: ``local`` (after AutoTP's split, the patterns of
    ``tape_train.parallel.tensor``), ``largest_layer`` (one decoder layer, local) and
    ``persistent`` (ZeRO-3 keeps tensors below the threshold whole)."""
    import torch

    from tape_train.model import TransformerLM
    from tape_train.parallel.tensor import partition_dim

    with torch.device("meta"):
        model = TransformerLM(model_cfg)
    local = persistent = 0
    layers: dict[str, int] = {}
    for name, p in model.named_parameters():
        n = p.numel() // tp if partition_dim(name) is not None else p.numel()
        local += n
        if n < persistence_threshold:
            persistent += n
        parts = name.split(".")
        if parts[0] == "layers":
            layers[parts[1]] = layers.get(parts[1], 0) + n
    largest = max([*layers.values(), model.embed.weight.numel(), model.lm_head.weight.numel()])
    return {"local": local, "largest_layer": largest, "persistent": persistent}


def model_state_bytes(n_params: int, stage: int, bf16: bool, partitions: int) -> dict[str, int]:
    """Weights, gradients, fp32 master copy and AdamW moments per rank (the module table)."""
    e, d = (2 if bf16 else 4), partitions
    weights = n_params * e // (d if stage == 3 else 1)
    grads = n_params * e // (d if stage >= 2 else 1)
    if stage == 0 and bf16:
        grads += n_params * 4  # BF16_Optimizer's fp32 gradient accumulator
    master = n_params * 4 // d if (bf16 or stage >= 1) else 0
    adam = n_params * 8 // (d if (bf16 or stage >= 1) else 1)
    return {"weights": weights, "gradients": grads, "master": master, "adam": adam}


def model_state_floor(cfg, world_size: int) -> int:
    """A lower bound of one rank's weights, gradients, fp32 master copy and AdamW moments, from
    the analytic parameter count (no model is built; every parameter counted as split by tp):
    a model far too large is refused before ``estimate_memory`` builds and traces it, which
    takes minutes at thousands of layers."""
    from tape_train.model.flops import count_parameters

    sp, tp = cfg.parallel.sp, cfg.parallel.tp
    partitions = world_size // (sp * tp) * sp
    states = model_state_bytes(count_parameters(cfg.model)["total"] // tp,
                               cfg.parallel.zero_stage, cfg.train.dtype == "bf16", partitions)
    return sum(states.values())


@dataclass
class MemoryFloor:
    """A lower bound of one rank's peak, from the config alone: no model built, no trace, in
    exact integer arithmetic (any size, however absurd, costs microseconds and cannot
    overflow). The preflight refuses a run whose floor exceeds the device before it traces
    anything (``estimate_memory``: minutes at a micro-batch of millions, an integer overflow
    in torch past 2**63 elements)."""

    model_states: int    # weights, gradients, fp32 master, AdamW (0: offloaded off the device)
    layer_inputs: int    # the hidden state every layer keeps of one micro-batch for backward
    eval_hidden: int     # one hidden state of the scheduled evaluation's batch (0: none)

    @property
    def step(self) -> int:
        return self.model_states + self.layer_inputs

    @property
    def evaluation(self) -> int:
        return self.model_states + self.eval_hidden if self.eval_hidden else 0


def activation_floor(cfg) -> tuple[int, int]:
    """``(step, evaluation)``: bytes one rank's activations need at least. A step keeps every
    layer's input hidden state (micro-batch × seq_len / sp × hidden, in the run dtype) for the
    backward, with or without activation checkpointing; an evaluation (``eval.interval`` > 0)
    holds at least one hidden state of ``eval.batch_size`` windows of the longest eval length
    (0 without one). Python ints: exact at any size."""
    sp = cfg.parallel.sp
    e = 2 if cfg.train.dtype == "bf16" else 4
    hidden = cfg.model.hidden_size * e
    step = cfg.model.num_layers * cfg.train.micro_batch_size * (cfg.train.seq_len // sp) * hidden
    evaluation = 0
    if cfg.eval.enabled:
        length = max(cfg.eval.resolve_lengths(cfg.train.seq_len))
        evaluation = cfg.eval.batch_size * (length // sp) * hidden
    return step, evaluation


def memory_floor(cfg, world_size: int, *, device_type: str = "cpu") -> MemoryFloor:
    """``MemoryFloor`` of ``cfg`` (``train.dtype`` resolved) on ``world_size`` ranks. On CUDA
    with ZeRO-Offload the model states may live on the host: only the activations count."""
    offloaded = (cfg.parallel.offload_optimizer, cfg.parallel.offload_params) != ("none", "none")
    states = 0 if device_type == "cuda" and offloaded else model_state_floor(cfg, world_size)
    return MemoryFloor(states, *activation_floor(cfg))


def estimate_memory(cfg, world_size: int, *, device_type: str = "cpu") -> MemoryEstimate:
    """Per-rank peak of ``cfg`` on ``world_size`` ranks (dp inferred as in ``RankGrid``)."""
    sp, tp, stage = cfg.parallel.sp, cfg.parallel.tp, cfg.parallel.zero_stage
    dp = world_size // (sp * tp)
    partitions = dp * sp
    dtype = dtype_of(cfg)
    bf16 = cfg.train.dtype == "bf16"
    counts = parameter_split(cfg.model, tp, cfg.parallel.zero3_param_persistence_threshold)
    states = model_state_bytes(counts["local"], stage, bf16, partitions)
    e = 2 if bf16 else 4
    parts = {
        f"weights ({'bf16' if bf16 else 'fp32'}{', /' + str(partitions) if stage == 3 else ''})":
            states["weights"],
        f"gradients{' (/' + str(partitions) + ')' if stage >= 2 else ''}": states["gradients"],
        "fp32 master weights": states["master"],
        "AdamW moments (fp32 m, v)": states["adam"],
    }
    notes = []
    offload_params = cfg.parallel.offload_params != "none"
    if stage == 3 and (partitions > 1 or offload_params):
        parts["ZeRO-3 gathered + persistent"] = (2 * counts["largest_layer"]
                                                 + counts["persistent"]) * e
    host = _offloaded(parts, cfg.parallel, counts["local"] * 4 // partitions)
    if device_type == "cpu":  # the host is the device: offloaded states stay in the total
        parts.update({f"{name} (offloaded)": value for name, value in host.items()})
        host = {}
    trace = trace_activations(cfg.model, cfg.train.micro_batch_size, cfg.train.seq_len // sp,
                              dtype, tp)
    no_ckpt = trace.saved
    ckpt = trace.layer_inputs + trace.largest_layer + trace.outside_layers
    checkpointing = cfg.train.activation_checkpointing
    parts["activations"] = (ckpt if checkpointing else no_ckpt) - trace.positional
    parts["TAPE positional state" if cfg.model.pe == "tape" else "positional encoding"] = \
        trace.positional
    parts["backward transient"] = 2 * trace.largest_tensor
    loss_chunk = loss_chunk_bytes(cfg.model.vocab_size,
                                  cfg.train.micro_batch_size * cfg.train.seq_len // sp, e)
    parts["loss chunk (logits of one token chunk)"] = loss_chunk
    # What a step alone holds (an evaluation between steps holds its own forward instead).
    step_only = parts["activations"] + trace.positional + parts["backward transient"] + loss_chunk
    if device_type == "cpu":
        parts["DeepSpeed working copies (CPU, measured)"] = int(
            CPU_DEEPSPEED_COPIES[stage] * 4 * counts["local"])
        parts["set-up growth (threads, gloo, engine)"] = CPU_STARTUP_GROWTH_BYTES
        parts["runtime (Python, torch, DeepSpeed)"] = CPU_RUNTIME_BYTES
    else:
        parts["CUDA context"] = CUDA_CONTEXT_BYTES
        notes.append("on CUDA the estimate is the table above plus activations; DeepSpeed's "
                     "working buffers and allocator fragmentation are not included (not "
                     "measured on a GPU yet)")
    est = MemoryEstimate(parts, no_ckpt, ckpt, checkpointing, notes, host)
    if cfg.eval.enabled:
        length = max(cfg.eval.resolve_lengths(cfg.train.seq_len))
        batch = cfg.eval.batch_size
        forward = eval_forward_bytes(cfg.model, batch, length // sp, dtype, tp)
        est.evaluation = EvalMemory(batch, length, length // sp, forward,
                                    est.total_bytes - step_only + forward)
    if checkpointing and cfg.model.pe == "tape":
        notes.append("with checkpointing TAPE's positional state is part of each layer's "
                     "saved input")
    if host:
        notes.append("ZeRO-Offload: the host parts are per rank; pinned (page-locked) host "
                     "memory, not measured on a GPU yet (docs/training.md, \"ZeRO-Offload\")")
    return est


def eval_forward_bytes(model_cfg, batch: int, local_len: int, dtype, tp: int = 1) -> int:
    """Working set of one forward without autograd (an evaluation batch), per rank: the
    largest layer's activations as the trace counts them for a training step (what autograd
    would keep of the layer; without it those tensors are freed as the layer goes, so about
    the most that is alive at once inside it), the layer's input and output (hidden state and,
    for TAPE, the positional state) and the chunked loss's logits of one chunk. Measured on
    CPU (``tiny``, fp32, 2-4 windows of 1024-2048 tokens, the resident peak of the real
    forward): 0.96-1.39x for TAPE, RoPE and NoPE, 1.78x for ALiBi's dense bias
    (docs/training.md, "Preflight")."""
    trace = trace_activations(model_cfg, batch, local_len, dtype, tp)
    layer_io = 2 * trace.layer_inputs // max(1, model_cfg.num_layers)
    return (trace.largest_layer + layer_io
            + loss_chunk_bytes(model_cfg.vocab_size, batch * local_len, dtype.itemsize))


def loss_chunk_bytes(vocab_size: int, tokens: int, elem: int) -> int:
    """Peak of the chunked loss (``tape_train.model.lm_head``): one chunk's logits in the run
    dtype, their fp32 copy (turned into the gradient in place) and that gradient in the run
    dtype; in fp32 the three are one tensor."""
    from tape_train.model.lm_head import chunk_tokens

    per_logit = 4 if elem == 4 else 2 * elem + 4
    return min(tokens, chunk_tokens(vocab_size)) * vocab_size * per_logit


def _offloaded(parts: dict[str, int], parallel, fp32_partition: int) -> dict[str, int]:
    """Move ZeRO-Offload's states out of ``parts`` (the first entries: weights, gradients,
    master, moments); returns them with the host's fp32 gradient partition (module doc)."""
    host: dict[str, int] = {}
    if parallel.offload_optimizer != "none":
        for name in ("fp32 master weights", "AdamW moments (fp32 m, v)"):
            host[name] = parts.pop(name)
        host["fp32 gradient partition"] = fp32_partition
    if parallel.offload_params != "none":
        weights = next(name for name in parts if name.startswith("weights"))
        host[weights] = parts.pop(weights)
    return host


# ------------------------------------------------------------------------------------------------
# What the device has
# ------------------------------------------------------------------------------------------------

# Memory per GPU (GiB as sold) by substring of the device name; used when planning for CUDA
# from a machine without that GPU (``--device-memory-gb`` overrides).
_GPU_MEMORY_GIB = {"H200": 141, "H100": 80, "A100-SXM4-80GB": 80, "A100 80GB": 80,
                   "A100": 40, "L40S": 48, "A6000": 48, "V100": 32}


def device_memory(device_type: str, gpu_name: str | None = None) -> tuple[int | None, str]:
    """Bytes a rank may use and where the number came from.

    CPU: the machine's available RAM (``MemAvailable``) for all ranks of this node together.
    CUDA: the visible device's total memory, else the table by ``gpu_name``; ``None`` if
    unknown.
    """
    if device_type == "cpu":
        try:
            with open("/proc/meminfo") as fh:
                for line in fh:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024, "available RAM (/proc/meminfo)"
        except OSError:
            pass
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical RAM"
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory, f"{props.name}, total memory"
    if gpu_name:
        for key, gib in _GPU_MEMORY_GIB.items():
            if key.lower() in gpu_name.lower():
                return gib * 10**9, f"table ({key})"
    return None, "no CUDA device here: pass --device-memory-gb to compare"
