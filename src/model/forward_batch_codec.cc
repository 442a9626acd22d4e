#include "model/forward_batch_codec.h"

#include "base/byte_codec.h"

namespace dl {
namespace {

Status GetFlag(ByteReader& r, bool* out, std::string_view field) {
  uint8_t v = 0;
  DL_RETURN_IF_ERROR(r.Get(&v, field));
  if (v > 1) return DataLoss("{}: {} is {}, not 0 or 1", r.what(), field, v);
  *out = v == 1;
  return Status::Ok();
}

}  // namespace

std::vector<std::byte> EncodeForwardBatch(const ForwardBatch& b) {
  ByteWriter w;
  w.Put<uint32_t>(kForwardBatchMagic);
  w.Put<uint32_t>(kForwardBatchVersion);
  w.Put<uint8_t>(static_cast<uint8_t>(b.mode));
  w.PutVector<int32_t>(b.tokens);
  w.Put<uint64_t>(b.seqs.size());
  for (const BatchSequence& s : b.seqs) {
    w.Put<int32_t>(s.first_row);
    w.Put<int32_t>(s.num_rows);
    w.Put<int32_t>(s.prompt_length);
    // A sequence without its cache view cannot be run; Validate refuses it before any encoding.
    w.Put<int32_t>(s.kv != nullptr ? s.kv->length() : 0);
    static const std::vector<int32_t> kNone;
    w.PutVector<int32_t>(s.kv != nullptr ? s.kv->block_table(KvGroup::kFull) : kNone);
    w.PutVector<int32_t>(s.kv != nullptr ? s.kv->block_table(KvGroup::kSliding) : kNone);
  }
  w.Put<uint64_t>(b.outputs.size());
  for (const OutputRequest& o : b.outputs) {
    w.Put<int32_t>(o.row);
    w.Put<uint8_t>(o.sample ? 1 : 0);
    w.Put<uint8_t>(o.want_logits ? 1 : 0);
    const RowSampling& s = o.sampling;
    w.Put<float>(s.temperature);
    w.Put<int32_t>(s.top_k);
    w.Put<float>(s.top_p);
    w.Put<float>(s.min_p);
    w.Put<uint64_t>(s.key);
    w.Put<uint64_t>(s.step);
    w.Put<uint64_t>(s.adjustments.size());
    for (const LogitAdjustment& a : s.adjustments) {
      w.Put<int32_t>(a.token);
      w.Put<float>(a.bias);
      w.Put<float>(a.repetition);
      w.Put<float>(a.penalty);
    }
  }
  w.PutVector<int32_t>(b.hidden_taps);
  return w.Take();
}

Result<DecodedForwardBatch> DecodeForwardBatch(std::span<const std::byte> bytes) {
  ByteReader r(bytes, "step plan");
  DL_RETURN_IF_ERROR(r.GetHeader(kForwardBatchMagic, kForwardBatchVersion));
  DecodedForwardBatch d;
  ForwardBatch& b = d.batch;
  uint8_t mode = 0;
  DL_RETURN_IF_ERROR(r.Get(&mode, "mode"));
  if (mode > static_cast<uint8_t>(ForwardMode::kVerify)) return DataLoss("step plan: unknown mode {}", mode);
  b.mode = static_cast<ForwardMode>(mode);
  DL_RETURN_IF_ERROR(r.GetVector(&b.tokens, "tokens"));
  uint64_t num_seqs = 0;
  // Each sequence takes at least 4 x i32 + two counts.
  DL_RETURN_IF_ERROR(r.GetCount(&num_seqs, 32, "sequence count"));
  d.kvs.reserve(num_seqs);  // reserved up front: the batch points into it
  for (uint64_t i = 0; i < num_seqs; ++i) {
    BatchSequence s;
    int32_t kv_length = 0;
    std::vector<int32_t> full, sliding;
    const std::string at = fmt::format("sequence {}", i);
    DL_RETURN_IF_ERROR(r.Get(&s.first_row, at + " first_row"));
    DL_RETURN_IF_ERROR(r.Get(&s.num_rows, at + " num_rows"));
    DL_RETURN_IF_ERROR(r.Get(&s.prompt_length, at + " prompt_length"));
    DL_RETURN_IF_ERROR(r.Get(&kv_length, at + " kv length"));
    if (kv_length < 0) return DataLoss("step plan: {} has a negative KV length {}", at, kv_length);
    DL_RETURN_IF_ERROR(r.GetVector(&full, at + " full block table"));
    DL_RETURN_IF_ERROR(r.GetVector(&sliding, at + " sliding block table"));
    d.kvs.push_back(SequenceKv::Mirror(kv_length, std::move(full), std::move(sliding)));
    s.kv = &d.kvs.back();
    b.seqs.push_back(s);
  }
  uint64_t num_outputs = 0;
  DL_RETURN_IF_ERROR(r.GetCount(&num_outputs, 46, "output count"));
  b.outputs.resize(num_outputs);
  for (uint64_t i = 0; i < num_outputs; ++i) {
    OutputRequest& o = b.outputs[i];
    RowSampling& s = o.sampling;
    const std::string at = fmt::format("output {}", i);
    DL_RETURN_IF_ERROR(r.Get(&o.row, at + " row"));
    DL_RETURN_IF_ERROR(GetFlag(r, &o.sample, at + " sample"));
    DL_RETURN_IF_ERROR(GetFlag(r, &o.want_logits, at + " want_logits"));
    DL_RETURN_IF_ERROR(r.Get(&s.temperature, at + " temperature"));
    DL_RETURN_IF_ERROR(r.Get(&s.top_k, at + " top_k"));
    DL_RETURN_IF_ERROR(r.Get(&s.top_p, at + " top_p"));
    DL_RETURN_IF_ERROR(r.Get(&s.min_p, at + " min_p"));
    DL_RETURN_IF_ERROR(r.Get(&s.key, at + " key"));
    DL_RETURN_IF_ERROR(r.Get(&s.step, at + " step"));
    uint64_t num_adj = 0;
    DL_RETURN_IF_ERROR(r.GetCount(&num_adj, 16, at + " adjustment count"));
    s.adjustments.resize(num_adj);
    for (LogitAdjustment& a : s.adjustments) {
      DL_RETURN_IF_ERROR(r.Get(&a.token, at + " adjustment token"));
      DL_RETURN_IF_ERROR(r.Get(&a.bias, at + " adjustment bias"));
      DL_RETURN_IF_ERROR(r.Get(&a.repetition, at + " adjustment repetition"));
      DL_RETURN_IF_ERROR(r.Get(&a.penalty, at + " adjustment penalty"));
    }
  }
  DL_RETURN_IF_ERROR(r.GetVector(&b.hidden_taps, "hidden taps"));
  DL_RETURN_IF_ERROR(r.ExpectEnd());
  return d;
}

}  // namespace dl
