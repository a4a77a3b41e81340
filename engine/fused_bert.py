"""BERT-family encoder layers on the CPU kernels, in bf16: the pooling runner's step without transformers' layer code.

transformers' ``BertLayer`` runs about twenty torch ops a layer: three q/k/v projections, reshapes, the attention
function, the output dense, a residual add and a LayerNorm, the intermediate dense and its GELU, the output dense, a
second add and LayerNorm. On a 2-core CPU their dispatch and Python left the second core idle for about an eighth
of a bf16 all-MiniLM-L6-v2 pass (``perf``: the OpenMP worker spinning), and the GELU, adds and norms each read and wrote
whole activations. Here a layer is seven kernel calls on [T, hidden] rows, into buffers kept across steps
(``linear_bf16_into``):

1. ``linear_bf16_into`` with q, k and v packed as one weight (3 x hidden columns, one pass over the input);
2. ``cpu_prefill.segment_attention`` reading q, k and v in place from that output (each input attends its own rows,
   bidirectionally, as ``encoder_runner.packed_attention_forward`` does);
3. ``linear_bf16_into`` (attention output dense), then ``fused_add_layer_norm`` in place (the residual add and the
   norm in one pass);
4. ``linear_bf16_into(..., gelu=True)``: the intermediate dense with GELU in the tile's epilogue (the bits of the
   dense then ``fused_gelu``, without writing and reading back the projection);
5. ``linear_bf16_into`` (output dense), then ``fused_add_layer_norm``.

The embeddings (word + position + token type, LayerNorm) stay the model's own module, once a step. Every kernel works
row by row (the linears' sums never depend on the row count; attention stays within an input), so an input's vector
does not depend on what shares its step. Only for what ``eligible`` accepts: bf16 on the CPU with the AVX512-BF16
kernels, the BERT layer layout with absolute positions and exact GELU, head_dim a multiple of 32; anything else keeps
transformers' modules (with ``fast_linear`` and ``fused_gelu``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from batchery.engine import cpu_kernels
from batchery.engine.attention import cpu_prefill

log = logging.getLogger("batchery.engine.pooling")


@dataclass
class _Layer:
    wqkv: torch.Tensor  # pack_bf16 of [query; key; value] weights: [3 * hidden, hidden]
    bqkv: torch.Tensor  # fp32 [3 * hidden]
    wo: torch.Tensor  # attention output dense
    bo: torch.Tensor
    ln1: tuple[torch.Tensor, torch.Tensor, float]  # attention output LayerNorm: weight, bias, eps
    wi: torch.Tensor  # intermediate dense (GELU in its epilogue)
    bi: torch.Tensor
    wo2: torch.Tensor  # output dense
    bo2: torch.Tensor
    ln2: tuple[torch.Tensor, torch.Tensor, float]


def _gelu_exact(act: Any) -> bool:
    from transformers.activations import GELUActivation

    return type(act) is GELUActivation and act.act is F.gelu


def eligible(model: Any, dtype: torch.dtype, device: torch.device) -> str | None:
    """None when ``FusedEncoder`` runs this model; else why not (logged)."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return "bf16 on the CPU only"
    kernels = cpu_kernels.load()
    if kernels is None or not kernels.has_bf16_silu() or not cpu_prefill.available():  # the vdpbf16ps tiles
        return "the CPU kernels have no AVX512-BF16 tiles here"
    cfg: Any = getattr(model, "config", None)
    if getattr(cfg, "model_type", None) != "bert" or getattr(cfg, "is_decoder", False):
        return "not a BERT encoder"
    if getattr(cfg, "position_embedding_type", "absolute") not in (None, "absolute"):
        return "relative position embeddings"
    layers = getattr(getattr(model, "encoder", None), "layer", None)
    if not layers or getattr(model, "embeddings", None) is None:
        return "no encoder layers"
    hidden, heads = int(cfg.hidden_size), int(cfg.num_attention_heads)
    if hidden % heads or (hidden // heads) % 32 or hidden % 64:
        return "head_dim not a multiple of 32 or hidden not a multiple of 64"
    for layer in layers:
        try:
            sa, ao, inter, out = layer.attention.self, layer.attention.output, layer.intermediate, layer.output
            linears = (sa.query, sa.key, sa.value, ao.dense, inter.dense, out.dense)
            norms = (ao.LayerNorm, out.LayerNorm)
        except AttributeError:
            return "not the BERT layer layout"
        if not all(isinstance(m, torch.nn.Linear) and m.bias is not None for m in linears):
            return "a projection without bias"
        if not all(isinstance(m, torch.nn.LayerNorm) and m.elementwise_affine and m.bias is not None for m in norms):
            return "a norm that is not an affine LayerNorm"
        if not _gelu_exact(inter.intermediate_act_fn) or inter.dense.out_features % 16:
            return "an activation other than exact GELU"
        if getattr(layer, "crossattention", None) is not None:
            return "cross-attention"
    return None


class FusedEncoder:
    """``forward(input_ids, position_ids, token_type_ids, seqs) -> [T, hidden]``: the model's last hidden state for
    one packed row of inputs (``seqs``: ``cpu_prefill.segments_array`` of their bounds)."""

    def __init__(self, model: Any) -> None:
        kernels = cpu_kernels.load()
        assert kernels is not None
        self.kernels = kernels
        self.embeddings: Any = model.embeddings
        cfg = model.config
        self.hidden = int(cfg.hidden_size)
        self.heads = int(cfg.num_attention_heads)
        self.head_dim = self.hidden // self.heads
        self.scale = self.head_dim**-0.5
        self.layers: list[_Layer] = []
        with torch.no_grad():
            for layer in model.encoder.layer:
                sa, ao, inter, out = layer.attention.self, layer.attention.output, layer.intermediate, layer.output
                wqkv = torch.cat([sa.query.weight, sa.key.weight, sa.value.weight]).detach()
                bqkv = torch.cat([sa.query.bias, sa.key.bias, sa.value.bias]).detach().float().contiguous()
                self.layers.append(
                    _Layer(
                        kernels.pack_bf16(wqkv.contiguous()),
                        bqkv,
                        kernels.pack_bf16(ao.dense.weight.detach().contiguous()),
                        ao.dense.bias.detach().float().contiguous(),
                        (ao.LayerNorm.weight.detach(), ao.LayerNorm.bias.detach(), float(ao.LayerNorm.eps)),
                        kernels.pack_bf16(inter.dense.weight.detach().contiguous()),
                        inter.dense.bias.detach().float().contiguous(),
                        kernels.pack_bf16(out.dense.weight.detach().contiguous()),
                        out.dense.bias.detach().float().contiguous(),
                        (out.LayerNorm.weight.detach(), out.LayerNorm.bias.detach(), float(out.LayerNorm.eps)),
                    )
                )
        self.intermediate = int(model.encoder.layer[0].intermediate.dense.out_features)
        self._buffers: dict[str, torch.Tensor] = {}
        self._rows = 0

    def _workspace(self, t: int, like: torch.Tensor) -> dict[str, torch.Tensor]:
        """The step's activation buffers ([t, ...] views of buffers kept across steps, grown to the largest step):
        fresh ones of these sizes are mapped and page-faulted in on every call (8% of a pass on the 2-core EPYC)."""
        if self._rows < t:
            h, i = self.hidden, self.intermediate
            mk = lambda n: like.new_empty(t, n)  # noqa: E731
            self._buffers = {"qkv": mk(3 * h), "ctx": mk(h), "a": mk(h), "b": mk(h), "inter": mk(i)}
            self._rows = t
        return {name: buf[:t] for name, buf in self._buffers.items()}

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None,
        seqs: torch.Tensor,
    ) -> torch.Tensor:
        """The last hidden state, [T, hidden]: a view of the workspace, valid until the next call (pool it first)."""
        k = self.kernels
        h, nh, d = self.hidden, self.heads, self.head_dim
        x = self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids)[0]
        x = x.contiguous()  # [T, hidden] bf16
        t = x.shape[0]
        ws = self._workspace(t, x)
        qkv, ctx, inter = ws["qkv"], ws["ctx"].view(t, nh, d), ws["inter"]
        spare = [ws["a"], ws["b"]]  # the residual stream alternates between these two
        for layer in self.layers:
            k.linear_bf16_into(x, layer.wqkv, 3 * h, layer.bqkv, qkv, False)  # [T, 3 * hidden]
            q, kk, v = (qkv[:, j * h : (j + 1) * h].view(t, nh, d) for j in range(3))
            cpu_prefill.segment_attention(q, kk, v, ctx, seqs, self.scale, False)
            a = spare[1] if x.data_ptr() == spare[0].data_ptr() else spare[0]
            k.linear_bf16_into(ctx.view(t, h), layer.wo, h, layer.bo, a, False)
            x = k.fused_add_layer_norm(a, x, *layer.ln1)  # a = LayerNorm(a + x)
            k.linear_bf16_into(x, layer.wi, self.intermediate, layer.bi, inter, True)  # GELU in the epilogue
            o = spare[1] if x.data_ptr() == spare[0].data_ptr() else spare[0]
            k.linear_bf16_into(inter, layer.wo2, h, layer.bo2, o, False)
            x = k.fused_add_layer_norm(o, x, *layer.ln2)
        return x


def install(model: Any, dtype: torch.dtype, device: torch.device) -> FusedEncoder | None:
    """A ``FusedEncoder`` for the model where ``eligible``; None (with the reason logged) otherwise."""
    why = eligible(model, dtype, device)
    if why is not None:
        log.info("pooling model on transformers' layers (%s)", why)
        return None
    return FusedEncoder(model)
