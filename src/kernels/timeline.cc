#include "kernels/timeline.h"

#include <algorithm>
#include <map>

#include <fmt/format.h>

namespace dl::kernels {

std::string_view TimelineTagName(TimelineTag tag) {
  switch (tag) {
    case TimelineTag::kEmbed: return "embed";
    case TimelineTag::kAddRmsNorm: return "add_rmsnorm";
    case TimelineTag::kGemv: return "gemv";
    case TimelineTag::kRopeAppend: return "qknorm_rope_append";
    case TimelineTag::kAttention: return "attention";
    case TimelineTag::kMoeRouter: return "moe_router";
    case TimelineTag::kMoeGateUp: return "moe_gate_up";
    case TimelineTag::kMoeDown: return "moe_down";
    case TimelineTag::kArgmax: return "argmax";
    case TimelineTag::kSiluMul: return "silu_mul";
    case TimelineTag::kCount: break;
  }
  return "unknown";
}

std::vector<KernelSpan> TimelineSpans(const std::vector<TimelineRecord>& records) {
  std::map<uint64_t, KernelSpan> by_grid;
  std::map<uint64_t, uint64_t> start_of;
  for (const TimelineRecord& r : records) {
    auto [it, fresh] = by_grid.try_emplace(r.grid);
    KernelSpan& s = it->second;
    const auto start = static_cast<int64_t>(r.start), end = static_cast<int64_t>(r.end);
    const int64_t waited = r.waited ? static_cast<int64_t>(r.waited) : -1;
    if (fresh) {
      s.grid = r.grid;
      s.tag = r.tag < static_cast<uint32_t>(TimelineTag::kCount) ? static_cast<TimelineTag>(r.tag) : TimelineTag::kCount;
      s.first_start = s.last_start = start;
      s.first_waited = s.last_waited = waited;
      s.last_end = end;
    } else {
      s.first_start = std::min(s.first_start, start);
      s.last_start = std::max(s.last_start, start);
      if (waited >= 0) {
        s.first_waited = s.first_waited < 0 ? waited : std::min(s.first_waited, waited);
        s.last_waited = std::max(s.last_waited, waited);
      }
      s.last_end = std::max(s.last_end, end);
    }
    ++s.blocks;
  }
  std::vector<KernelSpan> spans;
  spans.reserve(by_grid.size());
  for (auto& [grid, s] : by_grid) spans.push_back(s);
  std::sort(spans.begin(), spans.end(), [](const KernelSpan& a, const KernelSpan& b) {
    return a.first_start != b.first_start ? a.first_start < b.first_start : a.grid < b.grid;
  });
  if (spans.empty()) return spans;
  const int64_t t0 = spans.front().first_start;
  int64_t frontier = 0, prev_end = 0;
  for (KernelSpan& s : spans) {
    s.first_start -= t0, s.last_start -= t0, s.last_end -= t0;
    if (s.first_waited >= 0) s.first_waited -= t0, s.last_waited -= t0;
    s.exposed = std::max<int64_t>(0, s.last_end - frontier);
    s.prev_end = prev_end;
    frontier = std::max(frontier, s.last_end);
    prev_end = s.last_end;
  }
  return spans;
}

std::vector<TimelineRow> TimelineSummary(const std::vector<KernelSpan>& spans) {
  std::vector<TimelineRow> rows;
  std::map<std::string, size_t> index;
  std::vector<int> waits;  // launches of each row that waited
  for (const KernelSpan& s : spans) {
    const std::string name = fmt::format("{}[{}]", TimelineTagName(s.tag), s.blocks);
    auto [it, fresh] = index.try_emplace(name, rows.size());
    if (fresh) {
      rows.push_back({name});
      waits.push_back(0);
    }
    TimelineRow& r = rows[it->second];
    ++r.count;
    r.exposed_us += s.exposed * 1e-3;
    r.span_us += (s.last_end - s.first_start) * 1e-3;
    r.lag_us += (s.first_start - s.prev_end) * 1e-3;
    if (s.first_waited >= 0) {
      ++waits[it->second];
      r.release_us += (s.first_waited - s.prev_end) * 1e-3;
      r.after_us += (s.last_end - s.first_waited) * 1e-3;
    }
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    TimelineRow& r = rows[i];
    r.total_exposed_us = r.exposed_us;
    r.exposed_us /= r.count, r.span_us /= r.count, r.lag_us /= r.count;
    if (waits[i]) r.release_us /= waits[i], r.after_us /= waits[i];
  }
  return rows;
}

std::string FormatTimeline(const std::vector<TimelineRow>& rows, const std::vector<KernelSpan>& spans) {
  std::string out = fmt::format("{:<26} {:>5} {:>10} {:>11} {:>9} {:>9} {:>10} {:>9}\n", "kernel[blocks]", "count",
                                "exposed us", "total us", "span us", "lag us", "release us", "after us");
  double total = 0;
  for (const TimelineRow& r : rows) {
    out += fmt::format("{:<26} {:>5} {:>10.2f} {:>11.1f} {:>9.2f} {:>9.2f} {:>10.2f} {:>9.2f}\n", r.name, r.count,
                       r.exposed_us, r.total_exposed_us, r.span_us, r.lag_us, r.release_us, r.after_us);
    total += r.total_exposed_us;
  }
  int64_t last_end = 0;
  for (const KernelSpan& s : spans) last_end = std::max(last_end, s.last_end);
  out += fmt::format("{} launches; sum of exposed {:.1f} us = first start to last end {:.1f} us\n", spans.size(),
                     total, last_end * 1e-3);
  return out;
}

std::string FormatLaunches(const std::vector<KernelSpan>& spans, size_t count) {
  size_t first = spans.size() / 2;
  while (first < spans.size() && spans[first].tag != TimelineTag::kAddRmsNorm) ++first;
  if (first == spans.size()) first = spans.size() / 2;
  std::string out = fmt::format("{:<26} {:>8} {:>8} {:>9} {:>9} {:>8} {:>8}\n", "launch (us from the first)", "start",
                                "last st", "released", "last rel", "end", "exposed");
  if (first >= spans.size()) return out;
  const int64_t t0 = spans[first].first_start;
  auto us = [&](int64_t ns) { return fmt::format("{:.2f}", (ns - t0) * 1e-3); };
  for (size_t i = first; i < std::min(spans.size(), first + count); ++i) {
    const KernelSpan& s = spans[i];
    out += fmt::format("{:<26} {:>8} {:>8} {:>9} {:>9} {:>8} {:>8.2f}\n",
                       fmt::format("{}[{}]", TimelineTagName(s.tag), s.blocks), us(s.first_start), us(s.last_start),
                       s.first_waited >= 0 ? us(s.first_waited) : "-", s.last_waited >= 0 ? us(s.last_waited) : "-",
                       us(s.last_end), s.exposed * 1e-3);
  }
  return out;
}

}  // namespace dl::kernels
