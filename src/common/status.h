#pragma once
#include "nonstop/status.h"  // IWYU pragma: export
