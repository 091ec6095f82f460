"""Tensor parallelism: AutoTP's partition specs for this model, and TAPE's state under head
sharding.

AutoTP (inside ``deepspeed.initialize``) replaces the Linear layers named below: q/k/v and
gate/up column-parallel (output features split; their input gradient is all-reduced over TP in
backward), o/down row-parallel (input features split; output all-reduced in forward). Each TP
rank then holds H/tp contiguous heads: rank t has heads [t·H/tp, (t+1)·H/tp).

TAPE's state E = (E⁰, E¹) is kept FULL (all M heads) and identical on every TP rank; only the
attention of the local heads reads a head slice of it. The formulation, per layer:

    E_loc = scatter_heads(E)        forward: slice of local heads   backward: all-gather
    attention of local heads with E_loc  →  Ê_loc                    (no communication)
    Ê = gather_heads(Ê_loc)         forward: all-gather             backward: local slice
    E ← E + W_pa ×_heads Ê ; E_n ← E_n + K_n·E_n                     (replicated, all heads)

Everything outside the attention core is then replicated computation on replicated inputs, so
every replicated parameter (W_pa, W_x, W_up, W_dn, norms, embeddings, LM head) receives the
FULL gradient on every TP rank, with no gradient all-reduce needed (an all-reduce would
multiply it by tp). The only gradient fix-up is the all-gather in ``scatter_heads``'s backward:
without it each rank would see the state's gradient for its own heads only, and the gradients
of W_pa, W_x, W_up, W_dn and of everything upstream of E would be partial (the tests show the
mismatch). Cost per TAPE layer and rank: one all-gather of Ê (2·b·N·C/tp elements sent) in
forward and one of ∂E_loc in backward; the M×M head mixing is done redundantly by each rank.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from tape_train.parallel.collectives import gather_heads, group_size, scatter_heads

# Anchored regexes on AutoTP's parameter names ("layers.3.attn.q_proj.weight"). A parameter
# that matches none stays replicated (embed, lm_head, norms, pos_update.*, pe.*).
COLUMN_PARALLEL = (r"^(.*\.)?layers\.\d+\.attn\.(q_proj|k_proj|v_proj)\.weight$",
                   r"^(.*\.)?layers\.\d+\.mlp\.(gate_proj|up_proj)\.weight$")
ROW_PARALLEL = (r"^(.*\.)?layers\.\d+\.attn\.o_proj\.weight$",
                r"^(.*\.)?layers\.\d+\.mlp\.down_proj\.weight$")


def autotp_partition_config() -> dict:
    """The ``tensor_parallel.partition_config`` section for :class:`TransformerLM`."""
    return {
        "use_default_specs": False,
        "layer_specs": [
            {"patterns": list(COLUMN_PARALLEL), "partition_type": "column"},
            {"patterns": list(ROW_PARALLEL), "partition_type": "row"},
        ],
    }


def partition_dim(param_name: str) -> int | None:
    """Dim along which AutoTP splits ``param_name`` (0 column, 1 row), None if replicated."""
    if any(re.match(p, param_name) for p in COLUMN_PARALLEL):
        return 0
    if any(re.match(p, param_name) for p in ROW_PARALLEL):
        return 1
    return None


class TapeStateHeadSharding:
    """Forward hooks on one ``Attention`` module: cut the incoming TAPE state to the local heads
    and all-gather the attended state Ê back to all heads (see module docstring).

    ``sync_state_grad=False`` replaces the slice by a plain one (negative control only).
    """

    def __init__(self, tp_group, sync_state_grad: bool = True) -> None:
        self.tp_group = tp_group
        self.sync_state_grad = sync_state_grad

    def before(self, module, args):
        """Forward pre-hook: args = (x, ctx, cache, tape_state) as DecoderBlock passes them."""
        if len(args) < 4 or args[3] is None:
            return None
        e0, e1 = args[3]
        local = (scatter_heads(e0, self.tp_group, self.sync_state_grad),
                 scatter_heads(e1, self.tp_group, self.sync_state_grad))
        return (*args[:3], local, *args[4:])

    def after(self, module, args, output):
        """Forward hook: (out, (Ê⁰_loc, Ê¹_loc)) → (out, (Ê⁰, Ê¹)) with all M heads."""
        out, e_hat = output
        if e_hat is None:
            return None
        d = e_hat[0].shape[-1]
        # One all-gather for both tables.
        full = gather_heads(torch.cat(tuple(e_hat), dim=-1), self.tp_group)
        return out, tuple(full.split((d, e_hat[1].shape[-1]), dim=-1))


def shard_tape_state_over_heads(model: nn.Module, tp_group,
                                sync_state_grad: bool = True) -> list:
    """Register :class:`TapeStateHeadSharding` on every layer's attention (tp > 1, for an
    encoding that ``carries_state``).

    Returns the hook handles. Works with DeepSpeed's AutoTP applied before or after: the hooks
    sit on ``Attention`` modules, AutoTP replaces their Linear children.
    """
    if group_size(tp_group) == 1 or not model.cfg.encoding.carries_state:
        return []
    handles = []
    for layer in model.layers:
        hooks = TapeStateHeadSharding(tp_group, sync_state_grad)
        handles.append(layer.attn.register_forward_pre_hook(hooks.before))
        handles.append(layer.attn.register_forward_hook(hooks.after))
    return handles
