#pragma once
// TODO(#24): the public header is nonstop/data.h; apps/nonstop/data_command.cc still includes this one.
#include "nonstop/data.h"  // IWYU pragma: export
