#include "backend/cuda_weights.h"

#if defined(DECODELAB_HAVE_CUDA)
#include <cuda_runtime.h>

#include <algorithm>
#include <unordered_map>

#include "base/rng.h"
#include "cuda/check.h"
#include "kernels/elementwise.h"
#include "model/backend_support.h"
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

  // Whether a host tensor goes to the device as FP8 (in a file or as a shape-only view).
  static bool IsFp8(const WeightRef& t) { return t.dtype == DType::kF8E4M3; }
  // The FP8 block shape the device copy of t will have: its own, or for a shape-only tensor that
  // names none, the synthetic 128 x 128.
  void Fp8Blocks(const WeightRef& t, int64_t* br, int64_t* bc) const {
    if (t.data == nullptr && (t.block_rows < 1 || t.block_cols < 1)) {
      *br = *bc = kSyntheticFp8Block;
    } else {
      *br = t.block_rows, *bc = t.block_cols;
    }
  }
  // An FP8 tensor the kernels can run (model/backend_support.h).
  Status CheckFp8(const WeightRef& t) const {
    int64_t br = 0, bc = 0;
    Fp8Blocks(t, &br, &bc);
    return CheckCudaFp8WeightSupport(t.name, t.cols(), bc);
  }

  // One [rows, cols] matrix (or vector) made of `parts` stacked along the rows, all of one kind: BF16
  // (any host dtype but FP8) or FP8 (same block shape and width; every part but the last a whole
  // number of block rows, so the scale matrices stack too).
  Result<WeightRef> Stacked(const std::vector<const WeightRef*>& parts) {
    int64_t rows = 0;
    const int64_t cols = parts[0]->cols();
    for (const WeightRef* p : parts) rows += p->rows();
    WeightRef ref;
    ref.name = parts[0]->name;
    ref.shape = parts[0]->shape.size() > 1 ? std::vector<int64_t>{rows, cols} : std::vector<int64_t>{rows};
    if (!IsFp8(*parts[0])) {
      DL_ASSIGN_OR_RETURN(auto buf, cuda::DeviceBuffer::Create(static_cast<size_t>(rows * cols) * 2));
      int64_t off = 0;
      for (const WeightRef* p : parts) {
        DL_RETURN_IF_ERROR(UploadBf16(*p, buf.as<uint16_t>() + off).WithContext(p->name));
        off += p->numel();
      }
      ref.dtype = DType::kBF16;
      ref.data = buf.data();
      Keep(std::move(buf));
      return ref;
    }
    for (const WeightRef* p : parts) DL_RETURN_IF_ERROR(CheckFp8(*p));
    int64_t br = 0, bc = 0;
    Fp8Blocks(*parts[0], &br, &bc);
    const int64_t scale_cols = (cols + bc - 1) / bc;
    int64_t scale_rows = 0;
    for (const WeightRef* p : parts) scale_rows += (p->rows() + br - 1) / br;
    DL_ASSIGN_OR_RETURN(auto codes, cuda::DeviceBuffer::Create(static_cast<size_t>(rows * cols)));
    DL_ASSIGN_OR_RETURN(auto scales, cuda::DeviceBuffer::Create(static_cast<size_t>(scale_rows * scale_cols) * 4));
    int64_t off = 0, soff = 0;
    for (const WeightRef* p : parts) {
      DL_RETURN_IF_ERROR(UploadFp8(*p, codes.as<uint8_t>() + off, scales.as<float>() + soff).WithContext(p->name));
      off += p->numel();
      soff += (p->rows() + br - 1) / br * scale_cols;
    }
    ref.dtype = DType::kF8E4M3;
    ref.data = codes.data();
    ref.scales = scales.as<float>();
    ref.block_rows = br, ref.block_cols = bc;
    Keep(std::move(codes));
    Keep(std::move(scales));
    return ref;
  }
  // A tensor the kernels read as BF16 (embedding, norms, router, correction bias).
  Result<WeightRef> One(const WeightRef& t) {
    if (IsFp8(t)) {
      return Unimplemented("{}: FP8 here is not supported by the CUDA backend (embedding, norms, router and "
                           "correction bias stay BF16 in every Laguna FP8 layout)", t.name);
    }
    return Stacked({&t});
  }
  // A linear layer's parts, consecutive compatible parts stacked into one matrix.
  Result<LinearWeights> Linear(const LinearWeights& host) {
    LinearWeights lw;
    std::vector<const WeightRef*> group;
    int64_t group_rows = 0;
    auto flush = [&]() -> Status {
      if (group.empty()) return Status::Ok();
      DL_ASSIGN_OR_RETURN(WeightRef r, Stacked(group));
      lw.parts.push_back(std::move(r));
      group.clear();
      group_rows = 0;
      return Status::Ok();
    };
    for (const WeightRef& p : host.parts) {
      if (p.empty()) continue;
      if (!group.empty()) {
        const WeightRef& first = *group[0];
        bool joins = IsFp8(first) == IsFp8(p) && first.cols() == p.cols();
        if (joins && IsFp8(p)) {
          int64_t br0, bc0, br, bc;
          Fp8Blocks(first, &br0, &bc0);
          Fp8Blocks(p, &br, &bc);
          joins = br0 == br && bc0 == bc && group_rows % br == 0;
        }
        if (!joins) DL_RETURN_IF_ERROR(flush());
      }
      group.push_back(&p);
      group_rows += p.rows();
    }
    DL_RETURN_IF_ERROR(flush());
    return lw;
  }
  // Every expert's matrix (one kind: gate, up or down) stacked, its per-expert refs and device arrays
  // of their pointers (and, for FP8, of their scale pointers). Every expert of the kind has one dtype.
  Status Experts(const std::vector<WeightRef>& experts, std::vector<WeightRef>* refs, const void** table,
                 const void** scale_table) {
    const bool fp8 = IsFp8(experts[0]);
    for (const WeightRef& e : experts) {
      if (IsFp8(e) != fp8) {
        return Unimplemented("{}: the CUDA backend needs every routed expert of a layer in one dtype ({} is {})", e.name,
                             experts[0].name, fp8 ? "FP8" : "not FP8");
      }
    }
    const int64_t per = experts[0].numel();
    int64_t br = 0, bc = 0;
    if (fp8) {
      Fp8Blocks(experts[0], &br, &bc);
      DL_RETURN_IF_ERROR(CheckFp8(experts[0]));
    }
    const int64_t per_scales = fp8 ? (experts[0].rows() + br - 1) / br * ((experts[0].cols() + bc - 1) / bc) : 0;
    DL_ASSIGN_OR_RETURN(auto stacked, cuda::DeviceBuffer::Create(static_cast<size_t>(per) * experts.size() * (fp8 ? 1 : 2)));
    DL_ASSIGN_OR_RETURN(auto scales, cuda::DeviceBuffer::Create(std::max<size_t>(static_cast<size_t>(per_scales) * experts.size() * 4, 16)));
    std::vector<const void*> ptrs, scale_ptrs;
    for (const WeightRef& t : experts) {
      if (t.numel() != per || (fp8 && t.data != nullptr && (t.block_rows != br || t.block_cols != bc))) {
        return Unimplemented("{}: the CUDA backend needs every routed expert of a layer in one shape and block shape",
                             t.name);
      }
      const size_t i = ptrs.size();
      WeightRef r;
      r.name = t.name;
      r.shape = t.shape;
      if (fp8) {
        uint8_t* dst = stacked.as<uint8_t>() + static_cast<int64_t>(i) * per;
        float* sdst = scales.as<float>() + static_cast<int64_t>(i) * per_scales;
        DL_RETURN_IF_ERROR(UploadFp8(t, dst, sdst).WithContext(t.name));
        r.dtype = DType::kF8E4M3, r.data = dst, r.scales = sdst, r.block_rows = br, r.block_cols = bc;
        scale_ptrs.push_back(sdst);
      } else {
        void* dst = stacked.as<uint16_t>() + static_cast<int64_t>(i) * per;
        DL_RETURN_IF_ERROR(UploadBf16(t, dst).WithContext(t.name));
        r.dtype = DType::kBF16, r.data = dst;
      }
      ptrs.push_back(r.data);
      refs->push_back(std::move(r));
    }
    DL_ASSIGN_OR_RETURN(const void* t, PointerArray(ptrs));
    *table = t;
    if (fp8) {
      DL_ASSIGN_OR_RETURN(const void* st, PointerArray(scale_ptrs));
      *scale_table = st;
      Keep(std::move(scales));
    }
    Keep(std::move(stacked));
    return Status::Ok();
  }

 private:
  void Keep(cuda::DeviceBuffer b) {
    w_.bytes_ += b.size();
    w_.buffers_.push_back(std::move(b));
  }
  Result<const void*> PointerArray(const std::vector<const void*>& ptrs) {
    DL_ASSIGN_OR_RETURN(auto buf, cuda::DeviceBuffer::Create(ptrs.size() * sizeof(void*)));
    DL_CUDA_RETURN_IF_ERROR(cudaMemcpy(buf.data(), ptrs.data(), ptrs.size() * sizeof(void*), cudaMemcpyHostToDevice));
    const void* p = buf.data();
    Keep(std::move(buf));
    return p;
  }
  Result<TensorSpec> SpecOf(const WeightRef& t) const {
    auto it = specs_.find(t.name);
    if (it == specs_.end()) return Internal("tensor {} has no data and no synthetic spec", t.name);
    return it->second;
  }
  // Copies a tensor to the device as BF16 (converting F32/F16 on the host in chunks), or generates it
  // there when the view has no data (shape-only checkpoint).
  Status UploadBf16(const WeightRef& t, void* dst) {
    if (t.data == nullptr) {
      DL_ASSIGN_OR_RETURN(TensorSpec spec, SpecOf(t));
      float scale = 0, offset = 0;
      TensorValueAffine(spec.kind, spec.fan_in, &scale, &offset);
      return kernels::FillAffineBf16(static_cast<bf16*>(dst), t.numel(), StreamKey(synthetic_seed_, t.name), scale,
                                     offset, s_);
    }
    if (t.dtype == DType::kBF16) {
      DL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, t.data, static_cast<size_t>(t.numel()) * 2, cudaMemcpyHostToDevice, s_));
      return cudaStreamSynchronize(s_) == cudaSuccess ? Status::Ok() : Internal("upload of {} failed", t.name);
    }
    if (t.dtype == DType::kF8E4M3) return Internal("{}: an FP8 tensor reached the BF16 upload", t.name);
    const int64_t n = t.numel();
    const int64_t chunk = 1 << 22;
    std::vector<uint16_t> staging(static_cast<size_t>(std::min(n, chunk)));
    for (int64_t i = 0; i < n; i += chunk) {
      const int64_t m = std::min(chunk, n - i);
      for (int64_t j = 0; j < m; ++j) staging[j] = FloatToBf16(LoadAsFloat(t.data, t.dtype, static_cast<size_t>(i + j)));
      DL_CUDA_RETURN_IF_ERROR(
          cudaMemcpy(static_cast<uint16_t*>(dst) + i, staging.data(), m * 2, cudaMemcpyHostToDevice));
    }
    return Status::Ok();
  }
  // Copies an FP8 tensor's codes and scales unchanged, or generates them on the device (shape-only:
  // the synthetic value quantised by the FP8 contract's rule, in its block shape or 128 x 128).
  Status UploadFp8(const WeightRef& t, uint8_t* dst, float* scales_dst) {
    const int64_t rows = t.rows(), cols = t.cols();
    if (t.data == nullptr) {
      DL_ASSIGN_OR_RETURN(TensorSpec spec, SpecOf(t));
      float scale = 0, offset = 0;
      TensorValueAffine(spec.kind, spec.fan_in, &scale, &offset);
      int64_t br = 0, bc = 0;
      Fp8Blocks(t, &br, &bc);
      return kernels::FillAffineFp8(dst, scales_dst, rows, cols, static_cast<int>(br), static_cast<int>(bc),
                                    StreamKey(synthetic_seed_, t.name), scale, offset, s_);
    }
    if (t.scales == nullptr || t.block_rows < 1 || t.block_cols < 1) {
      return InvalidArgument("{}: an FP8 weight needs its scales and block shape (the FP8 weight contract)", t.name);
    }
    const int64_t n_scales = (rows + t.block_rows - 1) / t.block_rows * ((cols + t.block_cols - 1) / t.block_cols);
    DL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, t.data, static_cast<size_t>(rows * cols), cudaMemcpyHostToDevice, s_));
    DL_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(scales_dst, t.scales, static_cast<size_t>(n_scales) * 4, cudaMemcpyHostToDevice, s_));
    return cudaStreamSynchronize(s_) == cudaSuccess ? Status::Ok() : Internal("upload of {} failed", t.name);
  }

  CudaWeights& w_;
  cudaStream_t s_;
  uint64_t synthetic_seed_ = 0;
  std::unordered_map<std::string, TensorSpec> specs_;
};

Result<std::unique_ptr<CudaWeights>> CudaWeights::Upload(const Checkpoint& ck, uint64_t synthetic_seed,
                                                         CUstream_st* stream) {
  // The host's description of every weight (dtype, data, FP8 scales and block shape).
  return UploadHost(ck, HostLagunaWeights(ck.weights()), synthetic_seed, stream);
}

Result<std::unique_ptr<CudaWeights>> CudaWeights::UploadHost(const Checkpoint& ck, const LagunaWeights& host,
                                                             uint64_t synthetic_seed, CUstream_st* stream) {
  std::unique_ptr<CudaWeights> w(new CudaWeights());
  CudaWeightsBuilder b(*w, ck, synthetic_seed, stream);
  LagunaWeights& r = w->refs_;
  r.embed_vocab_begin = host.embed_vocab_begin;
  r.lm_head_vocab_begin = host.lm_head_vocab_begin;
  r.embed_vocab_parallel = host.embed_vocab_parallel;
  DL_ASSIGN_OR_RETURN(r.embed, b.One(host.embed));
  DL_ASSIGN_OR_RETURN(r.final_norm, b.One(host.final_norm));
  DL_ASSIGN_OR_RETURN(r.lm_head, b.Linear(host.lm_head));
  w->tables_.resize(host.layers.size());
  for (size_t l = 0; l < host.layers.size(); ++l) {
    const LagunaLayerWeights& hl = host.layers[l];
    LagunaLayerWeights L;
    DL_ASSIGN_OR_RETURN(L.qkvg, b.Linear(hl.qkvg));
    DL_ASSIGN_OR_RETURN(L.o, b.Linear(hl.o));
    DL_ASSIGN_OR_RETURN(L.input_norm, b.One(hl.input_norm));
    DL_ASSIGN_OR_RETURN(L.post_attn_norm, b.One(hl.post_attn_norm));
    DL_ASSIGN_OR_RETURN(L.q_norm, b.One(hl.q_norm));
    DL_ASSIGN_OR_RETURN(L.k_norm, b.One(hl.k_norm));
    if (!hl.moe.gate.empty()) {
      const MoeWeights& hm = hl.moe;
      MoeWeights& m = L.moe;
      DL_ASSIGN_OR_RETURN(m.router, b.One(hm.router));
      DL_ASSIGN_OR_RETURN(m.correction_bias, b.One(hm.correction_bias));
      ExpertTables& t = w->tables_[l];
      DL_RETURN_IF_ERROR(b.Experts(hm.gate, &m.gate, &t.gate, &t.gate_scales));
      DL_RETURN_IF_ERROR(b.Experts(hm.up, &m.up, &t.up, &t.up_scales));
      DL_RETURN_IF_ERROR(b.Experts(hm.down, &m.down, &t.down, &t.down_scales));
      t.fp8 = m.gate[0].dtype == DType::kF8E4M3;
      if (m.up[0].dtype != m.gate[0].dtype || m.down[0].dtype != m.gate[0].dtype) {
        return Unimplemented("layer {}: the CUDA backend needs the routed experts' gate, up and down in one dtype", l);
      }
      DL_ASSIGN_OR_RETURN(m.shared_gate, b.Stacked({&hm.shared_gate}));
      DL_ASSIGN_OR_RETURN(m.shared_up, b.Stacked({&hm.shared_up}));
      DL_ASSIGN_OR_RETURN(m.shared_down, b.Stacked({&hm.shared_down}));
      if (m.shared_up.dtype != m.shared_gate.dtype || m.shared_down.dtype != m.shared_gate.dtype) {
        return Unimplemented("layer {}: the CUDA backend needs the shared expert's gate, up and down in one dtype", l);
      }
    } else {
      DL_ASSIGN_OR_RETURN(L.mlp_gate_up, b.Linear(hl.mlp_gate_up));
      DL_ASSIGN_OR_RETURN(L.mlp_down, b.Linear(hl.mlp_down));
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
Result<std::unique_ptr<CudaWeights>> CudaWeights::UploadHost(const Checkpoint&, const LagunaWeights&, uint64_t,
                                                             CUstream_st*) {
  return Unavailable("this build of decodelab has no CUDA backend");
}

#endif

}  // namespace dl
