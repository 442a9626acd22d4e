#include "model/model_writer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>
#include <type_traits>

#include <nlohmann/json.hpp>

#include "model/fp8_layout.h"
#include "model/safetensors.h"
#include "model/synthetic.h"

#include "template/laguna_template.h"
#include "tokenizer/tokenizer_writer.h"

namespace dl {

namespace fs = std::filesystem;

Result<uint64_t> ParseByteSize(std::string_view s) {
  size_t i = 0;
  while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.')) ++i;
  if (i == 0) return InvalidArgument("size '{}' must start with a number (e.g. 5GB, 500MB, 2GiB)", s);
  double v = 0;
  try {
    v = std::stod(std::string(s.substr(0, i)));
  } catch (...) {
    return InvalidArgument("size '{}' is not a number", s);
  }
  std::string unit(s.substr(i));
  for (auto& ch : unit) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  double mul = 0;
  if (unit.empty() || unit == "B") mul = 1;
  else if (unit == "KB") mul = 1e3;
  else if (unit == "MB") mul = 1e6;
  else if (unit == "GB") mul = 1e9;
  else if (unit == "TB") mul = 1e12;
  else if (unit == "KIB") mul = 1024.0;
  else if (unit == "MIB") mul = 1024.0 * 1024;
  else if (unit == "GIB") mul = 1024.0 * 1024 * 1024;
  else if (unit == "TIB") mul = 1024.0 * 1024 * 1024 * 1024;
  else return InvalidArgument("size '{}': unknown unit '{}' (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)", s, unit);
  const double bytes = v * mul;
  if (!(bytes >= 1.0) || bytes > 1e18) return InvalidArgument("size '{}' is out of range", s);
  return static_cast<uint64_t>(bytes);
}

std::vector<ShardPlan> PlanShards(const std::vector<uint64_t>& tensor_bytes, uint64_t max_shard_size) {
  std::vector<ShardPlan> shards;
  for (size_t i = 0; i < tensor_bytes.size(); ++i) {
    if (shards.empty() || (!shards.back().tensors.empty() && shards.back().bytes + tensor_bytes[i] > max_shard_size)) {
      shards.emplace_back();
    }
    shards.back().tensors.push_back(i);
    shards.back().bytes += tensor_bytes[i];
  }
  if (shards.size() == 1) {
    shards[0].file = "model.safetensors";
  } else {
    for (size_t s = 0; s < shards.size(); ++s) {
      shards[s].file = fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, shards.size());
    }
  }
  return shards;
}

namespace {

Status WriteTextFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  out.close();
  if (!out) return DataLoss("writing {} failed", path);
  return Status::Ok();
}

Status WriteAll(int fd, const uint8_t* p, size_t n, const std::string& path) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == ENOSPC) return ResourceExhausted("disk full while writing {}", path);
      return DataLoss("writing {} failed: {}", path, std::strerror(errno));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return Status::Ok();
}

// One tensor of the files: a spec's values in the file dtype, or (FP8) its codes or its scales.
struct OutTensor {
  enum Role : uint8_t { kValues, kCodes, kScales };
  size_t spec = 0;
  Role role = kValues;
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  int64_t block_rows = 0, block_cols = 0;  // kCodes / kScales
  uint64_t bytes() const {
    uint64_t n = DTypeSize(dtype);
    for (int64_t d : shape) n *= static_cast<uint64_t>(d);
    return n;
  }
};

// The files' tensors in state-dict order: each spec, and right after an FP8 weight its scale tensor
// (the order an FP8Linear registers weight and weight_scale_inv).
std::vector<OutTensor> PlanOutTensors(const MakeModelOptions& o, const ModelConfig& cfg,
                                      const std::vector<TensorSpec>& specs) {
  std::vector<OutTensor> out;
  const WeightQuantization& q = cfg.weight_quant;
  for (size_t i = 0; i < specs.size(); ++i) {
    const TensorSpec& s = specs[i];
    if (!o.fp8 || !Fp8LayoutQuantizes(o.fp8->layout, s)) {
      out.push_back(OutTensor{i, OutTensor::kValues, s.name, o.dtype, s.shape});
      continue;
    }
    OutTensor codes{i, OutTensor::kCodes, s.name, DType::kF8E4M3, s.shape};
    q.BlockShape(s.shape[0], s.shape[1], &codes.block_rows, &codes.block_cols);
    OutTensor scales = codes;
    scales.role = OutTensor::kScales;
    scales.name = s.name + q.scale_suffix();
    scales.dtype = DType::kF32;
    scales.shape = q.ScaleShape(s.shape[0], s.shape[1]);
    out.push_back(std::move(codes));
    out.push_back(std::move(scales));
  }
  return out;
}

struct FillScratch {
  std::vector<float> values;
  std::vector<uint8_t> codes;
  std::vector<float> scales;
};

// Writes elements [first, first + count) of an FP8 codes or scales tensor into dst, quantising the
// block rows they fall in (model/synthetic.h).
void FillFp8(const TensorSpec& s, const OutTensor& t, uint64_t seed, int64_t first, int64_t count, uint8_t* dst,
             FillScratch& sc) {
  const int64_t out = s.shape[0], in = s.shape[1];
  const int64_t br = t.block_rows, bc = t.block_cols, col_blocks = (in + bc - 1) / bc;
  // Elements of band b: codes [b * br * in, min(out, (b + 1) * br) * in); scales [b * cb, (b + 1) * cb).
  const int64_t per_band = t.role == OutTensor::kCodes ? br * in : col_blocks;
  const int64_t b0 = first / per_band, b1 = (first + count - 1) / per_band;
  sc.codes.resize(static_cast<size_t>(br * in));
  sc.scales.resize(static_cast<size_t>(col_blocks));
  for (int64_t band = b0; band <= b1; ++band) {
    QuantizeSyntheticFp8Band(seed, s, br, bc, band, &sc.values, sc.codes.data(), sc.scales.data());
    const int64_t band_begin = band * per_band;
    const int64_t band_end = t.role == OutTensor::kCodes ? std::min(out, (band + 1) * br) * in : band_begin + col_blocks;
    const int64_t a = std::max(first, band_begin), b = std::min(first + count, band_end);
    if (a >= b) continue;
    if (t.role == OutTensor::kCodes) {
      std::memcpy(dst + (a - first), sc.codes.data() + (a - band_begin), static_cast<size_t>(b - a));
    } else {
      std::memcpy(dst + (a - first) * 4, sc.scales.data() + (a - band_begin), static_cast<size_t>(b - a) * 4);
    }
  }
}

// Fills out[0, hi-lo) with the bytes [lo, hi) of a shard's data section. lo and hi fall on element
// boundaries of every tensor (the shard's tensors are ordered by element size, largest first, and
// the ranges are multiples of 4 bytes or end at the data's end).
void FillRange(const std::vector<TensorSpec>& specs, const std::vector<OutTensor>& tensors, const SafetensorsPlan& plan,
               const std::vector<size_t>& ids, uint64_t seed, uint64_t lo, uint64_t hi, uint8_t* out,
               FillScratch& sc) {
  for (size_t k = 0; k < ids.size(); ++k) {
    const SafetensorsEntry& e = plan.entries[k];
    if (e.end <= lo || e.begin >= hi) continue;
    const OutTensor& t = tensors[ids[k]];
    const size_t es = DTypeSize(t.dtype);
    const uint64_t a = std::max(lo, e.begin), b = std::min(hi, e.end);
    const TensorSpec& s = specs[t.spec];
    const int64_t first = static_cast<int64_t>((a - e.begin) / es);
    const int64_t count = static_cast<int64_t>((b - a) / es);
    if (count == 0) continue;
    uint8_t* base = out + (a - lo);
    if (t.role != OutTensor::kValues) {
      FillFp8(s, t, seed, first, count, base, sc);
      continue;
    }
    if (sc.values.size() < (1u << 16)) sc.values.resize(1u << 16);
    for (int64_t done = 0; done < count;) {
      const int64_t n = std::min<int64_t>(count - done, static_cast<int64_t>(sc.values.size()));
      GenerateTensorValues(seed, s.name, s.kind, s.fan_in, sc.values.data(), first + done, n);
      uint8_t* dst = base + static_cast<uint64_t>(done) * es;
      if (t.dtype == DType::kBF16) {
        for (int64_t j = 0; j < n; ++j) {
          const uint16_t h = FloatToBf16(sc.values[j]);
          std::memcpy(dst + 2 * j, &h, 2);
        }
      } else {
        for (int64_t j = 0; j < n; ++j) StoreFromFloat(dst, t.dtype, static_cast<size_t>(j), sc.values[j]);
      }
      done += n;
    }
  }
}

Status WriteShards(const MakeModelOptions& o, const std::string& dir, const std::vector<TensorSpec>& specs,
                   const std::vector<OutTensor>& tensors, std::vector<ShardPlan>& shards, uint64_t total_bytes,
                   MakeModelResult* result) {
  const uint64_t chunk = 8u << 20;  // 8 MiB per write
  std::vector<uint8_t> buf[2] = {std::vector<uint8_t>(chunk), std::vector<uint8_t>(chunk)};
  const int threads = std::max(1, o.threads);
  std::vector<FillScratch> scratch(threads);
  uint64_t done_total = 0;
  for (ShardPlan& sh : shards) {
    // Largest elements first (as the Python safetensors writer orders data), so every tensor starts
    // at a multiple of its element size; a stable sort keeps single-dtype files in state-dict order.
    std::stable_sort(sh.tensors.begin(), sh.tensors.end(),
                     [&](size_t x, size_t y) { return DTypeSize(tensors[x].dtype) > DTypeSize(tensors[y].dtype); });
    std::vector<SafetensorsEntry> entries;
    for (size_t id : sh.tensors) entries.push_back(SafetensorsEntry{tensors[id].name, tensors[id].dtype, tensors[id].shape});
    const SafetensorsPlan plan = PlanSafetensors(entries);
    const std::string path = (fs::path(dir) / sh.file).string();
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return DataLoss("cannot create {}: {}", path, std::strerror(errno));
    struct Closer {
      int fd;
      ~Closer() { ::close(fd); }
    } closer{fd};
    DL_RETURN_IF_ERROR(WriteAll(fd, reinterpret_cast<const uint8_t*>(plan.prefix.data()), plan.prefix.size(), path));
    const uint64_t n_chunks = (plan.data_size + chunk - 1) / chunk;
    // Generation of chunk i+1 (split over `threads` at 4-byte boundaries) overlaps the write of chunk i.
    auto generate = [&](uint64_t i, uint8_t* out) {
      const uint64_t lo = i * chunk, hi = std::min(plan.data_size, lo + chunk);
      const uint64_t words = (hi - lo) / 4;
      std::vector<std::thread> ts;
      for (int t = 0; t < threads; ++t) {
        const uint64_t a = lo + words * t / threads * 4;
        const uint64_t b = t + 1 == threads ? hi : lo + words * (t + 1) / threads * 4;
        auto job = [&, t, a, b] { FillRange(specs, tensors, plan, sh.tensors, o.seed, a, b, out + (a - lo), scratch[t]); };
        if (t + 1 == threads) {
          job();
        } else {
          ts.emplace_back(job);
        }
      }
      for (auto& th : ts) th.join();
    };
    if (n_chunks > 0) generate(0, buf[0].data());
    for (uint64_t i = 0; i < n_chunks; ++i) {
      if (o.cancel && o.cancel->load()) return Status(StatusCode::kCancelled, "cancelled");
      std::thread next;
      if (i + 1 < n_chunks) next = std::thread(generate, i + 1, buf[(i + 1) % 2].data());
      const uint64_t lo = i * chunk, hi = std::min(plan.data_size, lo + chunk);
      Status s = WriteAll(fd, buf[i % 2].data(), hi - lo, path);
      if (next.joinable()) next.join();
      DL_RETURN_IF_ERROR(s);
      done_total += hi - lo;
      if (o.progress) o.progress(MakeModelProgress{done_total, total_bytes, sh.file});
    }
    if (::close(closer.fd) != 0) {
      closer.fd = -1;
      return DataLoss("closing {} failed: {}", path, std::strerror(errno));
    }
    closer.fd = -1;
    result->files.push_back(sh.file);
    result->file_bytes += plan.file_size();
  }
  return Status::Ok();
}

}  // namespace

Status WriteGenerationConfig(const std::string& dir, const ModelConfig& c) {
  nlohmann::ordered_json j;
  j["_from_model_config"] = true;
  if (c.bos_token_id >= 0) j["bos_token_id"] = c.bos_token_id;
  if (c.eos_token_ids.size() == 1) j["eos_token_id"] = c.eos_token_ids[0];
  if (c.eos_token_ids.size() > 1) j["eos_token_id"] = c.eos_token_ids;
  if (c.pad_token_id >= 0) j["pad_token_id"] = c.pad_token_id;
  j["transformers_version"] = "5.17.0";
  return WriteTextFile((fs::path(dir) / "generation_config.json").string(), j.dump(2) + "\n");
}

Status WriteModelExtras(const std::string& dir, const ModelConfig& config) {
  // A small byte-level BPE tokenizer of Laguna's structure and the Laguna-style chat template, so
  // text prompts and chat work on generated models.
  DL_RETURN_IF_ERROR(WriteSmallTokenizer(dir, config.vocab_size).WithContext("writing tokenizer.json"));
  return WriteTextFile((fs::path(dir) / "chat_template.jinja").string(), std::string(LagunaChatTemplate()));
}

Result<MakeModelResult> WriteSyntheticModel(const MakeModelOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  if (o.dtype == DType::kF8E4M3) {
    return InvalidArgument("make-model: FP8 weights are chosen with MakeModelOptions::fp8 (the dtype is that of the "
                           "tensors left unquantised)");
  }
  ModelConfig config = o.config;
  if (o.fp8) DL_RETURN_IF_ERROR(ApplyFp8Options(&config, *o.fp8).WithContext("make-model"));
  if (o.out_dir.empty()) return InvalidArgument("make-model: no output directory");
  if (o.max_shard_size == 0) return InvalidArgument("make-model: max shard size must be > 0");
  fs::path out = fs::absolute(o.out_dir).lexically_normal();
  if (out.filename().empty()) out = out.parent_path();
  std::error_code ec;
  if (fs::exists(out, ec)) {
    if (!fs::is_directory(out, ec) || !fs::is_empty(out, ec)) {
      return FailedPrecondition("{} already exists and is not an empty directory; remove it or pick another --out",
                                out.string());
    }
  }
  const fs::path parent = out.parent_path();
  // Like `mkdir -p`: missing parents are created (and left in place; they hold no partial data).
  if (!fs::is_directory(parent, ec)) {
    fs::create_directories(parent, ec);
    if (ec) return NotFound("cannot create the parent directory {}: {}", parent.string(), ec.message());
  }

  const std::vector<TensorSpec> specs = CheckpointTensorSpecs(config);
  const std::vector<OutTensor> tensors = PlanOutTensors(o, config, specs);
  std::vector<uint64_t> sizes;
  uint64_t total = 0;
  for (const auto& t : tensors) {
    sizes.push_back(t.bytes());
    total += sizes.back();
  }
  std::vector<ShardPlan> shards = PlanShards(sizes, o.max_shard_size);
  // Headers are small (≈100 bytes per tensor); keep 64 MiB of slack on top.
  const uint64_t need = total + tensors.size() * 256 + (64u << 20);
  uint64_t free_bytes = 0;
  if (o.free_bytes_override) {
    free_bytes = *o.free_bytes_override;
  } else {
    struct statvfs sv {};
    if (::statvfs(parent.c_str(), &sv) != 0) return DataLoss("cannot stat filesystem of {}", parent.string());
    free_bytes = static_cast<uint64_t>(sv.f_bavail) * sv.f_frsize;
  }
  if (free_bytes < need) {
    return ResourceExhausted("not enough disk space in {}: the model needs {:.2f} GB, {:.2f} GB are free",
                             parent.string(), need / 1e9, free_bytes / 1e9);
  }

  std::string tmpl = out.string() + ".partial-XXXXXX";
  if (!::mkdtemp(tmpl.data())) return DataLoss("cannot create {}: {}", tmpl, std::strerror(errno));
  const std::string partial = tmpl;
  {
    // mkdtemp makes the directory 0700; give it the mode mkdir would (0777 minus the umask).
    const mode_t mask = ::umask(0);
    ::umask(mask);
    std::error_code pec;
    fs::permissions(partial, static_cast<fs::perms>(0777 & ~mask), pec);
  }
  MakeModelResult result;
  result.weight_bytes = total;
  Status s = [&]() -> Status {
    // Config files first: a reader sees the shape of what is coming even while weights stream.
    DL_RETURN_IF_ERROR(WriteTextFile((fs::path(partial) / "config.json").string(), config.ToJson().dump(2) + "\n"));
    DL_RETURN_IF_ERROR(WriteGenerationConfig(partial, config));
    DL_RETURN_IF_ERROR(WriteShards(o, partial, specs, tensors, shards, total, &result));
    if (shards.size() > 1) {
      nlohmann::ordered_json idx;
      idx["metadata"] = {{"total_size", total}};
      nlohmann::json wm = nlohmann::json::object();  // sorted keys, as transformers writes them
      for (const auto& sh : shards) {
        for (size_t id : sh.tensors) wm[tensors[id].name] = sh.file;
      }
      idx["weight_map"] = wm;
      DL_RETURN_IF_ERROR(
          WriteTextFile((fs::path(partial) / "model.safetensors.index.json").string(), idx.dump(2) + "\n"));
    }
    DL_RETURN_IF_ERROR(WriteModelExtras(partial, config));
    std::error_code rec;
    if (fs::exists(out, rec)) fs::remove(out, rec);  // the empty directory checked above
    fs::rename(partial, out, rec);
    if (rec) return DataLoss("renaming {} to {} failed: {}", partial, out.string(), rec.message());
    return Status::Ok();
  }();
  if (!s.ok()) {
    std::error_code rec;
    fs::remove_all(partial, rec);
    return s.WithContext(fmt::format("make-model {}", out.string()));
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

}  // namespace dl
