#pragma once
#include "nonstop/state.h"  // IWYU pragma: export
