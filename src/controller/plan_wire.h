// How the plan of a generation travels to each member (docs/plan-wire.md).
//
// A full plan lists every member, so sending it to all N members costs O(N²)
// bytes: 4.9 MB to each of 100,000 workers, 493 GB per recovery. Every plan
// goes out as a control::kMsgPlanDelta instead. A member that received the
// previous plan on its current control connection holds it (frames on one
// connection arrive in order, and a worker keeps the newest plan it
// received), so it gets the plan written against that one, with only the
// transfers it takes part in: O(changes) bytes. Every other receiver (a
// spare taking a rank, the first plan, a worker that dialed again, every plan
// of a controller that has just taken over) gets the plan written against
// none: every member, in a compact form. A payload shared by several members
// is encoded once.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "control/messages.h"

namespace nonstop::controller {

class PlanWire {
 public:
  struct Frame {
    uint16_t type;               // control::kMsgPlanDelta
    const std::string* payload;  // valid until the next call of For()
    bool delta;                  // written against the previous plan (else against none)
  };

  // The frame that carries `plan` to `worker_id`, whose control connection
  // is `connection` (ControlServer::connection_of; 0: none).
  Frame For(int worker_id, uint64_t connection,
            const std::shared_ptr<const control::PlanMsg>& plan);
  // Whether that frame went out on that connection. Only then may the next
  // plan be written against this one for the worker.
  void Sent(int worker_id, uint64_t connection, bool ok);

  // How many workers it remembers a plan for: those sent the previous plan or
  // the current one (each new plan forgets the rest, such as workers that left
  // the job), so at most the members of two plans.
  size_t held_size() const { return held_.size(); }

 private:
  struct Held {
    uint64_t connection = 0;
    uint64_t plan = 0;  // serial of the plan sent last (current_serial_ numbers them)
  };
  void Start(const std::shared_ptr<const control::PlanMsg>& plan);

  std::shared_ptr<const control::PlanMsg> current_, previous_;
  uint64_t current_serial_ = 0, previous_serial_ = 0;
  uint64_t current_digest_ = 0;  // MembersDigest(current_->members), written into every delta
  // current_'s payloads, each encoded on first need: against no base (every
  // transfer), and against previous_ for the members that take part in no
  // transfer; and the members written against previous_, and which
  // transfers each worker takes part in, for the rest.
  std::string standalone_, shared_delta_, own_delta_;
  std::optional<control::PlanMembersDelta> delta_members_;
  std::optional<std::unordered_map<int, std::vector<size_t>>> transfers_of_;
  std::unordered_map<int, Held> held_;  // by worker id
};

}  // namespace nonstop::controller
