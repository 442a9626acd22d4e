#include "lab/lab_stats.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace dl::lab {

namespace {
constexpr size_t kEvents = 100;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double Percentile(std::vector<double> v, double pct) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double rank = pct / 100.0 * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(rank));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (rank - static_cast<double>(lo));
}

double Mean(const std::vector<double>& v) {
  if (v.empty()) return 0;
  return std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
}

Result<double> ConventionalTokS(const std::vector<double>& arrivals) {
  const size_t n = std::min(arrivals.size(), kEvents);
  if (n < 2) return InvalidArgument("conventional statistic: {} token events, need at least 2", n);
  std::vector<double> gaps;
  for (size_t i = 1; i < n; ++i) gaps.push_back(arrivals[i] - arrivals[i - 1]);
  const double m = Median(gaps);
  if (m <= 0) return InvalidArgument("conventional statistic: median token gap is {} s", m);
  return 1.0 / m;
}

Result<double> HistoricalTokS(double first_byte, const std::vector<double>& arrivals) {
  const size_t n = std::min(arrivals.size(), kEvents);
  if (n < 1) return InvalidArgument("historical statistic: no token events");
  std::vector<double> rates;
  for (size_t i = 0; i < n; ++i) {
    const double gap = arrivals[i] - (i == 0 ? first_byte : arrivals[i - 1]);
    // A zero gap (two events in one read) has no finite rate; it is skipped rather than infinite.
    if (gap > 0) rates.push_back(1.0 / gap);
  }
  if (rates.empty()) return InvalidArgument("historical statistic: every gap is zero");
  return Median(rates);
}

Result<double> StreamTokS(const std::vector<double>& arrivals) {
  const size_t n = std::min(arrivals.size(), kEvents);
  if (n < 2) return InvalidArgument("stream statistic: {} token events, need at least 2", n);
  const double span = arrivals[n - 1] - arrivals[0];
  if (!(span > 0))
    return InvalidArgument("stream statistic: the first {} tokens arrived at once", n);
  return static_cast<double>(n - 1) / span;
}

nlohmann::json Distribution::ToJson() const {
  return {{"mean_ms", mean * 1e3}, {"median_ms", median * 1e3}, {"p99_ms", p99 * 1e3}};
}

Distribution Describe(const std::vector<double>& v) {
  return {Mean(v), Median(v), Percentile(v, 99)};
}

Result<RunSpeed> ComputeRunSpeed(const std::vector<RequestTiming>& timings, bool per_event) {
  RunSpeed s;
  s.per_event = per_event;
  std::vector<double> ttft, tpot, itl;
  for (size_t r = 0; r < timings.size(); ++r) {
    const RequestTiming& t = timings[r];
    if (t.arrivals.empty()) return InvalidArgument("request {}: no token events", r);
    if (per_event) {
      DL_ASSIGN_OR_RETURN(double conv, ConventionalTokS(t.arrivals));
      DL_ASSIGN_OR_RETURN(double hist, HistoricalTokS(t.first_byte, t.arrivals));
      s.conventional.push_back(conv);
      s.historical.push_back(hist);
    }
    DL_ASSIGN_OR_RETURN(double stream, StreamTokS(t.arrivals));
    s.stream.push_back(stream);
    ttft.push_back(t.arrivals.front() - t.sent);
    if (t.arrivals.size() > 1) {
      tpot.push_back((t.arrivals.back() - t.arrivals.front()) /
                     static_cast<double>(t.arrivals.size() - 1));
    }
    for (size_t i = 1; i < t.arrivals.size(); ++i) itl.push_back(t.arrivals[i] - t.arrivals[i - 1]);
  }
  s.requests = static_cast<int>(timings.size());
  s.conventional_median = Median(s.conventional);
  s.historical_median = Median(s.historical);
  s.stream_median = Median(s.stream);
  s.ttft = Describe(ttft);
  s.tpot = Describe(tpot);
  s.itl = Describe(itl);
  return s;
}

}  // namespace dl::lab
