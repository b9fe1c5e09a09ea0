// Salvaging the step in flight in the default (ring) mode (docs/recovery.md,
// "Salvage in the default mode"). Each rank sums the gradients of its block of
// micro-batches in order into one local sum, which the ring then reduces.
// When a fault cuts a step short, a member keeps the local sum of the
// micro-batches it completed; on the first step of the next generation every
// member offers the set of micro-batches it holds a sum of (the offer records
// of worker/tree_step.h, the micro-batches written as tree nodes), and
// PlanRingStep says who keeps what and who computes the rest.
//
// With a spare in the lost rank's place (the world and the rank order
// unchanged) each survivor's set is a prefix of its own block: it continues
// its block where it stopped, so every local sum, and the ring's result, has
// the bits of the fault-free step. The spare alone would compute the lost
// block whole while the others wait (a whole rank's share of a step), so the
// tail of any block beyond the even load is lent: a member with less to do
// computes each lent micro-batch alone, from zero gradients, and sends its
// gradient back (Session::Broadcast, in micro-batch order), and the block's
// owner adds it to its sum in the block's order, as its own backward would
// have. Otherwise (a shrink) the micro-batches nobody holds are dealt over
// the members, and the result is the same sum in another order (rounding).
//
// Thread-safety: values and pure functions; a RingStepPlanner belongs to one thread.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "nonstop/status.h"
#include "nonstop/tree.h"

namespace nonstop::worker {

struct RingShare {
  std::vector<int> kept;      // micro-batches (ascending) whose sum this rank keeps; empty: none
  std::vector<int> compute;   // those it computes now, in this order, into its sum
  std::vector<int> lent;      // the rest of its block (ascending), computed by others, added last
  std::vector<int> borrowed;  // micro-batches of others' blocks (ascending) it computes alone
};

// A lent micro-batch: computed by `borrower`, added by `owner` to its sum.
struct Loan {
  int micro_batch = 0;
  int owner = 0;
  int borrower = 0;
  bool operator==(const Loan&) const = default;
};
// Every loan of a plan, in ascending micro-batch order (the order their gradients are sent).
std::vector<Loan> LoansOf(std::span<const RingShare> shares);

// offered[q]: the micro-batches rank q holds one sum of (empty: none). In
// rank order each offer is kept when it names micro-batches of [0, m), each
// once, none kept by an earlier rank (a peer's list is not trusted);
// otherwise that rank keeps nothing. If every kept set is a prefix of its
// rank's block (data::BlockBegin), each rank computes the rest of its block:
// the fault-free order, with the tails beyond ceil(left / world) lent to the
// ranks with less, in rank order. Otherwise the micro-batches no one keeps are dealt in
// contiguous, even parts of their ascending list. Every rank computes the
// same plan from the same offers.
// `lend` false: no loans (every block's rest computed by its owner).
std::vector<RingShare> PlanRingStep(int m, std::span<const std::vector<int>> offered,
                                    bool lend = true);

// A set of micro-batches as the tree nodes of its runs (an offer's form), and
// back: empty when a node is not one of the tree over [0, m) or two overlap.
std::vector<collective::TreeNode> NodesOfMicroBatches(int m, std::span<const int> micro_batches);
std::vector<int> MicroBatchesOfNodes(int m, std::span<const collective::TreeNode> nodes);

// Plans each step of the ring mode: the plain split, except on the first step
// of a generation, where the members' offers are exchanged first
// (ExchangeOffers). Every member takes part whatever its own setting, so that
// the collectives line up: one with salvage off offers nothing.
class RingStepPlanner {
 public:
  RingStepPlanner(bool salvage, bool lend) : salvage_(salvage), lend_(lend) {}

  // The shares of `step` for every rank (index = rank); `held` is what this
  // member holds a sum of for `held_step`. Fails only when the exchange does.
  Result<std::vector<RingShare>> Plan(Session& session, int m, int64_t step, int64_t held_step,
                                      std::span<const int> held);

  // Of the last plan: micro-batches kept, members that kept some, members that compute some.
  int kept_micro_batches() const { return kept_; }
  int kept_by() const { return kept_by_; }
  int computing() const { return computing_; }

 private:
  bool salvage_;
  bool lend_;
  bool everyone_lends_ = true;         // as the last exchange of offers said
  uint32_t exchanged_generation_ = 0;  // the generation whose offers were exchanged
  int kept_ = 0;
  int kept_by_ = 0;
  int computing_ = 0;
};

}  // namespace nonstop::worker
