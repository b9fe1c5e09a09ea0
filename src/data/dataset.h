#pragma once
// TODO(#24): the public header is nonstop/data.h; apps/nonstop/data_command.cc still includes this one
// (and uses TokenShard, which this header used to bring).
#include "data/token_shard.h"
#include "nonstop/data.h"  // IWYU pragma: export
