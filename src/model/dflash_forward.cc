#include "model/dflash_forward.h"

namespace dl {

Status DflashContextForward(const DflashConfig& c, const DflashWeights& w, const DraftBatch& batch, DflashOps& ops) {
  if (batch.contexts.empty()) return Status::Ok();
  // Fusion (§1.4): [per-slice norms,] fc, hidden_norm.
  if (c.aux_hidden_norms) {
    std::vector<WeightRef> norms(w.aux_norms.begin(), w.aux_norms.end());
    DL_RETURN_IF_ERROR(ops.NormTapSlices(norms));
  }
  DL_RETURN_IF_ERROR(ops.Linear(LinearWeights{{w.fc}}, DraftAct::kTaps, DraftAct::kContext));
  DL_RETURN_IF_ERROR(ops.RmsNorm(w.hidden_norm, DraftAct::kContext, DraftAct::kContext));
  // KV injection (§1.5): every draft layer's K/V of the context, computed once per position.
  for (int32_t l = 0; l < static_cast<int32_t>(c.num_hidden_layers); ++l) {
    const DflashLayerWeights& L = w.layers[l];
    DraftAct x = DraftAct::kContext;
    if (c.context_input_norm) {
      DL_RETURN_IF_ERROR(ops.RmsNorm(L.input_norm, DraftAct::kContext, DraftAct::kContextNormed));
      x = DraftAct::kContextNormed;
    }
    DL_RETURN_IF_ERROR(ops.Linear(LinearWeights{{L.k, L.v}}, x, DraftAct::kContextKv));
    DL_RETURN_IF_ERROR(ops.AppendContextKv(l, L.k_norm));
  }
  return Status::Ok();
}

Status DflashBlockForward(const DflashConfig& c, const DflashWeights& w, const WeightRef& target_embed,
                          const LinearWeights& target_lm_head, const DraftBatch& batch, DflashOps& ops) {
  if (batch.blocks.empty()) return Status::Ok();
  DL_RETURN_IF_ERROR(ops.Embed(target_embed));
  for (int32_t l = 0; l < static_cast<int32_t>(c.num_hidden_layers); ++l) {
    const DflashLayerWeights& L = w.layers[l];
    DL_RETURN_IF_ERROR(ops.AddRmsNorm(L.input_norm, /*add_delta=*/l > 0));
    LinearWeights qkvg{{L.q, L.k, L.v}};
    if (c.per_head_gate) qkvg.parts.push_back(L.g);
    DL_RETURN_IF_ERROR(ops.Linear(qkvg, DraftAct::kNormed, DraftAct::kQkvg));
    DL_RETURN_IF_ERROR(ops.BlockAttention(l, L.q_norm, L.k_norm));
    DL_RETURN_IF_ERROR(ops.Linear(LinearWeights{{L.o}}, DraftAct::kAttention, DraftAct::kDelta));
    DL_RETURN_IF_ERROR(ops.AddRmsNorm(L.post_attn_norm, /*add_delta=*/true));
    DL_RETURN_IF_ERROR(ops.Linear(LinearWeights{{L.gate, L.up}}, DraftAct::kNormed, DraftAct::kGateUp));
    DL_RETURN_IF_ERROR(ops.SiluMul());
    DL_RETURN_IF_ERROR(ops.Linear(LinearWeights{{L.down}}, DraftAct::kHidden, DraftAct::kDelta));
  }
  // §1.8: the drafter's final norm, then the target's LM head on the mask rows asked for.
  DL_RETURN_IF_ERROR(ops.OutputNorm(w.norm));
  DL_RETURN_IF_ERROR(ops.Linear(target_lm_head, DraftAct::kOutputNormed, DraftAct::kLogits));
  return ops.SelectTokens();
}

}  // namespace dl
