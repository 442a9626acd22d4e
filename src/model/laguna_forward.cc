#include "model/laguna_forward.h"

#include <algorithm>

namespace dl {

Status LagunaForward(const ModelConfig& c, const LagunaWeights& w, const ForwardBatch& batch,
                     LagunaOps& ops) {
  DL_RETURN_IF_ERROR(ops.Embed(w.embed));
  if (w.embed_vocab_parallel) DL_RETURN_IF_ERROR(ops.AllReduce(PartialSum::kEmbedding));
  size_t next_tap = 0;
  for (int32_t l = 0; l < static_cast<int32_t>(c.num_hidden_layers); ++l) {
    const LagunaLayerWeights& L = w.layers[l];
    // Attention block: pre-norm (the first layer's residual is the embedding, nothing to add).
    DL_RETURN_IF_ERROR(ops.AddRmsNorm(L.input_norm, /*add_delta=*/l > 0));
    DL_RETURN_IF_ERROR(ops.Linear(L.qkvg, Act::kNormed, Act::kQkvg));
    DL_RETURN_IF_ERROR(ops.QkNormRopeAppend(l, L));
    DL_RETURN_IF_ERROR(ops.Attention(l));
    DL_RETURN_IF_ERROR(ops.Linear(L.o, Act::kAttention, Act::kDelta));
    DL_RETURN_IF_ERROR(ops.AllReduce(PartialSum::kDelta));  // o_proj is row-parallel
    // MLP block.
    DL_RETURN_IF_ERROR(ops.AddRmsNorm(L.post_attn_norm, /*add_delta=*/true));
    if (c.is_sparse(l)) {
      DL_RETURN_IF_ERROR(ops.Moe(l, L.moe));
    } else {
      DL_RETURN_IF_ERROR(ops.Linear(L.mlp_gate_up, Act::kNormed, Act::kGateUp));
      DL_RETURN_IF_ERROR(ops.SiluMul());
      DL_RETURN_IF_ERROR(ops.Linear(L.mlp_down, Act::kHidden, Act::kDelta));
    }
    DL_RETURN_IF_ERROR(ops.AllReduce(PartialSum::kDelta));  // experts and down are width-parallel
    if (next_tap < batch.hidden_taps.size() && batch.hidden_taps[next_tap] == l) {
      DL_RETURN_IF_ERROR(ops.TapHidden(static_cast<int32_t>(next_tap++)));
    }
  }
  if (next_tap != batch.hidden_taps.size()) {
    return InvalidArgument("hidden tap at layer {} is beyond the model's {} layers",
                           batch.hidden_taps[next_tap], c.num_hidden_layers);
  }
  if (batch.outputs.empty()) return Status::Ok();
  DL_RETURN_IF_ERROR(ops.OutputNorm(w.final_norm));
  DL_RETURN_IF_ERROR(ops.Linear(w.lm_head, Act::kOutputNormed, Act::kLogits));
  return ops.SelectTokens();
}

LagunaWeights HostLagunaWeights(const ModelWeights& w) {
  LagunaWeights out;
  out.embed = w.embed;
  out.final_norm = w.final_norm;
  out.lm_head.parts = {w.lm_head};
  for (const LayerWeights& lw : w.layers) {
    LagunaLayerWeights L;
    L.input_norm = lw.input_norm;
    L.post_attn_norm = lw.post_attn_norm;
    L.qkvg.parts = {lw.q, lw.k, lw.v, lw.g};
    L.o.parts = {lw.o};
    L.q_norm = lw.q_norm;
    L.k_norm = lw.k_norm;
    if (!lw.mlp_gate.shape.empty()) {  // shape-only checkpoints have views without data
      L.mlp_gate_up.parts = {lw.mlp_gate, lw.mlp_up};
      L.mlp_down.parts = {lw.mlp_down};
    }
    if (!lw.experts.empty()) {
      MoeWeights& m = L.moe;
      m.router = lw.router;
      m.correction_bias = lw.correction_bias;
      for (const ExpertWeights& e : lw.experts) {
        m.gate.push_back(e.gate);
        m.up.push_back(e.up);
        m.down.push_back(e.down);
      }
      m.shared_gate = lw.shared.gate;
      m.shared_up = lw.shared.up;
      m.shared_down = lw.shared.down;
    }
    out.layers.push_back(std::move(L));
  }
  return out;
}

}  // namespace dl
