// The state a worker copied from its peers as it joined a running job (a
// spare that took a rank, a newcomer that grew the world), held until its
// first step begins. The program's setup runs in between (the script's own
// snapshot load, a re-initialised model, a reseed): the peers' state must win
// over it, so the first step begins by writing the held copy back
// (docs/recovery.md "The peers' state wins").
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "nonstop/state.h"

namespace nonstop::worker {

class HeldState {
 public:
  // A host copy of every registered region's bytes, as they are now.
  static HeldState Take(const state::StateRegistry& state);

  // Writes the held bytes back into every region whose live bytes differ
  // from them; returns those regions' names.
  std::vector<std::string> Restore(state::StateRegistry* state) const;

  size_t bytes() const { return bytes_; }

 private:
  std::vector<std::vector<std::byte>> regions_;  // one per registered region, in order
  size_t bytes_ = 0;
};

}  // namespace nonstop::worker
