#include "backend/cuda_weights.h"

#if defined(DECODELAB_HAVE_CUDA)
#include <cuda_runtime.h>

#include <algorithm>
#include <unordered_map>

#include "base/rng.h"
#include "cuda/check.h"
#include "kernels/elementwise.h"
#include "model/synthetic.h"
#endif

namespace dl {

#if defined(DECODELAB_HAVE_CUDA)

using kernels::bf16;

// Uploads tensors into buffers it owns and describes them as WeightRefs.
class CudaWeightsBuilder {
 public:
  CudaWeightsBuilder(CudaWeights& w, const Checkpoint& ck, uint64_t seed, cudaStream_t s) : w_(w), s_(s) {
    synthetic_seed_ = seed;
    if (ck.files().empty()) {
      for (TensorSpec& spec : CheckpointTensorSpecs(ck.config())) specs_[spec.name] = spec;
    }
  }

  // One BF16 [rows, cols] matrix (or vector) made of `parts` stacked along the rows.
  Result<WeightRef> Stacked(const std::vector<const TensorView*>& parts) {
    int64_t rows = 0;
    const int64_t cols = parts[0]->shape.size() > 1 ? parts[0]->shape[1] : 1;
    for (const TensorView* p : parts) rows += p->shape[0];
    DL_ASSIGN_OR_RETURN(auto buf, cuda::DeviceBuffer::Create(static_cast<size_t>(rows * cols) * 2));
    int64_t off = 0;
    for (const TensorView* p : parts) {
      DL_RETURN_IF_ERROR(UploadAt(*p, buf.as<uint16_t>() + off).WithContext(p->name));
      off += p->numel();
    }
    WeightRef ref;
    ref.name = parts[0]->name;
    ref.dtype = DType::kBF16;
    ref.shape = parts[0]->shape.size() > 1 ? std::vector<int64_t>{rows, cols} : std::vector<int64_t>{rows};
    ref.data = buf.data();
    Keep(std::move(buf));
    return ref;
  }
  Result<WeightRef> One(const TensorView& t) { return Stacked({&t}); }
  Result<LinearWeights> Linear(const std::vector<const TensorView*>& parts) {
    LinearWeights lw;
    DL_ASSIGN_OR_RETURN(WeightRef r, Stacked(parts));
    lw.parts.push_back(std::move(r));
    return lw;
  }
  // Every expert's `which` matrix stacked, its per-expert refs and a device array of their pointers.
  Status Experts(const std::vector<ExpertWeights>& experts, TensorView ExpertWeights::*which,
                 std::vector<WeightRef>* refs, const void** table) {
    const int64_t per = (experts[0].*which).numel();
    DL_ASSIGN_OR_RETURN(auto stacked, cuda::DeviceBuffer::Create(static_cast<size_t>(per) * experts.size() * 2));
    std::vector<const void*> ptrs;
    for (const ExpertWeights& e : experts) {
      const TensorView& t = e.*which;
      void* dst = stacked.as<uint16_t>() + static_cast<int64_t>(ptrs.size()) * per;
      DL_RETURN_IF_ERROR(UploadAt(t, dst).WithContext(t.name));
      WeightRef r;
      r.name = t.name;
      r.shape = t.shape;
      r.data = dst;
      refs->push_back(std::move(r));
      ptrs.push_back(dst);
    }
    DL_ASSIGN_OR_RETURN(auto table_buf, cuda::DeviceBuffer::Create(ptrs.size() * sizeof(void*)));
    DL_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(table_buf.data(), ptrs.data(), ptrs.size() * sizeof(void*), cudaMemcpyHostToDevice));
    *table = table_buf.data();
    Keep(std::move(stacked));
    Keep(std::move(table_buf));
    return Status::Ok();
  }

 private:
  void Keep(cuda::DeviceBuffer b) {
    w_.bytes_ += b.size();
    w_.buffers_.push_back(std::move(b));
  }
  // Copies a tensor to the device as BF16 (converting F32/F16 on the host in chunks), or generates it
  // there when the view has no data (shape-only checkpoint).
  Status UploadAt(const TensorView& t, void* dst) {
    if (t.data == nullptr) {
      auto it = specs_.find(t.name);
      if (it == specs_.end()) return Internal("tensor {} has no data and no synthetic spec", t.name);
      float scale = 0, offset = 0;
      TensorValueAffine(it->second.kind, it->second.fan_in, &scale, &offset);
      return kernels::FillAffineBf16(static_cast<bf16*>(dst), t.numel(), StreamKey(synthetic_seed_, t.name), scale,
                                     offset, s_);
    }
    if (t.dtype == DType::kBF16) {
      DL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, t.data, t.nbytes(), cudaMemcpyHostToDevice, s_));
      return cudaStreamSynchronize(s_) == cudaSuccess ? Status::Ok() : Internal("upload of {} failed", t.name);
    }
    if (t.dtype == DType::kF8E4M3) {
      return Unimplemented("{}: FP8 weights are not supported by the CUDA backend yet", t.name);
    }
    const int64_t n = t.numel();
    const int64_t chunk = 1 << 22;
    std::vector<uint16_t> staging(static_cast<size_t>(std::min(n, chunk)));
    for (int64_t i = 0; i < n; i += chunk) {
      const int64_t m = std::min(chunk, n - i);
      for (int64_t j = 0; j < m; ++j) staging[j] = FloatToBf16(t.at(i + j));
      DL_CUDA_RETURN_IF_ERROR(
          cudaMemcpy(static_cast<uint16_t*>(dst) + i, staging.data(), m * 2, cudaMemcpyHostToDevice));
    }
    return Status::Ok();
  }

  CudaWeights& w_;
  cudaStream_t s_;
  uint64_t synthetic_seed_ = 0;
  std::unordered_map<std::string, TensorSpec> specs_;
};

Result<std::unique_ptr<CudaWeights>> CudaWeights::Upload(const Checkpoint& ck, uint64_t synthetic_seed,
                                                         CUstream_st* stream) {
  std::unique_ptr<CudaWeights> w(new CudaWeights());
  CudaWeightsBuilder b(*w, ck, synthetic_seed, stream);
  const ModelWeights& mw = ck.weights();
  LagunaWeights& r = w->refs_;
  DL_ASSIGN_OR_RETURN(r.embed, b.One(mw.embed));
  DL_ASSIGN_OR_RETURN(r.final_norm, b.One(mw.final_norm));
  DL_ASSIGN_OR_RETURN(r.lm_head, b.Linear({&mw.lm_head}));
  w->tables_.resize(mw.layers.size());
  for (size_t l = 0; l < mw.layers.size(); ++l) {
    const LayerWeights& lw = mw.layers[l];
    LagunaLayerWeights L;
    DL_ASSIGN_OR_RETURN(L.qkvg, b.Linear({&lw.q, &lw.k, &lw.v, &lw.g}));
    DL_ASSIGN_OR_RETURN(L.o, b.Linear({&lw.o}));
    DL_ASSIGN_OR_RETURN(L.input_norm, b.One(lw.input_norm));
    DL_ASSIGN_OR_RETURN(L.post_attn_norm, b.One(lw.post_attn_norm));
    DL_ASSIGN_OR_RETURN(L.q_norm, b.One(lw.q_norm));
    DL_ASSIGN_OR_RETURN(L.k_norm, b.One(lw.k_norm));
    if (!lw.experts.empty()) {
      MoeWeights& m = L.moe;
      DL_ASSIGN_OR_RETURN(m.router, b.One(lw.router));
      DL_ASSIGN_OR_RETURN(m.correction_bias, b.One(lw.correction_bias));
      ExpertTables& t = w->tables_[l];
      DL_RETURN_IF_ERROR(b.Experts(lw.experts, &ExpertWeights::gate, &m.gate, &t.gate));
      DL_RETURN_IF_ERROR(b.Experts(lw.experts, &ExpertWeights::up, &m.up, &t.up));
      DL_RETURN_IF_ERROR(b.Experts(lw.experts, &ExpertWeights::down, &m.down, &t.down));
      DL_ASSIGN_OR_RETURN(m.shared_gate, b.One(lw.shared.gate));
      DL_ASSIGN_OR_RETURN(m.shared_up, b.One(lw.shared.up));
      DL_ASSIGN_OR_RETURN(m.shared_down, b.One(lw.shared.down));
    } else {
      DL_ASSIGN_OR_RETURN(L.mlp_gate_up, b.Linear({&lw.mlp_gate, &lw.mlp_up}));
      DL_ASSIGN_OR_RETURN(L.mlp_down, b.Linear({&lw.mlp_down}));
    }
    r.layers.push_back(std::move(L));
  }
  DL_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return w;
}

#else

Result<std::unique_ptr<CudaWeights>> CudaWeights::Upload(const Checkpoint&, uint64_t, CUstream_st*) {
  return Unavailable("this build of decodelab has no CUDA backend");
}

#endif

}  // namespace dl
