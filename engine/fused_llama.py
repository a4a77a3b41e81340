"""The decoder layers of Llama-family models on the CPU with fused kernels (``batchery.engine.cpu_fused``).

An engine step runs the HF model on one packed row; between the linear layers each HF decoder layer
runs some 25 small torch ops (RMSNorm twice, the rotary embedding, SiLU and the product with ``up``,
two residual adds), each one a dispatch and a pass over the activations: about 10% of a step in fp32
on SmolLM2-135M, more in bf16 where the matmuls are faster. ``install`` replaces the inner model's
forward (``LlamaModel``, per instance, as ``fast_linear`` does for linears) with one that runs the layers
itself: the previous layer's MLP output is added to the residual stream inside the next layer's first
norm (and the last one inside the final norm), the rotary embedding is applied in place to the q/k
projections, SiLU(gate) * up is one pass. The projections are called as they are (routed to our
linear kernels afterwards by ``fast_linear.install``), attention through our registered paged attention
function as ``LlamaAttention.forward`` calls it, cos/sin from HF's own rotary module once per forward
(every rope variant, scaling and dynamic update stays HF's). Every step rounds where HF's does.

Only an engine step takes that path: the step's attention metadata set on this thread, the model's
attention implementation ours, a plain call (ids and positions, no cache, mask, embeddings or
output capture, no grad). Anything else (HF ``generate`` with sdpa in our benchmarks' baseline, a
plain forward, training) runs HF's own forward unchanged.

Only models whose structure is verified are routed: ``LlamaForCausalLM`` with HF's own Llama modules,
RMSNorm, a SiLU gate/up/down MLP, no biases, the standard rotary module, CPU weights in fp32 or bf16.
Without the kernels (``BATCHERY_CPU_KERNELS=0``, no compiler) nothing is installed."""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass
from typing import Any

import torch

from batchery.engine import cpu_kernels
from batchery.engine.attention.backend import ATTN_IMPLEMENTATION, paged_attention_forward
from batchery.engine.attention.metadata import get_metadata

log = logging.getLogger("batchery.engine.kernels")

_STATE = "_batchery_fused"  # the attribute install sets on the inner model
# The kernels' scalar code (a build without AVX-512) beats HF's vectorized torch ops only on small
# steps: on a 2-core AVX2 EPYC, 30 layers' elementwise ops at 1/8/32/64/256 rows took 0.5/3.5/7.3/15.0/56.6 ms
# against HF's 6.8/8.3/10.9/14.4/30.1 ms (benchmarks/cpu_kernels.py). Larger steps there take HF's forward.
SCALAR_MAX_ROWS = 48
# the keywords LlamaForCausalLM.forward hands its inner model; any other keyword takes HF's path
_PLAIN_KWARGS = frozenset({"input_ids", "attention_mask", "position_ids", "cache", "inputs_embeds", "use_cache"})


@dataclass
class _Fused:
    """What install keeps on the inner model: HF's own forward (bound) and how many steps took the fused path."""

    hf_forward: Any  # the class's forward bound to the inner model
    head_dim: int
    num_layers: int
    steps: int = 0  # forwards that took the fused path (tests read it)


def _refusal(model: torch.nn.Module) -> str | None:
    """Why the model's structure is not the one the fused forward reproduces; None when it is."""
    from transformers.activations import SiLUActivation
    from transformers.models.llama import modeling_llama as ml

    if type(model) is not ml.LlamaForCausalLM:
        return f"{type(model).__name__} is not LlamaForCausalLM"
    inner: Any = model.model
    if type(inner) is not ml.LlamaModel or "forward" in vars(inner):
        return "the inner model is not HF's LlamaModel with its own forward"
    cfg = model.config
    if (
        getattr(cfg, "hidden_act", None) != "silu"
        or getattr(cfg, "attention_bias", False)
        or getattr(cfg, "mlp_bias", False)
    ):
        return "not a SiLU MLP without biases"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    if type(inner.rotary_emb) is not ml.LlamaRotaryEmbedding or "forward" in vars(inner.rotary_emb):
        return "not HF's rotary module"
    dtype = inner.embed_tokens.weight.dtype
    if dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype}"
    if any(p.device.type != "cpu" or p.dtype != dtype for p in model.parameters()):
        return "not every weight is on the CPU in one dtype"
    hidden = cfg.hidden_size
    exact = {
        ml.LlamaDecoderLayer: "layer",
        ml.LlamaAttention: "self_attn",
        ml.LlamaMLP: "mlp",
        ml.LlamaRMSNorm: "norm",
    }
    modules: list[Any] = [inner, inner.norm]
    if type(inner.norm) is not ml.LlamaRMSNorm or tuple(inner.norm.weight.shape) != (hidden,):
        return "the final norm is not LlamaRMSNorm"
    first: Any = inner.layers[0] if len(inner.layers) else None
    for layer in inner.layers[: cfg.num_hidden_layers]:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
        parts: list[tuple[Any, type]] = [(layer, ml.LlamaDecoderLayer), (attn, ml.LlamaAttention), (mlp, ml.LlamaMLP)]
        parts += [(n, ml.LlamaRMSNorm) for n in norms]
        for module, cls in parts:
            if type(module) is not cls:
                return f"a {exact[cls]} is not HF's {cls.__name__}"
            modules.append(module)
        assert attn is not None and mlp is not None  # checked just above
        if type(mlp.act_fn) is not SiLUActivation or "forward" in vars(mlp.act_fn):
            return "the MLP activation is not SiLU"
        d = attn.head_dim
        shapes = {
            "q_proj": (hidden, cfg.num_attention_heads * d),
            "k_proj": (hidden, cfg.num_key_value_heads * d),
            "v_proj": (hidden, cfg.num_key_value_heads * d),
            "o_proj": (cfg.num_attention_heads * d, hidden),
        }
        if d % 2 or d != first.self_attn.head_dim:
            return "an odd head_dim, or one that differs between layers"
        lins = [(getattr(attn, name), shape) for name, shape in shapes.items()]
        inter = mlp.intermediate_size
        lins += [(mlp.gate_proj, (hidden, inter)), (mlp.up_proj, (hidden, inter)), (mlp.down_proj, (inter, hidden))]
        for lin, (fan_in, fan_out) in lins:
            if type(lin) is not torch.nn.Linear or lin.bias is not None:
                return "a projection is not a plain nn.Linear without bias"
            if (lin.in_features, lin.out_features) != (fan_in, fan_out):
                return "a projection has an unexpected shape"
        if any(tuple(n.weight.shape) != (hidden,) for n in norms if n is not None):
            return "a norm has an unexpected shape"
    for module in modules:
        if module._forward_hooks or module._forward_pre_hooks:
            return f"{type(module).__name__} has forward hooks"
        if module is not inner and "forward" in vars(module):
            return f"{type(module).__name__} has its forward replaced"
    return None


def _engine_step(inner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this call of the inner model is an engine step the fused path reproduces exactly."""
    if args or not _PLAIN_KWARGS.issuperset(kwargs) or torch.is_grad_enabled() or inner.training:
        return False
    if kwargs.get("attention_mask") is not None or kwargs.get("cache") is not None or kwargs.get("use_cache"):
        return False
    if kwargs.get("inputs_embeds") is not None:
        return False
    ids, pos = kwargs.get("input_ids"), kwargs.get("position_ids")
    if not isinstance(ids, torch.Tensor) or not isinstance(pos, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1:
        return False
    cfg = inner.config
    if cfg._attn_implementation != ATTN_IMPLEMENTATION or cfg.output_hidden_states or cfg.output_attentions:
        return False
    if ids.device.type != "cpu" or inner.norm.weight.dtype not in (torch.float32, torch.bfloat16):
        return False
    try:
        get_metadata()
    except RuntimeError:  # not inside an engine step
        return False
    return True


def _model_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    """LlamaModel.forward for an engine step with the fused kernels; HF's own forward for anything else."""
    state: _Fused = getattr(self, _STATE)
    kernel = cpu_kernels.load()
    if kernel is None or not _engine_step(self, args, kwargs):
        return state.hf_forward(*args, **kwargs)
    if kwargs["input_ids"].shape[1] > SCALAR_MAX_ROWS and not kernel.fused_vectorized():
        return state.hf_forward(*args, **kwargs)
    from transformers.modeling_outputs import BaseModelOutputWithPast

    position_ids = kwargs["position_ids"]
    h = self.embed_tokens(kwargs["input_ids"])  # [1, T, hidden]: a new tensor, the residual stream (updated in place)
    if h.dtype != self.norm.weight.dtype:
        return state.hf_forward(*args, **kwargs)
    d = state.head_dim
    cos, sin = self.rotary_emb(h, position_ids=position_ids)  # [1, T, D] in the model dtype, as HF's layers get them
    if cos.shape[-1] != d:
        return state.hf_forward(*args, **kwargs)
    state.steps += 1
    t = h.shape[1]
    cos, sin = cos.reshape(t, d).contiguous(), sin.reshape(t, d).contiguous()
    delta: torch.Tensor | None = None  # the previous layer's MLP output, not yet added to h
    for layer in self.layers[: self.config.num_hidden_layers]:
        attn, mlp, norm = layer.self_attn, layer.mlp, layer.input_layernorm
        if delta is None:
            x = kernel.fused_rms_norm(h, norm.weight, norm.variance_epsilon)
        else:  # h += delta; delta = norm(h)
            x = kernel.fused_add_rms_norm(h, delta, norm.weight, norm.variance_epsilon)
        qkv = getattr(attn, "_batchery_qkv", None)  # the three projections in one pass (fast_linear)
        q, k, v = qkv(x) if qkv is not None else (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x))  # [1, T, heads * D]
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        kernel.fused_rope(q, k, cos, sin)
        # as LlamaAttention.forward calls the attention function: [1, heads, T, D] views
        out, _ = paged_attention_forward(
            attn,
            q.view(1, t, -1, d).transpose(1, 2),
            k.view(1, t, -1, d).transpose(1, 2),
            v.view(1, t, -1, d).transpose(1, 2),
            None,
            dropout=0.0,
            scaling=attn.scaling,
            position_ids=position_ids,
        )
        o = attn.o_proj(out.reshape(1, t, -1).contiguous()).contiguous()
        norm = layer.post_attention_layernorm
        x = kernel.fused_add_rms_norm(h, o, norm.weight, norm.variance_epsilon)  # h += o; o = norm(h)
        gate_up = getattr(mlp, "_batchery_gate_up", None)  # both projections and the SiLU in one pass (fast_linear)
        if gate_up is not None and x.dtype == torch.bfloat16:
            act = gate_up(x)
        else:
            act = kernel.fused_silu_mul(mlp.gate_proj(x).contiguous(), mlp.up_proj(x).contiguous())
        delta = mlp.down_proj(act).contiguous()
    norm = self.norm
    if delta is None:
        h = kernel.fused_rms_norm(h, norm.weight, norm.variance_epsilon)
    else:
        h = kernel.fused_add_rms_norm(h, delta, norm.weight, norm.variance_epsilon)
    return BaseModelOutputWithPast(last_hidden_state=h)


def install(model: torch.nn.Module) -> int:
    """Route the model's decoder layers through the fused kernels where it can; returns how many (0: none)."""
    inner = getattr(model, "model", None)
    state = getattr(inner, _STATE, None)
    if isinstance(state, _Fused):  # installed before
        return state.num_layers
    if cpu_kernels.load() is None:
        return 0
    reason = _refusal(model)
    if reason is not None:
        log.info("fused decoder layers not installed: %s", reason)
        return 0
    assert inner is not None  # _refusal checked it is a LlamaModel
    layers = inner.layers[: inner.config.num_hidden_layers]
    setattr(inner, _STATE, _Fused(inner.forward, int(layers[0].self_attn.head_dim) if layers else 0, len(layers)))
    # a per-instance forward is how a torch module is rerouted without swapping its class
    inner.forward = types.MethodType(_model_forward, inner)
    log.info("%d decoder layers run with the fused CPU kernels", len(layers))
    return len(layers)


def uninstall(model: torch.nn.Module) -> bool:
    """Give the inner model HF's own forward back (benchmarks compare both); False when nothing was installed."""
    inner = getattr(model, "model", None)
    if not isinstance(getattr(inner, _STATE, None), _Fused):
        return False
    assert inner is not None
    del inner.forward
    delattr(inner, _STATE)
    return True


def installed(model: torch.nn.Module) -> bool:
    """Whether ``install`` routed this model's decoder layers through the fused kernels."""
    return isinstance(getattr(getattr(model, "model", None), _STATE, None), _Fused)


def fused_steps(model: torch.nn.Module) -> int:
    """How many forwards of the model took the fused path (0 when not installed)."""
    state = getattr(getattr(model, "model", None), _STATE, None)
    return state.steps if isinstance(state, _Fused) else 0
