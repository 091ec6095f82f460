"""The DeepSpeed engine: config dict, activation checkpointing, compilation, and the
token-weighted step.

Order (data flows one way): build the plain model → ``torch.compile`` each decoder block,
then activation checkpointing around it, from the outside → AdamW groups →
``deepspeed.initialize``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tape_train.config import RunConfig
from tape_train.train.optim import build_optimizer
from tape_train.train.profiling import no_label

log = logging.getLogger("tape_train.train")


def deepspeed_config(cfg: RunConfig, device_type: str = "cuda") -> dict:
    """The DeepSpeed config dict for ``cfg`` on ``device_type``; every setting that matters is
    explicit.

    ``gradient_clipping`` is always written: DeepSpeed 0.19.8 silently defaults it to 1.0.
    On CPU (docs/training.md, "Performance"): ZeRO-3 keeps torch's own ``F.linear``
    (DeepSpeed's ``memory_efficient_linear`` swaps it process-wide for a Python autograd
    function that saves the same tensors, ~5 % of a 125m step); ZeRO-1/2 turn
    ``contiguous_gradients`` off — its gradient buffers landed in freshly faulted host memory
    every step (0.6 GiB of page faults per 125m fp32 step, trainer ÷ plain loop 1.21 → 1.05).
    On CUDA DeepSpeed's defaults stay until measured there.

    ZeRO-Offload (``parallel.offload_optimizer`` / ``offload_params``): ``offload_optimizer`` /
    ``offload_param`` sections with ``pin_memory`` on CUDA only (page-locked host buffers make
    the copies asynchronous; on CPU there is no copy to speed up). ``zero_force_ds_cpu_optimizer``
    is always False: ``build_engine`` chooses the optimizer itself (DeepSpeed's CPU Adam, or
    torch AdamW when that op cannot be built) and logs the choice.
    """
    parallel = cfg.parallel
    zero: dict = {"stage": parallel.zero_stage}
    pin = device_type == "cuda"
    if parallel.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": parallel.offload_optimizer, "pin_memory": pin}
    if parallel.offload_params != "none":
        zero["offload_param"] = {"device": parallel.offload_params, "pin_memory": pin}
    if cfg.parallel.zero_stage in (1, 2) and device_type == "cpu":
        zero["contiguous_gradients"] = False
    if cfg.parallel.zero_stage == 3:
        zero.update(reduce_scatter=True, stage3_param_persistence_threshold=(
            cfg.parallel.zero3_param_persistence_threshold))
        if device_type == "cpu":
            zero["memory_efficient_linear"] = False
    return {
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": cfg.train.grad_accum_steps,
        "gradient_clipping": float(cfg.optim.grad_clip),
        "bf16": {"enabled": cfg.train.dtype == "bf16"},
        "fp16": {"enabled": False},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
        "checkpoint": {"tag_validation": "Fail"},
    }


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Recompute every decoder layer in the backward (``use_reentrant=False``).

    The layer's ``forward`` is wrapped on the instance, so parameter names, and thus
    checkpoints, are identical with and without it. Returns the number of layers wrapped.
    """
    for layer in model.layers:
        inner = layer.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        layer.forward = forward
    return len(model.layers)


COMPILE_RECOMPILE_LIMIT = 32


def compile_blocks(model: nn.Module) -> int:
    """``torch.compile`` the forward of every decoder layer, on the instance (parameter names,
    and thus checkpoints, are unchanged); returns the number of layers compiled.

    What a block compiles to: its norms, rotary modulation, SwiGLU, residual adds and TAPE's
    state updates fused by TorchInductor around the GEMMs. The attention core stays outside
    the graph (``torch.compiler.disable`` on each layer's core, whatever module sits there:
    the plain core or the sequence-parallel wrapper): it is one fused kernel already (flash,
    cuDNN, the fused TAPE kernel) or a collective exchange. ZeRO-3's gather hooks sit on the
    block (``gather_whole_blocks``), outside the compiled forward; hooks on modules inside it
    (``parallel.zero3_gather_blocks=false``) are compile-disabled by DeepSpeed: a graph break
    around each gather. The layers share
    one compiled code object: the first and last layers (layer-0 state broadcast over the
    batch; no state update) compile once more, and so does each new sequence length until
    lengths turn dynamic. Runs before ``apply_activation_checkpointing``, so a checkpointed
    layer recomputes the compiled forward (the checkpoint wraps the compiled code, not the
    other way round: a graph break cannot sit inside a checkpoint region).
    """
    # Every layer shares the code objects; train/eval, the first/last layer and static then
    # dynamic lengths are separate entries: more than Dynamo's default 8 (it would silently
    # run the rest eagerly).
    dynamo = torch._dynamo.config  # `cache_size_limit` before torch 2.7
    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    setattr(dynamo, name, max(getattr(dynamo, name), COMPILE_RECOMPILE_LIMIT))
    for layer in model.layers:
        core = layer.attn.core
        core.forward = torch.compiler.disable(core.forward, recursive=True)
        layer.forward = torch.compile(layer.forward)
    return len(model.layers)


def gather_whole_blocks(model: nn.Module) -> None:
    """ZeRO-3: fetch and release each decoder block's parameters as one unit
    (``deepspeed.utils.set_z3_leaf_modules``; before ``deepspeed.initialize``, which then hooks
    the blocks and none of the modules inside them).

    Per-module hooks cost host time on every Linear, norm and gate in the forward and the
    backward; per block it is one pair. On the 350m layer structure at width 64 (where a step
    is host time) a ZeRO-3 TAPE step took 235 ms per module and 146 ms per block on CPU
    (ZeRO-1: 94 ms; docs/training.md); losses were bit-identical, also with activation
    checkpointing, 2 ranks, tp = 2, sp = 2 and ``train.compile``. A block's parameters are what the memory plan counts
    as gathered already (``tape_train.train.memory``: two whole layers, with prefetch)."""
    from deepspeed.utils import set_z3_leaf_modules

    from tape_train.model.transformer import DecoderBlock

    set_z3_leaf_modules(model, [DecoderBlock])


def build_engine(cfg: RunConfig, model: nn.Module, grid, *, load_universal: bool = False):
    """``(engine, optimizer)``; the optimizer is our ``SkippableAdamW`` inside ZeRO.

    ``load_universal``: the engine will load a DeepSpeed universal checkpoint (a resume on
    another layout); DeepSpeed reads this flag at ``initialize``.

    ``model`` has been through ``tape_train.parallel.parallelize(model, grid)``; AutoTP's
    section is merged into the DeepSpeed config here (DeepSpeed shards the Linear layers in
    ``initialize`` and remaps the client optimizer's parameters), and no ``mpu`` is passed:
    DeepSpeed's data-parallel group is then dp×sp, which ``verify_engine`` checks.
    """
    import deepspeed

    from tape_train.parallel import deepspeed_config_updates, verify_engine

    if cfg.train.compile:
        log.info("train.compile: %d decoder layers compiled with torch.compile (the first "
                 "step and each new sequence length compile; attention stays eager)",
                 compile_blocks(model))
    if cfg.train.activation_checkpointing:
        apply_activation_checkpointing(model)
    if cfg.parallel.zero_stage == 3 and cfg.parallel.zero3_gather_blocks:
        gather_whole_blocks(model)
    optimizer = build_optimizer(model, cfg.optim, cfg.train, cpu_adam=use_cpu_adam(cfg))
    from deepspeed.accelerator import get_accelerator

    config = {**deepspeed_config(cfg, get_accelerator().device_name()),
              **deepspeed_config_updates(grid)}
    if load_universal:
        config["checkpoint"] = {**config["checkpoint"], "load_universal": True}
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=config, dist_init_required=False)
    verify_engine(engine, grid)
    skip_bf16_overflow_scan(engine.optimizer)
    multi_tensor_grad_norm(engine.optimizer)
    return engine, optimizer


def skip_bf16_overflow_scan(zero_optimizer) -> bool:
    """ZeRO-1/2 in bf16: leave out DeepSpeed's per-gradient non-finite scan before the step;
    returns whether it was left out.

    DeepSpeed 0.19.8 (``bf16.check_grad_overflow``, on by default) runs ``has_inf_or_nan`` on
    every gradient of the partition (13 operators each: 4048 of the 10 389 a 350m-structured
    TAPE step dispatched, 39 %; docs/kernel.md), all-reduces the flag and reads it back (a host
    sync), then computes the gradient norm, in fp64, from the same gradients, and treats a
    non-finite norm as an overflow too (the rule fp32 runs already have). A gradient holding
    NaN or inf makes that norm non-finite (no finite bf16/fp32 gradient can overflow it), so
    the norm alone skips exactly the same steps, by the same path (gradients cleared, weights
    and Adam moments untouched, ``get_global_grad_norm()`` inf). The scan is kept where the
    norm is not computed (``compute_grad_norm=false``) and under ZeRO-Offload (its flag is
    gathered while the gradients are copied, no scan)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not (type(zero_optimizer) is DeepSpeedZeroOptimizer
            and zero_optimizer.dtype == torch.bfloat16 and zero_optimizer.check_grad_overflow
            and zero_optimizer.compute_grad_norm and not zero_optimizer.cpu_offload):
        return False

    def check_overflow(partition_gradients=True):
        zero_optimizer.overflow = False  # decided by the gradient norm, next in step()

    zero_optimizer.check_overflow = check_overflow
    return True


def use_cpu_adam(cfg: RunConfig) -> bool:
    """Whether the run's AdamW is DeepSpeed's CPU Adam (collective; logs the choice on rank 0).

    With ``parallel.offload_optimizer=cpu`` the update runs on the host, where DeepSpeed's
    vectorised CPU Adam is the fast choice; its op is compiled on first use. Where that fails
    on any rank (no g++ or ninja on the node), every rank falls back to torch AdamW on the
    host partitions, with a warning naming the cause and the fix: the same update (measured:
    the same losses as without offload, docs/training.md), a slower optimizer step.
    """
    from tape_train.train import distributed as tdist
    from tape_train.train.optim import cpu_adam_problem

    if cfg.parallel.offload_optimizer == "none":
        log.info("optimizer: torch AdamW on the device (parallel.offload_optimizer=none%s)",
                 ", parameters on the host: parallel.offload_params=cpu"
                 if cfg.parallel.offload_params != "none" else "")
        return False
    problem = cpu_adam_problem()
    if tdist.all_reduce_max_int(problem is not None):
        log.warning("parallel.offload_optimizer=cpu: DeepSpeed's CPU Adam op could not be built "
                    "or loaded (%s); using torch AdamW on the host instead (same update, slower "
                    "optimizer step). Fix: install g++ and ninja on every node (the op compiles "
                    "on first use and is cached in TORCH_EXTENSIONS_DIR), or install DeepSpeed "
                    "with DS_BUILD_CPU_ADAM=1", problem or "on another rank")
        return False
    log.info("optimizer: DeepSpeed CPU Adam (AdamW mode) on the host (parallel."
             "offload_optimizer=cpu, parallel.offload_params=%s)", cfg.parallel.offload_params)
    return True


def count_target_tokens(micro_batches: Sequence[dict]) -> int:
    """Labels ≠ −100 over this rank's micro-batches of one optimizer step."""
    return int(sum(int((mb["labels"] != -100).sum()) for mb in micro_batches))


def forward_backward(engine, micro_batches: Sequence[dict], *, grid,
                     global_tokens: int, before_last_step=None, label=no_label) -> torch.Tensor:
    """Forward/backward/step over one optimizer step's micro-batches on this rank.

    Loss normalisation: DeepSpeed averages gradients over its data-parallel group, which is
    dp×sp here (``tape_train.parallel.loss_scale``), so each rank backprops
    ``loss_sum · dp·sp / G`` with G the target tokens of the whole global batch: the average
    over ranks is then exactly the token mean of the global batch, however unevenly the valid
    tokens fall on ranks, sequence chunks and micro-batches.

    Args:
        micro_batches: ``grad_accum_steps`` dicts with ``input_ids``/``labels`` (b, L) int64,
            this data-parallel rank's (identical on the ranks of its SP/TP group); each is cut
            to this rank's sequence chunk here when sp > 1.
        grid: the ``tape_train.parallel.RankGrid``.
        global_tokens: target tokens of the global batch (all dp ranks, all micro-batches);
            the loss of every micro-batch is divided by it.
        before_last_step: called with the local ``loss_sum`` (fp64) after the last backward
            and before the optimizer step (the accumulation boundary), e.g. to agree on
            skipping a non-finite update.
        label: ``label(name)`` is a context around each phase of a micro-batch (``forward``,
            ``backward``, ``optimizer_step``): ``RunProfiler.label``, a no-op when nothing is
            profiled.

    Returns this rank's summed NLL (fp64 scalar, nats) over its micro-batches, on
    ``engine.device``.

    No host synchronisation per micro-batch: the sum stays on the device (on a GPU, reading a
    value back drains the queue of launched kernels, and the host then waits before it can
    queue the next micro-batch), and host-to-device copies are ``non_blocking``. The caller
    reads the sum once per step (``before_last_step``).
    """
    from tape_train.parallel import loss_scale, shard_batch

    factor = loss_scale(grid) / max(global_tokens, 1)
    local_sum = torch.zeros((), dtype=torch.float64, device=engine.device)
    for i, mb in enumerate(micro_batches):
        kwargs = {}
        if grid.sp > 1:  # this rank's chunk, with its global layer-0 positions
            input_ids, labels, positions = shard_batch(mb, grid)
            kwargs["positions"] = positions.to(engine.device, non_blocking=True)
        else:  # no positions: RandPE / TAPE's train_offset draw their own in training
            input_ids, labels = mb["input_ids"], mb["labels"]
        with label("forward"):
            input_ids = input_ids.to(engine.device, non_blocking=True)
            labels = labels.to(engine.device, non_blocking=True)
            out = engine(input_ids, labels=labels, **kwargs)
        with label("backward"):
            # scale_wrt_gas=False: the 1/G normalisation already spans all micro-batches.
            engine.backward(out.loss_sum * factor, scale_wrt_gas=False)
        local_sum += out.loss_sum.detach().double()
        if i == len(micro_batches) - 1 and before_last_step is not None:
            before_last_step(local_sum)
        with label("optimizer_step"):
            engine.step()
    return local_sum



def multi_tensor_grad_norm(zero_optimizer) -> bool:
    """ZeRO-1/2: the L2 gradient norm of the partition from one multi-tensor norm
    (``torch._foreach_norm``) instead of DeepSpeed's loop of a cast and a norm per gradient
    (2 operators and 2 views each: 1278 per 350m-structured TAPE step); returns whether it
    was replaced.

    The same gradients count (no padding, no pipeline-replicated copy, tensor-parallel ones on
    every rank and the rest on model-parallel rank 0), each norm in DeepSpeed's norm dtype
    (fp64), then DeepSpeed's sequence: squares summed, cast to fp32, all-reduced over the
    data- and model-parallel groups, square root, non-finite masked to -1. The per-gradient
    norms are bit-identical on CPU (torch's multi-tensor norm falls back to one norm per
    tensor there); CUDA's fused kernel sums in another order (fp64, a difference far below
    the fp32 result's last bit). Other norm types keep DeepSpeed's loop."""
    from deepspeed import comm as dist
    from deepspeed.runtime.constants import PIPE_REPLICATED
    from deepspeed.runtime.utils import (is_model_parallel_parameter,
                                         mask_nan_or_inf_with_val_inplace)
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.runtime.zero.utils import get_norm_dtype

    if type(zero_optimizer) is not DeepSpeedZeroOptimizer:
        return False
    opt, per_gradient = zero_optimizer, zero_optimizer.get_grad_norm_direct

    def grad_norm(gradients, params, norm_type=2):
        unpadded = (g for g in gradients if not getattr(g, "_zero_padding", False))
        counted = [g for g, p in zip(unpadded, params) if not getattr(p, PIPE_REPLICATED, False)
                   and (is_model_parallel_parameter(p) or opt.model_parallel_rank == 0)]
        if float(norm_type) != 2.0 or not counted:
            return per_gradient(gradients, params, norm_type)
        norms = torch._foreach_norm(counted, 2.0, dtype=get_norm_dtype())
        total = torch.stack(norms).pow(2).sum().float()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=opt.dp_process_group)
        opt._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
        total = total.pow(0.5)
        mask_nan_or_inf_with_val_inplace(total, device=opt.device)
        return total

    opt.get_grad_norm_direct = grad_norm
    return True
