#pragma once
#include "nonstop/check.h"  // IWYU pragma: export
