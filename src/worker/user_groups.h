// torch.distributed's subgroups (Session::NewGroup, new_group in Python): a
// communicator over some of a generation's ranks, kept across generations
// while each of its ranks is held by the worker that held it when the group
// was made (docs/python.md, "Subgroups").
//
// Thread-safety: the training thread's, like the collectives.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "collective/data_plane.h"
#include "common/time.h"
#include "nonstop/status.h"

namespace nonstop::worker {

class UserGroups {
 public:
  // A group of `ranks` (distinct, in the group's rank order, `my_rank` among
  // them) of the generation whose worker ids by rank are `members`. Returns
  // its id (1, 2, ...: this process's count). `timeout` bounds each of its
  // collectives (zero: the world's bound).
  Result<int> Add(std::vector<int> ranks, std::span<const int> members, int my_rank,
                  Millis timeout = Millis(0));
  // The communicator of group `id` over `world`, the generation's (made at
  // its first use in a generation). FAILED_PRECONDITION when one of its ranks
  // is held by another worker now (or by none), naming it; NOT_FOUND for an
  // unknown id.
  Result<collective::Communicator*> Get(int id, const collective::Communicator& world,
                                        std::span<const int> members);
  // A new generation: every group's communicator is made again at its next use.
  void NewGeneration();

 private:
  struct Group {
    std::vector<int> ranks;
    std::vector<int> workers;  // by group rank, when made
    uint32_t op_space = 0;
    Millis timeout{0};
    std::unique_ptr<collective::Communicator> comm;
  };
  std::vector<Group> groups_;
};

}  // namespace nonstop::worker
