#include "worker/tree_step.h"

#include <algorithm>
#include <cstring>

#include "common/check.h"
#include "nonstop/session.h"

namespace nonstop::worker {

namespace {

void PutWord(std::span<std::byte> record, size_t word, int64_t v) {
  auto u = static_cast<uint64_t>(v);
  for (size_t b = 0; b < 8; ++b)
    record[word * 8 + b] = static_cast<std::byte>((u >> (8 * b)) & 0xff);
}

int64_t GetWord(std::span<const std::byte> record, size_t word) {
  uint64_t u = 0;
  for (size_t b = 0; b < 8; ++b) u |= static_cast<uint64_t>(record[word * 8 + b]) << (8 * b);
  return static_cast<int64_t>(u);
}

}  // namespace

void EncodeOffer(const HeldSums& held, int64_t step, std::span<std::byte> record) {
  NONSTOP_CHECK_EQ(record.size(), kOfferBytes);
  std::memset(record.data(), 0, record.size());
  const bool offer = held.step == step && held.nodes.size() <= kMaxOfferedNodes;
  PutWord(record, 0, offer ? step : -1);
  PutWord(record, 1, offer ? static_cast<int64_t>(held.nodes.size()) : 0);
  if (!offer) return;
  for (size_t k = 0; k < held.nodes.size(); ++k) {
    PutWord(record, 2 + 2 * k, held.nodes[k].level);
    PutWord(record, 3 + 2 * k, held.nodes[k].index);
  }
}

std::vector<collective::TreeNode> DecodeOffer(std::span<const std::byte> record, int64_t step) {
  std::vector<collective::TreeNode> nodes;
  if (record.size() != kOfferBytes || GetWord(record, 0) != step || step < 0) return nodes;
  int64_t count = GetWord(record, 1);
  if (count < 0 || count > static_cast<int64_t>(kMaxOfferedNodes)) return nodes;
  for (int64_t k = 0; k < count; ++k) {
    int64_t level = GetWord(record, static_cast<size_t>(2 + 2 * k));
    int64_t index = GetWord(record, static_cast<size_t>(3 + 2 * k));
    // not a tree node of any M here
    if (level < 0 || level > 62 || index < 0 || index > (int64_t{1} << 30)) return {};
    nodes.push_back({static_cast<int>(level), static_cast<int>(index)});
  }
  return nodes;
}

void KeepOnly(HeldSums* held, int64_t step, std::span<const collective::TreeNode> kept) {
  HeldSums out;
  for (size_t k = 0; k < held->nodes.size() && held->step == step; ++k) {
    if (std::find(kept.begin(), kept.end(), held->nodes[k]) == kept.end()) continue;
    out.nodes.push_back(held->nodes[k]);
    out.partials.push_back(std::move(held->partials[k]));
  }
  out.step = out.nodes.empty() ? -1 : step;
  *held = std::move(out);
}

HeldSums CollectSums(int m, int64_t step, HeldSums kept,
                     std::vector<collective::TreeFolder>* folders) {
  std::vector<std::pair<collective::TreeNode, std::vector<float>>> have;
  for (size_t k = 0; k < kept.nodes.size(); ++k)
    have.push_back({kept.nodes[k], std::move(kept.partials[k])});
  for (auto& f : *folders) {
    std::vector<collective::TreeNode> nodes = f.nodes();
    std::vector<std::vector<float>> sums = f.TakePartials();
    for (size_t k = 0; k < nodes.size(); ++k) have.push_back({nodes[k], std::move(sums[k])});
  }
  std::sort(have.begin(), have.end(), [m](const auto& a, const auto& b) {
    return collective::NodeRange(m, a.first).first < collective::NodeRange(m, b.first).first;
  });
  HeldSums out;
  out.step = step;
  for (auto& [node, sum] : have) {
    out.nodes.push_back(node);
    out.partials.push_back(std::move(sum));
  }
  return out;
}

std::vector<std::vector<std::pair<int, int>>> NodeLists(
    std::span<const collective::TreeShare> shares) {
  std::vector<std::vector<std::pair<int, int>>> out(shares.size());
  for (size_t q = 0; q < shares.size(); ++q) {
    for (const auto& node : shares[q].nodes) out[q].push_back({node.level, node.index});
  }
  return out;
}

Result<std::vector<std::vector<collective::TreeNode>>> ExchangeOffers(
    Session& session, int64_t step, const HeldSums& held, bool lends, bool* everyone_lends) {
  const int world = session.world_size();
  std::vector<std::byte> records(kOfferBytes * static_cast<size_t>(world));
  std::span<std::byte> mine = std::span<std::byte>(records).subspan(
      kOfferBytes * static_cast<size_t>(session.rank()), kOfferBytes);
  EncodeOffer(held, step, mine);
  PutWord(mine, kOfferOptionsWord, lends ? 0 : kOfferDeclinesLoans);
  NONSTOP_RETURN_IF_ERROR(session.AllGather(records, kOfferBytes));
  std::vector<std::vector<collective::TreeNode>> offered(static_cast<size_t>(world));
  if (everyone_lends != nullptr) *everyone_lends = true;
  for (int q = 0; q < world; ++q) {
    std::span<const std::byte> record = std::span<const std::byte>(records).subspan(
        kOfferBytes * static_cast<size_t>(q), kOfferBytes);
    if (everyone_lends != nullptr && (GetWord(record, kOfferOptionsWord) & kOfferDeclinesLoans))
      *everyone_lends = false;
    offered[static_cast<size_t>(q)] =
        DecodeOffer(std::span<const std::byte>(records).subspan(
                        kOfferBytes * static_cast<size_t>(q), kOfferBytes),
                    step);
  }
  return offered;
}

Result<std::vector<collective::TreeShare>> TreeStepPlanner::Plan(Session& session, int m,
                                                                 int64_t step, const HeldSums& held,
                                                                 std::span<const int> counts) {
  const int world = session.world_size();
  std::vector<std::vector<collective::TreeNode>> offered(static_cast<size_t>(world));
  kept_ = 0;
  kept_by_ = 0;
  if (session.generation() != exchanged_generation_) {
    // A new membership: what does each member still hold of this step?
    auto offers = ExchangeOffers(session, step, salvage_ ? held : HeldSums{});
    if (!offers.ok()) return offers.status();
    exchanged_generation_ = session.generation();
    if (counts.empty()) offered = std::move(*offers);  // counts deal the whole step: nothing kept
  }
  std::vector<collective::TreeShare> shares = collective::PlanTreeStep(m, offered, counts);
  for (const auto& share : shares) {
    for (const auto& node : share.kept) {
      auto [first, last] = collective::NodeRange(m, node);
      kept_ += last - first;
    }
    kept_by_ += share.kept.empty() ? 0 : 1;
  }
  return shares;
}

}  // namespace nonstop::worker
